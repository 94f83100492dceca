"""Checkpoints: exact mid-epoch resume (one process here; every 2-rank strategy across two machines in
tests/test_multinode.py), atomic saves, damaged checkpoints (sizes and checksums), resuming on another
world size (FSDP and ZeRO-2 resharded, ZeRO-3 refused), the end of a run on resume, --overwrite_output_dir and the
atomic export, offline consolidation, and safe loading. (A killed rank, SIGTERM and restarts:
tests/test_recovery.py.)"""

import io
import json
import math
import re
import shutil
import struct
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from common.checkpoint import (
    SETTING_SOURCES,
    _atomic_export,
    check_resume,
    complete_checkpoints,
    _resolve_checkpoint,
    save_checkpoint,
    strategy_name,
    verify_checkpoint,
)
from common.errors import Stop
from conftest import REPO, RUN30, corpus_args, launch, read_metrics
from tools.consolidate import consolidate

STEPS, SAVE = (
    16,
    10,
)  # 7 optimizer steps per epoch (56 blocks / global batch 8): step 10 is mid-epoch 2

# Resumed runs against the uninterrupted one, relative: measured 0 (bit-exact, fp32) at every
# comparison of test_exact_resume_mid_epoch and of test_hsdp's 2-machine resume. metrics.jsonl holds full floats,
# so 1e-6 is not a print precision: it is ~10 fp32 ulps (an ulp is 6e-8..1.2e-7 relative), far
# under any resume fault.
RESUME_RTOL = 1e-6


def resume_refusal(*args, **kwargs) -> str | None:
    """`check_resume`'s one-line refusal, or None where the run may resume."""
    try:
        check_resume(*args, **kwargs)
    except Stop as err:
        return str(err)
    return None


def args(out, corpus, *extra):
    train, valid, tok = corpus
    return [
        "--output_dir",
        out,
        "--train_file",
        train,
        "--validation_file",
        valid,
        "--tokenizer_name_or_path",
        tok,
        "--block_size",
        64,
        "--max_steps",
        STEPS,
        "--save_steps",
        SAVE,
        "--warmup_steps",
        4,
        "--lr_scheduler_type",  # not llama.py's default: a schedule from its flags resumes exactly
        "cosine_with_min_lr",
        "--lr_scheduler_kwargs",
        '{"min_lr_rate": 0.1}',
        "--logging_steps",
        1,
        "--eval_steps",
        STEPS,
        "--report_to",
        "none",
        "--ddp_timeout",
        60,
        "--sample_tokens",
        0,
        "--record_sample_ids",
        *extra,
    ]  # the data order: tests/test_data_order.py


def batch_args(config):
    """Global batch 8 with accumulation 2, on 1 or 2 ranks."""
    return [
        "--per_device_train_batch_size",
        4 if config == "single" else 2,
        "--gradient_accumulation_steps",
        2,
    ]


@pytest.mark.parametrize("config", ["single"])  # 2 ranks of every strategy: tests/test_multinode.py
def test_exact_resume_mid_epoch(config, tmp_path, cache_dir, small_corpus, reference_run):
    # The uninterrupted run (fp32) is the session's reference_run, which tests/test_multinode.py
    # shares: the same flags (args() minus its --output_dir) give the same run. New processes resume
    # it into another directory; tests/test_multinode.py resumes each 2-rank strategy the same way.
    straight = reference_run(config, *args(None, small_corpus, *batch_args(config))[2:])
    resumed = tmp_path / "resumed"
    info = json.loads((straight / "run_info.json").read_text())
    per_epoch = info["updates_per_epoch"]
    assert (
        per_epoch < SAVE < 2 * per_epoch and SAVE % per_epoch
    )  # the stop is mid-way through epoch 2
    # TensorBoard events of an attempt that died after its checkpoint: the run's losses up to step 10, other
    # values after it (a dead attempt's steps 11-16)
    want = {r["step"]: r for r in read_metrics(straight)[0]}
    from torch.utils.tensorboard import SummaryWriter

    with SummaryWriter(str(resumed / "llama")) as dead:
        for step, r in want.items():
            dead.add_scalar("loss", r["loss"] * (1 if step <= SAVE else 2), step)
    # New processes, resuming from the step-10 checkpoint into another directory, with TensorBoard.
    launch(
        config,
        "recipes/llama.py",
        *args(
            resumed,
            small_corpus,
            *batch_args(config),
            "--report_to",
            "tensorboard",
            "--resume_from_checkpoint",
            straight / f"checkpoint-{SAVE}",
        ),
        cache_dir=cache_dir,
        mixed_precision="no",
    )
    got = read_metrics(resumed)[0]
    # TensorBoard holds each step once: the dead attempt's past the checkpoint purged, the resumed run's
    # values as metrics.jsonl has them (float32), so the uninterrupted run's
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = EventAccumulator(str(resumed / "llama"))
    board.Reload()
    logged = [(e.step, e.value) for e in board.Scalars("loss")]
    assert [step for step, _ in logged] == list(range(1, STEPS + 1)), logged
    for step, value in logged:
        assert value == pytest.approx(want[step]["loss"], rel=1e-6), step
    assert [value for step, value in logged if step > SAVE] == pytest.approx(
        [r["loss"] for r in got], rel=1e-6
    )
    assert json.loads((resumed / "run_info.json").read_text())["trackers"] == ["tensorboard"]
    assert [r["step"] for r in got] == list(range(SAVE + 1, STEPS + 1))
    assert got[0]["epoch"] == 1
    for r in got:
        for key in ("loss", "grad_norm", "lr"):
            assert r[key] == pytest.approx(want[r["step"]][key], rel=RESUME_RTOL, abs=1e-12), (
                config,
                r["step"],
                key,
            )
    assert got[-1]["eval_loss"] == pytest.approx(want[STEPS]["eval_loss"], rel=RESUME_RTOL)
    # cosine_with_min_lr: the cosine rides on a floor of 10% of the peak LR (plain cosine: near 0)
    floor = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (STEPS - 1 - 4) / (STEPS - 4)))
    assert got[-1]["lr"] == pytest.approx(3e-3 * floor, rel=1e-9)


