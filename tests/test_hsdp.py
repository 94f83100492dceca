"""HSDP (accelerate_configs/hsdp.yaml: FSDP2 on a dp_replicate 2 x dp_shard 2 mesh), 4 gloo ranks in
fp32, on conftest.SHORT's 10 steps of global batch 4 (1 per device here): one launch, saving
checkpoint-5 and checkpoint-10, serves the parity test against the single-process reference of
tests/test_parity.py (the session's `short_run("single")`), the export and offline-consolidation test
and the resume test's reference; the other launch resumes it on 2 loopback machines (2 processes each)."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from common.checkpoint import strategy_name, verify_checkpoint
from conftest import SHORT, launch, read_metrics, strict_json
from test_checkpoint import RESUME_RTOL, resume_refusal
from test_multinode import launch_two_machines
from test_parity import FP32_RTOL, KEYS, worst_gaps
from tools.consolidate import consolidated_state_dict

SAVE = 5  # mid-run; the resumed run logs steps 6, 8 and 10 (SHORT logs every 2nd)
FLAGS = ["--per_device_train_batch_size", 1, *SHORT, "--save_steps", SAVE]


@pytest.fixture(scope="module")
def hsdp(tmp_path_factory, cache_dir):
    out = tmp_path_factory.mktemp("hsdp") / "run"
    launch(
        "hsdp",
        "recipes/llama.py",
        "--output_dir",
        out,
        *FLAGS,
        cache_dir=cache_dir,
        mixed_precision="no",
    )
    return out


def steps_of(out):
    return {r["step"]: r for r in read_metrics(out)[0]}


def test_hsdp_matches_one_process(hsdp, short_run):
    info = strict_json((hsdp / "run_info.json").read_text())
    assert (info["distributed_type"], info["world_size"], info["global_batch"]) == ("FSDP", 4, 4)
    assert info["mesh"] == {"dp_replicate": 2, "dp_shard": 2}
    # Each rank holds half the parameter elements (sharded over dp_shard 2), not a quarter.
    for n in info["local_param_elements"]:
        assert abs(n / info["n_params"] - 0.5) < 0.02, (n, info["n_params"])
    reference, _ = short_run("single")
    # FSDP's bounds (tests/test_parity.py); measured worst relative gaps on a 2-core AVX-512 CPU (torch
    # 2.13): loss 1.9e-7, grad norm 2.0e-8, eval loss 1.4e-7. A norm summed over the replicas too would
    # be sqrt(2) x the true one.
    gaps = worst_gaps(hsdp, reference)
    assert gaps["steps"] == 5 and gaps["lr"] == 0, gaps
    for key in KEYS:
        assert gaps[key] < FP32_RTOL[key], (
            f"HSDP 2x2 {key}: worst relative gap {gaps[key]:.2e} vs one process"
        )


def test_hsdp_export_reloads_to_the_live_logits(hsdp):
    """The export reloads to the live (sharded) model's logits, and tools/consolidate.py turns the
    last sharded checkpoint into the same weights, offline (measured: both bit-equal)."""
    exported = load_file(hsdp / "final" / "model.safetensors")
    consolidated = consolidated_state_dict(hsdp / "checkpoint-10")
    consolidated.pop("lm_head.weight", None)  # tied to the embedding: the export stores it once
    assert sorted(consolidated) == sorted(exported)
    assert all(torch.equal(consolidated[k], exported[k]) for k in exported)
    model = AutoModelForCausalLM.from_pretrained(hsdp / "final", dtype=torch.float32).eval()
    probe = load_file(hsdp / "final_logits.safetensors")
    with torch.no_grad():
        logits = model(input_ids=probe["input_ids"]).logits
    assert torch.equal(logits, probe["logits"]), (logits - probe["logits"]).abs().max()


def test_an_hsdp_state_resumes_only_on_its_own_mesh():
    """The checkpoint records the mesh with the strategy, so FSDP2 over all 4 ranks, or another HSDP
    layout, refuses an HSDP 2 x 2 state at start-up instead of loading it onto other shards."""
    from accelerate.parallelism_config import ParallelismConfig

    from test_checkpoint import fake_accelerator

    def name(**sizes):
        accelerator = fake_accelerator("FSDP")
        accelerator.parallelism_config = ParallelismConfig(**sizes) if sizes else None
        return strategy_name(accelerator)

    hsdp = name(dp_replicate_size=2, dp_shard_size=2)
    assert hsdp == "FSDP2 (dp_replicate 2 x dp_shard 2)"
    assert (
        name() == name(dp_shard_size=4) == "FSDP2"
    )  # FSDP over all ranks: one name, with or without a mesh
    saved = {"step": 5, "distributed_type": hsdp, "world_size": 4}
    for other in (name(), name(dp_replicate_size=4, dp_shard_size=2)):
        error = resume_refusal(
            Path("ckpt"), saved, {"distributed_type": other, "world_size": 4, "max_steps": 10}, []
        )
        assert error and f"a {hsdp} state of 4 rank(s), this run is {other} with 4" in error, error
    assert (
        resume_refusal(
            Path("ckpt"), saved, {"distributed_type": hsdp, "world_size": 4, "max_steps": 10}, []
        )
        is None
    )


def test_hsdp_resumes_exactly_on_two_machines(hsdp, tmp_path, cache_dir):
    """New processes, 2 machines x 2 over loopback, resume the 1-machine run's checkpoint-5 and end as it
    did: each machine's 2 ranks are one dp_shard group and the machines the 2 replicas, the same mesh as
    1 machine x 4, so the resumed steps 6-10 equal the straight run's (measured: bit-equal)."""
    marker = verify_checkpoint(hsdp / f"checkpoint-{SAVE}")
    assert (marker["world_size"], marker["distributed_type"]) == (
        4,
        "FSDP2 (dp_replicate 2 x dp_shard 2)",
    )
    out = tmp_path / "resumed"
    launch_two_machines(
        "hsdp",
        out,
        *FLAGS,
        "--resume_from_checkpoint",
        hsdp / f"checkpoint-{SAVE}",
        cache_dir=cache_dir,
        logs=tmp_path / "logs",
        num_processes=4,
    )
    info = json.loads((out / "run_info.json").read_text())
    assert (info["world_size"], info["mesh"]) == (4, {"dp_replicate": 2, "dp_shard": 2})
    want, got = steps_of(hsdp), steps_of(out)
    assert sorted(got) == [6, 8, 10]
    for s, r in got.items():
        for key in ("loss", "grad_norm", "lr"):
            assert r[key] == pytest.approx(want[s][key], rel=RESUME_RTOL, abs=1e-12), (s, key)
    assert got[10]["eval_loss"] == pytest.approx(want[10]["eval_loss"], rel=RESUME_RTOL)
