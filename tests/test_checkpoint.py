"""Checkpoints: exact mid-epoch resume on every strategy, atomic saves, damaged checkpoints,
world-size changes, offline consolidation, and safe loading. (A killed rank, SIGTERM and restarts:
tests/test_recovery.py.)"""

import json
import re
import subprocess
import sys

import pytest
from safetensors.torch import load_file

from common.checkpoint import verify_checkpoint
from conftest import CONFIGS, REPO, launch, read_metrics

STEPS, SAVE = 16, 10  # with 6 optimizer steps per epoch, step 10 is mid-way through epoch 2


def args(out, corpus, *extra):
    train, valid, tok = corpus
    return ["--output_dir", out, "--train_file", train, "--validation_file", valid, "--tokenizer_name_or_path", tok,
            "--block_size", 64, "--max_steps", STEPS, "--save_steps", SAVE, "--warmup_steps", 4,
            "--logging_steps", 1, "--eval_steps", STEPS, "--report_to", "none", "--ddp_timeout", 60, *extra]


def batch_args(config):
    """Global batch 8 with accumulation 2, on 1 or 2 ranks."""
    return ["--per_device_train_batch_size", 4 if config == "single" else 2, "--gradient_accumulation_steps", 2]


@pytest.mark.parametrize("config", CONFIGS)
def test_exact_resume_mid_epoch(config, tmp_path, cache_dir, small_corpus, reference_run):
    # The uninterrupted run (fp32) is the session's reference_run, which tests/test_multinode.py
    # shares: the same flags (args() minus its --output_dir) give the same run.
    straight = reference_run(config, *args(None, small_corpus, *batch_args(config))[2:])
    resumed = tmp_path / "resumed"
    info = json.loads((straight / "run_info.json").read_text())
    per_epoch = info["updates_per_epoch"]
    assert per_epoch < SAVE < 2 * per_epoch and SAVE % per_epoch  # the stop is mid-way through epoch 2
    # New processes, resuming from the step-10 checkpoint into another directory.
    launch(config, "recipes/llama.py", *args(resumed, small_corpus, *batch_args(config),
           "--resume_from_checkpoint", straight / f"checkpoint-{SAVE}"), cache_dir=cache_dir, mixed_precision="no")
    want = {r["step"]: r for r in read_metrics(straight)[0]}
    got = read_metrics(resumed)[0]
    assert [r["step"] for r in got] == list(range(SAVE + 1, STEPS + 1))
    assert got[0]["epoch"] == 1
    for r in got:
        for key in ("loss", "grad_norm", "lr"):
            assert r[key] == pytest.approx(want[r["step"]][key], rel=1e-6, abs=1e-12), (config, r["step"], key)
    assert got[-1]["eval_loss"] == pytest.approx(want[STEPS]["eval_loss"], rel=1e-6)


def test_rotation_latest_and_damaged_checkpoints(tmp_path, cache_dir, small_corpus):
    out = tmp_path / "run"
    launch("ddp", "recipes/llama.py", *args(out, small_corpus, "--save_steps", 4, "--save_total_limit", 2),
           cache_dir=cache_dir)
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-12", "checkpoint-16"]
    assert verify_checkpoint(out / "checkpoint-16")["step"] == 16

    # A truncated file: an explicit resume names it and exits non-zero...
    victim = out / "checkpoint-16" / "optimizer.bin"
    victim.write_bytes(victim.read_bytes()[:100])
    proc = launch("ddp", "recipes/llama.py", *args(out, small_corpus, "--resume_from_checkpoint", out / "checkpoint-16"),
                  cache_dir=cache_dir, check=False)
    assert proc.returncode != 0
    assert f"checkpoint file {victim}" in proc.stderr and "truncated" in proc.stderr
    # ...an unfinished save (no marker) is ignored, and `latest` warns and falls back to step 12.
    (out / "checkpoint-20.tmp").mkdir()
    (out / "checkpoint-24").mkdir()
    proc = launch("ddp", "recipes/llama.py", *args(out, small_corpus, "--resume_from_checkpoint", "latest"),
                  cache_dir=cache_dir)
    assert "skipping damaged checkpoint" in proc.stderr
    assert "resumed from" in proc.stdout and "checkpoint-12 at step 12" in proc.stdout
    assert [r["step"] for r in read_metrics(out)[0]] == list(range(1, STEPS + 1))  # 13-16 replaced, no duplicates


