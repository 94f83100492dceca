"""recipes/llama.py off the happy path: what users change between runs either continues exactly
or stops at start-up with one line; odd windows are skipped and logged as strict JSON."""

import json
import math
import re

import pytest

from common.checkpoint import verify_checkpoint
from conftest import REPO, corpus_args, launch, read_metrics, run_in_process, strict_lines
from test_bad_input import DEEPSPEED_ZERO2_ENV
from test_checkpoint import SAVE, STEPS, batch_args
from test_checkpoint import args as ckpt_args

# The settings: blocks of 64 tokens, micro batch 2, one line per step, no evaluation; no text
# sample from the export (not under test here).
FL = [
    "--block_size",
    64,
    "--report_to",
    "none",
    "--eval_steps",
    1000,
    "--logging_steps",
    1,
    "--max_eval_samples",
    8,
    "--sample_tokens",
    0,
    "--ddp_timeout",
    120,
]


def test_resume_with_another_split_of_the_global_batch(
    tmp_path, cache_dir, small_corpus, reference_run
):
    """The session's 16-step fp32 DDP run (2 per device x 2 accumulation x 2 ranks, tests/test_checkpoint.py)
    resumed from checkpoint-10, 3 steps into epoch 2, with the same global batch 8 split otherwise (the
    reported case: skipping by the saved accumulation shifted every window): it must skip 3 x 4 blocks
    per rank of the epoch, whatever micro batches they come in. The skip is llama.py's one line for
    every strategy (`skip_first_batches` by the new accumulation), so DDP stands for all; FSDP2's and
    ZeRO's resumes of this same run at checkpoint-10 (same split) are launched in tests/test_multinode.py."""
    config, (per_device, accumulation) = "ddp", (1, 4)
    straight = reference_run(config, *ckpt_args(None, small_corpus, *batch_args(config))[2:])
    split = [
        "--per_device_train_batch_size",
        per_device,
        "--gradient_accumulation_steps",
        accumulation,
    ]
    resumed = tmp_path / "resumed"
    launch(
        config,
        "recipes/llama.py",
        *ckpt_args(
            resumed,
            small_corpus,
            *split,
            "--resume_from_checkpoint",
            straight / f"checkpoint-{SAVE}",
        ),
        cache_dir=cache_dir,
        mixed_precision="no",
    )
    want = {r["step"]: r for r in read_metrics(straight)[0]}
    got = read_metrics(resumed)[0]
    assert [r["step"] for r in got] == list(range(SAVE + 1, STEPS + 1))
    # skipping by the saved accumulation: 0.97% off in loss, 55% in grad norm; measured 7.9e-8 (another micro-batch
    # split sums the accumulated gradients in another order: ~1 fp32 ulp); 1e-6 is ~13x that
    for r in got:
        for key in ("loss", "grad_norm", "lr"):
            assert r[key] == pytest.approx(want[r["step"]][key], rel=1e-6), (config, r["step"], key)


def test_deepspeed_json_that_contradicts_the_flags_stops_at_start_up(tmp_path, monkeypatch):
    # Every explicit batch key wrong, and bf16 forced on while the launch asks for fp32. Checked before
    # the Accelerator: in this process, with the variables a launch of deepspeed_zero2.yaml pointing at
    # this JSON gives its ranks (tests/test_bad_input.py launches the same check for real).
    ds = json.loads((REPO / "ds_configs/zero2.json").read_text())
    ds.update(
        train_batch_size=16,
        train_micro_batch_size_per_gpu=2,
        gradient_accumulation_steps=4,
        bf16={"enabled": True},
    )
    (tmp_path / "zero2.json").write_text(json.dumps(ds))
    for key, value in {
        **DEEPSPEED_ZERO2_ENV,
        "ACCELERATE_DEEPSPEED_CONFIG_FILE": str(tmp_path / "zero2.json"),
        "ACCELERATE_MIXED_PRECISION": "no",
    }.items():
        monkeypatch.setenv(key, value)
    message = run_in_process(
        monkeypatch,
        "recipes/llama.py",
        "--output_dir",
        tmp_path / "out",
        "--max_steps",
        8,
        "--per_device_train_batch_size",
        4,
        *FL,
    )
    where = f"the DeepSpeed JSON {tmp_path / 'zero2.json'}"
    for line in (
        f"error: {where} sets train_micro_batch_size_per_gpu: 2, but --per_device_train_batch_size is 4",
        f"error: {where} sets gradient_accumulation_steps: 4, but --gradient_accumulation_steps is 1",
        f"error: {where} sets train_batch_size: 16, but the global batch (4 per device x 1 accumulation "
        "x 2 ranks) is 8",
        f"error: the launch asks for mixed precision no, but {where} enables bf16",
    ):
        assert line in message, message
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


