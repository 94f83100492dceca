"""Same answer under every strategy: loss, grad norm, LR and eval loss of recipes/llama.py under
DDP, FSDP2, FSDP1, ZeRO-2 and ZeRO-3 (2 ranks) against a single-process fp32 reference on the same
global batch: 4 sequences without accumulation in the 10-step runs that tests/test_llama.py also
checks (logged every 2nd step); 8 with accumulation in the 16-step runs that
tests/test_checkpoint.py resumes (logged every step)."""

import json
import math
import os
import runpy
import subprocess
import sys

import pytest
import torch

from conftest import REPO, launch, read_metrics

sys.path.insert(0, str(REPO / "tests" / "scripts"))
from compare_runs import KEYS, worst_gaps  # noqa: E402
from test_checkpoint import args, batch_args  # noqa: E402

sys.path.insert(0, str(REPO))
from common.precision import _cpu_native_dtypes  # noqa: E402

STRATEGIES = ["ddp", "fsdp", "fsdp1", "deepspeed_zero2", "deepspeed_zero3"]
STEPS, WARMUP, LR = 10, 3, 3e-3  # conftest.SHORT
# Per key, about 10x the worst gap measured on a 2-core AVX-512 CPU over the 5 strategies, without and
# with accumulation (2026-12, torch 2.13): loss 1.6e-7 (1.2e-7 without accumulation: 2 fp32 ulps at
# 7.6), grad norm 3.5e-7 (ZeRO-3, accumulation; 6.8e-8 without, ZeRO-2), so that a norm off by
# 3.4e-5 (torch's serial fp32 vector_norm, the reason for common/grad_norm.py) fails 8x over.
# Eval loss: measured 0 (every strategy: the same fp32 value, a gap under one ulp, 6.9e-8 at 6.9);
# it gets the loss bound, the gap the same weights give a training loss.
FP32_RTOL = {"loss": 2e-6, "grad_norm": 4e-6, "eval_loss": 2e-6}
# bf16 keeps 8 mantissa bits: ~4e-3 relative rounding per op, compounding over steps. About 10x the
# worst measured per key (README table: loss 8.1e-5, grad norm 2.5e-3, eval loss 8.6e-5), so that
# FSDP2 casting its output to bf16 (a 2.2e-3 loss gap, what workarounds.keep_fp32_reduction prevents) fails.
BF16_RTOL = {"loss": 1e-3, "grad_norm": 2.5e-2, "eval_loss": 1e-3}


def run(short_run, config, precision="no"):
    out, _ = short_run(config, precision)
    steps, _ = read_metrics(out)
    assert [r["step"] for r in steps] == list(range(2, STEPS + 1, 2))
    return out, steps


def expected_lr(step):
    """LR applied by optimizer step `step` (1-based): transformers' cosine schedule with warmup,
    evaluated after step-1 scheduler steps, written out independently of the library."""
    k = step - 1
    if k < WARMUP:
        return LR * k / WARMUP
    return LR * 0.5 * (1 + math.cos(math.pi * (k - WARMUP) / (STEPS - WARMUP)))


def report(**row):
    """Append a measured gap to $PARITY_REPORT (for the README table), if set."""
    if os.environ.get("PARITY_REPORT"):
        with open(os.environ["PARITY_REPORT"], "a") as f:
            f.write(json.dumps(row) + "\n")