def test_world_size_change(tmp_path, cache_dir, small_corpus):
    # A 1-process checkpoint resumes on 2 DDP ranks (same global batch 8) and continues the run.
    single, ddp = tmp_path / "single", tmp_path / "ddp"
    launch("single", "recipes/llama.py", *args(single, small_corpus, *batch_args("single")), cache_dir=cache_dir,
           mixed_precision="no")
    launch("ddp", "recipes/llama.py", *args(ddp, small_corpus, *batch_args("ddp"), "--resume_from_checkpoint",
           single / f"checkpoint-{SAVE}"), cache_dir=cache_dir, mixed_precision="no")
    want = {r["step"]: r["loss"] for r in read_metrics(single)[0]}
    for r in read_metrics(ddp)[0]:
        assert r["loss"] == pytest.approx(want[r["step"]], rel=1e-5)
    # A 2-rank FSDP2 checkpoint refuses 1 rank, at once and saying what is supported.
    fsdp = tmp_path / "fsdp"
    launch("fsdp", "recipes/llama.py", *args(fsdp, small_corpus, "--max_steps", SAVE), cache_dir=cache_dir)
    proc = launch("fsdp", "recipes/llama.py", *args(tmp_path / "fsdp1rank", small_corpus, "--per_device_train_batch_size",
                  16, "--resume_from_checkpoint", fsdp / f"checkpoint-{SAVE}"), num_processes=1,
                  cache_dir=cache_dir, check=False)
    assert proc.returncode != 0
    assert "FSDP2 state of 2 rank(s)" in proc.stderr and "same strategy and world size" in proc.stderr


def test_resume_refuses_another_data_order(tmp_path, cache_dir, small_corpus):
    # The step count only locates the data position under the same seed and blocks.
    run = tmp_path / "run"
    launch("ddp", "recipes/llama.py", *args(run, small_corpus, "--max_steps", 4, "--save_steps", 4),
           cache_dir=cache_dir, mixed_precision="no")
    marker = verify_checkpoint(run / "checkpoint-4")
    assert (marker["seed"], marker["block_size"], marker["packing"]) == (42, 64, True) and marker["train_blocks"] > 0
    for flag, value, change in [("--seed", 7, "seed 42 -> 7"), ("--block_size", 32, "block_size 64 -> 32")]:
        proc = launch("ddp", "recipes/llama.py", *args(tmp_path / "changed", small_corpus, flag, value,
                      "--resume_from_checkpoint", run / "checkpoint-4"), cache_dir=cache_dir, check=False)
        assert proc.returncode != 0
        assert f"cannot resume from {run / 'checkpoint-4'}: {change}" in proc.stderr
    # Unchanged data, a longer run: accepted, with a warning that the LR schedule now differs.
    proc = launch("ddp", "recipes/llama.py", *args(tmp_path / "longer", small_corpus, "--resume_from_checkpoint",
                  run / "checkpoint-4"), cache_dir=cache_dir, mixed_precision="no")
    assert "was saved by a 4-step run, this one has 16" in proc.stdout
    assert [r["step"] for r in read_metrics(tmp_path / "longer")[0]] == list(range(5, STEPS + 1))


@pytest.mark.parametrize("config", ["fsdp", "deepspeed_zero3"])
def test_consolidate_sharded_checkpoint(config, tmp_path, cache_dir, small_corpus):
    out = tmp_path / "run"
    # fp32: in bf16 ZeRO exports the bf16 weights, the checkpoint holds the fp32 masters
    launch(config, "recipes/llama.py", *args(out, small_corpus, "--max_steps", SAVE), cache_dir=cache_dir,
           mixed_precision="no")
    subprocess.run([sys.executable, REPO / "common/consolidate.py", out / f"checkpoint-{SAVE}", tmp_path / "hf"],
                   check=True, capture_output=True)
    merged, exported = load_file(tmp_path / "hf/model.safetensors"), load_file(out / "final/model.safetensors")
    assert merged.keys() == exported.keys()
    for name, tensor in exported.items():
        assert tuple(merged[name].shape) == tuple(tensor.shape)  # full size, not a shard
        assert (merged[name].float() - tensor.float()).abs().max() == 0, name


def test_save_then_load_in_the_same_job(tmp_path, cache_dir):
    for config in ("fsdp", "deepspeed_zero3"):
        launch(config, "tests/scripts/save_load.py", tmp_path / config, cache_dir=cache_dir)
        assert (tmp_path / config / "ok").read_text() == "2"


def test_every_torch_load_is_weights_only():
    calls = [(p, line) for p in REPO.rglob("*.py") if ".venv" not in p.parts
             for line in p.read_text().splitlines() if re.search(r"torch\.load\(", line) and "re.search" not in line]
    assert all("weights_only=True" in line for _, line in calls), calls
