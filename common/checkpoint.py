"""Atomic, verified checkpoints around `save_state` / `load_state`, the resume check, the export:
`checkpoint-{step}/COMPLETE.json`, written last, holds the step, save order, run state, each
file's size and sha256, and its own sha256."""

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
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

from accelerate.utils import DistributedType

from common import errors, launch, models, schedule, workarounds
from common.errors import Stop
from common.run_dir import restart_note

MARKER = "COMPLETE.json"
ORDER = "save_order"  # the marker's place among its output_dir's saves
SEAL = "marker_sha256"  # the marker's sha256 of its other contents (`_marker_sha256`)
TRAINABLE = "trainable_sums"  # a partial checkpoint's {name: [elements, sum, sum of squares]}
_CKPT = re.compile(r"^checkpoint-(\d+)$")
PREEMPTED_EXIT_CODE = 143  # 128 + SIGTERM, as a shell reports a job ended by SIGTERM; never 0


def _fsync(*paths: Path) -> None:
    """Flush files' and folders' (their entries') data and metadata to disk."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _digests(accelerator, directory: Path, sizes: dict[str, int]) -> dict[str, str]:
    """{name: sha256} of the files `sizes` names, each hashed by one rank (a collective)."""
    world, rank = (accelerator.num_processes, accelerator.process_index) if accelerator else (1, 0)
    loads, mine = [0] * world, {}
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        i = loads.index(min(loads))
        loads[i] += sizes[name]
        if i == rank:
            with open(directory / name, "rb") as f:
                os.fsync(f.fileno())  # what the marker vouches for is on disk
                mine[name] = hashlib.file_digest(f, "sha256").hexdigest()
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
    """Save the training state as `{output_dir}/checkpoint-{step}`, atomically (every rank); returns
    its path. `run_state` goes into the marker, `hf_files` into `hf/` (tools/consolidate.py).
    Frozen parameters are left out; `trainable_sums` vouch for the rest."""
    if save_total_limit is not None and save_total_limit < 1:
        raise Stop(
            f"save_total_limit must be at least 1 or None (keep all), got {save_total_limit}"
        )
    out = Path(output_dir)
    tmp, final = out / f"checkpoint-{step}.tmp", out / f"checkpoint-{step}"
    if accelerator.is_main_process and tmp.exists():
        shutil.rmtree(tmp)  # debris of a save that crashed
    accelerator.wait_for_everyone()
    partial = trainable_only(accelerator)
    with _state_kwargs(accelerator, partial, load=False) as kwargs:
        accelerator.save_state(str(tmp), **kwargs)
    trainable = trainable_sums(accelerator) if partial else None  # (a collective)
    accelerator.wait_for_everyone()  # every shard is written before anyone lists them
    sizes = None
    if accelerator.is_main_process:
        workarounds.safetensors_mode_from_umask(tmp)  # (safetensors writes 0600)
        for obj in hf_files:  # (a config with its KV cache on, as every export)
            models.for_inference(obj).save_pretrained(tmp / "hf")
        files = sorted(p for p in tmp.rglob("*") if p.is_file())
        sizes = {str(p.relative_to(tmp)): p.stat().st_size for p in files}
    if accelerator.num_processes > 1:  # (waits for rank 0's hf files)
        from accelerate.utils import broadcast_object_list

        sizes = broadcast_object_list([sizes])[0]
    sums = _digests(accelerator, tmp, sizes)
    if accelerator.is_main_process:
        done = complete_checkpoints(out)
        older = [p for p in done if p.name != final.name]  # the new one is never rotated out
        marker = {
            "step": step,
            ORDER: 1 + max((_lineage(p)[0] for p in done), default=0),
            "saved_at": time.time(),  # information only: clocks differ between nodes
            **(run_state or {}),
            **({TRAINABLE: trainable} if partial else {}),
            "files": sizes,
            "sha256": sums,
        }
        marker[SEAL] = _marker_sha256(marker)
        _fsync(tmp, *(p for p in tmp.rglob("*") if p.is_dir()))  # the names the marker vouches for
        (tmp / MARKER).write_text(json.dumps(marker, indent=1))
        _fsync(tmp / MARKER, tmp)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync(out)
        if save_total_limit:
            for old in older[: max(0, len(older) - (save_total_limit - 1))]:
                shutil.rmtree(old)
    accelerator.wait_for_everyone()  # nobody reads it before the rename
    return final


@contextmanager
def _atomic_export(accelerator, output_dir: str):
    """Yields `{output_dir}/final.tmp`; after the block rank 0 fsyncs it and renames it `final/`."""
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
        _fsync(*tmp.rglob("*"), tmp)  # files and folders
        if final.exists():
            os.replace(final, old)
        os.replace(tmp, final)
        _fsync(out)
        shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()


def _marker_sha256(marker: dict) -> str:
    """sha256 of a marker but its own sum, as canonical JSON (read back, it gives the same sum)."""
    body = json.loads(json.dumps({k: v for k, v in marker.items() if k != SEAL}))
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def verify_checkpoint(path: Path, accelerator=None) -> dict:
    """The marker at `path`, checked against its sha256 and each file's; Stop naming a mismatch."""
    marker = Path(path) / MARKER
    if not marker.is_file():
        raise Stop(
            f"{path} is not a complete checkpoint: {MARKER} missing (the save did not finish)"
        )
    try:
        info = json.loads(marker.read_text())
    except ValueError:
        info = None
    if not isinstance(info, dict):
        raise Stop(f"checkpoint marker {marker} is not a JSON object: damaged or altered")
    if SEAL in info and info[SEAL] != _marker_sha256(info):
        raise Stop(
            f"checkpoint marker {marker} does not match the sha256 recorded in it when it was "
            "saved: damaged or altered"
        )
    if SEAL not in info and "sha256" in info:
        errors.warn(
            f"{marker} was saved without a checksum of its own (an older version): its step and "
            "settings are not verified"
        )
    for name, size in info["files"].items():
        f = Path(path) / name
        if not f.is_file():
            raise Stop(f"checkpoint file missing: {f}")
        if f.stat().st_size != size:
            raise Stop(
                f"checkpoint file {f} is {f.stat().st_size} bytes, {size} were written: truncated "
                "or altered"
            )
    if "sha256" not in info:
        errors.warn(f"{path} was saved without checksums (an older version): sizes checked only")
        return info
    sums = _digests(accelerator, Path(path), info["files"])
    if bad := [name for name in info["files"] if sums[name] != info["sha256"].get(name)]:
        raise Stop(
            f"checkpoint file {Path(path) / bad[0]} does not match the sha256 recorded when it was "
            f"saved: damaged or altered ({len(bad)} of {len(sums)} files differ)"
        )
    return info


