"""Exact byte counts of what training holds, on any device (the CPU has no allocator statistics):
tensors saved for backward, parameters, gradients, and the peak of a block of code."""

from __future__ import annotations


import torch


class SavedTensorBytes:
    """Context manager: bytes of the storages autograd saves for backward inside it ("activations").

    Counted on exit, each storage once (views are not counted twice): what the forward leaves for
    the backward. Parameters and their views are left out, and so are storages freed by then
    (FSDP2's gathered parameters). Autocast's low-precision weight copies are in `bytes` and also
    in `weight_copy_bytes`. Not seen: tensors held otherwise, e.g. a non-reentrant checkpoint's
    keyword arguments (Llama's rotary cos and sin); inside a checkpointed region only its
    positional inputs count, which is what checkpointing keeps. Set `tag` while open (from
    forward hooks) to split the count into `by_tag`: a storage counts under the tag when first
    saved. After exit: `bytes`, `weight_copy_bytes`, `count` (storages), `by_tag`.
    """

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
    """Context manager: the most bytes torch allocated inside it, net of what it freed.

    For the CPU (on CUDA: `torch.cuda.max_memory_allocated`): the profiler's memory events, every
    allocation and free in time order, kernels' temporaries included. After exit: `peak` (bytes
    >= 0, what the block needed beyond what it started with) and `net` (allocations - frees).
    """

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
