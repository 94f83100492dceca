"""Atomic, collective-safe checkpoints around `accelerator.save_state` / `load_state`.

Layout: `{output_dir}/checkpoint-{step}/`, holding what `save_state` writes (model, optimizer,
scheduler, grad scaler, per-rank RNG states; one shard per rank under FSDP/ZeRO) plus
`COMPLETE.json`, written last by rank 0 with the step, the save order, every file's size and
sha256, and a sha256 of the marker's own other contents. Every file is fsynced before the marker
is written, and the directory after it. A directory without that marker, or whose marker or files
do not match it (a truncated write, bytes damaged on disk or in a copy, an edited marker), is
never resumed from. Checksums are computed and verified by all ranks together, each reading about
1/world_size of the bytes (sha256: about 0.6 GB/s per core here, with SHA-NI). Checkpoints
written before checksums existed carry sizes only: they are verified by size, with a warning; a
marker without its own sha256 is accepted, with a warning.

Order: "newest" (rotation, `latest`, `auto`) is the order of the saves in `output_dir`, never a
clock: each marker records `save_order`, 1 + the largest among the complete checkpoints already
there (`complete_checkpoints`).

Assumes `output_dir` is one filesystem seen by every rank (a shared disk on multi-node jobs);
`check_shared_dir` refuses to start when it is not.

Recovery: `--resume_from_checkpoint auto` resumes from the newest complete checkpoint, or starts
fresh when there is none, so one command line serves the first attempt and every restart
(torchrun's `--max_restarts`, a SLURM requeue). `stop_on_signal` turns the SIGTERM (or Ctrl-C's SIGINT) that SLURM,
Kubernetes, torchrun and users send before they kill into a checkpoint at the next step boundary.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import re
import shutil
import signal
import time
import uuid
import warnings
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

from accelerate.utils import DistributedType

from common import launch, models, workarounds
from common.errors import Stop

MARKER = "COMPLETE.json"
ORDER = "save_order"  # the marker's place in its output_dir's saves (`complete_checkpoints`)
SEAL = "marker_sha256"  # the marker's sha256 of its other contents (`_marker_sha256`)
_CKPT = re.compile(r"^checkpoint-(\d+)$")
PREEMPTED_EXIT_CODE = 143  # 128 + SIGTERM: what a shell reports for a job ended by SIGTERM; never 0


def restart_note() -> str:
    """Which attempt this is: "" on the first, else e.g. "torchrun restart 1" or "SLURM requeue 2".

    From `TORCHELASTIC_RESTART_COUNT` (set by torchrun, hence `accelerate launch`, for every
    worker; 0 on the first attempt) and `SLURM_RESTART_COUNT` (set in a requeued SLURM job).
    """
    notes = [
        f"{name} {os.environ[var]}"
        for var, name in (
            ("TORCHELASTIC_RESTART_COUNT", "torchrun restart"),
            ("SLURM_RESTART_COUNT", "SLURM requeue"),
        )
        if os.environ.get(var, "0").isdigit() and int(os.environ.get(var, "0")) > 0
    ]
    return ", ".join(notes)


def _manifest(directory: Path) -> dict[str, int]:
    return {
        str(p.relative_to(directory)): p.stat().st_size
        for p in sorted(directory.rglob("*"))
        if p.is_file() and p.name != MARKER
    }


def _fsync(path: Path) -> None:
    """Flush a file's or a directory's data and metadata to disk (a directory: its entries)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dirs(directory: Path) -> None:
    """fsync `directory` and every folder below it: the file names inside reach the disk too."""
    for d in [directory, *(p for p in directory.rglob("*") if p.is_dir())]:
        _fsync(d)


def _file_sha256(path: Path) -> str:
    """sha256 of a file's bytes (hex), after an fsync: what the marker vouches for is on disk."""
    with open(path, "rb") as f:
        os.fsync(f.fileno())
        return hashlib.file_digest(f, "sha256").hexdigest()


def _shares(sizes: dict[str, int], world: int) -> list[list[str]]:
    """Split file names over `world` ranks by bytes, largest first (the same on every rank)."""
    loads, shares = [0] * world, [[] for _ in range(world)]
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        i = loads.index(min(loads))
        shares[i].append(name)
        loads[i] += sizes[name]
    return shares


def _digests(accelerator, directory: Path, sizes: dict[str, int]) -> dict[str, str]:
    """{name: sha256} of the files `sizes` names under `directory`, each file read by one rank.

    A collective when `accelerator` has several processes (call on every rank); without an
    accelerator this process reads every file.
    """
    world, rank = (accelerator.num_processes, accelerator.process_index) if accelerator else (1, 0)
    mine = {name: _file_sha256(directory / name) for name in _shares(sizes, world)[rank]}
    if world == 1:
        return mine
    from accelerate.utils import gather_object

    return dict(sorted((k, v) for part in gather_object([mine]) for k, v in part.items()))