def zero_tensor_bytes(path):
    """Zero a file's tensor values, keeping its size and format, so that it still loads: everything after
    a safetensors header; in a .distcp shard (one torch.save zip per tensor, at the offsets in the
    folder's .metadata) every zip entry under data/."""
    data = bytearray(path.read_bytes())
    if path.suffix == ".safetensors":
        regions = [(8 + struct.unpack("<Q", data[:8])[0], len(data))]
    else:
        from torch.distributed.checkpoint import FileSystemReader

        regions = []
        for item in FileSystemReader(str(path.parent)).read_metadata().storage_data.values():
            if item.relative_path != path.name:
                continue
            for entry in zipfile.ZipFile(
                io.BytesIO(data[item.offset : item.offset + item.length])
            ).infolist():
                if "/data/" in entry.filename:  # the raw storage bytes, stored uncompressed
                    header = item.offset + entry.header_offset
                    start = header + 30 + sum(struct.unpack("<HH", data[header + 26 : header + 30]))
                    regions.append((start, start + entry.file_size))
    assert regions
    for start, end in regions:
        data[start:end] = bytes(end - start)
    path.write_bytes(data)


@pytest.fixture(scope="module")
def rotated(tmp_path_factory, cache_dir, small_corpus):
    """A 16-step DDP run saving every 4th step and keeping the last 2 (checkpoints 12 and 16), started
    with --overwrite_output_dir in a directory that holds an earlier run's files, of every kind a run
    writes. Tests that change it work on a copy."""
    out = tmp_path_factory.mktemp("rotated") / "run"
    for name in (
        "final/model.safetensors",
        "final_logits.safetensors",
        "checkpoint-30/COMPLETE.json",
        "checkpoint-31.tmp/optimizer.bin",
        "sample_ids/rank0.json",
        "notes.txt",
    ):
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text("{}")
    launch(
        "ddp",
        "recipes/llama.py",
        *args(
            out, small_corpus, "--overwrite_output_dir", "--save_steps", 4, "--save_total_limit", 2
        ),
        cache_dir=cache_dir,
        mixed_precision="no",
    )
    return out


def test_rotation_latest_and_damaged_checkpoints(
    rotated, tmp_path, cache_dir, small_corpus, capsys
):
    out = tmp_path / "run"
    shutil.copytree(rotated, out)
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-12", "checkpoint-16"]
    assert verify_checkpoint(out / "checkpoint-16")["step"] == 16

    # Weights zeroed on disk, the file's size kept: an explicit resume names the file (the recipe's
    # call, without the launch; test_resume_from_a_checkpoint_that_is_not_there launches its refusal)...
    victim = out / "checkpoint-16" / "model.safetensors"
    size = victim.stat().st_size
    zero_tensor_bytes(victim)
    assert victim.stat().st_size == size
    with pytest.raises(
        ValueError,
        match=f"checkpoint file {re.escape(str(victim))} does not match the sha256 "
        "recorded when it was saved",
    ):
        _resolve_checkpoint(out, str(out / "checkpoint-16"))
    # ...an unfinished save (no marker) is ignored, and `latest` warns and falls back to step 12 (the
    # recipe's call here; a launch that goes on from such a fallback, exactly, past a damaged FSDP2
    # shard: tests/test_multinode.py).
    (out / "checkpoint-20.tmp").mkdir()
    (out / "checkpoint-24").mkdir()
    capsys.readouterr()
    path, marker = _resolve_checkpoint(out, "latest")
    assert capsys.readouterr().err.startswith(
        f"warning: skipping damaged checkpoint: checkpoint file {victim} does not match"
    )
    assert path == out / "checkpoint-12" and marker["step"] == 12
    # The launch: `latest` skips checkpoint-16 the same way, and checkpoint-12 is past the end of a
    # 6-step run: refused, nothing written (the end of a run: test_the_end_of_a_run_on_resume).
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file() and p.name != ".lock"}
    proc = launch(
        "ddp",
        "recipes/llama.py",
        *args(
            out,
            small_corpus,
            "--max_steps",
            6,
            "--save_steps",
            6,
            "--resume_from_checkpoint",
            "latest",
        ),
        cache_dir=cache_dir,
        check=False,
    )
    assert proc.returncode != 0
    assert f"skipping damaged checkpoint: checkpoint file {victim} does not match" in proc.stderr, (
        proc.stderr[-3000:]
    )
    assert (
        f"error: cannot resume from {out / 'checkpoint-12'}: it is at step 12 of a 16-step run, and this run "
        "ends at step 6"
    ) in proc.stderr, proc.stderr[-3000:]
    assert before == {
        p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file() and p.name != ".lock"
    }
    # A truncated file fails on its size, before any hashing; a marker without sums (an older
    # checkpoint) is checked by size only, with a warning.
    truncated = out / "checkpoint-12" / "optimizer.bin"
    truncated.write_bytes(truncated.read_bytes()[:100])
    with pytest.raises(
        ValueError, match=f"checkpoint file {re.escape(str(truncated))} is 100 bytes.*truncated"
    ):
        verify_checkpoint(out / "checkpoint-12")
    marker = json.loads((out / "checkpoint-16" / "COMPLETE.json").read_text())
    assert (
        marker["sha256"].keys() == marker["files"].keys()
        and "model.safetensors" in marker["sha256"]
    )
    del marker["sha256"], marker["marker_sha256"]  # an older version's marker: neither
    (out / "checkpoint-16" / "COMPLETE.json").write_text(json.dumps(marker))
    assert verify_checkpoint(out / "checkpoint-16")["step"] == 16
    assert re.search("saved without checksums.*sizes checked only", capsys.readouterr().err)


