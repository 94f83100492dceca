"""The large-batch guard: --scale_lr applies the linear scaling rule with warmup, and says so."""

import pytest

from common.causal_lm import scaled_learning_rate
from conftest import FAST, launch, read_metrics

# FAST's batch (the global batch the messages name), with small blocks, a small eval and no sample.
SMALL = [*FAST, "--block_size", 64, "--max_eval_samples", 8, "--sample_tokens", 0]


def test_linear_scaling_arithmetic():
    assert scaled_learning_rate(3e-4, 256, 32) == pytest.approx(2.4e-3)  # 8x the batch, 8x the LR
    assert scaled_learning_rate(1e-3, 8, 16) == pytest.approx(5e-4)
    assert scaled_learning_rate(1e-3, 16, 16) == 1e-3
    with pytest.raises(ValueError, match="--learning_rate must be positive"):
        scaled_learning_rate(0.0, 8, 16)
    with pytest.raises(ValueError, match="--reference_global_batch 0"):
        scaled_learning_rate(1e-3, 8, 0)


def test_scale_lr_in_the_recipe(tmp_path, cache_dir):
    out = tmp_path / "run"
    proc = launch(
        "ddp",
        "recipes/llama.py",
        "--output_dir",
        out,
        *SMALL,
        "--scale_lr",
        "--reference_global_batch",
        2,
        "--learning_rate",
        1e-3,
        "--warmup_steps",
        2,
        "--max_steps",
        4,
        "--logging_steps",
        1,
        "--eval_steps",
        4,
        cache_dir=cache_dir,
    )
    # global batch 8 = 4 per device x 2 ranks: 4x the reference batch, so 4x the LR, after warmup
    assert (
        "LR: base 0.001 (tuned at global batch 2), effective 0.004 at global batch 8, 2 warmup steps"
        in proc.stdout
    )
    lrs = [r["lr"] for r in read_metrics(out)[0]]
    assert lrs[:3] == pytest.approx([0.0, 0.002, 0.004])
    # (without --scale_lr the same batch is a warning: tests/test_bad_input.py's epoch run)