def save_checkpoint(
    accelerator,
    output_dir: str,
    step: int,
    save_total_limit: int | None = None,
    run_state: dict | None = None,
    hf_files: tuple = (),
) -> Path:
    """Save the full training state as `checkpoint-{step}`, atomically. Call on every rank.

    Every rank runs `save_state` (it holds collectives and per-rank shard writes); then, after a
    barrier, rank 0 writes `hf_files` (objects with `save_pretrained`, e.g. the model config and
    tokenizer, so `tools/consolidate.py` can rebuild an HF model offline); every rank fsyncs and
    hashes its share of the files (`_digests`); rank 0 fsyncs the folders, writes the marker
    (step, save order, sizes, sha256 sums and `run_state`: world size, global batch, ... for checks
    on resume; sealed by `_marker_sha256`), renames `checkpoint-{step}.tmp` into place, and deletes
    the oldest complete checkpoints beyond `save_total_limit` (`_rotate`: never the new one).

    A model with frozen parameters (LoRA: the pretrained base) is saved without them: the trainable
    parameters and their optimizer state only (`_state_kwargs`, for every strategy), and the marker
    records each trainable parameter's `trainable_sums`, which `load_checkpoint` checks after the load.

    Returns:
        The path of the finished checkpoint (the same on every rank, after a final barrier).

    Raises:
        ValueError: `save_total_limit` below 1 (a negative one sliced away the new checkpoint).
    """
    if save_total_limit is not None and save_total_limit < 1:
        raise Stop(
            f"save_total_limit must be at least 1 or None (keep all), got {save_total_limit}"
        )
    out = Path(output_dir)
    tmp, final = out / f"checkpoint-{step}.tmp", out / f"checkpoint-{step}"
    if accelerator.is_main_process and tmp.exists():
        shutil.rmtree(tmp)  # debris of a save that crashed
    accelerator.wait_for_everyone()
    partial = trainable_only(accelerator)  # frozen parameters (LoRA): left out, fingerprinted
    with _state_kwargs(accelerator, partial, load=False) as kwargs:
        accelerator.save_state(str(tmp), **kwargs)
    trainable = trainable_sums(accelerator) if partial else None  # (a collective)
    accelerator.wait_for_everyone()  # every shard is written before anyone lists them
    if accelerator.is_main_process:
        workarounds.safetensors_mode_from_umask(tmp)  # (safetensors writes 0600)
        for obj in hf_files:  # (a config with its KV cache on, as every export)
            models.inference_ready(obj).save_pretrained(tmp / "hf")
    sizes = _manifest(tmp) if accelerator.is_main_process else None
    if accelerator.num_processes > 1:  # (waits for rank 0's hf files)
        from accelerate.utils import broadcast_object_list

        sizes = broadcast_object_list([sizes])[0]
    sums = _digests(accelerator, tmp, sizes)  # each rank fsyncs and hashes its share
    if accelerator.is_main_process:
        # saved_at is information only (and zero_universal's cache key): clocks differ between nodes
        marker = {
            "step": step,
            ORDER: _next_save_order(out),
            "saved_at": time.time(),
            **(run_state or {}),
            **({TRAINABLE: trainable} if trainable is not None else {}),
            "files": sizes,
            "sha256": sums,
        }
        marker[SEAL] = _marker_sha256(marker)
        _fsync_dirs(tmp)  # the names too, before the marker vouches for them
        with open(tmp / MARKER, "w") as f:
            f.write(json.dumps(marker, indent=1))
            f.flush()
            os.fsync(f.fileno())
        _fsync(tmp)  # the marker's name
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync(out)  # the rename
        if save_total_limit:
            _rotate(out, final, save_total_limit)
    accelerator.wait_for_everyone()  # nobody reads it before the rename
    return final


def _rotate(out: Path, new: Path, save_total_limit: int) -> None:
    """Delete the oldest complete checkpoints in `out` so that `save_total_limit` remain, `new` among
    them. `new` (the checkpoint just written) is left out of the candidates, whatever the order says."""
    older = [p for p in complete_checkpoints(out) if p.name != new.name]
    for old in older[: max(0, len(older) - (save_total_limit - 1))]:
        shutil.rmtree(old)


@contextmanager
def atomic_export(accelerator, output_dir: str):
    """Write an export into `{output_dir}/final.tmp`, then move it into place as `final/`.

    Yields the temporary folder (the same path on every rank; call on every rank). After the
    block, rank 0 fsyncs what it holds and renames it over the previous `final/` (moved aside
    first and then deleted: a folder cannot be renamed over a non-empty one). So `final/` is
    always a whole export, this run's or an earlier one's, never a mix; a crash in between leaves
    `final.tmp` (deleted by the next export) and at worst `final.old` beside no `final/`. If the
    block raises, nothing is moved.
    """
    out = Path(output_dir)
    tmp, final, old = out / "final.tmp", out / "final", out / "final.old"
    if accelerator.is_main_process:
        for debris in (tmp, old):
            shutil.rmtree(debris, ignore_errors=True)
        tmp.mkdir()
    accelerator.wait_for_everyone()
    yield str(tmp)
    accelerator.wait_for_everyone()  # every rank's part is written
    if accelerator.is_main_process:
        workarounds.safetensors_mode_from_umask(tmp)  # (safetensors writes 0600)
        for f in (p for p in tmp.rglob("*") if p.is_file()):
            _fsync(f)
        _fsync_dirs(tmp)
        if final.exists():
            os.replace(final, old)
        os.replace(tmp, final)
        _fsync(out)
        shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()


def _marker_sha256(marker: dict) -> str:
    """sha256 of a marker's contents but its own sum, as canonical JSON (key order, spacing and
    tuples-as-lists do not count, so the marker read back gives the sum written)."""
    body = json.loads(json.dumps({k: v for k, v in marker.items() if k != SEAL}))
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _read_marker(marker: Path) -> dict:
    """A marker's contents, checked against its own sha256 where it has one (older ones: a warning)."""
    try:
        info = json.loads(marker.read_text())
    except ValueError:
        info = None
    if not isinstance(info, dict):
        raise Stop(f"checkpoint marker {marker} is not a JSON object: damaged or altered")
    if SEAL in info and info[SEAL] != _marker_sha256(info):
        raise Stop(
            f"checkpoint marker {marker} does not match the sha256 recorded in it when it was saved: "
            "damaged or altered"
        )
    if (
        SEAL not in info and "sha256" in info
    ):  # (a marker without file sums gets verify_checkpoint's warning)
        warnings.warn(
            f"{marker} was saved without a checksum of its own (an older version): its step and "
            "settings are not verified"
        )
    return info


def verify_checkpoint(path: Path, accelerator=None) -> dict:
    """Check a checkpoint against its marker: the marker against its own sha256, then every file
    present, of its size and sha256.

    Args:
        accelerator: share the hashing over its ranks (a collective: call on every rank); None
            hashes every file in this process. Markers without sums (checkpoints written before
            they existed) are checked by size only, with a warning; markers without their own sum,
            with a warning.

    Returns:
        The marker: `step` (optimizer steps done), `save_order`, plus the `run_state` given at save time.

    Raises:
        FileNotFoundError / ValueError: naming the missing marker, a marker that is not the one
            written (its step or settings edited, damaged), a missing file, the file whose size
            differs from the one recorded (a truncated write), or whose bytes do not match their
            sha256 (damaged on disk or in a copy).
    """
    marker = Path(path) / MARKER
    if not marker.is_file():
        raise Stop(
            f"{path} is not a complete checkpoint: {MARKER} missing (the save did not finish)"
        )
    info = _read_marker(marker)
    for name, size in info["files"].items():
        f = Path(path) / name
        if not f.is_file():
            raise Stop(f"checkpoint file missing: {f}")
        if f.stat().st_size != size:
            raise Stop(
                f"checkpoint file {f} is {f.stat().st_size} bytes, {size} were written: truncated or altered"
            )
    if "sha256" not in info:
        warnings.warn(
            f"{path} was saved without checksums (an older version): file sizes checked only"
        )
        return info
    sums = _digests(accelerator, Path(path), info["files"])
    if bad := [name for name in info["files"] if sums[name] != info["sha256"].get(name)]:
        raise Stop(
            f"checkpoint file {Path(path) / bad[0]} does not match the sha256 recorded when it was "
            f"saved: damaged or altered ({len(bad)} of {len(sums)} files differ)"
        )
    return info


