"""Test helper: fail when project code hands a collective a tensor that would live on the host on a GPU.

Under NCCL every tensor handed to a collective must be on `accelerator.device`: NCCL rejects CPU
tensors, and Accelerate's gather puts its output on the device. On a CPU-only host the host *is*
the device, so nothing fails there; this guard simulates the difference. It tracks tensors that
*project code* (files under recipes/, common/, benchmarks/: the caller's frame decides) leaves on
the host, and raises when project code passes one to a collective:

  * marked "host": the results of torch.tensor / as_tensor / zeros / ones / full / empty / arange /
    rand / randn / randint / from_numpy called without `device=` (or with the string "cpu"), and
    of `Tensor.cpu()` / `Tensor.to("cpu")` (on a CPU host these return the tensor itself, so the
    guard returns a view of it instead, which it marks: the original stays unmarked);
  * views of a marked tensor (`t._base`) count as marked, and `t.to(dtype)` passes the mark on;
  * `t.to(device)` with a `torch.device` (e.g. `accelerator.device`), an index or an unmarked
    tensor, by anyone, clears the mark (on a CPU host it returns `t` itself);
  * checked collectives, when called from project code, including nested lists/tuples/dicts of
    tensors: `Accelerator.gather / gather_for_metrics / reduce / pad_across_processes`,
    `accelerate.utils.gather / reduce / broadcast / pad_across_processes` and
    `torch.distributed.all_reduce / all_gather / all_gather_into_tensor / broadcast / reduce /
    reduce_scatter / reduce_scatter_tensor / all_to_all_single / gather / scatter`;
  * allowed: a `torch.distributed` collective on a group made with `new_group(backend="gloo")`
    (gloo takes CPU tensors under any default backend), and every collective that library code
    (Accelerate's internals, DeepSpeed, FSDP) calls itself.

Not tracked: tensors computed from a host tensor (`host * 2`, `host.sum()`, `torch.cat([host])`),
views of a `.cpu()` result (their `_base` is the original), and tensors made on the host by
library code (e.g. a DataLoader's collate). Only wrapped Python entry points pay a cost: a frame
lookup and a dictionary check per call (about 0.3-0.6 us), no per-op hook. The wrappers return
what the originals return; `with torch.device(...)` still places the wrapped factories. Inside
a region torch.compile traces they skip the bookkeeping (its frame lookups would break the graph),
so compiled code is checked as users run it, not cut into pieces (tests/test_collective_devices.py).

`install()` patches torch/accelerate in this process; `sitecustomize.py` next to this file calls
it at start-up in every process of a launch with this folder on PYTHONPATH.
"""

import functools
import os
import sys

import accelerate
import accelerate.utils
import accelerate.utils.operations
import torch
import torch.distributed as dist
from torch.utils._device import _device_constructors
from torch.utils.weak import WeakIdKeyDictionary

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__))))
PROJECT = tuple(os.path.join(REPO, d) + os.sep for d in ("recipes", "common", "benchmarks"))
_HERE = os.path.dirname(os.path.abspath(__file__)) + os.sep  # frames of this folder are not callers
FACTORIES = (
    "tensor",
    "as_tensor",
    "zeros",
    "ones",
    "full",
    "empty",
    "arange",
    "rand",
    "randn",
    "randint",
    "from_numpy",
)
ACCELERATOR_COLLECTIVES = ("gather", "gather_for_metrics", "reduce", "pad_across_processes")
UTILS_COLLECTIVES = ("gather", "reduce", "broadcast", "pad_across_processes")
DIST_COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "broadcast",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all_single",
    "gather",
    "scatter",
)

_marks = WeakIdKeyDictionary()  # host tensor -> "where it was made (how)"
_gloo_groups = []  # process groups made with backend="gloo"
_roots = PROJECT


@functools.lru_cache(maxsize=None)
def _is_project_file(filename: str) -> bool:
    return os.path.realpath(filename).startswith(_roots)


def _where(frame) -> str:
    return f"{os.path.relpath(frame.f_code.co_filename, REPO)}:{frame.f_lineno}"


def host_origin(tensor):
    """Where `tensor` (or the tensor it is a view of) was left on the host, as "file:line (how)"; None if not marked."""
    if not _marks or not isinstance(tensor, torch.Tensor):
        return None
    origin = _marks.get(tensor)
    if origin is None and tensor._base is not None:
        origin = _marks.get(tensor._base)
    return origin


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors(item)


def _is_host_target(target) -> bool:
    return (isinstance(target, str) and target.startswith("cpu")) or host_origin(target) is not None


def _caller():
    """The frame that called the wrapper calling this, past this folder's own frames (host_reads.py
    wraps some of these wrappers in turn)."""
    frame = sys._getframe(2)
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_HERE):
        frame = frame.f_back
    return frame


def _factory(fn, name):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        out = fn(*args, **kwargs)
        if (
            torch.compiler.is_compiling()
        ):  # inside a traced region: no bookkeeping (dynamo would break the graph)
            return out
        device = kwargs.get("device")
        if (device is None or _is_host_target(device)) and _is_project_file(
            (frame := _caller()).f_code.co_filename
        ):
            _marks[out] = f"{_where(frame)} (torch.{name} without device=)"
        return out

    return wrapper