def test_overwrite_deletes_the_earlier_run(rotated):
    # The earlier run's files all went (checkpoint-30 too, which `latest` would take): only this run's remain.
    # (A resume past the end, refused: test_rotation_latest_and_damaged_checkpoints.)
    out = rotated
    assert sorted(p.name for p in out.iterdir()) == [
        ".lock",
        "checkpoint-12",
        "checkpoint-16",
        "final",
        "metrics.jsonl",
        "run_info.json",
        "sample_ids",
    ]
    assert (
        json.loads((out / "sample_ids/rank0.json").read_text())["world_size"] == 2
    )  # this run's, not the "{}"
    exported = load_file(out / "final/model.safetensors")
    assert exported["model.norm.weight"].shape == (256,)  # this run's export, whole


def test_the_end_of_a_run_on_resume():
    # Past the end: refused. At the end: a no-op for the same run only (the export is written again).
    for step, saved_max, max_steps, refused in [
        (12, 12, 6, True),
        (6, 12, 6, True),
        (12, 12, 12, False),
        (6, None, 6, False),
        (6, 12, 12, False),
        (6, 6, 12, False),
        (13, None, 12, True),
    ]:
        saved = {"step": step, **({"max_steps": saved_max} if saved_max else {})}
        run = {"distributed_type": "MULTI_CPU", "world_size": 2, "max_steps": max_steps}
        error = resume_refusal(Path("ckpt"), saved, run, ["max_steps"])
        assert bool(error) == refused, (step, saved_max, max_steps, error)
        if refused:
            assert (
                error.startswith(f"cannot resume from ckpt: it is at step {step}")
                and "nothing would train" in error
            )


def test_a_refused_setting_names_its_flags():
    """A compared setting that is no flag of its own names the flags behind it."""
    saved = {"step": 4, "global_batch": 4, "seed": 42}
    run = {
        "max_steps": 8,
        "global_batch": 8,
        "seed": 7,
        "world_size": 2,
        "distributed_type": "MULTI_CPU",
    }
    error = resume_refusal(Path("ckpt"), saved, run, ["global_batch", "seed"])
    assert error.startswith(
        "cannot resume from ckpt: global_batch 4 -> 8 (--per_device_train_batch_size x "
        "--gradient_accumulation_steps x world size); seed 42 -> 7. Resume with"
    ), error
    # Every flag named is a real one; the data's name each flag llama.py reads its data and tokenizer with.
    flags = "".join(
        (REPO / f).read_text()
        for f in ("recipes/llama.py", "recipes/ddp_classifier.py", "common/args.py")
    )
    for sources in SETTING_SOURCES.values():
        assert all(f"    {name}: " in flags for name in re.findall(r"--(\w+)", sources)), sources
    llama = (REPO / "recipes" / "llama.py").read_text()
    reads = re.search(
        r"raw = data\.load_text_dataset\(.*?\)\n.*?get_tokenizer\(.*?\)\n", llama, re.S
    ).group(0)
    for name in {
        *re.findall(r"args\.(\w+)", reads),
        "tokenizer_name_or_path",
        "block_size",
        "packing",
    } - {"cache_dir"}:
        assert (
            f"--{name}" in SETTING_SOURCES["data_digest"]
            and f"--{name}" in SETTING_SOURCES["train_blocks"]
        ), name


def test_a_longer_run_resumes_only_within_the_warmup():
    """Another --max_steps moves a decaying LR schedule (cosine, linear) after its warmup: a checkpoint
    inside the warmup continues exactly as the new length (the LRs so far, and the one it holds for the
    next step, are both schedules'), one past it is refused; a schedule that --max_steps does not move
    (lr_decays_after None: constant) resumes either way."""

    def error(step, lr_decays_after, max_steps=20):
        saved = {"step": step, "max_steps": 12, "seed": 42}
        run = {"max_steps": max_steps, "seed": 42, "world_size": 2, "distributed_type": "MULTI_CPU"}
        return resume_refusal(Path("ckpt"), saved, run, ["seed", "max_steps"], lr_decays_after)

    assert error(6, lr_decays_after=6) is None and error(3, lr_decays_after=15) is None
    assert error(7, lr_decays_after=6).startswith(
        "cannot resume from ckpt: max_steps 12 -> 20 (the LR decays over "
        "--max_steps after 6 warmup steps, and the checkpoint's 7 steps "
        "went past them). Resume with the saved settings"
    )
    assert error(7, lr_decays_after=0, max_steps=8).startswith(
        "cannot resume from ckpt: max_steps 12 -> 8"
    )
    assert (
        error(7, lr_decays_after=None) is None and error(7, lr_decays_after=6, max_steps=12) is None
    )


def fake_accelerator(kind: str, fsdp2: bool = True, zero_stage: int = 2):
    """What `strategy_name` reads of an Accelerator."""
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    return SimpleNamespace(
        distributed_type=DistributedType[kind],
        is_fsdp2=fsdp2,
        state=SimpleNamespace(deepspeed_plugin=SimpleNamespace(zero_stage=zero_stage)),
    )