def _lineage(path: Path) -> tuple[int, int]:
    """(save order, step) of a checkpoint directory: its place among the saves in its output_dir.

    A marker without a save order (an older version), or one that cannot be read, counts as 0: such
    checkpoints come first, by step among themselves. The step is the directory's name.
    """
    try:
        order = json.loads((path / MARKER).read_text()).get(ORDER, 0)
    except (OSError, ValueError, AttributeError):
        order = 0
    return order if type(order) is int else 0, int(_CKPT.match(path.name).group(1))


def _next_save_order(output_dir: Path) -> int:
    """1 + the largest save order among the complete checkpoints in `output_dir` (1 in an empty one)."""
    return 1 + max((_lineage(p)[0] for p in complete_checkpoints(output_dir)), default=0)


def complete_checkpoints(output_dir: Path) -> list[Path]:
    """Checkpoint directories that carry a marker, oldest *save* first: by (save order, step).

    The order of the saves in this folder, not the step: after a resume from checkpoint-2, the new
    checkpoint-3 is newer than an abandoned checkpoint-8, for rotation and for `latest` alike. Not a
    clock either: checkpoints written on a node whose clock runs ahead stay older than the ones
    saved after them.
    """
    found = [
        p
        for p in Path(output_dir).glob("checkpoint-*")
        if _CKPT.match(p.name) and (p / MARKER).is_file()
    ]
    return sorted(found, key=_lineage)


def resolve_checkpoint(
    output_dir: str, resume_from_checkpoint: str | None, accelerator=None
) -> tuple[Path | None, dict]:
    """Turn `--resume_from_checkpoint {PATH|latest|auto}` into a verified checkpoint.

    With `accelerator`, a collective (call on every rank): the ranks share the checksum reads.

    `latest` takes the newest complete checkpoint under `output_dir` in save order
    (`complete_checkpoints`), skipping (with a warning) any that fail verification; finding none is
    an error, as in transformers' Trainer. `auto` is the same, but finding none means a fresh start
    (the first attempt of a job that may be restarted or requeued). An explicit PATH must verify.

    Returns:
        (path, marker) as `verify_checkpoint` gives it, or (None, {"step": 0}) for a fresh start.

    Raises:
        FileNotFoundError / ValueError: an explicit PATH that is missing, incomplete or damaged,
            or `latest` with no usable checkpoint.
    """
    if not resume_from_checkpoint:
        return None, {"step": 0}
    if resume_from_checkpoint not in ("latest", "auto"):
        if not Path(resume_from_checkpoint).is_dir():
            raise Stop(f"--resume_from_checkpoint {resume_from_checkpoint}: no such directory")
        return Path(resume_from_checkpoint), verify_checkpoint(
            Path(resume_from_checkpoint), accelerator
        )
    for path in reversed(complete_checkpoints(Path(output_dir))):
        try:
            return path, verify_checkpoint(path, accelerator)
        except (FileNotFoundError, ValueError) as err:
            warnings.warn(f"skipping damaged checkpoint: {err}")
    if resume_from_checkpoint == "auto":
        return None, {"step": 0}
    raise Stop(
        f"--resume_from_checkpoint latest: no complete checkpoint in {output_dir} "
        "(save some with --save_steps)"
    )


def load_checkpoint(accelerator, path: Path, model, optimizer, optimizer_steps: int) -> list[str]:
    """`accelerator.load_state(path)` on every rank, with two workarounds (common/workarounds.py).

    FSDP1: `fill_fsdp1_optimizer_state` first, else the optimizer's moments would stay zero.
    After the load, `micro_steps_from_optimizer_steps`: the count of micro batches follows this
    run's split of the global batch (batch 2 x 1 saved at step 9, resumed as batch 1 x
    accumulation 2: 18 micro batches, where the saved count 9 would give 9 % 2 = 1 and close
    every window one micro batch early). A ZeRO-2 checkpoint of another world size loads through
    DeepSpeed's universal checkpoint (`zero_universal`); FSDP's DCP folders reshard by themselves.

    Returns:
        The names of the workarounds applied.
    """
    applied = workarounds.fill_fsdp1_optimizer_state(accelerator, model, optimizer)
    partial = trainable_only(accelerator)
    with (
        zero_universal(accelerator, path, model) as load_from,
        _state_kwargs(accelerator, partial, load=True, applied=applied) as kwargs,
    ):
        accelerator.load_state(str(load_from), **kwargs)
    if partial and (saved := _read_marker(Path(path) / MARKER).get(TRAINABLE)) is not None:
        if error := trainable_error(saved, trainable_sums(accelerator)):  # (a collective)
            raise Stop(f"cannot resume from {path}: {error}")
    applied += workarounds.relink_offload_lr_scheduler(accelerator)
    return applied + workarounds.micro_steps_from_optimizer_steps(accelerator, optimizer_steps)


TRAINABLE = (
    "trainable_sums"  # the marker's {name: [elements, sum, sum of squares]} (`trainable_sums`)
)


def trainable_only(accelerator) -> bool:
    """Whether a prepared model has frozen parameters (LoRA: the pretrained base), which its
    checkpoints leave out."""
    return any(not p.requires_grad for model in accelerator._models for p in model.parameters())


