"""Same answer under every strategy: per-step loss, grad norm, LR and eval loss of
recipes/llama.py under DDP, FSDP2, FSDP1, ZeRO-2 and ZeRO-3 (2 ranks) against a single-process
fp32 reference on the same global batch of 4 sequences."""

import json
import math
import os

import pytest
import torch

from conftest import grad_norm_rtol, launch, read_metrics

STRATEGIES = ["ddp", "fsdp", "fsdp1", "deepspeed_zero2", "deepspeed_zero3"]
STEPS, WARMUP, LR = 10, 3, 3e-3
COMMON = ["--max_steps", STEPS, "--warmup_steps", WARMUP, "--learning_rate", LR, "--logging_steps", 1,
          "--eval_steps", STEPS, "--block_size", 64, "--max_eval_samples", 13, "--per_device_eval_batch_size", 4,
          "--report_to", "none", "--ddp_timeout", 120]
FP32_RTOL = 1e-4
BF16_RTOL = 2e-2  # bf16 keeps 8 mantissa bits: ~4e-3 relative rounding per op, compounding over steps


def run(tmp_path, cache_dir, config, per_device, accum, precision):
    out = tmp_path / f"{config}-{per_device}x{accum}-{precision}"
    launch(config, "recipes/llama.py", "--output_dir", out, "--per_device_train_batch_size", per_device,
           "--gradient_accumulation_steps", accum, *COMMON, cache_dir=cache_dir, mixed_precision=precision)
    steps, _ = read_metrics(out)
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    return steps


def expected_lr(step):
    """LR applied by optimizer step `step` (1-based): transformers' cosine schedule with warmup,
    evaluated after step-1 scheduler steps, written out independently of the library."""
    k = step - 1
    if k < WARMUP:
        return LR * k / WARMUP
    return LR * 0.5 * (1 + math.cos(math.pi * (k - WARMUP) / (STEPS - WARMUP)))


def worst_gap(run_steps, ref_steps, key):
    return max(abs(r[key] - q[key]) / abs(q[key]) for r, q in zip(run_steps, ref_steps) if q.get(key))


def report(**row):
    """Append a measured gap to $PARITY_REPORT (for the README table), if set."""
    if os.environ.get("PARITY_REPORT"):
        with open(os.environ["PARITY_REPORT"], "a") as f:
            f.write(json.dumps(row) + "\n")


@pytest.fixture(scope="module")
def reference(tmp_path_factory, cache_dir):
    steps = run(tmp_path_factory.mktemp("ref"), cache_dir, "single", 4, 1, "no")
    for r in steps:  # the schedule advances once per optimizer step: exact values
        assert r["lr"] == pytest.approx(expected_lr(r["step"]), rel=1e-9, abs=1e-12)
    assert steps[WARMUP]["lr"] == pytest.approx(LR)  # warmup over: step 4 runs at the peak LR
    assert steps[-1]["loss"] < steps[0]["loss"] - 0.5
    return steps


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("per_device,accum", [(2, 1), (1, 2)], ids=["batch2", "batch1-accum2"])
def test_fp32_parity(strategy, per_device, accum, reference, tmp_path, cache_dir):
    steps = run(tmp_path, cache_dir, strategy, per_device, accum, "no")
    gaps = {key: worst_gap(steps, reference, key) for key in ("loss", "grad_norm", "eval_loss")}
    report(strategy=strategy, precision="fp32", accum=accum, **gaps)
    for key in ("loss", "eval_loss"):
        assert gaps[key] < FP32_RTOL, f"{strategy} {key}: worst relative gap {gaps[key]:.2e} vs single-process fp32"
    # 1e-4, or 5e-4 for sharded strategies on CPU: see conftest.grad_norm_rtol for the measured cause
    assert gaps["grad_norm"] < grad_norm_rtol(strategy), f"{strategy} grad_norm: worst relative gap {gaps['grad_norm']:.2e}"
    for r in steps:  # LR at exact steps, whatever the world size and accumulation
        assert r["lr"] == pytest.approx(expected_lr(r["step"]), rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_bf16_parity(strategy, reference, tmp_path, cache_dir):
    steps = run(tmp_path, cache_dir, strategy, 2, 1, "bf16")
    gaps = {key: worst_gap(steps, reference, key) for key in ("loss", "grad_norm", "eval_loss")}
    report(strategy=strategy, precision="bf16", accum=1, **gaps)
    for key, gap in gaps.items():
        assert gap < BF16_RTOL, f"{strategy} bf16 {key}: worst relative gap {gap:.2e} vs single-process fp32"


@pytest.mark.skipif(torch.cuda.is_available(), reason="measures the CPU kernel")
def test_cpu_norm_kernel_error():
    """The cause behind conftest.grad_norm_rtol: torch's CPU fp32 norm of a 4096x256 gradient
    (the debug model's embedding) is off against fp64 by more than 1e-5, while a summed square
    of the same tensor is not. When torch fixes this, this test fails: tighten the bound."""
    g = torch.randn(4096, 256, generator=torch.Generator().manual_seed(0))
    g = g * torch.rand(4096, 1, generator=torch.Generator().manual_seed(1)) ** 8  # few frequent tokens, as in text
    exact = g.double().norm().item()
    assert abs(g.norm().item() / exact - 1) > 1e-5
    assert abs(g.pow(2).sum().sqrt().item() / exact - 1) < 1e-6