def test_a_sharded_state_resumes_only_on_its_own_fsdp_version_and_zero_stage():
    """FSDP1 and FSDP2, ZeRO-2 and ZeRO-3 write different sharded states under one Accelerate name;
    the recorded strategy tells them apart, so the resume check refuses the other one."""
    names = {
        (kind, fsdp2, stage): strategy_name(fake_accelerator(kind, fsdp2, stage))
        for kind, fsdp2, stage in [
            ("FSDP", True, 2),
            ("FSDP", False, 2),
            ("DEEPSPEED", True, 2),
            ("DEEPSPEED", True, 3),
            ("MULTI_CPU", True, 2),
            ("NO", True, 2),
        ]
    }
    assert list(names.values()) == [
        "FSDP2",
        "FSDP1",
        "DEEPSPEED_ZERO2",
        "DEEPSPEED_ZERO3",
        "MULTI_CPU",
        "NO",
    ]
    for saved_as, run_as in [("FSDP1", "FSDP2"), ("DEEPSPEED_ZERO2", "DEEPSPEED_ZERO3")]:
        saved = {"step": 4, "distributed_type": saved_as, "world_size": 2}
        error = resume_refusal(
            Path("ckpt"), saved, {"distributed_type": run_as, "world_size": 2, "max_steps": 8}, []
        )
        assert error and f"a {saved_as} state of 2 rank(s), this run is {run_as} with 2" in error
    for stage in (
        "DEEPSPEED_ZERO2",
        "DEEPSPEED_ZERO3",
        "FSDP2",
        "FSDP1",
    ):  # the same strategy, another world size
        saved = {"step": 4, "distributed_type": stage, "world_size": 2}
        for world in (1, 3, 4):
            error = resume_refusal(
                Path("ckpt"),
                saved,
                {"distributed_type": stage, "world_size": world, "max_steps": 8},
                [],
            )
            if stage != "DEEPSPEED_ZERO3":  # resharded (test_resume_on_another_world_size)
                assert error is None, (stage, world, error)
            else:
                assert (
                    error
                    and f"a {stage} state of 2 rank(s), this run has {world}: DeepSpeed loads"
                    in error
                )
        assert (
            resume_refusal(
                Path("ckpt"),
                saved,
                {"distributed_type": stage, "world_size": 2, "max_steps": 8},
                [],
            )
            is None
        )  # and the same world size resumes
        if stage.startswith(
            "FSDP"
        ):  # but not one file per rank (FSDP1's LOCAL_STATE_DICT): no DCP metadata
            local = {
                **saved,
                "files": {"pytorch_model_fsdp_0_rank0.bin": 1, "pytorch_model_fsdp_0_rank1.bin": 1},
            }
            error = resume_refusal(
                Path("ckpt"),
                local,
                {"distributed_type": stage, "world_size": 3, "max_steps": 8},
                [],
            )
            assert (
                error
                and "saved one file per rank (pytorch_model_fsdp_0_rank0.bin: LOCAL_STATE_DICT)"
                in error
            )
        # and not where the world size must match for its own sake (dropout masks, per-rank data shards)
        error = resume_refusal(
            Path("ckpt"),
            {**saved, "world_size": 2},
            {"distributed_type": stage, "world_size": 3, "max_steps": 8},
            ["world_size"],
        )
        assert error and "world_size 2 -> 3" in error, (stage, error)
    saved = {
        "step": 4,
        "distributed_type": "MULTI_CPU",
        "world_size": 2,
    }  # a full state: any replicated world size
    assert (
        resume_refusal(
            Path("ckpt"), saved, {"distributed_type": "NO", "world_size": 1, "max_steps": 8}, []
        )
        is None
    )


def test_every_resumable_recipe_records_the_sharded_layout():
    """A recipe that checks a resume records `strategy_name` in the state the check compares, not
    Accelerate's `distributed_type` ("FSDP" for both FSDP versions)."""
    texts = {p.name: p.read_text() for p in sorted((REPO / "recipes").glob("*.py"))}
    checks = ("check_resume(", "resume_or_start(")
    resumable = [name for name, text in texts.items() if any(c in text for c in checks)]
    # all but gradient_checkpointing.py, which saves no checkpoint
    assert sorted(resumable) == sorted(set(texts) - {"gradient_checkpointing.py"}), resumable
    # in the recipe's own run state, or through checkpoint.run_state, which records it
    run_state = (
        (REPO / "common" / "checkpoint.py")
        .read_text()
        .split("def run_state(", 1)[1]
        .split("\ndef ", 1)[0]
    )
    assert '"distributed_type": strategy_name(accelerator)' in run_state
    assert [
        name
        for name in resumable
        if "checkpoint.strategy_name(accelerator)" not in texts[name]
        and "checkpoint.run_state(" not in texts[name]
    ] == []


def test_every_recipe_whose_lr_decays_over_max_steps_says_so_on_resume():
    """Every recipe that resumes builds its schedule with `schedule.lr_scheduler` and hands it to the
    resume check through the run state (another --max_steps past the warmup of a decaying LR is
    refused; a constant one resumes at any --max_steps: tests/test_schedule.py)."""
    texts = {p.name: p.read_text() for p in sorted((REPO / "recipes").glob("*.py"))}
    texts = {name: text for name, text in texts.items() if "resume_or_start(" in text}
    assert set(texts) == {
        "llama.py",
        "ddp_classifier.py",
        "mixed_precision.py",
        "sft.py",
        "sharded_data.py",
    }
    for name, text in texts.items():
        assert "schedule.lr_scheduler(optimizer, args, max_steps)" in text, name
        assert "lr_decays_after" not in text and "_schedule_with_warmup(" not in text, name


class OneProcess:
    """What `_atomic_export` uses of an Accelerator, in a single process."""

    is_main_process = True

    def wait_for_everyone(self):
        pass


@pytest.fixture
def accelerator():
    """A real one-process Accelerator on the CPU that has prepared a small model and its AdamW, for
    `save_checkpoint` in this process (a few ms a save). Accelerate's state is a per-process
    singleton: reset before and after."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    def reset():
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()

    reset()
    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(4, 2)
    accelerator.prepare(model, torch.optim.AdamW(model.parameters()))
    yield accelerator
    reset()


def clock(monkeypatch, offset_s):
    """This process's wall clock, `offset_s` seconds off: a node whose clock is wrong."""
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + offset_s)
    return real


def names(directory):
    return sorted((p.name for p in Path(directory).iterdir()), key=lambda n: int(n.split("-")[1]))