def _clean_name(name: str) -> str:
    """A parameter's name without the wrappers' parts (DDP's or DeepSpeed's `module.`, FSDP1's
    `_fsdp_wrapped_module.`, activation checkpointing's, torch.compile's)."""
    for part in ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod."):
        name = name.replace(part, "")
    return name.removeprefix("module.")


@contextmanager
def _state_kwargs(accelerator, partial: bool, load: bool, applied: list | None = None):
    """Yields the keyword arguments of `save_state` (load=False) or `load_state` that keep frozen
    parameters out of a checkpoint when `partial`, and back it in exactly; {} otherwise.

    DeepSpeed: its engine's `exclude_frozen_parameters` on save, `load_module_strict=False` on load
    (Accelerate passes both through). FSDP1 and FSDP2: `workarounds.fsdp_trainable_state_only`
    for the block (its name is added to `applied`). Single process and DDP: a save hook of
    Accelerate's, for the block, drops the frozen weights from `model.safetensors` (by the bare
    model's names, which its keys carry; a save that would keep fewer than every trainable
    parameter stops), and the load is not strict. Optimizers hold the trainable parameters only.
    """
    if not partial:
        yield {}
    elif accelerator.distributed_type == DistributedType.DEEPSPEED:
        yield {"load_module_strict": False} if load else {"exclude_frozen_parameters": True}
    elif accelerator.distributed_type == DistributedType.FSDP:
        with workarounds.fsdp_trainable_state_only(accelerator) as names:
            if applied is not None:
                applied += names
            yield {}
    elif load:
        yield {"strict": False}
    else:

        def drop_frozen(models, weights, output_dir):
            for model, weights_of_model in zip(models, weights):
                bare = accelerator.unwrap_model(model, keep_torch_compile=False)
                trainable = {name for name, p in bare.named_parameters() if p.requires_grad}
                for key in [key for key in weights_of_model if _clean_name(key) not in trainable]:
                    del weights_of_model[key]
                if missing := trainable - set(map(_clean_name, weights_of_model)):
                    raise Stop(
                        f"a checkpoint would lack {len(missing)} of the {len(trainable)} trainable "
                        f"parameters (first: {sorted(missing)[0]})"
                    )

        handle = accelerator.register_save_state_pre_hook(drop_frozen)
        try:
            yield {}
        finally:
            handle.remove()


def trainable_sums(accelerator) -> dict[str, list]:
    """{name: [elements, sum, sum of squares]} of every trainable parameter of the prepared models,
    whole (over every rank's shard), in fp64: what a checkpoint of a model with frozen parameters
    records, so that a load which silently left a parameter as it was is caught. A collective.

    Cheap for LoRA (the adapters only): ZeRO-3 gathers the trainable parameters, FSDP2 each
    trainable DTensor whole; FSDP1 adds up its ranks' local views (`use_orig_params`); replicated
    strategies (single, DDP, ZeRO-2) read their own copy.
    """
    import torch

    sums, deepspeed = {}, accelerator.distributed_type == DistributedType.DEEPSPEED
    fsdp1 = accelerator.distributed_type == DistributedType.FSDP and not accelerator.is_fsdp2
    for index, model in enumerate(accelerator._models):
        named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        gather = contextlib.nullcontext()
        if deepspeed and accelerator.state.deepspeed_plugin.zero_stage == 3:
            import deepspeed as ds

            gather = ds.zero.GatheredParameters([p for _, p in named])
        rows = []
        with gather:
            for _, p in named:
                whole = p.full_tensor() if hasattr(p, "full_tensor") else p  # FSDP2: a DTensor
                values = whole.detach().double()
                rows.append(
                    torch.stack(
                        [
                            values.new_tensor(float(values.numel())),
                            values.sum(),
                            values.square().sum(),
                        ]
                    )
                )
        table = (
            torch.stack(rows)
            if rows
            else torch.zeros((0, 3), dtype=torch.float64, device=accelerator.device)
        )
        if fsdp1 and accelerator.num_processes > 1:  # each rank holds a slice of each parameter
            torch.distributed.all_reduce(table)
        prefix = f"model_{index}." if index else ""
        sums.update(
            {prefix + _clean_name(name): row for (name, _), row in zip(named, table.tolist())}
        )
    return sums


def trainable_error(saved: dict, loaded: dict) -> str | None:
    """Why the trainable parameters after a load are not the ones a checkpoint recorded
    (`trainable_sums`), as one clause; None if they are (fp64 sums: 1e-9 relative, room for
    another summation order on another number of ranks)."""
    if missing := sorted(set(saved) ^ set(loaded)):
        return (
            f"its trainable parameters are not this model's: {len(missing)} names differ (first: "
            f"{missing[0]}); resume with the --lora_* and model settings it was saved with"
        )

    def differs(a, b):
        (n, total, squares), (_, total_now, squares_now) = a, b
        return not (
            math.isclose(squares, squares_now, rel_tol=1e-9, abs_tol=1e-30)
            and abs(total - total_now) <= 1e-9 * math.sqrt(max(squares, 1e-60) * max(n, 1))
        )

    if wrong := [name for name in saved if differs(saved[name], loaded[name])]:
        return (
            f"{len(wrong)} of its {len(saved)} trainable parameters did not load (first: {wrong[0]}: "
            f"sum of squares {saved[wrong[0]][2]:.9g} saved, {loaded[wrong[0]][2]:.9g} after the load)"
        )
    return None


