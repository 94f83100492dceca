"""Tensor parallel with FSDP2 (accelerate_configs/tp.yaml: dp_shard 2 x tp 2), 4 gloo ranks in fp32, on
conftest.SHORT's 10 steps of global batch 4 (2 per device: the 2 ranks of a tp group train one batch).
One launch, saving checkpoint-5, serves the parity test against the single-process reference of
tests/test_parity.py (the session's `short_run("single")`), the sample-id and export tests and the resume
test's reference; the resumed run is the other launch."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from common.checkpoint import strategy_name, verify_checkpoint
from conftest import SHORT, launch, read_metrics, strict_json
from test_checkpoint import RESUME_RTOL, resume_refusal
from test_parity import FP32_RTOL, KEYS, worst_gaps

SAVE = 5  # mid-run; the resumed run logs steps 6, 8 and 10 (SHORT logs every 2nd)
FLAGS = ["--per_device_train_batch_size", 2, *SHORT]
# The live model computes each projection in tp slices (a rowwise layer adds 2 partial sums), the export
# whole: measured worst logit gap 1.2e-6 on logits up to 5.2 (fp32, 2-core AVX-512 CPU, torch 2.13).
EXPORT_ATOL = 1e-5


@pytest.fixture(scope="module")
def tp(tmp_path_factory, cache_dir):
    out = tmp_path_factory.mktemp("tp") / "run"
    launch(
        "tp",
        "recipes/llama.py",
        "--output_dir",
        out,
        *FLAGS,
        "--save_steps",
        SAVE,
        "--record_sample_ids",
        cache_dir=cache_dir,
        mixed_precision="no",
    )
    return out


def steps_of(out):
    return {r["step"]: r for r in read_metrics(out)[0]}


def test_tp_matches_one_process(tp, short_run):
    info = strict_json((tp / "run_info.json").read_text())
    assert (info["distributed_type"], info["world_size"], info["global_batch"]) == ("FSDP", 4, 4)
    assert info["mesh"] == {"dp_shard": 2, "tp": 2}
    assert {"replicate_parallel_for_accelerate", "gather_metrics_once_per_tp_group"} <= set(
        info["workarounds"]
    )
    # Each rank holds a quarter of the parameter elements: its tp slice, halved again by FSDP over dp_shard
    # (the RMSNorm weights, whole on each tp rank, are 0.05% of them).
    for n in info["local_param_elements"]:
        assert abs(n / info["n_params"] - 0.25) < 0.01, (n, info["n_params"])
    reference, _ = short_run("single")
    # FSDP's bounds (tests/test_parity.py); measured worst relative gaps on a 2-core AVX-512 CPU (torch
    # 2.13): loss 1.2e-7, grad norm 1.7e-8, eval loss 0. A grad norm that counted FSDP's _StridedShard
    # dim as replicated was 12% low; an eval gathering both ranks of a tp group, 1.2e-3 off; a loss or
    # token count summed over the tp ranks too, 2x.
    gaps = worst_gaps(tp, reference)
    assert gaps["steps"] == 5 and gaps["lr"] == 0, gaps
    for key in KEYS:
        assert gaps[key] < FP32_RTOL[key], (
            f"TP 2x2 {key}: worst relative gap {gaps[key]:.2e} vs one process"
        )


def test_tp_ranks_share_a_batch_and_count_it_once(tp):
    """--record_sample_ids: one file per data-parallel rank (the first rank of each tp group writes it),
    10 steps x 2 blocks each, none trained twice."""
    files = sorted((tp / "sample_ids").glob("rank*.json"))
    assert [f.name for f in files] == ["rank0.json", "rank1.json"]
    ids = [json.loads(f.read_text()) for f in files]
    assert [(r["rank"], r["world_size"]) for r in ids] == [(0, 2), (1, 2)]
    epochs = [r["epochs"][0] for r in ids]
    assert [len(e) for e in epochs] == [20, 20] and not set(epochs[0]) & set(epochs[1])


def test_tp_export_reloads_to_the_live_logits(tp):
    """The export is whole (the names of an unsharded model, no tensor-parallel config) and reloads with
    plain transformers to the live tensor-parallel model's logits, within the slicing's rounding."""
    exported = load_file(tp / "final" / "model.safetensors")
    assert (
        "lm_head.weight" not in exported and exported["model.embed_tokens.weight"].shape[1] == 256
    )
    assert "distributed_config" not in json.loads((tp / "final" / "config.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(tp / "final", dtype=torch.float32).eval()
    probe = load_file(tp / "final_logits.safetensors")
    with torch.no_grad():
        logits = model(input_ids=probe["input_ids"]).logits
    gap = (logits - probe["logits"]).abs().max().item()
    assert 0 < probe["logits"].abs().max() and gap < EXPORT_ATOL, gap


def test_tp_resumes_exactly(tp, tmp_path, cache_dir):
    marker = verify_checkpoint(tp / f"checkpoint-{SAVE}")
    assert (marker["world_size"], marker["distributed_type"]) == (4, "FSDP2 (dp_shard 2 x tp 2)")
    resumed = tmp_path / "resumed"
    launch(
        "tp",
        "recipes/llama.py",
        "--output_dir",
        resumed,
        *FLAGS,
        "--resume_from_checkpoint",
        tp / f"checkpoint-{SAVE}",
        cache_dir=cache_dir,
        mixed_precision="no",
    )
    want, got = (
        steps_of(tp),
        steps_of(resumed),
    )  # measured: bit-equal (no checkpoint written: quicker)
    assert sorted(got) == [6, 8, 10]
    for s, r in got.items():
        for key in ("loss", "grad_norm", "lr"):
            assert r[key] == pytest.approx(want[s][key], rel=RESUME_RTOL, abs=1e-12), (s, key)
    assert got[10]["eval_loss"] == pytest.approx(want[10]["eval_loss"], rel=RESUME_RTOL)


def test_a_tp_state_resumes_only_on_its_own_mesh():
    """The checkpoint records the mesh with the strategy: FSDP2 over all 4 ranks, HSDP, or another tp size
    refuses a dp_shard 2 x tp 2 state at start-up instead of loading it onto other slices."""
    from accelerate.parallelism_config import ParallelismConfig

    from test_checkpoint import fake_accelerator

    def name(**sizes):
        accelerator = fake_accelerator("FSDP")
        accelerator.parallelism_config = ParallelismConfig(**sizes) if sizes else None
        return strategy_name(accelerator)

    tp = name(dp_shard_size=2, tp_size=2)
    assert tp == "FSDP2 (dp_shard 2 x tp 2)"
    saved = {"step": 5, "distributed_type": tp, "world_size": 4}
    for other in (
        name(),
        name(dp_replicate_size=2, dp_shard_size=2),
        name(dp_shard_size=4, tp_size=2),
    ):
        error = resume_refusal(
            Path("ckpt"), saved, {"distributed_type": other, "world_size": 4, "max_steps": 10}, []
        )
        assert error and f"a {tp} state of 4 rank(s), this run is {other} with 4" in error, error
    assert (
        resume_refusal(
            Path("ckpt"), saved, {"distributed_type": tp, "world_size": 4, "max_steps": 10}, []
        )
        is None
    )