def _lineage(path: Path) -> tuple[int, int]:
    """(save order, step) of a checkpoint folder; an unreadable or older marker's order is 0."""
    try:
        order = json.loads((path / MARKER).read_text()).get(ORDER, 0)
    except (OSError, ValueError, AttributeError):
        order = 0
    return order if type(order) is int else 0, int(_CKPT.match(path.name).group(1))


def complete_checkpoints(output_dir: Path) -> list[Path]:
    """The checkpoint folders of `output_dir` with a marker, oldest save first (not by step)."""
    found = Path(output_dir).glob("checkpoint-*")
    return sorted(
        (p for p in found if _CKPT.match(p.name) and (p / MARKER).is_file()), key=_lineage
    )


def _resolve_checkpoint(
    output_dir: str, resume_from_checkpoint: str | None, accelerator=None
) -> tuple[Path | None, dict]:
    """(path, marker) of the verified checkpoint `--resume_from_checkpoint {PATH|latest|auto}`
    names, or (None, {"step": 0}). `latest`/`auto`: the newest that verifies; with none, `latest`
    stops and `auto` starts fresh, unless all are damaged. With `accelerator`, a collective."""
    if not resume_from_checkpoint:
        return None, {"step": 0}
    if resume_from_checkpoint not in ("latest", "auto"):
        path = Path(resume_from_checkpoint)
        if not path.is_dir():
            raise Stop(f"--resume_from_checkpoint {resume_from_checkpoint}: no such directory")
        return path, verify_checkpoint(path, accelerator)
    found = complete_checkpoints(Path(output_dir))
    for path in reversed(found):
        try:
            return path, verify_checkpoint(path, accelerator)
        except (OSError, Stop) as err:
            errors.warn(f"skipping damaged checkpoint: {err}")
    if found:
        raise Stop(
            f"--resume_from_checkpoint {resume_from_checkpoint}: every checkpoint in {output_dir} "
            f"is damaged ({', '.join(p.name for p in found)}); pass --overwrite_output_dir "
            "to delete them and start over"
        )
    if resume_from_checkpoint == "auto":
        return None, {"step": 0}
    raise Stop(
        f"--resume_from_checkpoint latest: no complete checkpoint in {output_dir} "
        "(save some with --save_steps)"
    )


