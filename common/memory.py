"""Exact byte counts of what training holds: tensors saved for backward, parameters, gradients.

`SavedTensorBytes` counts what autograd keeps from the forward pass for the backward pass (the
"activations" of the memory budget) with `torch.autograd.graph.saved_tensors_hooks`: it works on
any device, CPU included, where no allocator statistics exist. Each underlying storage is
counted once, so views (transposes, reshapes, slices of one buffer) are not double-counted.
"""

from __future__ import annotations


import torch


def _is_parameter(t: torch.Tensor) -> bool:
    """A parameter, or a view of one (a linear layer saves `weight.t()`, which shares its storage)."""
    return isinstance(t, torch.nn.Parameter) or isinstance(t._base, torch.nn.Parameter)


def _is_weight_copy(t: torch.Tensor) -> bool:
    """A dtype cast of a parameter (or a view of one): what autocast feeds a matmul in bf16/fp16."""
    fn = (t._base if t._base is not None else t).grad_fn
    return (
        fn is not None
        and type(fn).__name__ == "ToCopyBackward0"
        and any(
            isinstance(getattr(nxt, "variable", None), torch.nn.Parameter)
            for nxt, _ in fn.next_functions
        )
    )


class SavedTensorBytes:
    """Context manager: bytes of the unique storages autograd saves for backward inside it.

    The count is taken on exit, i.e. what is held at the end of the forward pass, waiting for
    backward. Parameters and views of parameters are skipped (they are counted as parameters and
    live whether or not a backward follows), and so is any storage already freed by then (FSDP2
    frees each block's gathered parameters after its forward). Under autocast the low-precision
    *copies* of weights are saved tensors too, held until backward like activations: they are
    counted in `bytes` and reported apart in `weight_copy_bytes`.

    What is not seen: tensors kept alive by other means than autograd's saved-tensor mechanism,
    e.g. keyword arguments captured by a non-reentrant `torch.utils.checkpoint` closure (for
    Llama, the rotary cos and sin, (1, seq, head_dim) each, shared by all layers). Inside a
    checkpointed region the checkpoint's own hooks take over, so only the region's positional
    tensor inputs are counted: exactly what checkpointing keeps.

    Set `tag` while it is open (e.g. from module forward hooks) to split the count: each storage
    is attributed to the tag current when it was first saved.

    Attributes (valid after exit):
        bytes: total bytes of the unique saved storages (int, bytes).
        weight_copy_bytes: the part of `bytes` that is low-precision copies of parameters.
        count: number of unique storages.
        by_tag: {tag: bytes}.

    Example:
        with SavedTensorBytes() as saved:
            loss = model(**batch).loss
        loss.backward()
        saved.bytes
    """

    def __init__(self):
        self._storages: dict[tuple, tuple] = {}  # storage key -> (tag, weight copy?, storage)
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self.tag, self.bytes, self.weight_copy_bytes, self.count, self.by_tag = "", 0, 0, 0, {}

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if not _is_parameter(t):
            try:
                storage = t.untyped_storage()
                key = (t.device.type, storage.data_ptr())
            except (RuntimeError, NotImplementedError):  # tensor subclasses without a plain storage
                storage, key = t, ("id", id(t))
            self._storages.setdefault(key, (self.tag, _is_weight_copy(t), storage))
        return t  # keep the tensor itself: the measurement changes nothing in the computation

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
    """Context manager: the peak of the bytes torch allocated inside it, net of what it freed.

    A byte meter for the CPU, where torch keeps no allocator statistics: it reads the memory
    events of torch's profiler (`profile_memory=True`), i.e. every allocation and free of torch's
    allocator, including a kernel's internal temporaries (an fp64 cast inside `vector_norm`,
    say), in time order. Memory held before entry counts zero, so `peak` is the extra memory
    the code inside needed at its worst moment. (On CUDA, use `torch.cuda.max_memory_allocated`.)

    Attributes (valid after exit):
        peak: the maximum of the running sum of allocations minus frees (int, bytes, >= 0).
        net: allocations minus frees at exit (int, bytes; negative if it freed older memory).

    Example:
        with PeakTensorBytes() as meter:
            loss = model(**batch).loss
        meter.peak
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
        for _, nbytes in sorted(
            (e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]"
        ):
            self.net += nbytes
            self.peak = max(self.peak, self.net)