def test_latest_and_rotation_follow_the_save_order_not_the_step(accelerator, tmp_path, monkeypatch):
    """After a resume from checkpoint-2 of a run that saved to checkpoint-8, the new checkpoint-3 is
    newer than the abandoned checkpoint-8, and checkpoint-10 (no marker: an unfinished save) is not
    one: `latest` is checkpoint-3, and `--save_total_limit 2` keeps 8 and 3. The resumed run's node
    has a clock an hour behind: save time order would delete checkpoint-3 as it is written (and
    keep 6 and 8), step order would resume step 8."""
    for step in (2, 4, 6, 8):
        save_checkpoint(accelerator, tmp_path, step)
    (tmp_path / "checkpoint-10").mkdir()
    clock(monkeypatch, -3600)
    save_checkpoint(accelerator, tmp_path, 3, save_total_limit=2)
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["checkpoint-8", "checkpoint-3"]
    assert names(tmp_path) == ["checkpoint-3", "checkpoint-8", "checkpoint-10"]
    path, marker = _resolve_checkpoint(str(tmp_path), "latest")
    assert path == tmp_path / "checkpoint-3" and (marker["step"], marker["save_order"]) == (3, 5)


def test_a_clock_ahead_does_not_reorder_the_saves(accelerator, tmp_path, monkeypatch):
    """Checkpoints 3 and 6 written on a node whose clock ran an hour ahead, then resumed with
    --save_total_limit 2 on a node with the right clock: each new save is kept, 3 and 6 go, and
    `latest` is 12. (By save time, 9 and 12 were deleted as they were written and `latest` was 6.)"""
    real = clock(monkeypatch, 3600)
    saved_at = {}
    for step in (3, 6, 9, 12):
        if step == 9:
            monkeypatch.setattr(time, "time", real)
        save_checkpoint(accelerator, tmp_path, step, save_total_limit=2)
        assert names(tmp_path) == [f"checkpoint-{s}" for s in (step - 3, step) if s > 0]
        saved_at[step] = json.loads(
            (tmp_path / f"checkpoint-{step}" / "COMPLETE.json").read_text()
        )["saved_at"]
    assert (
        saved_at[3] - 3600 < saved_at[9] < saved_at[12] < saved_at[6] - 3500
    )  # the older saves stamped later
    path, marker = _resolve_checkpoint(str(tmp_path), "latest")
    assert path == tmp_path / "checkpoint-12" and (marker["step"], marker["save_order"]) == (12, 4)


def test_checkpoints_of_an_older_version_come_first_by_step(
    accelerator, tmp_path, monkeypatch, capsys
):
    """Markers without a save order (an older version) count as 0: before every new save, by step
    among themselves, whatever their save times (here 3's an hour ahead of 6's)."""
    real = clock(monkeypatch, 3600)
    save_checkpoint(accelerator, tmp_path, 3)
    monkeypatch.setattr(time, "time", real)
    save_checkpoint(accelerator, tmp_path, 6)
    for step in (3, 6):  # as the older version wrote them: no save order, no sum of the marker
        marker = tmp_path / f"checkpoint-{step}" / "COMPLETE.json"
        old = {
            k: v
            for k, v in json.loads(marker.read_text()).items()
            if k not in ("save_order", "marker_sha256")
        }
        marker.write_text(json.dumps(old))
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["checkpoint-3", "checkpoint-6"]
    save_checkpoint(accelerator, tmp_path, 9, save_total_limit=2)
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["checkpoint-6", "checkpoint-9"]
    capsys.readouterr()
    assert verify_checkpoint(tmp_path / "checkpoint-6")["step"] == 6
    assert "COMPLETE.json was saved without a checksum of its own" in capsys.readouterr().err


def test_an_edited_marker_is_refused_and_latest_skips_it(accelerator, tmp_path, capsys):
    """The marker is covered by its own sha256: its step edited (every file still matching), it fails
    verification in one line and `latest` falls back past it; rewritten with the same contents in
    another layout (key order, spacing), it still verifies."""
    for step in (4, 8):
        save_checkpoint(accelerator, tmp_path, step)
    path = tmp_path / "checkpoint-8" / "COMPLETE.json"
    marker = json.loads(path.read_text())
    path.write_text(json.dumps(marker, sort_keys=True))
    assert verify_checkpoint(tmp_path / "checkpoint-8")["step"] == 8
    path.write_text(json.dumps({**marker, "step": 12}, indent=1))
    message = f"checkpoint marker {path} does not match the sha256 recorded in it when it was saved: damaged or altered"
    with pytest.raises(Stop) as err:
        verify_checkpoint(tmp_path / "checkpoint-8")
    assert str(err.value) == message
    capsys.readouterr()
    found, saved = _resolve_checkpoint(str(tmp_path), "latest")
    assert capsys.readouterr().err == f"warning: skipping damaged checkpoint: {message}\n"
    assert found == tmp_path / "checkpoint-4" and saved["step"] == 4
    path.write_text("[]")  # not a marker at all
    with pytest.raises(
        Stop, match=f"^checkpoint marker {re.escape(str(path))} is not a JSON object"
    ):
        verify_checkpoint(tmp_path / "checkpoint-8")


def test_auto_with_only_damaged_checkpoints_stops_rather_than_delete_them(accelerator, tmp_path):
    """`auto` starts fresh where there is no checkpoint; where every one is damaged, a fresh
    start would delete them (resume_or_start clears old checkpoint folders): it stops instead."""
    assert _resolve_checkpoint(str(tmp_path), "auto") == (None, {"step": 0})
    save_checkpoint(accelerator, tmp_path, 4)
    marker = tmp_path / "checkpoint-4" / "COMPLETE.json"
    marker.write_text(json.dumps({**json.loads(marker.read_text()), "step": 5}))
    for how in ("auto", "latest"):
        with pytest.raises(Stop) as err:
            _resolve_checkpoint(str(tmp_path), how)
        assert str(err.value) == (
            f"--resume_from_checkpoint {how}: every checkpoint in {tmp_path} is damaged "
            "(checkpoint-4); pass --overwrite_output_dir to delete them and start over"
        )
    assert marker.is_file()


