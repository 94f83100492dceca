"""One live run per `--output_dir` (`claim`), and which attempt of its job this is.

`{output_dir}/.lock` is a POSIX record lock (`fcntl.lockf`: forked workers do not inherit it),
dropped by the kernel however the process ends; on NFS at lease expiry (NFSv4: about 90 s)."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import socket
import sys
import time
import uuid
from pathlib import Path

from common import errors
from common.errors import Stop

LOCK = ".lock"
_held: list[int] = []  # the lock's file descriptor, open for the life of the process


def restart_note() -> str:
    """ "" on a job's first attempt, else e.g. "torchrun restart 1" or "SLURM requeue 2"."""
    counts = {
        "torchrun restart": "TORCHELASTIC_RESTART_COUNT",
        "SLURM requeue": "SLURM_RESTART_COUNT",
    }
    return ", ".join(
        f"{name} {n}"
        for name, var in counts.items()
        if (n := os.environ.get(var, "0")).isdigit() and int(n) > 0
    )


def lock(output_dir: str) -> None:
    """Take `{output_dir}/.lock`, writing who holds it; Stop naming the live job holding it."""
    path = Path(output_dir) / LOCK
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as err:
        raise Stop(
            f"--output_dir {output_dir}: cannot write its lock file {path} ({err.strerror})"
        ) from None
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        try:
            info = json.loads(os.pread(fd, 65536, 0) or b"{}")
        except ValueError:
            info = {}
        os.close(fd)  # (closing any descriptor of the file would drop a lock this process held)
        if err.errno not in (errno.EACCES, errno.EAGAIN):
            errors.warn(f"cannot lock {path} ({err.strerror}): a second job would not be stopped")
            return
        job = "".join(f", {k} {info[k]}" for k in ("SLURM job", "torchrun run") if k in info)
        raise Stop(
            f"--output_dir {output_dir} is in use by a live job: pid {info.get('pid', '?')} on "
            f"{info.get('host', '?')}{job}, since {info.get('since', '?')}, started as "
            f"`{info.get('command', '?')}`. Wait for it to end or stop it, or give another "
            f"--output_dir (if that job is gone, e.g. its node crashed, delete {path})"
        ) from None
    jobs = {"SLURM job": "SLURM_JOB_ID", "torchrun run": "TORCHELASTIC_RUN_ID"}
    holder = {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        **{k: os.environ[v] for k, v in jobs.items() if os.environ.get(v, "none") != "none"},
        "since": time.strftime("%Y-%m-%d %H:%M:%S"),
        "command": " ".join(sys.argv),
    }
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(holder).encode(), 0)
    os.fsync(fd)
    _held.append(fd)


def clear(output_dir: str, resume_from_checkpoint: str | None) -> None:
    """`--overwrite_output_dir`: delete all but the lock and a checkpoint being resumed (main process);
    Stop for a folder that is not a run's."""
    out, here = Path(output_dir), Path(output_dir).resolve()
    if resume_from_checkpoint in ("latest", "auto"):  # it continues what is there
        return
    keep = {out / LOCK}
    if resume_from_checkpoint:  # an explicit checkpoint inside the folder
        resume = Path(resume_from_checkpoint).resolve()
        keep |= {p for p in out.iterdir() if p.resolve() in (resume, *resume.parents)}
    doomed = [p for p in sorted(out.iterdir()) if p not in keep]
    cwd = Path.cwd().resolve()
    why = "holds a .git repository" if (here / ".git").exists() else None
    if here in (Path.home().resolve(), cwd, *cwd.parents):
        why = "is the home or working folder (or above it)"
    if doomed and why:
        raise Stop(
            f"--overwrite_output_dir would delete everything in {output_dir}, which {why}: give "
            "the run a folder of its own"
        )
    for p in doomed:
        shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()


def claim(accelerator, args) -> None:
    """Make `args.output_dir` this run's: create, lock and (`--overwrite_output_dir`) empty it, then
    check that every rank sees the same folder. A collective, before anything is written there."""
    error = None
    try:
        os.makedirs(args.output_dir, exist_ok=True)
    except OSError as err:
        error = f"--output_dir {args.output_dir}: cannot create it ({err.strerror})"
    if accelerator.is_main_process and error is None:
        try:
            lock(args.output_dir)
            if args.overwrite_output_dir:
                clear(args.output_dir, args.resume_from_checkpoint)
        except Stop as err:
            error = str(err)
    token = None
    if accelerator.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        main = [error, uuid.uuid4().hex] if accelerator.is_main_process else [None, None]
        main_error, token = broadcast_object_list(main)
        error = main_error or error
    if error:
        raise Stop(error)
    if token is None:
        return
    # every rank writes checkpoints, rank 0 renames them: a node-local folder would split them
    import torch

    mine = Path(args.output_dir) / f".shared-check-{token}-{accelerator.process_index}"
    mine.touch()
    accelerator.wait_for_everyone()
    seen = len(list(Path(args.output_dir).glob(f".shared-check-{token}-*")))
    fewest = accelerator.gather(torch.tensor([seen], device=accelerator.device)).min().item()
    accelerator.wait_for_everyone()
    mine.unlink()
    if fewest != accelerator.num_processes:
        raise Stop(
            f"--output_dir {args.output_dir} is not one directory shared by every rank: rank "
            f"{accelerator.process_index} on {socket.gethostname()} sees {seen} of the "
            f"{accelerator.num_processes} ranks' files there (fewest seen by any rank: {fewest}). "
            "Give every node the same shared filesystem path"
        )
