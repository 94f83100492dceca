"""Test helper: log, per rank, every file a process writes under one directory.

With this directory on PYTHONPATH, Python imports this module at start-up in every process of a
launch (the launcher, each rank, each forked DataLoader worker). It records a write when:
  * anything opens a file for writing (the `open` audit event: builtins.open, io.open, os.open);
  * `safetensors.torch.save_file` or `torch.save` is called, or a tokenizer's `save_pretrained`
    returns the files it saved (these open files in native code, where no audit event fires;
    they are wrapped here, before the recipe imports them).
Environment: WRITE_AUDIT_ROOT (the directory to watch) and WRITE_AUDIT_LOG (where the logs go,
outside the watched one). Each process appends JSON lines {"rank", "pid", "path", "how", "t"} (a
rename adds "src") to
{WRITE_AUDIT_LOG}/{pid}.jsonl: its own file, so the log itself has one writer per file.
`rank` is the RANK set by torchrun, or null for the launcher.
"""

import json
import os
import sys
import time

_ROOT = os.environ.get("WRITE_AUDIT_ROOT")
_LOG = os.environ.get("WRITE_AUDIT_LOG")


def _record(path, how, **extra):
    try:
        path = os.path.abspath(os.fsdecode(path))
    except TypeError:  # a file descriptor or a file object: not a path we can attribute
        return
    if not path.startswith(_ROOT + os.sep):
        return
    line = (
        json.dumps(
            {
                "rank": os.environ.get("RANK"),
                "pid": os.getpid(),
                "path": path,
                "how": how,
                "t": time.time_ns(),
                **extra,
            }
        )
        + "\n"
    )
    fd = os.open(
        os.path.join(_LOG, f"{os.getpid()}.jsonl"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644
    )
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def _hook(event, args):
    if event == "open":
        path, mode, flags = args
        writes = (mode is not None and any(c in mode for c in "wax+")) or (
            mode is None and flags is not None and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT)
        )
        if writes:
            _record(path, "open")
    elif event in (
        "os.rename",
        "os.replace",
    ):  # (src: what was written there now lies under the new name)
        _record(args[1], event, src=os.path.abspath(os.fsdecode(args[0])))


def _wrap(module, name):
    original = getattr(module, name)

    def wrapper(*args, **kwargs):
        target = args[1] if len(args) > 1 else kwargs.get("filename", kwargs.get("f"))
        if isinstance(target, (str, bytes, os.PathLike)):
            _record(target, f"{module.__name__}.{name}")
        return original(*args, **kwargs)

    setattr(module, name, wrapper)


def _wrap_returning_paths(cls, name):
    original = getattr(cls, name)

    def wrapper(self, *args, **kwargs):
        saved = original(self, *args, **kwargs)
        for path in saved or ():
            _record(path, f"{cls.__name__}.{name}")
        return saved

    setattr(cls, name, wrapper)


if _ROOT and _LOG:
    _ROOT = os.path.abspath(_ROOT)
    if os.path.abspath(_LOG).startswith(_ROOT + os.sep):
        raise ValueError(
            f"WRITE_AUDIT_LOG {_LOG} lies inside WRITE_AUDIT_ROOT {_ROOT}: the log would log itself"
        )
    os.makedirs(_LOG, exist_ok=True)
    sys.addaudithook(_hook)
    import safetensors.torch
    import torch
    from transformers import PreTrainedTokenizerBase

    _wrap(safetensors.torch, "save_file")
    _wrap(torch, "save")
    _wrap_returning_paths(PreTrainedTokenizerBase, "save_pretrained")