@contextmanager
def zero_universal(accelerator, path: Path, engine):
    """Yields the folder to `load_state` from: `path`, or for a ZeRO-2 checkpoint written by another
    number of ranks, a universal copy of it. A collective: call on every rank.

    DeepSpeed loads its ZeRO-2 optimizer partitions only on the number of ranks that wrote them. Its
    universal checkpoint holds every parameter's fp32 weights, moments and step whole, and loads on
    any number: each node's first rank converts `path/pytorch_model` with `ds_to_universal`
    (`--inject_missing_state`: Accelerate's engine records no universal-checkpoint info) into a
    node-local temporary folder ($TMPDIR; 82 MB for the debug model's 65 MB of ZeRO-2 files), beside
    links to `path`'s other files (LR scheduler, RNG states); the engine loads it with
    `load_universal_checkpoint` on, and the folder is deleted after. A failed conversion stops every
    rank with one line.
    """
    import tempfile
    from types import SimpleNamespace

    saved = json.loads((Path(path) / MARKER).read_text())
    if (
        saved.get("distributed_type") != "DEEPSPEED_ZERO2"
        or strategy_name(accelerator) != "DEEPSPEED_ZERO2"
        or saved.get("world_size") in (None, accelerator.num_processes)
    ):
        yield path
        return
    key = hashlib.sha256(f"{Path(path).resolve()}:{saved.get('saved_at')}".encode()).hexdigest()[
        :16
    ]
    folder = (
        Path(tempfile.gettempdir()) / f"zero-universal-{key}"
    )  # the same name on every rank of a node
    error = None
    if accelerator.is_local_main_process:
        import contextlib
        import io

        from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

        try:
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            for item in Path(path).iterdir():
                if item.name != "pytorch_model":
                    (folder / item.name).symlink_to(item.resolve())
            with contextlib.redirect_stdout(io.StringIO()):  # a line per tensor
                ds_to_universal(
                    SimpleNamespace(
                        input_folder=str(Path(path) / "pytorch_model"),
                        output_folder=str(folder / "pytorch_model"),
                        num_extract_workers=1,
                        num_merge_workers=1,
                        keep_temp_folder=False,
                        strict=True,
                        inject_missing_state=True,
                    )
                )
        except (Exception, SystemExit) as err:  # (every rank stops, not only this one)
            shutil.rmtree(folder, ignore_errors=True)
            error = (
                f"cannot resume from {path} on {accelerator.num_processes} rank(s): converting it to "
                f"{folder} with DeepSpeed's ds_to_universal failed: {type(err).__name__}: {err}"
            )
    if accelerator.num_processes > 1:
        from accelerate.utils import gather_object

        error = next((e for e in gather_object([error]) if e), None)
    if error:
        raise Stop(error)
    engine._config.load_universal_checkpoint = True
    try:
        yield folder
    finally:
        engine._config.load_universal_checkpoint = False
        accelerator.wait_for_everyone()
        if accelerator.is_local_main_process:
            shutil.rmtree(folder, ignore_errors=True)


# The flags behind the settings a resume compares that are not flags themselves.
_DATA = (
    "--train_file, --validation_file, --dataset_name, --dataset_config_name, --validation_split_percentage, "
    "the tokenizer (--tokenizer_name_or_path, --model_name_or_path, --vocab_size), --block_size, --packing"
)
SETTING_SOURCES = {
    "data_digest": f"the data: {_DATA}",
    "train_blocks": f"the data: {_DATA}",
    "train_passages": "the data: --tokenizer_name_or_path, --block_size, --validation_split_percentage, "
    "--max_train_samples",
    "global_batch": "--per_device_train_batch_size x --gradient_accumulation_steps x world size",
    "frozen_base": "the frozen base model's weights: --model_name_or_path",
}


def changed_settings(saved: dict, current: dict) -> list[str]:
    """The settings a checkpoint was saved with that differ now, as "name saved -> now" strings.

    Keys the checkpoint did not record (older checkpoints) are not compared. Use it for what a
    resume restores silently (the optimizer's LR, weight decay and betas come back from its state)
    or what the data position depends on (seed, blocks, global batch): a difference there means
    the resumed run would not be the run the flags and logs describe.
    """
    changes, named = [], set()
    for k, v in current.items():
        if k not in saved or saved[k] == v:
            continue
        if isinstance(v, dict) and isinstance(
            saved[k], dict
        ):  # e.g. the model config: name the keys
            changes += [
                f"{k}.{key} {saved[k].get(key)} -> {v.get(key)}"
                for key in sorted(set(v) | set(saved[k]))
                if saved[k].get(key) != v.get(key)
            ]
            continue
        source = SETTING_SOURCES.get(k)  # its flags once; then "(the data)"
        changes.append(
            f"{k} {saved[k]} -> {v}"
            + (f" ({source if source not in named else source.split(':')[0]})" if source else "")
        )
        named.add(source)
    return changes


def start_fresh(accelerator, output_dir: str) -> None:
    """A fresh (not resumed) run: remove the checkpoints an earlier run left in `output_dir`.

    Under `--overwrite_output_dir`, `run_dir.claim` has emptied the directory already; this also
    covers a restarted job whose `auto` found no intact checkpoint (damaged ones, unfinished
    saves). Left there, a later `--resume_from_checkpoint latest` would pick such a checkpoint
    whenever this run saved none yet (a crash before its first save), and train the old weights
    under the new flags. Only `checkpoint-N` and `checkpoint-N.tmp` directories go; nothing else
    in the directory is touched. Call on every rank (rank 0 deletes, all wait).
    """
    if accelerator.is_main_process:
        for path in Path(output_dir).glob("checkpoint-*"):
            if path.is_dir() and re.match(r"^checkpoint-\d+(\.tmp)?$", path.name):
                shutil.rmtree(path)
    accelerator.wait_for_everyone()


def precision_state(accelerator) -> dict:
    """The precision settings a resume must keep, for a checkpoint's run state.

    `mixed_precision`, and under DeepSpeed the JSON's gradient-reduction dtypes
    (`communication_data_type`, `data_types.grad_accum_dtype`; "default" when unset, i.e. the
    model's dtype): a resumed ZeRO run that reduces its gradients in bf16 instead of fp32 trains
    on, exits 0, and differs from the run it continues (measured: 7e-6 relative at step 4).

    Returns:
        {"mixed_precision": "no" | "bf16" | "fp16", plus, under DeepSpeed,
        "deepspeed_communication_data_type" and "deepspeed_grad_accum_dtype" as strings}.
    """
    state = {"mixed_precision": accelerator.mixed_precision}
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        config = accelerator.state.deepspeed_plugin.deepspeed_config
        state["deepspeed_communication_data_type"] = str(
            config.get("communication_data_type") or "default"
        )
        state["deepspeed_grad_accum_dtype"] = str(
            (config.get("data_types") or {}).get("grad_accum_dtype") or "default"
        )
    return state