def load_checkpoint(accelerator, path: Path, model, optimizer, optimizer_steps: int) -> list[str]:
    """`accelerator.load_state(path)` on every rank; returns the workarounds applied."""
    applied = workarounds.fill_fsdp1_optimizer_state(accelerator, model, optimizer)
    partial = trainable_only(accelerator)
    with (
        zero_universal(accelerator, path, model) as load_from,
        _state_kwargs(accelerator, partial, load=True, applied=applied) as kwargs,
    ):
        accelerator.load_state(str(load_from), **kwargs)
    marker = Path(path) / MARKER
    if partial and (saved := json.loads(marker.read_text()).get(TRAINABLE)) is not None:
        _check_trainable(path, saved, trainable_sums(accelerator))  # (a collective)
    applied += workarounds.relink_offload_lr_scheduler(accelerator)
    return applied + workarounds.micro_steps_from_optimizer_steps(accelerator, optimizer_steps)


def trainable_only(accelerator) -> bool:
    """Whether the prepared models have frozen parameters, which checkpoints leave out."""
    return any(not p.requires_grad for model in accelerator._models for p in model.parameters())


def _clean_name(name: str) -> str:
    """A parameter's name without the wrappers' parts (DDP, DeepSpeed, FSDP1, checkpointing, compile)."""
    for part in ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod."):
        name = name.replace(part, "")
    return name.removeprefix("module.")