def test_the_export_is_replaced_whole_or_not_at_all(tmp_path):
    (tmp_path / "final").mkdir()
    (tmp_path / "final" / "model.safetensors").write_text("old")
    with pytest.raises(RuntimeError):  # a crash half-way through writing the new export
        with _atomic_export(OneProcess(), tmp_path) as export:
            Path(export, "config.json").write_text("new")
            raise RuntimeError
    assert [p.name for p in (tmp_path / "final").iterdir()] == [
        "model.safetensors"
    ]  # the old one, untouched
    with _atomic_export(OneProcess(), tmp_path) as export:
        Path(export, "model.safetensors").write_text("new")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]  # no .tmp, no .old
    assert (tmp_path / "final" / "model.safetensors").read_text() == "new"


# Another world size: 2 ranks to step 12 (global batch 6 = 3 x 2), saving checkpoint-6 on the way;
# new processes resume checkpoint-6 on M ranks (6 = 2 x 3, 6 x 1) to step 12, saving checkpoint-12.
RESHARD = [
    "--block_size",
    64,
    "--max_steps",
    12,
    "--save_steps",
    6,
    "--warmup_steps",
    4,
    "--logging_steps",
    1,
    "--eval_steps",
    12,
    "--report_to",
    "none",
    "--ddp_timeout",
    60,
    "--sample_tokens",
    0,
    "--gradient_accumulation_steps",
    1,
]
# Measured (fp32): at most 2.3e-7 relative (FSDP2, FSDP1, ZeRO-2; 2 -> 3 and 2 -> 1 ranks; DDP 2 -> 1:
# 1.7e-7), 3.2e-7 with AVX2's kernels (ZeRO-2; ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2
# MKL_ENABLE_INSTRUCTIONS=SSE4_2): the global batch is reduced in another order, so not bit-equal.
# (A window shifted by one micro batch: 0.97% in loss, docs/checkpoints.md.)
RESHARD_RTOL = 3e-6
# The Adam moments at step 12, per tensor, relative to its largest value: measured at most 5.8e-6
# (FSDP1 and FSDP2, 2 -> 3 ranks; 2.5e-6 on 1 rank; ZeRO-2: 4.4e-6 and 1.4e-6).
MOMENT_RTOL = 1e-4


def optimizer_state(checkpoint_dir, tmp_path):
    """The optimizer state a checkpoint holds, gathered whole: {param name: {"step", "exp_avg", "exp_avg_sq"}}.
    FSDP: Accelerate's DCP folder `optimizer_0`, merged offline by torch's `dcp_to_torch_save`; ZeRO-2:
    the per-parameter files of DeepSpeed's universal checkpoint (`ds_to_universal`)."""
    import torch

    if (Path(checkpoint_dir) / "optimizer_0").is_dir():
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        dcp_to_torch_save(Path(checkpoint_dir) / "optimizer_0", tmp_path / "optimizer.pt")
        return torch.load(tmp_path / "optimizer.pt", weights_only=True)["optimizer"]["state"]
    universal = tmp_path / "universal"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "deepspeed.checkpoint.ds_to_universal",
            "--input_folder",
            str(Path(checkpoint_dir) / "pytorch_model"),
            "--output_folder",
            str(universal),
            "--num_extract_workers",
            "1",
            "--num_merge_workers",
            "1",
            "--inject_missing_state",
        ],
        check=True,
        capture_output=True,
    )

    def tensor(file):
        value = torch.load(file, weights_only=True)
        return value["param"] if isinstance(value, dict) else value

    return {
        d.name: {key: tensor(d / f"{key}.pt") for key in ("step", "exp_avg", "exp_avg_sq")}
        for d in sorted((universal / "zero").iterdir())
        if (d / "exp_avg.pt").is_file()
    }  # (not tied lm_head)


# Shrinking to 1 rank runs the same resharding code as growing to 3: FSDP2 tests it, FSDP1 and ZeRO-2 grow only.
@pytest.mark.parametrize(
    "config,ranks", [("fsdp", 3), ("fsdp", 1), ("fsdp1", 3), ("deepspeed_zero2", 3)]
)
def test_resume_on_another_world_size(
    config, ranks, tmp_path, cache_dir, small_corpus, reference_run
):
    """A checkpoint of 2 ranks continues exactly on 3 ranks and on 1 with the same global batch: FSDP2
    and FSDP1 reshard their model and optimizer states through torch.distributed.checkpoint, ZeRO-2
    through DeepSpeed's universal checkpoint (DDP: the next test). Steps 7-12 (loss, grad norm, LR,
    eval loss) and the optimizer state at step 12 (moments and step counts, gathered) equal the
    uninterrupted 2-rank run's."""
    straight = reference_run(
        config, *corpus_args(small_corpus), *RESHARD, "--per_device_train_batch_size", 3
    )
    saved = straight / "checkpoint-6"
    out = tmp_path / "resumed"
    proc = launch(
        config,
        "recipes/llama.py",
        "--output_dir",
        out,
        *corpus_args(small_corpus),
        *RESHARD,
        "--per_device_train_batch_size",
        6 // ranks,
        "--resume_from_checkpoint",
        saved,
        num_processes=ranks,
        cache_dir=cache_dir,
        mixed_precision="no",
    )
    how = "DeepSpeed's universal checkpoint" if config == "deepspeed_zero2" else "DCP"
    assert (
        f"resumed from {saved} at step 6: resharded from 2 to {ranks} ranks through {how}"
        in proc.stdout
    ), proc.stdout[-3000:]
    info = json.loads((out / "run_info.json").read_text())
    assert info["world_size"] == ranks and info["global_batch"] == 6
    assert info["resumed"] == {
        "checkpoint": str(saved),
        "step": 6,
        "saved_world_size": 2,
        "resharded": how,
    }
    want = {r["step"]: r for r in read_metrics(straight)[0]}
    got = read_metrics(out)[0]
    assert [r["step"] for r in got] == list(range(7, 13))
    for r in got:
        for key in ("loss", "grad_norm", "lr"):
            assert r[key] == pytest.approx(want[r["step"]][key], rel=RESHARD_RTOL), (
                config,
                ranks,
                r["step"],
                key,
            )
    assert got[-1]["eval_loss"] == pytest.approx(want[12]["eval_loss"], rel=RESHARD_RTOL)
    # The moments the resumed run trained on to step 12 are the uninterrupted run's: a resharded
    # state that lost or misplaced the saved ones would differ at once (Adam's moments at step 6
    # weigh 0.9^6 = 53% and 0.999^6 = 99% of those at step 12).
    (tmp_path / "want").mkdir()
    (tmp_path / "got").mkdir()
    want_state = optimizer_state(straight / "checkpoint-12", tmp_path / "want")
    got_state = optimizer_state(out / "checkpoint-12", tmp_path / "got")
    assert (
        got_state.keys() == want_state.keys() and len(got_state) == 38
    )  # every parameter of the debug model
    for name, state in want_state.items():
        assert float(got_state[name]["step"]) == float(state["step"]) == 12, name
        for key in ("exp_avg", "exp_avg_sq"):
            assert got_state[name][key].shape == state[key].shape, (name, key)  # whole, not a shard
            torch_close(got_state[name][key], state[key], name, key)