def strategy_name(accelerator) -> str:
    """The strategy as a checkpoint records it: Accelerate's distributed type, plus the FSDP version
    or the ZeRO stage ("FSDP2", "FSDP1", "DEEPSPEED_ZERO3", "MULTI_CPU", ...), and a 2-D mesh
    ("FSDP2 (dp_replicate 2 x dp_shard 2)": HSDP's states are laid out on it).

    Accelerate's own name ("FSDP", "DEEPSPEED") is one for FSDP1 and FSDP2, ZeRO-2 and ZeRO-3,
    whose sharded states differ: `resume_error` compares this name, so every recipe records it.
    """
    name = accelerator.distributed_type.value
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        return f"{name}_ZERO{accelerator.state.deepspeed_plugin.zero_stage}"
    if accelerator.distributed_type == DistributedType.FSDP:
        mesh = launch.mesh_layout(accelerator)  # HSDP: "FSDP2 (dp_replicate 2 x dp_shard 2)"
        return (
            name
            + ("2" if accelerator.is_fsdp2 else "1")
            + (f" ({' x '.join(f'{dim} {size}' for dim, size in mesh.items())})" if mesh else "")
        )
    return name


REPLICATED = {
    "NO",
    "MULTI_CPU",
    "MULTI_GPU",
}  # a full model state on every rank: loads at any world size
# Sharded states that load on another number of ranks, exactly, and through what. Accelerate writes
# FSDP's model and optimizer with torch.distributed.checkpoint (SHARDED_STATE_DICT; FULL_STATE_DICT
# writes whole files), which reshards on load; LOCAL_STATE_DICT's per-rank files do not. ZeRO-2 loads
# through a universal checkpoint (`zero_universal`). ZeRO-3 is refused, for the reason given.
RESHARDS = {"FSDP2": "DCP", "FSDP1": "DCP", "DEEPSPEED_ZERO2": "DeepSpeed's universal checkpoint"}
NO_RESHARD = {
    "DEEPSPEED_ZERO3": "DeepSpeed loads ZeRO-3 optimizer partitions on the number of ranks that wrote "
    "them only, and its universal checkpoint does not continue a ZeRO-3 run exactly (0.3% off in grad "
    "norm within 6 steps, even on as many ranks)"
}


def layout_error(saved: dict, run_state: dict) -> str | None:
    """Why a checkpoint's sharded layout cannot load in this run, as one clause; None if it can.

    A full state (single process, DDP) loads anywhere replicated; a sharded one only on its own
    strategy (FSDP1 and FSDP2, ZeRO-2 and ZeRO-3 write different states), and on another world size
    only where `RESHARDS` names how.
    """
    (was, n), (now, m) = (
        (saved.get("distributed_type"), saved.get("world_size")),
        (run_state["distributed_type"], run_state["world_size"]),
    )
    if not was or {was, now} <= REPLICATED or (was, n) == (now, m):
        return None
    if was != now:
        return (
            f"a {was} state of {n} rank(s), this run is {now} with {m} (a sharded FSDP/ZeRO state resumes "
            "on its own strategy only; tools/consolidate.py converts one to plain weights)"
        )
    per_rank = sorted(f for f in saved.get("files", {}) if re.search(r"_rank\d+\.bin$", f))
    why = (
        NO_RESHARD.get(was, "no resharding")
        if was not in RESHARDS
        else (
            f"its model or optimizer is saved one file per rank ({per_rank[0]}: LOCAL_STATE_DICT), not through DCP"
            if per_rank
            else None
        )
    )
    if n != m and why:
        return (
            f"a {was} state of {n} rank(s), this run has {m}: {why} (resume on {n} ranks, or convert it "
            "with tools/consolidate.py and start from its weights)"
        )
    return None


def resume_error(
    path: Path,
    saved: dict,
    run_state: dict,
    must_match: list[str],
    lr_decays_after: int | None = None,
) -> str | None:
    """Why this run cannot continue the checkpoint at `path` exactly, as one line; None if it can.

    Args:
        saved: the checkpoint's marker (`resolve_checkpoint`).
        run_state: this run's values, with `distributed_type` (e.g. "FSDP2", "DEEPSPEED_ZERO3")
            and `world_size` among them, and `max_steps` (the step this run ends at).
        must_match: keys of `run_state` that must equal the saved ones: what fixes the data
            position (global batch, seed, blocks), and what the optimizer state would silently
            bring back (LR, weight decay, betas). Keys the checkpoint did not record are skipped;
            `max_steps` is not compared here (see `lr_decays_after` and the end). The world size is
            compared only where it is listed here (dropout masks, per-rank data shards) or where
            the strategy cannot reshard (`layout_error`).
        lr_decays_after: the warmup steps of an LR schedule that decays over `max_steps` after
            them (cosine, linear); None where the LR does not depend on `max_steps`. Another
            `max_steps` is then refused once the checkpoint is past the warmup: its steps, and
            the LR its optimizer holds for the next one, came from the old schedule. Within the
            warmup, where both schedules agree, the run continues exactly as the longer one.

    The end: a checkpoint past `max_steps` is refused (nothing would train, and the export would
    hold the later weights under this run's name), and so is one exactly at `max_steps` saved by
    a run with another `max_steps` (its weights come from another schedule). Exactly at the end
    of the same run (same `max_steps`, or a marker without one) is allowed: nothing trains, and
    the recipe exports the checkpoint's weights again (a job that died after its last save).

    Returns:
        "cannot resume from PATH: seed 42 -> 7; ...", listing every difference, including a
        sharded state on another strategy, or on another world size where it cannot reshard; or None.
    """
    changes = changed_settings(saved, {k: run_state[k] for k in must_match if k != "max_steps"})
    before, after = saved.get("max_steps"), run_state.get("max_steps")
    if (
        lr_decays_after is not None
        and before not in (None, after)
        and saved["step"] > lr_decays_after
    ):
        changes.append(
            f"max_steps {before} -> {after} (the LR decays over --max_steps after {lr_decays_after} "
            f"warmup steps, and the checkpoint's {saved['step']} steps went past them)"
        )
    if layout := layout_error(saved, run_state):
        changes.append(layout)
    if end_error := _end_error(saved, run_state.get("max_steps")):
        return f"cannot resume from {path}: {end_error}"
    if not changes:
        return None
    return (
        f"cannot resume from {path}: {'; '.join(changes)}. Resume with the saved settings, or start a new run "
        "(into another --output_dir) from its weights"
    )