def test_fp16_skipped_steps_hold_the_lr_survive_resume_and_stop_a_collapse(
    tmp_path, cache_dir, small_corpus
):
    # lr 3.0 wrecks the weights at step 1; every later step overflows and is skipped.
    out = tmp_path / "run"
    args = [
        "--learning_rate",
        3.0,
        "--warmup_steps",
        0,
        "--per_device_train_batch_size",
        1,
        *FL,
        "--block_size",
        8,
        *corpus_args(small_corpus),
    ]  # 18 emulated fp16 steps: blocks of 8 tokens, small corpus
    proc = launch(
        "ddp",
        "recipes/llama.py",
        "--output_dir",
        out,
        "--max_steps",
        25,
        "--save_steps",
        5,
        *args,
        cache_dir=cache_dir,
        mixed_precision="fp16",
        check=False,
    )
    lines = strict_lines(out / "metrics.jsonl")
    assert [r["step"] for r in lines] == list(range(1, 19))  # stopped in step 18, after logging it
    assert proc.returncode != 0
    assert "error: step 18: the fp16 loss scale fell to 0.5, below its minimum 1" in proc.stderr
    assert "warning: step 11: 10 fp16 steps in a row skipped" in proc.stderr
    assert [r["skipped_steps"] for r in lines] == list(range(0, 18))
    assert [r["loss_scale"] for r in lines] == [
        65536 / 2**k for k in range(0, 18)
    ]  # 0.5 at step 18
    assert all(
        r["lr"] == lines[1]["lr"] for r in lines[1:]
    )  # one real update, then the schedule holds
    assert lines[1]["loss"] is None and "loss" in lines[1]["nonfinite"]
    # The counters and the scale come back with the checkpoint: resumed from step 5, the run skips
    # and halves as it did, and stops at the same step.
    assert verify_checkpoint(out / "checkpoint-5")["skipped_steps"] == 4
    resumed = tmp_path / "resumed"
    proc = launch(
        "ddp",
        "recipes/llama.py",
        "--output_dir",
        resumed,
        "--max_steps",
        25,
        *args,
        "--resume_from_checkpoint",
        out / "checkpoint-5",
        cache_dir=cache_dir,
        mixed_precision="fp16",
        check=False,
    )
    after = strict_lines(resumed / "metrics.jsonl")
    assert [(r["step"], r["skipped_steps"], r["loss_scale"]) for r in after] == [
        (r["step"], r["skipped_steps"], r["loss_scale"]) for r in lines[5:]
    ]  # steps 6-18: (6, 5, 2048.0), ...
    assert proc.returncode != 0 and "error: step 18: the fp16 loss scale fell to 0.5" in proc.stderr