@contextmanager
def _state_kwargs(accelerator, partial: bool, load: bool, applied: list | None = None):
    """`save_state`'s (`load_state`'s) kwargs that leave frozen parameters out if `partial`."""
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
    """{name: [elements, sum, sum of squares]} (fp64) of each trainable parameter; a collective."""
    import torch

    sums, deepspeed = {}, accelerator.distributed_type == DistributedType.DEEPSPEED
    fsdp1 = accelerator.distributed_type == DistributedType.FSDP and not accelerator.is_fsdp2
    for index, model in enumerate(accelerator._models):
        named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        gather = contextlib.nullcontext()
        if deepspeed and accelerator.state.deepspeed_plugin.zero_stage == 3:
            import deepspeed as ds

            gather = ds.zero.GatheredParameters([p for _, p in named])
        table = torch.zeros((len(named), 3), dtype=torch.float64, device=accelerator.device)
        with gather:
            for row, (_, p) in enumerate(named):
                values = (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().double()
                table[row] = torch.stack(
                    [values.new_tensor(float(values.numel())), values.sum(), values.square().sum()]
                )
        if fsdp1 and accelerator.num_processes > 1:  # each rank holds a slice of each parameter
            torch.distributed.all_reduce(table)
        prefix = f"model_{index}." if index else ""
        sums.update({prefix + _clean_name(n): row for (n, _), row in zip(named, table.tolist())})
    return sums


def _check_trainable(path: Path, saved: dict, loaded: dict) -> None:
    """Stop unless the loaded trainable parameters match `trainable_sums` saved (1e-9 relative)."""
    if missing := sorted(set(saved) ^ set(loaded)):
        raise Stop(
            f"cannot resume from {path}: its trainable parameters are not this model's: "
            f"{len(missing)} names differ (first: {missing[0]}); resume with the --lora_* and "
            "model settings it was saved with"
        )

    def differs(a, b):
        (n, total, squares), (_, total_now, squares_now) = a, b
        return not (
            math.isclose(squares, squares_now, rel_tol=1e-9, abs_tol=1e-30)
            and abs(total - total_now) <= 1e-9 * math.sqrt(max(squares, 1e-60) * max(n, 1))
        )

    if wrong := [name for name in saved if differs(saved[name], loaded[name])]:
        raise Stop(
            f"cannot resume from {path}: {len(wrong)} of its {len(saved)} trainable parameters did "
            f"not load (first: {wrong[0]}: sum of squares {saved[wrong[0]][2]:.9g} saved, "
            f"{loaded[wrong[0]][2]:.9g} after the load)"
        )


@contextmanager
def zero_universal(accelerator, path: Path, engine):
    """Yields the folder to `load_state` from: `path`, or for a ZeRO-2 checkpoint of another world
    size, a universal copy that each node's first rank makes with `ds_to_universal` in $TMPDIR
    (about 1.3x its size; deleted after). A collective."""
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
    key = hashlib.sha256(f"{Path(path).resolve()}:{saved.get('saved_at')}".encode()).hexdigest()
    folder = Path(tempfile.gettempdir()) / f"zero-universal-{key[:16]}"  # the same on a node
    error = None
    if accelerator.is_local_main_process:
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
                        inject_missing_state=True,  # Accelerate's engine records no universal info
                    )
                )
        except (Exception, SystemExit) as err:  # (every rank stops, not only this one)
            shutil.rmtree(folder, ignore_errors=True)
            error = (
                f"cannot resume from {path} on {accelerator.num_processes} rank(s): converting it "
                f"to {folder} with DeepSpeed's ds_to_universal failed: {type(err).__name__}: {err}"
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


# The flags behind the settings a resume compares that are no flags themselves.
_DATA = (
    "--train_file, --validation_file, --dataset_name, --dataset_config_name, "
    "--dataset_text_field, --validation_split_percentage, the tokenizer (--tokenizer_name_or_path, "
    "--model_name_or_path, --vocab_size), --block_size, --packing"
)
SETTING_SOURCES = {
    "data_digest": f"the data: {_DATA}, or the data stage's code",
    "train_blocks": f"the data: {_DATA}",
    "train_passages": "the data: --tokenizer_name_or_path, --block_size, "
    "--validation_split_percentage, --max_train_samples",
    "global_batch": "--per_device_train_batch_size x --gradient_accumulation_steps x world size",
    "frozen_base": "the frozen base model's weights: --model_name_or_path",
    "warmup_steps": "--warmup_steps, or --warmup_ratio x --max_steps",
}


def changed_settings(saved: dict, current: dict) -> list[str]:
    """{key: "saved -> now"} for each setting of `current` the checkpoint recorded otherwise."""
    changes, named = [], set()
    for k, v in current.items():
        if k not in saved or saved[k] == v:
            continue
        if isinstance(v, dict) and isinstance(saved[k], dict):  # e.g. the model config
            keys = sorted(set(v) | set(saved[k]))
            changes += [
                f"{k}.{key} {saved[k].get(key)} -> {v.get(key)}"
                for key in keys
                if saved[k].get(key) != v.get(key)
            ]
            continue
        source = SETTING_SOURCES.get(k)  # its flags once; then "(the data)"
        label = source and source.split(":")[0]
        changes.append(
            f"{k} {saved[k]} -> {v}"
            + (f" ({source if label not in named else label})" if source else "")
        )
        named.add(label)
    return changes


def precision_state(accelerator) -> dict:
    """The precision a resume keeps: `mixed_precision`, DeepSpeed's gradient-reduction dtypes."""
    state = {"mixed_precision": accelerator.mixed_precision}
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        config = accelerator.state.deepspeed_plugin.deepspeed_config
        grad_accum = (config.get("data_types") or {}).get("grad_accum_dtype")
        state["deepspeed_communication_data_type"] = str(
            config.get("communication_data_type") or "default"
        )
        state["deepspeed_grad_accum_dtype"] = str(grad_accum or "default")
    return state


def strategy_name(accelerator) -> str:
    """The strategy a checkpoint records: "FSDP2", "DEEPSPEED_ZERO3", "NO" (+ a mesh)."""
    name = accelerator.distributed_type.value
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        return f"{name}_ZERO{accelerator.state.deepspeed_plugin.zero_stage}"
    if accelerator.distributed_type == DistributedType.FSDP:
        mesh = launch.mesh_layout(accelerator)
        layout = " x ".join(f"{dim} {size}" for dim, size in mesh.items()) if mesh else ""
        return name + ("2" if accelerator.is_fsdp2 else "1") + (f" ({layout})" if layout else "")
    return name


REPLICATED = {"NO", "MULTI_CPU", "MULTI_GPU"}  # a full state on every rank: loads at any world size
# sharded states that load exactly on another number of ranks, and through what
RESHARDS = {"FSDP2": "DCP", "FSDP1": "DCP", "DEEPSPEED_ZERO2": "DeepSpeed's universal checkpoint"}
NO_RESHARD = {
    "DEEPSPEED_ZERO3": "DeepSpeed loads ZeRO-3 optimizer partitions on the number of ranks that "
    "wrote them only, and its universal checkpoint does not continue a ZeRO-3 run exactly (0.3% "
    "off in grad norm within 6 steps, even on as many ranks)"
}


def check_resume(
    path: Path,
    saved: dict,
    run_state: dict,
    must_match: list[str],
    lr_decays_after: int | None = None,
) -> None:
    """Stop unless this run continues the checkpoint at `path` (marker `saved`) exactly, in one
    line naming every difference ("cannot resume from PATH: seed 42 -> 7; ..."). `must_match`: the
    keys of `run_state` that must equal the saved ones; the world size also where a sharded state
    cannot reshard. `lr_decays_after`: the warmup of an LR that decays over `max_steps` (None:
    constant); past it another `max_steps` is refused."""
    at, before, after = saved["step"], saved.get("max_steps"), run_state.get("max_steps")
    if after is not None and (at > after or at == after and before not in (None, after)):
        of = f" of a {before}-step run" if before is not None else ""
        raise Stop(
            f"cannot resume from {path}: it is at step {at}{of}, and this run ends at step {after} "
            f"(--max_steps, or --num_train_epochs): nothing would train. Give --max_steps above "
            f"{at} to train on, or start a new run (into another --output_dir) from its weights"
        )
    changes = changed_settings(saved, {k: run_state[k] for k in must_match if k != "max_steps"})
    if lr_decays_after is not None and before not in (None, after) and at > lr_decays_after:
        changes.append(
            f"max_steps {before} -> {after} (the LR decays over --max_steps after "
            f"{lr_decays_after} warmup steps, and the checkpoint's {at} steps went past them)"
        )
    was, n = saved.get("distributed_type"), saved.get("world_size")
    now, m = run_state["distributed_type"], run_state["world_size"]
    if was and not {was, now} <= REPLICATED and (was, n) != (now, m):
        per_rank = sorted(f for f in saved.get("files", {}) if re.search(r"_rank\d+\.bin$", f))
        why = NO_RESHARD.get(was, "no resharding") if was not in RESHARDS else None
        if was in RESHARDS and per_rank:
            why = (
                f"its model or optimizer is saved one file per rank ({per_rank[0]}: "
                "LOCAL_STATE_DICT), not through DCP"
            )
        if was != now:
            changes.append(
                f"a {was} state of {n} rank(s), this run is {now} with {m} (a sharded FSDP/ZeRO "
                "state resumes on its own strategy only; tools/consolidate.py converts one to "
                "plain weights)"
            )
        elif n != m and why:
            changes.append(
                f"a {was} state of {n} rank(s), this run has {m}: {why} (resume on {n} ranks, or "
                "convert it with tools/consolidate.py and start from its weights)"
            )
    if changes:
        raise Stop(
            f"cannot resume from {path}: {'; '.join(changes)}. Resume with the saved settings, or "
            "start a new run (into another --output_dir) from its weights"
        )


def leave_signals_to_the_rank(worker_id: int) -> None:
    """DataLoader workers ignore SIGTERM, SIGINT, SIGHUP: the rank saves, then stops them."""
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)