def _end_error(saved: dict, max_steps: int | None) -> str | None:
    """Why a checkpoint at or past this run's last step cannot be resumed (`resume_error`); else None."""
    at, before = saved["step"], saved.get("max_steps")
    if max_steps is None or at < max_steps or (at == max_steps and before in (None, max_steps)):
        return None
    of = f" of a {before}-step run" if before is not None else ""
    return (
        f"it is at step {at}{of}, and this run ends at step {max_steps} (--max_steps, or --num_train_epochs): "
        f"nothing would train. Give --max_steps above {at} to train on, or start a new run (into another "
        "--output_dir) from its weights"
    )


def check_shared_dir(accelerator, output_dir: str) -> None:
    """Refuse to start unless every rank sees the same `output_dir` (a shared disk across nodes).

    Checkpoints are written collectively (each rank its shards and RNG state) and then marked and
    renamed by rank 0, so a node-local `output_dir` splits every checkpoint between machines: rank
    0 renames a directory that lacks the other nodes' files. Every rank writes one empty file
    named by a token from rank 0, and then counts them. A collective: call on every rank.

    Raises:
        ValueError: on every rank, naming the directory and how many ranks' files this rank sees.
    """
    import torch
    from accelerate.utils import broadcast_object_list

    if accelerator.num_processes == 1:
        return
    token = broadcast_object_list([uuid.uuid4().hex if accelerator.is_main_process else None])[0]
    mine = Path(output_dir) / f".shared-check-{token}-{accelerator.process_index}"
    mine.touch()
    accelerator.wait_for_everyone()
    seen = len(list(Path(output_dir).glob(f".shared-check-{token}-*")))
    worst = accelerator.gather(torch.tensor([seen], device=accelerator.device)).min().item()
    accelerator.wait_for_everyone()
    mine.unlink()
    if worst != accelerator.num_processes:
        raise Stop(
            f"--output_dir {output_dir} is not one directory shared by every rank: rank "
            f"{accelerator.process_index} on {os.uname().nodename} sees {seen} of the "
            f"{accelerator.num_processes} ranks' files there (fewest seen by any rank: {worst}). "
            "Checkpoints are written by every rank and finished by rank 0: give every node the same "
            "shared filesystem path"
        )


def stop_on_signal(accelerator, timeout_s: float):
    """Turn SIGTERM, SIGINT and SIGHUP into "save at the next step boundary, then exit"; returns `preempted()`.

    SLURM (preemption, a time limit, `scancel --signal=TERM`), Kubernetes (eviction) and a user
    (`kill`, Ctrl-C, a closed terminal) send one of these before anything harder; torchrun passes
    the one its launcher got on to every worker, then SIGKILLs them after 30 s (SLURM: `KillWait`,
    often 30 s; Kubernetes: `terminationGracePeriodSeconds`, 30 s by default). The handler only
    records the signal. Call `preempted()` on every rank at every optimizer-step boundary: it
    all-reduces the signal number (MAX) over a gloo group, so every rank stops at the same step
    even when the signal reaches the ranks at different moments. That is one 4-byte CPU
    collective per step, with no device sync. Install it right before the training loop: until
    then these signals end the process as usual.

    Args:
        timeout_s: collective timeout in seconds (`--ddp_timeout`).

    Returns:
        `preempted() -> str | None`: the signal's name (e.g. "SIGTERM") on every rank once any rank
        received one, else None.
    """
    import torch
    import torch.distributed as dist

    received = []

    def handler(signum, frame):
        received.append(signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, handler)
    group = None
    if (
        dist.is_initialized() and accelerator.num_processes > 1
    ):  # a CPU group, whatever the device backend
        group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))

    def preempted() -> str | None:
        signum = torch.tensor([received[0] if received else 0], dtype=torch.int32)
        if group is not None:
            dist.all_reduce(signum, op=dist.ReduceOp.MAX, group=group)
        return signal.Signals(int(signum)).name if int(signum) else None

    return preempted


def full_state_dict(accelerator, model) -> dict:
    """The full (unsharded) model state dict for export. Call on every rank: it is a collective.

    `accelerator.get_state_dict`, except FSDP1 on a CPU-only host, which gathers without
    offloading (`workarounds.fsdp1_cpu_state_dict`).

    Returns:
        name -> full-size tensor on rank 0 (FSDP1 leaves other ranks' dicts empty).
    """
    state_dict = workarounds.fsdp1_cpu_state_dict(accelerator, model)
    return accelerator.get_state_dict(model) if state_dict is None else state_dict


def export_model(accelerator, model, tokenizer, output_dir: str) -> str:
    """Write the trained model and its tokenizer to `{output_dir}/final/` in Hugging Face format
    (safetensors), whole and atomically (`atomic_export`); returns that path. Call on every rank:
    gathering a sharded state dict is a collective; only rank 0 writes.

    Replicated runs (single, DDP) save the bare model's own state dict: Accelerate's
    `get_state_dict` returned the DDP wrapper's ("module." keys) under regional compilation, and
    the export reloaded untrained. Tied embeddings are stored once, as Hugging Face does (gathered
    copies no longer share storage). The configs are written ready for inference
    (`models.inference_ready`: the KV cache that training turns off is on). A LoRA model (peft)
    writes its adapter to `final/adapter/` (peft's files) and the model with the adapter merged
    to `final/` (`models.lora_copy`).
    """
    unwrapped = accelerator.unwrap_model(
        model, keep_torch_compile=False
    )  # (True re-points a compiled DDP model)
    sharded = accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED)
    state_dict = full_state_dict(accelerator, model) if sharded else unwrapped.state_dict()
    if state_dict and getattr(
        unwrapped.config, "tie_word_embeddings", False
    ):  # (other ranks may hold none)
        state_dict.pop("lm_head.weight", None)
    adapter = hasattr(unwrapped, "peft_config")  # LoRA (peft): the adapter, and the merged model
    with atomic_export(accelerator, output_dir) as export_dir:  # final/ is never half written
        whole = unwrapped
        if adapter and accelerator.is_main_process:  # a fresh copy of the gathered weights
            copy = models.lora_copy(unwrapped, state_dict)
            copy.save_pretrained(os.path.join(export_dir, "adapter"))  # peft's own files
            whole = copy.merge_and_unload()
        # configs ready for inference (the KV cache on), then the live ones back; a model that
        # generates nothing (a classifier) has no generation config
        names = [n for n in ("config", "generation_config") if getattr(whole, n, None) is not None]
        live = {n: getattr(whole, n) for n in names}
        for name in names:
            setattr(whole, name, models.inference_ready(live[name]))
        try:
            whole.save_pretrained(
                export_dir,
                is_main_process=accelerator.is_main_process,
                save_function=accelerator.save,
                state_dict=None if whole is not unwrapped else state_dict,
            )
        finally:
            for name in names:
                setattr(whole, name, live[name])
        if accelerator.is_main_process:
            tokenizer.save_pretrained(export_dir)
    return os.path.join(output_dir, "final")