def test_a_ddp_checkpoint_resumes_on_one_rank(tmp_path, cache_dir, small_corpus, reference_run):
    """A DDP state is whole on every rank: the session's 16-step 2-rank DDP run (global batch 8 = 2 x 2
    x 2) resumes from checkpoint-10 on one rank (4 x 2) and ends as it did, to 2e-6 (12x the measured)."""
    straight = reference_run("ddp", *args(None, small_corpus, *batch_args("ddp"))[2:])
    saved = straight / f"checkpoint-{SAVE}"
    mode = {f: (saved / f).stat().st_mode & 0o777 for f in ("model.safetensors", "hf/config.json")}
    assert mode["model.safetensors"] == mode["hf/config.json"], (
        mode
    )  # the umask's, not safetensors' 0600
    out = tmp_path / "resumed"
    proc = launch(
        "ddp",
        "recipes/llama.py",
        *args(out, small_corpus, *batch_args("single"), "--resume_from_checkpoint", saved),
        num_processes=1,
        cache_dir=cache_dir,
        mixed_precision="no",
    )
    assert (
        f"resumed from {saved} at step {SAVE}: written by 2 rank(s), loaded whole on each of 1"
        in proc.stdout
    ), proc.stdout[-3000:]
    info = json.loads((out / "run_info.json").read_text())
    assert info["world_size"] == 1 and info["global_batch"] == 8
    assert info["resumed"] == {
        "checkpoint": str(saved),
        "step": SAVE,
        "saved_world_size": 2,
        "resharded": None,
    }
    want = {r["step"]: r for r in read_metrics(straight)[0]}
    got = read_metrics(out)[0]
    assert [r["step"] for r in got] == list(range(SAVE + 1, STEPS + 1))
    for r in got:
        for key in ("loss", "grad_norm", "lr"):
            assert r[key] == pytest.approx(want[r["step"]][key], rel=2e-6), (
                r["step"],
                key,
            )  # measured 1.7e-7
    assert got[-1]["eval_loss"] == pytest.approx(want[STEPS]["eval_loss"], rel=2e-6)


def torch_close(got, want, name, key):
    """`got` equals `want` within MOMENT_RTOL of the tensor's largest value (moments near 0 have no
    meaningful relative error)."""
    scale = float(want.abs().max())
    assert float((got - want).abs().max()) <= MOMENT_RTOL * scale, (
        name,
        key,
        float((got - want).abs().max()),
        scale,
    )


@pytest.fixture(scope="module")
def refused(tmp_path_factory, cache_dir, small_corpus, reference_run):
    """One launch that the next two tests read: the session's 2-rank ZeRO-3 checkpoint-10 (the flags of
    test_exact_resume_mid_epoch's runs) resumed on 1 ZeRO-3 rank, with the data order, the LR, the
    warmup, the precision and --max_steps changed too. Returns (the checkpoint, the output dir, the launch)."""
    zero3 = reference_run(
        "deepspeed_zero3", *args(None, small_corpus, *batch_args("deepspeed_zero3"))[2:]
    )
    ckpt, out = zero3 / f"checkpoint-{SAVE}", tmp_path_factory.mktemp("refused") / "run"
    proc = launch(
        "deepspeed_zero3",
        "recipes/llama.py",
        *args(
            out,
            small_corpus,
            "--per_device_train_batch_size",
            4,
            "--seed",
            7,
            "--block_size",
            32,
            "--gradient_accumulation_steps",
            4,
            "--packing",
            "documents",
            "--learning_rate",
            1e-3,
            "--warmup_steps",
            5,
            "--max_steps",
            20,
            "--resume_from_checkpoint",
            ckpt,
        ),
        num_processes=1,
        cache_dir=cache_dir,
        mixed_precision="bf16",
        check=False,
    )
    return ckpt, out, proc


def refusal(refused):
    """The refused launch's one error line (the whole of what it says), after checking that it wrote nothing."""
    _, out, proc = refused
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert not (out / "metrics.jsonl").exists()
    return errors[0]


def test_a_zero3_checkpoint_on_another_world_size_is_refused(refused):
    # A 2-rank ZeRO-3 checkpoint on 1 ZeRO-3 rank: refused at start-up, in one line, naming why and the
    # way out, after every other difference (`refused`; the world size alone: test_a_sharded_state_...,
    # which also covers a ZeRO state on another strategy).
    error = refusal(refused)
    assert (
        "; a DEEPSPEED_ZERO3 state of 2 rank(s), this run has 1: DeepSpeed loads ZeRO-3 optimizer partitions on "
        "the number of ranks that wrote them only, and its universal checkpoint does not continue a ZeRO-3 run "
        "exactly"
    ) in error
    assert (
        "(resume on 2 ranks, or convert it with tools/consolidate.py and start from its weights). Resume with "
        "the saved settings" in error
    ), error  # the last difference named