def stop_on_signal(accelerator, timeout_s: float):
    """Record SIGTERM, SIGINT and SIGHUP instead of dying; returns `preempted()`, called on every
    rank at each step boundary: the signal's name once any rank got one, else None (4 bytes)."""
    import torch
    import torch.distributed as dist

    received = []

    def handler(signum, frame):
        received.append(signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, handler)
    group = None
    if dist.is_initialized() and accelerator.num_processes > 1:  # CPU, whatever the device backend
        group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))

    def preempted() -> str | None:
        signum = torch.tensor([received[0] if received else 0], dtype=torch.int32)
        if group is not None:
            dist.all_reduce(signum, op=dist.ReduceOp.MAX, group=group)
        return signal.Signals(int(signum)).name if int(signum) else None

    return preempted


def export_model(accelerator, model, tokenizer, output_dir: str) -> str:
    """Write the model and tokenizer whole to `{output_dir}/final/` (safetensors, KV cache on),
    atomically, on every rank (a collective); returns the path. LoRA: the adapter in `adapter/`."""
    unwrapped = accelerator.unwrap_model(model, keep_torch_compile=False)  # (True re-points DDP)
    if accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED):
        state_dict = workarounds.fsdp1_cpu_state_dict(accelerator, model)
        if state_dict is None:
            state_dict = accelerator.get_state_dict(model)  # (on rank 0; FSDP1: others' empty)
    else:  # the bare model's: `get_state_dict` gave DDP's "module." keys under regional compile
        state_dict = unwrapped.state_dict()
    if state_dict and getattr(unwrapped.config, "tie_word_embeddings", False):  # stored once
        state_dict.pop("lm_head.weight", None)
    with _atomic_export(accelerator, output_dir) as export_dir:
        whole = unwrapped
        if hasattr(unwrapped, "peft_config") and accelerator.is_main_process:  # LoRA
            from peft import get_peft_model

            # a fresh fp32 copy on the host, loaded strictly: an adapter exported empty (FSDP1) stops
            base = unwrapped.get_base_model()
            copy = get_peft_model(
                models.causal_lm_class(base.config)(base.config), unwrapped.peft_config["default"]
            )
            copy.load_state_dict({k: v.float() for k, v in state_dict.items()})
            copy.get_base_model().generation_config = base.generation_config
            copy.save_pretrained(os.path.join(export_dir, "adapter"))  # peft's own files
            whole = copy.merge_and_unload()
        # configs ready for inference, then the live ones back (a classifier has no generation one)
        names = [n for n in ("config", "generation_config") if getattr(whole, n, None) is not None]
        live = {n: getattr(whole, n) for n in names}
        for name in names:
            setattr(whole, name, models.for_inference(live[name]))
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