@pytest.fixture(scope="module")
def reference(short_run):
    out, steps = run(short_run, "single")
    for r in steps:  # the schedule advances once per optimizer step: exact values
        assert r["lr"] == pytest.approx(expected_lr(r["step"]), rel=1e-9, abs=1e-12)
    assert steps[1]["lr"] == pytest.approx(LR)  # warmup over: step 4 runs at the peak LR
    assert steps[-1]["loss"] < steps[0]["loss"] - 0.5
    return out


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_fp32_parity(strategy, reference, short_run):
    out, steps = run(short_run, strategy)
    gaps = {
        key: worst_gaps(out, reference)[key] for key in KEYS
    }  # what the README's by-hand check prints
    report(strategy=strategy, precision="fp32", accum=1, **gaps)
    for key, gap in gaps.items():
        assert gap < FP32_RTOL[key], (
            f"{strategy} {key}: worst relative gap {gap:.2e} vs single-process fp32"
        )
    for r in steps:  # LR at exact steps, whatever the world size
        assert r["lr"] == pytest.approx(expected_lr(r["step"]), rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_fp32_parity_with_accumulation(strategy, small_corpus, reference_run):
    """Global batch 8 as 2 per device x accumulation 2 x 2 ranks against 4 x 2 x 1 process, 16
    steps: the session's runs of tests/test_checkpoint.py (shared with the resume and multi-node
    tests, so no launch of its own when those ran)."""
    single = reference_run("single", *args(None, small_corpus, *batch_args("single"))[2:])
    out = reference_run(strategy, *args(None, small_corpus, *batch_args(strategy))[2:])
    gaps = worst_gaps(out, single)
    assert gaps["steps"] == 16 and gaps["lr"] == 0  # every step logged, on the same schedule
    gaps = {key: gaps[key] for key in KEYS}
    report(strategy=strategy, precision="fp32", accum=2, **gaps)
    for key, gap in gaps.items():
        assert gap < FP32_RTOL[key], (
            f"{strategy} accumulation {key}: worst relative gap {gap:.2e} vs single-process fp32"
        )


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_bf16_parity(strategy, reference, short_run):
    out, _ = run(short_run, strategy, "bf16")
    # Position buffers stay fp32 in the live bf16 model (FSDP1's buffer_dtype rounded them to bf16).
    assert read_metrics(out)[1][0]["buffer_dtypes"] == {
        "model.rotary_emb.inv_freq": "float32",
        "model.rotary_emb.original_inv_freq": "float32",
    }
    # forced on the launch line: bf16 even on a CPU that emulates it, and the run says so
    used = json.loads((out / "run_info.json").read_text())["precision"]
    assert used["used"] == used["requested"] == "bf16"
    assert ("emulated" in used["reason"]) == ("bf16" not in _cpu_native_dtypes()), used
    gaps = {key: worst_gaps(out, reference)[key] for key in KEYS}
    report(strategy=strategy, precision="bf16", accum=1, **gaps)
    for key, gap in gaps.items():
        assert gap < BF16_RTOL[key], (
            f"{strategy} bf16 {key}: worst relative gap {gap:.2e} vs single-process fp32"
        )


@pytest.fixture(scope="module")
def documents_run(tmp_path_factory, cache_dir, small_corpus):
    """`run(config)`: 5 fp32 steps of --packing documents (global batch 4, 64-token blocks) on the
    paragraphs of the small corpus, one document each (87 in 55 blocks), once per config."""
    root = tmp_path_factory.mktemp("documents")
    train, valid, tokenizer = small_corpus
    for path in (train, valid):
        paragraphs = [p for p in path.read_text().split("\n\n") if p.strip()]
        (root / f"{path.stem}.jsonl").write_text(
            "".join(json.dumps({"text": p}) + "\n" for p in paragraphs)
        )

    def run(config):
        out = root / config
        if not out.exists():
            launch(
                config,
                "recipes/llama.py",
                "--output_dir",
                out,
                "--train_file",
                root / "train.jsonl",
                "--validation_file",
                root / "valid.jsonl",
                "--tokenizer_name_or_path",
                tokenizer,
                "--packing",
                "documents",
                "--block_size",
                64,
                "--per_device_train_batch_size",
                4 if config == "single" else 2,
                "--max_steps",
                5,
                "--warmup_steps",
                1,
                "--logging_steps",
                1,
                "--eval_steps",
                5,
                "--max_eval_samples",
                8,
                "--report_to",
                "none",
                "--ddp_timeout",
                120,
                "--sample_tokens",
                0,
                cache_dir=cache_dir,
                mixed_precision="no",
            )
        return out

    return run


@pytest.mark.parametrize("strategy", ["fsdp", "deepspeed_zero3"])
def test_documents_packing_parity(strategy, documents_run):
    """--packing documents passes its position ids through the sharded strategies' forwards (FSDP2's
    hooks, DeepSpeed's engine): the same loss, grad norm and eval loss as one process (FP32_RTOL), on
    blocks of several documents. DDP's forward hands its keywords to the model as they are (its
    counted-target path under padding: tests/test_token_weighted.py)."""
    reference = documents_run("single")
    data = json.loads((reference / "run_info.json").read_text())["data"]["train"]
    assert (
        data["rows"] > data["blocks"] > 0 and data["split_documents"] > 0
    )  # measured 87 documents in 55 blocks
    gaps = worst_gaps(documents_run(strategy), reference)
    assert gaps["steps"] == 5 and gaps["lr"] == 0
    report(
        strategy=strategy, precision="fp32", packing="documents", **{key: gaps[key] for key in KEYS}
    )
    for key in KEYS:
        assert gaps[key] < FP32_RTOL[key], (
            f"{strategy} documents {key}: worst relative gap {gaps[key]:.2e}"
        )


def test_fsdp1_no_shard_norm_is_not_double_counted(reference, short_run, tmp_path):
    """FSDP1 NO_SHARD keeps full gradients on every rank, like DDP: summing the ranks' squares
    would report (and clip with) sqrt(2) x the norm. The default --max_grad_norm 1 clips 9 of the
    10 steps (norms 1.1 to 4.8), so a wrong norm shows in the losses too."""
    config = tmp_path / "fsdp1_no_shard.yaml"
    config.write_text(
        (REPO / "accelerate_configs" / "fsdp1.yaml")
        .read_text()
        .replace("fsdp_sharding_strategy: FULL_SHARD", "fsdp_sharding_strategy: NO_SHARD")
    )
    out, _ = run(short_run, config)
    gaps = worst_gaps(out, reference)
    assert gaps["grad_norm"] < FP32_RTOL["grad_norm"] and gaps["loss"] < FP32_RTOL["loss"], gaps


def test_clip_grad_norm_is_exact_and_clips():
    """common.grad_norm on one process: the norm is the fp64 norm of all gradients (torch 2.13's
    CPU fp32 `vector_norm` is off by ~3e-5 on such a 4096x256 embedding gradient, which is what made
    strategies disagree), and the clipped gradients have exactly the threshold as norm."""
    from accelerate import Accelerator

    from common.grad_norm import clip_grad_norm_

    accelerator = Accelerator(cpu=True)
    model = torch.nn.Sequential(torch.nn.Embedding(4096, 256), torch.nn.Linear(256, 3))
    g = torch.randn(4096, 256, generator=torch.Generator().manual_seed(0))
    g = (
        g * torch.rand(4096, 1, generator=torch.Generator().manual_seed(1)) ** 8
    )  # few frequent tokens, as in text
    grads = [g, torch.full((3, 256), 0.5), torch.ones(3)]
    for p, grad in zip(model.parameters(), grads):
        p.grad = grad.clone()
    exact = math.sqrt(sum(grad.double().pow(2).sum().item() for grad in grads))
    for max_norm in (
        exact * 2,
        0.0,
    ):  # below the threshold, or clipping off: the norm, gradients untouched
        assert float(clip_grad_norm_(accelerator, model, max_norm=max_norm)) == pytest.approx(
            exact, rel=1e-12
        )
        assert all(torch.equal(p.grad, grad) for p, grad in zip(model.parameters(), grads))
    assert float(clip_grad_norm_(accelerator, model, max_norm=1.0)) == pytest.approx(
        exact, rel=1e-12
    )
    clipped = math.sqrt(sum(p.grad.double().pow(2).sum().item() for p in model.parameters()))
    assert clipped == pytest.approx(1.0, rel=1e-5)


def test_compare_runs_fails_on_a_gap_over_its_bound(tmp_path, monkeypatch, capsys):
    """The by-hand check's exit status: 0 within the bound, 1 over it (named), or when a run is missing.
    Once as the real command; the other cases run its __main__ in this process."""

    def metrics(name, loss, lr=1e-3):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text(
            json.dumps({"step": 1, "loss": loss, "grad_norm": 1.0, "lr": lr, "eval_loss": 7.0})
            + "\n"
        )
        return tmp_path / name

    ref, close, off, lr_off = (
        metrics("ref", 8.0),
        metrics("close", 8.0 * (1 + 1e-6)),
        metrics("off", 8.0 * (1 + 1e-3)),
        metrics("lr_off", 8.0, lr=1.1e-3),
    )
    script = str(REPO / "tests/scripts/compare_runs.py")

    def compare(*argv):
        """(exit status, stdout) of `compare_runs.py ARGV`, in this process."""
        monkeypatch.setattr(sys, "argv", [script, *map(str, argv)])
        with pytest.raises(SystemExit) as exc:
            runpy.run_path(script, run_name="__main__")
        return exc.value.code, capsys.readouterr().out

    proc = subprocess.run([sys.executable, script, ref, close, off], capture_output=True, text=True)
    assert proc.returncode == 1 and "OVER: loss" in proc.stdout.splitlines()[-1]
    assert compare(ref, close)[0] == 0
    status, out = compare(ref, close, off)  # in process as by the command: the same line
    assert status == 1 and out.splitlines()[-1] == proc.stdout.splitlines()[-1]
    assert compare("--rtol", 2.5e-2, ref, off)[0] == 0  # the bf16 bound
    assert compare("--rtol", 2.5e-2, ref, lr_off)[0] == 1  # another schedule, at any bound
    assert compare(ref, tmp_path / "absent")[0] == 1