def resume_or_start(
    accelerator,
    args,
    run_state: dict,
    must_match: list[str] | None = None,
    lr_decays_after: int | None = None,
) -> tuple[Path | None, dict]:
    """Resolve --resume_from_checkpoint, and refuse a checkpoint that would not continue this run exactly.

    Every recipe's resume check. Called before `prepare` (llama.py, ddp_classifier.py), a refused
    resume leaves before any wrapped model exists. A fresh run marks its folder (`start_fresh`): an
    overwritten run's checkpoints are never resumed. Loading the state (`load_checkpoint`, after
    `prepare`) is the recipe's.

    Args:
        run_state: what this run is (recorded in its checkpoints): `resume_error` compares
            `must_match` of its keys (None: all of them) with the checkpoint's.
        lr_decays_after: the warmup steps of an LR schedule that decays over `max_steps`
            (`resume_error`); another `max_steps` within them is allowed, with a line that says so.

    Returns:
        (the checkpoint's path or None, its recorded state: `resolve_checkpoint`'s, {"step": 0} fresh).
    """
    try:
        path, saved = resolve_checkpoint(args.output_dir, args.resume_from_checkpoint, accelerator)
    except Stop as err:
        raise Stop(f"cannot resume: {err}") from None
    if not path:
        start_fresh(accelerator, args.output_dir)
        return None, saved
    if error := resume_error(
        path,
        saved,
        run_state,
        list(run_state) if must_match is None else must_match,
        lr_decays_after,
    ):
        raise Stop(error)
    max_steps = run_state.get("max_steps")
    if lr_decays_after is not None and saved.get("max_steps", max_steps) != max_steps:
        accelerator.print(
            f"{path} was saved by a {saved['max_steps']}-step run, this one has {max_steps}: its "
            f"{saved['step']} steps are all in the {lr_decays_after}-step warmup, which --max_steps "
            f"does not change, so it continues exactly as a {max_steps}-step run"
        )
    return path, saved


def resumed_line(
    path: Path, step: int, saved: dict | None = None, run_info: dict | None = None
) -> str:
    """ "resumed from PATH at step N", which restart this is, if one (`restart_note`), and, on another
    world size than the checkpoint's (`saved`: its marker), how it got here: e.g. ": resharded from 2
    to 3 ranks through DCP". With `run_info` (this run's, with its `world_size`), records the same
    under its "resumed" key for run_info.json: checkpoint, step, saved_world_size, resharded (how,
    or None for a full state that every rank loads whole, or the same world size).
    """
    line = f"resumed from {path} at step {step}" + (
        f" ({note})" if (note := restart_note()) else ""
    )
    if saved is None or run_info is None:
        return line
    n, m, how = (
        saved.get("world_size"),
        run_info["world_size"],
        RESHARDS.get(saved.get("distributed_type")),
    )
    moved = n is not None and n != m
    run_info["resumed"] = {
        "checkpoint": str(path),
        "step": step,
        "saved_world_size": n,
        "resharded": how if moved else None,
    }
    if not moved:
        return line
    return line + (
        f": resharded from {n} to {m} ranks through {how}"
        if how
        else f": written by {n} rank(s), loaded whole on each of {m}"
    )


def run_state(
    accelerator, args, model, learning_rate: float, max_steps: int, **data_position
) -> tuple[dict, list[str]]:
    """What a causal-LM run records in its checkpoints, and the keys a resume must match.

    Must match: `data_position` (the global batch, seed, blocks: what fixes the data order), and
    what a resume restores whatever the flags say: the optimizer's LR (`learning_rate`, after any
    scaling), decay, betas and warmup, --max_grad_norm, the precision (`precision_state`: another
    precision is another run) and the model config; with dropout, also the split of the global
    batch over micro batches and ranks, on which its masks depend. Recorded besides, for
    `resume_error`: the world size and strategy (`strategy_name`), and `max_steps`. A model with
    frozen parameters (LoRA) must also keep its base: `frozen_base`, the digest of the pretrained
    weights (`models.weights_digest`), as the checkpoint does not hold them.

    Returns:
        (the run state, the keys of it that must match, data position first).
    """
    same_run = {
        "learning_rate": learning_rate,
        "max_grad_norm": args.max_grad_norm,
        **{
            k: getattr(args, k)
            for k in ("weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon", "warmup_steps")
        },
        **precision_state(accelerator),
        "model_config": models.config_state(model.config),
        **_frozen_base(args, model),
        **(
            {
                "per_device_train_batch_size": args.per_device_train_batch_size,
                "gradient_accumulation_steps": args.gradient_accumulation_steps,
                "world_size": accelerator.num_processes,
            }
            if models.uses_dropout(model)
            else {}
        ),
    }
    state = {
        "world_size": accelerator.num_processes,
        "max_steps": max_steps,
        "distributed_type": strategy_name(accelerator),
        **data_position,
        **same_run,
    }
    return state, [*data_position, *same_run]


def _frozen_base(args, model) -> dict:
    """{"frozen_base": the digest of the pretrained weights} for a model with frozen parameters
    (`models.weights_digest` of --model_name_or_path, else of the config's source); {} otherwise,
    or where no weight files are found."""
    if all(p.requires_grad for p in model.parameters()):
        return {}
    source = getattr(args, "model_name_or_path", None) or getattr(
        model.config, "_name_or_path", None
    )
    digest = models.weights_digest(source)
    return {"frozen_base": digest} if digest else {}