def run_state(
    accelerator, args, model, learning_rate: float, max_steps: int, **data_position
) -> tuple[dict, list[str]]:
    """(what a run records in its checkpoints, the keys a resume must match). Must match:
    `data_position` (the data order, and e.g. a frozen base's digest) and what a resume restores
    whatever the flags say: LR (scaled), decay, betas, schedule, warmup steps, --max_grad_norm,
    precision, model config; with dropout, the batch split (the masks depend on it). Recorded
    besides: world size, strategy and `max_steps` (`check_resume`)."""
    import torch

    dropout = any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules()) or any(
        ("dropout" in k or "pdrop" in k) and isinstance(v, (int, float)) and v > 0
        for k, v in model.config.to_dict().items()
    )  # (some models apply dropout functionally, with no module)
    optimizer = ("weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon", "lr_scheduler_type")
    split = ("per_device_train_batch_size", "gradient_accumulation_steps")
    same_run = {
        "learning_rate": learning_rate,
        "max_grad_norm": args.max_grad_norm,
        **{k: getattr(args, k) for k in optimizer},
        "lr_scheduler_kwargs": json.loads(args.lr_scheduler_kwargs or "{}"),
        "warmup_steps": schedule.warmup_count(args.warmup_steps, args.warmup_ratio, max_steps),
        **precision_state(accelerator),
        "model_config": models.config_state(model.config),
        **({k: getattr(args, k) for k in split} if dropout else {}),
        **({"world_size": accelerator.num_processes} if dropout else {}),
    }
    state = {
        "world_size": accelerator.num_processes,
        "max_steps": max_steps,
        "distributed_type": strategy_name(accelerator),
        **data_position,
        **same_run,
    }
    return state, [*data_position, *same_run]


def resume_or_start(
    accelerator,
    args,
    run_state: dict,
    must_match: list[str] | None = None,
) -> tuple[Path | None, dict]:
    """(the checkpoint `--resume_from_checkpoint` names, its marker) after `check_resume`, or (None,
    {"step": 0}), on every rank before `prepare`. A fresh start deletes earlier `checkpoint-N`."""
    try:
        path, saved = _resolve_checkpoint(args.output_dir, args.resume_from_checkpoint, accelerator)
    except Stop as err:
        raise Stop(f"cannot resume: {err}") from None
    if not path:
        if accelerator.is_main_process:
            for old in Path(args.output_dir).glob("checkpoint-*"):
                if old.is_dir() and re.match(r"^checkpoint-\d+(\.tmp)?$", old.name):
                    shutil.rmtree(old)
        accelerator.wait_for_everyone()
        return None, saved
    must_match = list(run_state) if must_match is None else must_match
    lr_decays_after = schedule.lr_decays_after(run_state)  # another --max_steps: in its warmup only
    check_resume(path, saved, run_state, must_match, lr_decays_after)
    max_steps = run_state.get("max_steps")
    if lr_decays_after is not None and saved.get("max_steps", max_steps) != max_steps:
        accelerator.print(
            f"{path} was saved by a {saved['max_steps']}-step run, this one has {max_steps}: its "
            f"{saved['step']} steps are all in the {lr_decays_after}-step warmup, which "
            f"--max_steps does not change, so it continues exactly as a run of {max_steps} steps"
        )
    return path, saved


def resumed_line(path: Path, step: int) -> str:
    """ "resumed from PATH at step N", and which restart this is (`run_dir.restart_note`)."""
    note = restart_note()
    return f"resumed from {path} at step {step}" + (f" ({note})" if note else "")
