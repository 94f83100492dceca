"""One live run per `--output_dir`, and `--overwrite_output_dir` that leaves nothing of the old run.

`claim` runs on every rank right after the `Accelerator` exists, before the run writes anything:
it creates the folder, locks it for this job, empties it under `--overwrite_output_dir` (the
first attempt of a fresh run only), and checks that every rank sees the same folder.

The lock is a POSIX record lock (`fcntl.lockf`) on `{output_dir}/.lock`, held by the main
process for its lifetime. The kernel drops it when that process ends, however it ends (exit,
crash, SIGKILL), so a restarted attempt of the same job (torchrun's `--max_restarts`, a SLURM
requeue) finds it free, and a lock left by a crash is never stale: the file stays, naming the
last holder, but nothing holds it. Unlike `flock`, a record lock is not inherited by forked
children (DataLoader workers), which may outlive a killed parent by seconds. On NFS the lock is
the server's (NFSv4, or NFSv3 with lockd): a crashed node's lock lasts until its lease expires
(NFSv4: about 90 s) or, on NFSv3, until that node reboots; Lustre needs the `flock` mount option
for locks seen by every node (`localflock` locks per node only). Where locking fails outright,
`claim` warns and goes on.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import socket
import sys
import time
import warnings
from pathlib import Path

from common.checkpoint import check_shared_dir
from common.errors import Stop

LOCK = ".lock"
_held: list[int] = []  # the lock's file descriptor, open for the life of the process


def _holder() -> dict:
    """Who is taking the lock: host, pid, the job (SLURM, torchrun) and when."""
    job = {
        k: os.environ[v]
        for k, v in (("slurm_job", "SLURM_JOB_ID"), ("torchrun_run", "TORCHELASTIC_RUN_ID"))
        if os.environ.get(v, "none") != "none"
    }
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        **job,
        "since": time.strftime("%Y-%m-%d %H:%M:%S"),
        "command": " ".join(sys.argv),
    }


def _describe(info: dict) -> str:
    job = "".join(
        f", {name} {info[k]}"
        for k, name in (("slurm_job", "SLURM job"), ("torchrun_run", "torchrun run"))
        if k in info
    )
    return f"pid {info.get('pid', '?')} on {info.get('host', '?')}{job}, since {info.get('since', '?')}"


def lock(output_dir: str) -> str | None:
    """Take `{output_dir}/.lock` for this process (until it ends); on failure, a message naming the holder.

    Returns:
        None once held (also where the filesystem cannot lock: then with a warning), or one line
        naming the live job that holds it.
    """
    path = Path(output_dir) / LOCK
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as err:
        return f"--output_dir {output_dir}: cannot write its lock file {path} ({err.strerror})"
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        try:
            info = json.loads(os.pread(fd, 65536, 0) or b"{}")
        except ValueError:
            info = {}
        os.close(fd)  # (closing any descriptor of the file would drop a lock this process held)
        if err.errno not in (errno.EACCES, errno.EAGAIN):
            warnings.warn(
                f"cannot lock {path} ({err.strerror}): a second job started in --output_dir "
                f"{output_dir} would not be stopped"
            )
            return None
        return (
            f"--output_dir {output_dir} is in use by a live job: {_describe(info)}, started as "
            f"`{info.get('command', '?')}`. Wait for it to end or stop it, or give another --output_dir (if "
            f"that job is gone, e.g. a crashed node whose lock the file server still holds, delete {path})"
        )
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(_holder()).encode(), 0)
    os.fsync(fd)
    _held.append(fd)
    return None


def _entries_to_delete(output_dir: Path, resume_from_checkpoint: str | None) -> list[Path]:
    """What `--overwrite_output_dir` deletes: everything but the lock (and a checkpoint being resumed)."""
    if resume_from_checkpoint in ("latest", "auto"):  # it continues what is there
        return []
    keep = {output_dir / LOCK}
    if resume_from_checkpoint:  # an explicit checkpoint inside the folder
        resume = Path(resume_from_checkpoint).resolve()
        keep |= {
            p
            for p in output_dir.iterdir()
            if p.resolve() == resume or p.resolve() in resume.parents
        }
    return [p for p in sorted(output_dir.iterdir()) if p not in keep]


def _not_a_run_folder(output_dir: Path) -> str | None:
    """Why a folder must not be emptied wholesale (a repository, a home, the working folder); else None."""
    here = output_dir.resolve()
    if (
        here == Path.home().resolve()
        or here == Path.cwd().resolve()
        or here in Path.cwd().resolve().parents
    ):
        return "is the home or working folder (or above it)"
    if (here / ".git").exists():
        return "holds a .git repository"
    return None


def clear(output_dir: str, resume_from_checkpoint: str | None) -> str | None:
    """Delete an earlier run's files from `output_dir` (`--overwrite_output_dir`); main process only.

    Returns:
        None, or one line refusing to empty a folder that is not a run's (see `_not_a_run_folder`).
    """
    out = Path(output_dir)
    doomed = _entries_to_delete(out, resume_from_checkpoint)
    if doomed and (why := _not_a_run_folder(out)):
        return (
            f"--overwrite_output_dir would delete everything in {output_dir}, which {why}: give the run a "
            "folder of its own"
        )
    for p in doomed:
        shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
    return None


def claim(accelerator, args) -> None:
    """Make `args.output_dir` this run's. A collective: call on every rank before writing anything there.

    Creates the folder; the main process locks it (`lock`) and, with `args.overwrite_output_dir`,
    empties it (`clear`: `common.args.parse_args` has already turned the flag off on restarts,
    so only a fresh run's first attempt deletes); then `check_shared_dir`.

    Raises:
        ValueError: on every rank (the main process's reason), naming the folder: it cannot be
            created, another live job holds it, it must not be emptied, or it is not shared.
    """
    error = None
    try:
        os.makedirs(args.output_dir, exist_ok=True)
    except OSError as err:
        error = f"--output_dir {args.output_dir}: cannot create it ({err.strerror})"
    if accelerator.is_main_process and error is None:
        error = lock(args.output_dir)
        if error is None and args.overwrite_output_dir:
            error = clear(args.output_dir, args.resume_from_checkpoint)
    if accelerator.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        main_error = broadcast_object_list([error if accelerator.is_main_process else None])[0]
        error = main_error or error
    if error:
        raise Stop(error)
    check_shared_dir(accelerator, args.output_dir)