def _to_host(out, self, frame, how):
    """Mark `out`, a host copy of `self` made by project code; on a CPU host it is `self`: mark a view instead."""
    if out is self:
        if type(out) not in (torch.Tensor, torch.nn.Parameter) or out.layout != torch.strided:
            return out  # an alias of a subclass could change behaviour: leave it untracked
        out = out.view_as(out)
    _marks[out] = f"{_where(frame)} ({how})"
    return out


def _wrap_cpu(fn):
    @functools.wraps(fn)
    def cpu(self, *args, **kwargs):
        out = fn(self, *args, **kwargs)
        if torch.compiler.is_compiling():
            return out
        frame = _caller()
        return (
            _to_host(out, self, frame, ".cpu()")
            if _is_project_file(frame.f_code.co_filename)
            else out
        )

    return cpu


def _wrap_to(fn):
    @functools.wraps(fn)
    def to(self, *args, **kwargs):
        out = fn(self, *args, **kwargs)
        if torch.compiler.is_compiling():
            return out
        target = kwargs.get("device", args[0] if args else None)
        if isinstance(target, (torch.device, int, str)) or isinstance(target, torch.Tensor):
            if _is_host_target(target):
                frame = _caller()
                if _is_project_file(frame.f_code.co_filename):
                    out = _to_host(out, self, frame, ".to(cpu)")
            elif out is self:
                _marks.pop(out, None)  # moved to the device (a no-op on a CPU host)
        elif out is not self and (origin := host_origin(self)) is not None:
            _marks[out] = origin  # a dtype change stays on the host
        return out

    return to


def _collective(fn, name):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        frame = sys._getframe(1)
        if _is_project_file(frame.f_code.co_filename):
            values = [*args, *kwargs.values()]
            if not any(v is g for v in values for g in _gloo_groups):
                for tensor in _tensors(values):
                    if (origin := host_origin(tensor)) is not None:
                        raise AssertionError(
                            f"{_where(frame)} hands {name} a tensor left on the host at {origin}: under NCCL "
                            "every tensor handed to a collective must live on accelerator.device (create it "
                            "with device=accelerator.device or move it with .to(accelerator.device))"
                        )
        return fn(*args, **kwargs)

    return wrapper


def _wrap_new_group(fn):
    @functools.wraps(fn)
    def new_group(*args, **kwargs):
        group = fn(*args, **kwargs)
        if kwargs.get("backend", args[2] if len(args) > 2 else None) == "gloo":
            _gloo_groups.append(group)
        return group

    return new_group


def install(roots=PROJECT):
    """Patch torch and accelerate in this process so that project code cannot hand a host tensor to a collective.

    Args:
        roots: path prefixes (str) of the files whose calls are checked: project code.
    Returns:
        `uninstall()`, which restores every patched attribute and forgets all marks.
    Raises (later, from a checked collective): AssertionError naming the caller's file:line and
        where the tensor was left on the host.
    """
    global _roots
    _roots = tuple(roots)
    _is_project_file.cache_clear()
    # `with torch.device(d):` adds device=d to the calls of the factories listed in this cached set,
    # by identity: list them now, before the wrappers replace them (transformers builds and
    # re-initialises models under such contexts: its rotary buffers were left uninitialised).
    _device_constructors()
    patches = [(torch, name, _factory(getattr(torch, name), name)) for name in FACTORIES]
    patches += [
        (torch.Tensor, "cpu", _wrap_cpu(torch.Tensor.cpu)),
        (torch.Tensor, "to", _wrap_to(torch.Tensor.to)),
        (dist, "new_group", _wrap_new_group(dist.new_group)),
    ]
    patches += [
        (
            accelerate.Accelerator,
            n,
            _collective(getattr(accelerate.Accelerator, n), f"accelerator.{n}"),
        )
        for n in ACCELERATOR_COLLECTIVES
    ]
    for module in (accelerate.utils, accelerate.utils.operations):
        patches += [
            (
                module,
                n,
                _collective(getattr(accelerate.utils.operations, n), f"accelerate.utils.{n}"),
            )
            for n in UTILS_COLLECTIVES
        ]
    patches += [
        (dist, n, _collective(getattr(dist, n), f"torch.distributed.{n}")) for n in DIST_COLLECTIVES
    ]
    originals = [
        (owner, name, owner.__dict__.get(name)) for owner, name, _ in patches
    ]  # None: inherited
    for owner, name, wrapper in patches:
        setattr(owner, name, wrapper)

    def uninstall():
        global _roots
        for owner, name, original in reversed(originals):
            if original is None:
                delattr(owner, name)  # torch.Tensor.cpu / .to live on torch._C.TensorBase
            else:
                setattr(owner, name, original)
        _marks.clear()
        _gloo_groups.clear()
        _roots = PROJECT
        _is_project_file.cache_clear()

    return uninstall
