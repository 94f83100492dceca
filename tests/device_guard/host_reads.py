"""Test helper: log every read of a tensor's value on the host, with the recipe's `step` at that moment.

On a GPU, `.item()`, `.tolist()`, `float(t)`, `int(t)`, `bool(t)`, `f"{t}"`, `str(t)` / `print(t)`
(`__repr__`), `.cpu()` and `.to("cpu")` copy a device value to the host: the host waits for every kernel
queued so far, and cannot run ahead of the device. Once per logging step that is harmless; once per step it
stalls the GPU every step.
On a CPU-only host nothing stalls, so this logger makes the reads visible instead.

With `HOST_READS_DIR` set, `sitecustomize.py` calls `install()` in every process of a launch; at
exit, a process whose `__main__` is a project script writes `{HOST_READS_DIR}/rank{RANK}-{pid}.json`:
`{"script": path, "reads": [[origin, name, "file:line", step, via], ...]}` where

  * origin is "project" when the caller's frame is in recipes/, common/ or benchmarks/, else
    "library" (Accelerate, DeepSpeed, torch: e.g. GradScaler's inf check);
  * step is the value of the script's `step` (a global, or a local of its running function; None
    before it exists): in llama.py a read made while optimizer step k trains sees k - 1, one made
    in step k's logging block sees k; in a `for step in range(1, ...)` loop both see k;
  * via is the innermost project frame on the stack for a library read ("file:line"), else None.

With `HOST_READS_CUDA_SYNCS=1` too (a GPU host), it turns on `torch.cuda.set_sync_debug_mode("warn")`
once the script's `step` exists (not at start-up: no CUDA call before the script's own), and logs every
synchronizing CUDA operation the same way, named "cuda_sync" (whatever the op: `.item()`, a boolean mask,
`nonzero`, a blocking copy), attributed to the Python frame that ran it.
"warn", not "error": libraries sync on their own (transformers' packed-sequence check, GradScaler,
DeepSpeed's overflow check), and "error" would stop the run at the first of those.

Not counted: reads nested inside another logged read (`f"{t}"` calls `.item()`), and reads of
tensors that project code made on the host on purpose (collective_guard's marks: factories
without `device=`, e.g. the gloo flag of `checkpoint.stop_on_signal`), which no GPU syncs for.
"""

import atexit
import functools
import json
import os
import sys
import warnings

import torch

import collective_guard

READS = (
    "item",
    "tolist",
    "__float__",
    "__int__",
    "__bool__",
    "__format__",
    "__repr__",
    "cpu",
)  # + .to(host)
_reads, _depth = [], [0]


_cuda_syncs = [os.environ.get("HOST_READS_CUDA_SYNCS") == "1"]  # to switch on at the first step


def _main_step():
    """The script's `step`: a module global (llama.py), else a local of the script's running function
    (sharded_data.py's main()): the innermost frame of the script's file that has one."""
    main = sys.modules.get("__main__")
    step = getattr(main, "step", None) if main is not None else None
    script = getattr(main, "__file__", None)
    if not isinstance(step, int) and script:
        frame = sys._getframe(1)
        while frame is not None:
            if frame.f_code.co_filename == script and isinstance(frame.f_locals.get("step"), int):
                step = frame.f_locals["step"]
                break
            frame = frame.f_back
    if _cuda_syncs[0] and isinstance(step, int):
        _cuda_syncs[0] = False
        warnings.showwarning = _show_cuda_sync
        warnings.filterwarnings("always", message=".*synchroniz")  # every sync, not once per line
        torch.cuda.set_sync_debug_mode("warn")
    return step


def _wrap(fn, name, reads=lambda *args, **kwargs: True):
    """Log a call of `fn` as a read named `name`, unless nested in another read, made on a tensor
    left on the host on purpose, or `reads(*args, **kwargs)` says this call reads nothing."""

    @functools.wraps(fn)
    def read(self, *args, **kwargs):
        if (
            _depth[0]
            or collective_guard.host_origin(self) is not None
            or not reads(*args, **kwargs)
        ):
            return fn(self, *args, **kwargs)
        _log(sys._getframe(1), name)
        _depth[0] += 1
        try:
            return fn(self, *args, **kwargs)
        finally:
            _depth[0] -= 1

    return read


def _to_host(*args, **kwargs):
    """Whether `.to(...)` targets the host ("cpu", or a host tensor): then it reads the value."""
    return collective_guard._is_host_target(kwargs.get("device", args[0] if args else None))


def _log(origin_frame, name):
    step = _main_step()
    step = step if isinstance(step, int) else None
    if collective_guard._is_project_file(origin_frame.f_code.co_filename):
        _reads.append(["project", name, collective_guard._where(origin_frame), step, None])
        return
    via = origin_frame.f_back
    while via is not None and not collective_guard._is_project_file(via.f_code.co_filename):
        via = via.f_back
    _reads.append(
        [
            "library",
            name,
            collective_guard._where(origin_frame),
            step,
            collective_guard._where(via) if via is not None else None,
        ]
    )


def _show_cuda_sync(message, category, filename, lineno, file=None, line=None):
    if "synchroniz" not in str(message):
        return _showwarning(message, category, filename, lineno, file, line)
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename in (warnings.__file__, __file__):
        frame = frame.f_back
    if frame is not None:
        _log(frame, "cuda_sync")


_showwarning = warnings.showwarning


def _dump(out_dir):
    script = (
        os.path.realpath(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    )  # (__main__ has lost __file__ by now)
    if not collective_guard._is_project_file(script):
        return  # the launcher, a helper process: not a recipe
    path = os.path.join(out_dir, f"rank{os.environ.get('RANK', '0')}-{os.getpid()}.json")
    with open(path, "w") as f:
        json.dump({"script": os.path.relpath(script, collective_guard.REPO), "reads": _reads}, f)


def install(out_dir):
    """Wrap torch.Tensor's value reads (READS) in this process and write the log to `out_dir` at exit.

    Call after `collective_guard.install()` (its `.cpu()` wrapper and its host marks are used).
    Raises nothing; a process that dies without running atexit handlers writes no log.
    """
    for name in READS:
        setattr(torch.Tensor, name, _wrap(getattr(torch.Tensor, name), name))
    torch.Tensor.to = _wrap(torch.Tensor.to, "to(cpu)", _to_host)
    atexit.register(_dump, out_dir)
