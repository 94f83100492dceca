"""A loss or gradient norm that turns inf/NaN outside fp16 loss scaling stops every recipe, under every
strategy, with one line naming the first bad step, before any checkpoint or export of the weights.

`--learning_rate 1e10 --warmup_steps 0`: step 1 is finite, and its update wrecks the weights, so
step 2's loss is NaN (DDP and FSDP would then step AdamW on NaN gradients; DeepSpeed skips every
step from there, and reported them as "fp16 steps" in an fp32 run)."""

import pytest

from conftest import launch, strict_lines

WRECK = ["--learning_rate", 1e10, "--warmup_steps", 0, "--ddp_timeout", 120]
FL = [
    "--block_size",
    64,
    "--per_device_train_batch_size",
    2,
    "--report_to",
    "none",
    "--eval_steps",
    1000,
    "--max_eval_samples",
    8,
    "--sample_tokens",
    0,
]


def error_lines(proc):
    """The distinct error lines (each rank prints its own; another rank's progress bar may precede one)."""
    return {
        line[line.index("error:") :]
        for line in proc.stderr.splitlines()
        if "error:" in line and "traceback :" not in line
    }  # (torchrun's summary repeats it, cut short)


# DDP, and ZeRO-2 for the sharded strategies (DeepSpeed reports the overflow its own way: inf, and it would
# skip the steps). FSDP2 is not launched here: the stop is common code, and a non-finite gradient norm
# through FSDP2's all-reduced shard norms is launched in test_mixed_precision.py (fp16 inf drill, fsdp).
@pytest.mark.parametrize("config", ["ddp", "deepspeed_zero2"])
def test_a_nan_loss_stops_the_run_before_any_weights_are_saved(config, tmp_path, cache_dir):
    # Logged at step 4, saved at 3: the device-side flag is read at the save (no read per step),
    # and names step 2, the first bad one.
    out = tmp_path / "run"
    proc = launch(
        config,
        "recipes/llama.py",
        "--output_dir",
        out,
        "--max_steps",
        6,
        "--logging_steps",
        4,
        "--save_steps",
        3,
        *WRECK,
        *FL,
        cache_dir=cache_dir,
        mixed_precision="no",
        check=False,
    )
    assert proc.returncode != 0
    errors = error_lines(proc)
    assert len(errors) == 1, proc.stderr[-3000:]  # the same line on each rank
    norm = "inf" if config == "deepspeed_zero2" else "nan"  # DeepSpeed reports an overflow as inf
    assert errors == {
        f"error: step 2: the training loss is nan and the gradient norm {norm} in fp32; stopped before "
        "saving any weights (only fp16 loss scaling skips such a step and goes on). Lower "
        "--learning_rate, lengthen --warmup_steps, keep --max_grad_norm clipping on, or check the data"
    }
    assert not list(out.glob("checkpoint-*")) and not (out / "final").exists()
    assert (
        strict_lines(out / "metrics.jsonl") == []
    )  # stopped at step 3, before the first logging step
    assert (
        "fp16 steps" not in proc.stdout + proc.stderr
    )  # (ZeRO-2 counted its skipped steps as such in fp32)


def assert_stopped_at_step_2(proc, out):
    """The other recipes: one line naming step 2, steps 1 and 2 logged, nothing saved (checkpoint at 4)."""
    assert proc.returncode != 0
    errors = error_lines(proc)
    assert (
        len(errors) == 1
        and "error: step 2: the training loss is nan" in next(iter(errors))
        and "in fp32; stopped before saving any weights" in next(iter(errors))
    ), proc.stderr[-3000:]
    steps = strict_lines(out / "metrics.jsonl")
    assert [r["step"] for r in steps] == [1, 2] and steps[1]["loss"] is None
    assert not list(out.glob("checkpoint-*")) and not (out / "final").exists()


def test_the_classifier_stops_at_a_nan_loss_too(tmp_path, cache_dir):
    out = tmp_path / "run"
    proc = launch(
        "ddp",
        "recipes/ddp_classifier.py",
        "--output_dir",
        out,
        "--max_train_samples",
        256,
        "--per_device_train_batch_size",
        8,
        "--max_steps",
        4,
        "--logging_steps",
        1,
        "--save_steps",
        4,
        *WRECK,
        cache_dir=cache_dir,
        mixed_precision="no",
        check=False,
    )
    assert_stopped_at_step_2(proc, out)