def test_resume_refuses_another_data_order(refused):
    # The step count only locates the data position under the same seed and blocks.
    ckpt = refused[0]
    marker = verify_checkpoint(ckpt)
    assert (marker["seed"], marker["block_size"], marker["packing"]) == (42, 64, "stream")
    assert marker["train_blocks"] > 0
    # The world size and eight flags changed, one launch (`refused`): the refusal names every difference in
    # one line. The data order (the global batch 8 -> 16 too: the step count would point at another sample);
    # then what would make it another run: the LR (the optimizer state would silently bring back the saved one), the
    # warmup and the precision; and a longer run: past the 5 warmup steps (this run's, as the recipe
    # passes them) the cosine LR of steps 1-10 was the 16-step run's, so no 20-step run trains them
    # (within the warmup: test_a_longer_run_...).
    error = refusal(refused)
    assert error.startswith(
        f"error: cannot resume from {ckpt}: global_batch 8 -> 16 (--per_device_train_batch_size "
        "x --gradient_accumulation_steps x world size); seed 42 -> 7; block_size 64 -> 32; "
        "packing stream -> documents"
    ), error
    assert "--block_size, --packing); data_digest " in error and error.count("--packing") == 1, (
        error
    )  # (once)
    assert (
        "(the data); learning_rate 0.003 -> 0.001; warmup_steps 4 -> 5 (--warmup_steps, or "
        "--warmup_ratio x --max_steps); mixed_precision no -> bf16; max_steps "
        f"{STEPS} -> 20 (the LR decays over --max_steps after 5 warmup steps, and the checkpoint's {SAVE} steps "
        "went past them); a DEEPSPEED_ZERO3 state" in error
    ), error


@pytest.mark.parametrize("config", ["fsdp", "deepspeed_zero3"])
def test_consolidate_sharded_checkpoint(config, tmp_path, cache_dir, small_corpus, reference_run):
    # fp32: in bf16 ZeRO exports the bf16 weights, the checkpoint holds the fp32 masters. A run whose
    # last step saves: FSDP2's is the session's 30-step run. ZeRO-3's is built already partitioned
    # (zero3_init_flag: true, deepspeed.zero.Init), which the shipped YAMLs leave off.
    if config == "fsdp":
        out, last = reference_run("fsdp", *corpus_args(small_corpus), *RUN30), 30
    else:
        out, last = tmp_path / "run", SAVE
        yaml = tmp_path / "zero3_init.yaml"
        yaml.write_text(
            (REPO / "accelerate_configs/deepspeed_zero3.yaml")
            .read_text()
            .replace("zero3_init_flag: false", "zero3_init_flag: true")
        )
        launch(
            yaml,
            "recipes/llama.py",
            *args(out, small_corpus, *batch_args(config), "--max_steps", SAVE),
            cache_dir=cache_dir,
            mixed_precision="no",
        )
        # the same model (its size counted from the partitions) from another random init: the
        # 2-rank ZeRO-3 run of these flags that starts from the plain init begins elsewhere
        plain = reference_run(config, *args(None, small_corpus, *batch_args(config))[2:])
        info, plain_info = (json.loads((d / "run_info.json").read_text()) for d in (out, plain))
        assert (
            info["n_params"] == plain_info["n_params"] and info["distributed_type"] == "DEEPSPEED"
        )
        first, plain_first = read_metrics(out)[0][0], read_metrics(plain)[0][0]
        assert first["step"] == plain_first["step"] == 1 and first["loss"] != plain_first["loss"]
    (tmp_path / "hf").mkdir()
    save_file(
        {"w": torch.zeros(1)}, tmp_path / "hf/private.safetensors"
    )  # a file of the user's: left as it was
    subprocess.run(
        [
            sys.executable,
            REPO / "tools/consolidate.py",
            out / f"checkpoint-{last}",
            tmp_path / "hf",
        ],
        check=True,
        capture_output=True,
    )
    assert (tmp_path / "hf/private.safetensors").stat().st_mode & 0o777 == 0o600
    with pytest.raises(
        ValueError
    ) as again:  # its weights would mix with an earlier model's shards or index
        consolidate(out / f"checkpoint-{last}", tmp_path / "hf")
    assert (
        str(again.value)
        == f"{tmp_path / 'hf'} holds a model already (config.json, model.safetensors): give a "
        "new folder or remove it"
    )
    # every export is ready for inference: the KV cache that training turns off is on
    for folder in (tmp_path / "hf", out / "final", out / f"checkpoint-{last}/hf"):
        assert json.loads((folder / "config.json").read_text())["use_cache"] is True, folder
    merged, exported = (
        load_file(tmp_path / "hf/model.safetensors"),
        load_file(out / "final/model.safetensors"),
    )
    assert merged.keys() == exported.keys()
    modes = {
        str(f): f.stat().st_mode & 0o777
        for f in (
            tmp_path / "hf/model.safetensors",
            tmp_path / "hf/config.json",
            out / "final/model.safetensors",
        )
    }
    assert len(set(modes.values())) == 1, (
        modes
    )  # what the umask allows: safetensors alone writes 0600
    for name, tensor in exported.items():
        assert tuple(merged[name].shape) == tuple(tensor.shape)  # full size, not a shard
        assert (merged[name].float() - tensor.float()).abs().max() == 0, name


def test_save_then_load_in_the_same_job(tmp_path, cache_dir):
    for config in ("fsdp", "deepspeed_zero3"):
        launch(config, "tests/scripts/save_load.py", tmp_path / config, cache_dir=cache_dir)
        assert (tmp_path / config / "ok").read_text() == "2"


def test_every_torch_load_is_weights_only():
    calls = [
        (p, line)
        for p in REPO.rglob("*.py")
        if ".venv" not in p.parts
        for line in p.read_text().splitlines()
        if re.search(r"torch\.load\(", line) and "re.search" not in line
    ]
    assert all("weights_only=True" in line for _, line in calls), calls
