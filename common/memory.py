"""Exact byte counts of what training holds, on any device (the CPU has no allocator statistics):
tensors saved for backward, parameters, gradients, and the peak of a block of code."""

from __future__ import annotations


import torch


class SavedTensorBytes:
    """Context manager: bytes of the storages autograd saves for backward inside it, each once,
    without parameters (autocast's weight copies also in `weight_copy_bytes`). Not seen: tensors
    held otherwise (a non-reentrant checkpoint's keyword arguments). Set `tag` while open to split
    the count into `by_tag`. After exit: `bytes`, `weight_copy_bytes`, `count`, `by_tag`."""

    def __init__(self):
        self._storages: dict[tuple, tuple] = {}  # storage key -> (tag, weight copy?, storage)
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self.tag, self.bytes, self.weight_copy_bytes, self.count, self.by_tag = "", 0, 0, 0, {}

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        base = t._base if t._base is not None else t  # a linear layer saves `weight.t()`, a view
        if isinstance(base, torch.nn.Parameter):
            return t
        try:
            storage = t.untyped_storage()
            key = (t.device.type, storage.data_ptr())
        except (RuntimeError, NotImplementedError):  # tensor subclasses without a plain storage
            storage, key = t, ("id", id(t))
        # autocast's weight copy: a dtype cast (ToCopyBackward0) of a parameter
        fn = base.grad_fn
        copy = type(fn).__name__ == "ToCopyBackward0" and any(
            isinstance(getattr(nxt, "variable", None), torch.nn.Parameter)
            for nxt, _ in fn.next_functions
        )
        self._storages.setdefault(key, (self.tag, copy, storage))
        return t  # the tensor itself: the measurement changes nothing in the computation

    def __enter__(self) -> "SavedTensorBytes":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
        for tag, is_copy, s in self._storages.values():
            n = s.nbytes() if isinstance(s, torch.UntypedStorage) else s.numel() * s.element_size()
            self.by_tag[tag] = self.by_tag.get(tag, 0) + n
            self.bytes += n
            self.weight_copy_bytes += n if is_copy else 0
            self.count += bool(n)
        self._storages.clear()  # hold no reference past the forward: backward must be able to free them


class PeakTensorBytes:
    """Context manager: the most bytes torch allocated inside it net of frees (the CPU profiler's
    memory events, temporaries included). After exit: `peak` (>= 0) and `net`."""

    def __enter__(self) -> "PeakTensorBytes":
        self._profiler = torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
        )
        self._profiler.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._profiler.__exit__(*exc)
        events = self._profiler.profiler.kineto_results.events()
        self.peak = self.net = 0
        memory = [(e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]"]
        for _, nbytes in sorted(memory):
            self.net += nbytes
            self.peak = max(self.peak, self.net)
