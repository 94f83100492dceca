"""Atomic, collective-safe checkpoints around `accelerator.save_state` / `load_state`.

Layout: `{output_dir}/checkpoint-{step}/`, holding what `save_state` writes (model, optimizer,
scheduler, grad scaler, per-rank RNG states; one shard per rank under FSDP/ZeRO) plus
`COMPLETE.json`, written last by rank 0 with the step and every file's size. A directory
without that marker, or whose files do not match it, is never resumed from.

Assumes `output_dir` is one filesystem seen by every rank (a shared disk on multi-node jobs).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import warnings
from pathlib import Path

MARKER = "COMPLETE.json"
_CKPT = re.compile(r"^checkpoint-(\d+)$")


def _manifest(directory: Path) -> dict[str, int]:
    return {str(p.relative_to(directory)): p.stat().st_size
            for p in sorted(directory.rglob("*")) if p.is_file() and p.name != MARKER}


def save_checkpoint(accelerator, output_dir: str, step: int, save_total_limit: int | None = None) -> Path:
    """Save the full training state as `checkpoint-{step}`, atomically. Call on every rank.

    Every rank runs `save_state` (it holds collectives and per-rank shard writes); then, after a
    barrier, rank 0 writes the marker and renames `checkpoint-{step}.tmp` into place, and
    deletes the oldest complete checkpoints beyond `save_total_limit` (never the new one).

    Returns:
        The path of the finished checkpoint (the same on every rank, after a final barrier).
    """
    out = Path(output_dir)
    tmp, final = out / f"checkpoint-{step}.tmp", out / f"checkpoint-{step}"
    if accelerator.is_main_process and tmp.exists():
        shutil.rmtree(tmp)  # debris of a save that crashed
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    accelerator.wait_for_everyone()  # every shard is on disk before the marker says so
    if accelerator.is_main_process:
        (tmp / MARKER).write_text(json.dumps({"step": step, "files": _manifest(tmp)}, indent=1))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        if save_total_limit:
            for old in complete_checkpoints(out)[:-save_total_limit]:
                shutil.rmtree(old)
    accelerator.wait_for_everyone()  # nobody reads it before the rename
    return final


def verify_checkpoint(path: Path) -> int:
    """Check a checkpoint against its marker.

    Returns:
        The optimizer step it was saved at.

    Raises:
        FileNotFoundError / ValueError: naming the missing marker, missing file or the file whose
            size differs from the one recorded (a truncated write).
    """
    marker = Path(path) / MARKER
    if not marker.is_file():
        raise FileNotFoundError(f"{path} is not a complete checkpoint: {MARKER} missing (the save did not finish)")
    info = json.loads(marker.read_text())
    for name, size in info["files"].items():
        f = Path(path) / name
        if not f.is_file():
            raise FileNotFoundError(f"checkpoint file missing: {f}")
        if f.stat().st_size != size:
            raise ValueError(f"checkpoint file {f} is {f.stat().st_size} bytes, {size} were written: truncated or altered")
    return int(info["step"])


def complete_checkpoints(output_dir: Path) -> list[Path]:
    """Checkpoint directories that carry a marker, oldest step first."""
    found = [p for p in Path(output_dir).glob("checkpoint-*") if _CKPT.match(p.name) and (p / MARKER).is_file()]
    return sorted(found, key=lambda p: int(_CKPT.match(p.name).group(1)))


def resolve_checkpoint(output_dir: str, resume_from_checkpoint: str | None) -> tuple[Path | None, int]:
    """Turn `--resume_from_checkpoint {PATH|latest}` into a verified checkpoint.

    `latest` takes the newest complete checkpoint under `output_dir`, skipping (with a warning)
    any that fail verification; none at all means a fresh start. An explicit PATH must verify.

    Returns:
        (path, step), or (None, 0) for a fresh start.

    Raises:
        FileNotFoundError / ValueError: an explicit PATH that is missing, incomplete or damaged.
    """
    if not resume_from_checkpoint:
        return None, 0
    if resume_from_checkpoint != "latest":
        if not Path(resume_from_checkpoint).is_dir():
            raise FileNotFoundError(f"--resume_from_checkpoint {resume_from_checkpoint}: no such directory")
        return Path(resume_from_checkpoint), verify_checkpoint(Path(resume_from_checkpoint))
    for path in reversed(complete_checkpoints(Path(output_dir))):
        try:
            return path, verify_checkpoint(path)
        except (FileNotFoundError, ValueError) as err:
            warnings.warn(f"skipping damaged checkpoint: {err}")
    return None, 0