def test_windows_without_target_tokens_are_skipped_and_logged(tmp_path, cache_dir):
    # 24 rows, 20 of them empty, one padded row each (--packing false): some windows hold no target.
    # Under DDP: the count of targets is all-reduced (every rank skips the same windows) and the skip
    # is strategy-free code (llama.py, common/precision.StepHealth), the same under FSDP.
    real = [
        "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer",
        "The slings and arrows of outrageous fortune, or to take arms against a sea of troubles",
        "And by opposing end them. To die, to sleep, no more; and by a sleep to say we end",
        "The heart-ache and the thousand natural shocks that flesh is heir to.",
    ]
    rows = [real[i // 6] if i % 6 == 0 else "" for i in range(24)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in rows))
    (tmp_path / "valid.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in real))
    out = tmp_path / "run"
    proc = launch(
        "ddp",
        "recipes/llama.py",
        "--output_dir",
        out,
        "--packing",
        "false",
        "--max_steps",
        6,
        "--warmup_steps",
        0,
        "--per_device_train_batch_size",
        2,
        "--train_file",
        tmp_path / "train.jsonl",
        "--validation_file",
        tmp_path / "valid.jsonl",
        *FL,
        cache_dir=cache_dir,
        mixed_precision="no",
    )
    lines = strict_lines(out / "metrics.jsonl")
    steps = [r for r in lines if not r.get("summary")]
    empty = [r["step"] for r in steps if r["loss"] is None]
    assert empty and len(empty) < 6
    for r in steps:
        if r["step"] in empty:
            assert r["grad_norm"] is None and set(r["nonfinite"]) == {"loss", "grad_norm"}
        else:
            assert math.isfinite(r["loss"]) and "nonfinite" not in r
    # The scheduler steps on real updates only (cosine decay, no warmup: each one lowers the LR).
    lrs = {r["step"]: r["lr"] for r in steps}
    for k in range(1, 6):
        assert (lrs[k + 1] == lrs[k]) if k in empty else (lrs[k + 1] < lrs[k]), (k, empty, lrs)
    assert steps[-1]["empty_windows"] == lines[-1]["empty_windows"] == len(empty)
    assert (
        f"warning: {len(empty)} of 6 windows had no target tokens and were skipped" in proc.stderr
    )


def test_a_fresh_run_never_overwrites_an_earlier_one(tmp_path, monkeypatch):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    message = run_in_process(
        monkeypatch, "recipes/llama.py", "--output_dir", out, "--seed", 7, *FL
    )  # a flag check
    assert message.startswith(f"error: --output_dir {out} already holds files (metrics.jsonl)"), (
        message
    )
    assert "--overwrite_output_dir" in message
    assert "--resume_from_checkpoint latest" not in message  # it holds no checkpoint to resume
    assert (out / "metrics.jsonl").read_text() == '{"step": 1, "loss": 5.0}\n'  # untouched
    # (With --overwrite_output_dir everything of the earlier run goes, its checkpoints too:
    # tests/test_checkpoint.py's test_overwrite_deletes_the_earlier_run.)


def test_deepspeed_flags_of_the_launch_line_are_refused_where_they_would_not_run(
    tmp_path, cache_dir, monkeypatch
):
    # DeepSpeed copies --gradient_accumulation_steps into the JSON's "auto" key (the recipe counted 1 and
    # reported 4x the optimizer steps); a stage the JSON sets, or an offload it lacks, was dropped silently.
    # A real launch: each rank reads the flags from its launcher's command line.
    out = tmp_path / "out"
    proc = launch(
        "deepspeed_zero3",
        "recipes/llama.py",
        "--output_dir",
        out,
        "--max_steps",
        2,
        "--per_device_train_batch_size",
        2,
        *FL,
        cache_dir=cache_dir,
        mixed_precision="no",
        check=False,
        launcher_args=[
            "--gradient_accumulation_steps",
            4,
            "--zero_stage",
            2,
            "--offload_optimizer_device",
            "cpu",
        ],
    )
    assert proc.returncode != 0
    errors = sorted({line for line in proc.stderr.splitlines() if line.startswith("error:")})
    expected = [
        "error: accelerate launch --gradient_accumulation_steps 4 differs from the recipe's "
        "--gradient_accumulation_steps 1",
        "error: accelerate launch --offload_optimizer_device cpu conflicts with the DeepSpeed JSON "
        "ds_configs/zero3.json, which has no zero_optimization.offload_optimizer.device",
        "error: accelerate launch --zero_stage 2 conflicts with the DeepSpeed JSON ds_configs/zero3.json, "
        "which sets zero_optimization.stage: 3 and wins",
    ]
    assert len(errors) == len(expected) and all(
        e.startswith(x) for e, x in zip(errors, expected)
    ), proc.stderr[-3000:]
    assert not (out / "metrics.jsonl").exists()  # stopped at start-up

    # Accelerate passes these flags to DeepSpeed only: under DDP it dropped them. The same check, in this
    # process, with a DDP rank's variables and that launcher command line.
    from common import checks

    monkeypatch.setattr(
        checks, "launcher_args", lambda pid=None: {"--gradient_accumulation_steps": "4"}
    )
    for key, value in {
        "WORLD_SIZE": "2",
        "LOCAL_WORLD_SIZE": "2",
        "ACCELERATE_MIXED_PRECISION": "no",
    }.items():
        monkeypatch.setenv(key, value)
    message = run_in_process(
        monkeypatch,
        "recipes/llama.py",
        "--output_dir",
        tmp_path / "ddp",
        "--max_steps",
        2,
        "--per_device_train_batch_size",
        2,
        *FL,
    )
    assert message.startswith(
        "error: accelerate launch --gradient_accumulation_steps 4: Accelerate passes it to "
        "DeepSpeed only, and this launch is not DeepSpeed (MULTI_GPU), so it would be ignored"
    ), message


@pytest.mark.parametrize(
    "env, num_processes, kind, expected",
    [
        (
            {"WORLD_SIZE": "2"},
            1,
            "NO",
            "launched with WORLD_SIZE=2 but Accelerate built a state with 1 process(es)",
        ),
        (
            {"WORLD_SIZE": "2", "ACCELERATE_USE_FSDP": "true"},
            2,
            "MULTI_CPU",
            "the accelerate config asks for FSDP but Accelerate chose MULTI_CPU",
        ),
    ],
)
def test_a_fallback_to_independent_processes_is_a_one_line_error(
    env, num_processes, kind, expected, monkeypatch
):
    """`check_distributed` raises the error type every recipe prints as its `error:` line (ValueError),
    so a silent fallback ends the run in one line, not a traceback."""
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    from common import launch as launch_module

    for name in ("WORLD_SIZE", "ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    accelerator = SimpleNamespace(
        num_processes=num_processes, distributed_type=DistributedType[kind]
    )
    with pytest.raises(ValueError, match=re.escape(expected)):
        launch_module.check_distributed(accelerator)
