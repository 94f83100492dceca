"""recipes/llama.py under every launch config, for real: 2 gloo ranks (1 for `single`), in fp32:
the 10-step runs of global batch 4 that tests/test_parity.py compares (conftest.SHORT). (The
precision a config picks alone: tests/test_bad_input.py's epoch run.)"""

import json
import math
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM

from conftest import CONFIGS, ordinary_step_reads, read_metrics

EXPECTED_TYPE = {
    "single": "NO",
    "ddp": "MULTI_CPU",
    "fsdp": "FSDP",
    "fsdp1": "FSDP",
    "deepspeed_zero2": "DEEPSPEED",
    "deepspeed_zero3": "DEEPSPEED",
}
SHARDED = {"fsdp", "fsdp1", "deepspeed_zero3"}  # parameters split across ranks


@pytest.mark.parametrize("config", CONFIGS)
def test_every_config_trains_and_exports(config, short_run):
    out, reads = short_run(
        config
    )  # every read of a tensor value logged (tests/device_guard/host_reads.py)

    # In-run facts: the run really was distributed the way the config says.
    info = json.loads((out / "run_info.json").read_text())
    world = 1 if config == "single" else 2
    assert info["distributed_type"] == EXPECTED_TYPE[config]
    assert info["world_size"] == world
    assert (
        info["mixed_precision"]
        == info["precision"]["requested"]
        == info["precision"]["used"]
        == "no"
    )
    # The library workarounds that ran (common/workarounds.py): under torchrun, the parent-death
    # signal; on a CPU-only host, real gloo ranks; an export that does not import deepspeed.
    # fp32, uncompiled, fresh: nothing else.
    deepspeed_on_cpu = ["skip_deepspeed_shm_build", "cache_deepspeed_cpu_device_count"]
    on_cpu = {
        "ddp": ["ddp_ranks_on_cpu"],
        "fsdp": ["fsdp_ranks_on_cpu"],
        "fsdp1": ["fsdp_ranks_on_cpu"],
        "deepspeed_zero2": deepspeed_on_cpu,
        "deepspeed_zero3": deepspeed_on_cpu,
    }
    assert info["workarounds"] == ["die_with_launcher"] * (world == 2) + (
        on_cpu[config] if config in on_cpu and not torch.cuda.is_available() else []
    ) + (["no_deepspeed_import_on_unwrap"] if "deepspeed" not in config else [])
    # a library warning once per rank, not once per collective (workarounds.cache_deepspeed_cpu_device_count)
    stderr = (out.parent / "stderr.log").read_text()
    assert stderr.count("is deprecated. Please use `torch.distributed.") <= 2 * world, stderr[
        -3000:
    ]
    local = info["local_param_elements"]
    assert len(local) == world
    if config in SHARDED:
        for n in local:  # each rank holds about half the parameter elements
            assert abs(n / info["n_params"] - 0.5) < 0.02, (n, info["n_params"])
    else:
        assert local == [info["n_params"]] * world
    # the bundled corpus, packed: 1.56M training tokens, less than one block of them dropped
    train = info["data"]["train"]
    assert (
        train["rows"] == 40
        and train["blocks"] * 64 + train["dropped_tokens"] == train["tokens"] > 1.5e6
    )
    assert all(split["dropped_tokens"] < 64 for split in info["data"].values())
    # --packing stream: every position but a block's first is a target, as the loss counts them
    assert all(split["targets"] == split["blocks"] * 63 for split in info["data"].values())
    # What DeepSpeed ran with (its filled-in config), as run_info.json and the start line report it.
    stage = {"deepspeed_zero2": 2, "deepspeed_zero3": 3}.get(config)
    assert info["deepspeed"] == (
        stage
        and {
            "zero_stage": stage,
            "offload_optimizer_device": "none",
            "offload_param_device": "none",
            "gradient_accumulation_steps": 1,
            "train_batch_size": 4,
            "gradient_clipping": 1.0,
        }
    )

    # No read of a device value in an ordinary step (steps 1, 3, ..., 9 and the training of the
    # next): on a GPU each one would stall the host until the device catches up. Reads from
    # inside a library (Accelerate, DeepSpeed) are listed apart, in HOST_READS_REPORT if set.
    assert sorted(reads) == list(range(world))
    for rank, log in reads.items():
        assert any(r[0] == "project" and r[3] == 10 for r in log), (
            "the logger saw no logging-step read"
        )
        ordinary = ordinary_step_reads(log, logging_steps=2, max_steps=10)
        project = [r for r in ordinary if r[0] == "project"]
        assert not project, f"rank {rank}: reads of tensor values in ordinary steps: {project[:4]}"
        if os.environ.get("HOST_READS_REPORT") and rank == 0:
            with open(os.environ["HOST_READS_REPORT"], "a") as f:
                library = sorted({(r[1], r[2], r[4]) for r in ordinary})
                f.write(
                    json.dumps(
                        {
                            "config": config,
                            "library_reads_per_step": len(ordinary) / 5,
                            "where": library,
                        }
                    )
                    + "\n"
                )

    # Finite losses that go down, and the required metric keys.
    steps, summary = read_metrics(out)
    assert [r["step"] for r in steps] == list(range(2, 11, 2))
    for r in steps:
        assert {"loss", "lr", "grad_norm", "tokens_per_second"} <= r.keys()
        assert (
            math.isfinite(r["loss"])
            and math.isfinite(r["grad_norm"])
            and r["tokens_per_second"] > 0
        )
    assert (
        steps[0]["loss"] > 7.5
    )  # step 2, after a step at LR 0: untrained, about ln(4096) = 8.3 nats/token
    assert (
        sum(r["loss"] for r in steps[-3:]) / 3 < steps[0]["loss"] - 0.8
    )  # measured: 8.36 -> 6.89 (steps 6-10)
    assert math.isfinite(steps[-1]["eval_loss"]) and steps[-1]["eval_loss"] < steps[0]["loss"]
    # the run's tokens, over both ranks: packed blocks have no padding, and a block's first token is
    # no target; each record counts up to its step
    assert summary and (summary[0]["input_tokens"], summary[0]["target_tokens"]) == (
        10 * 4 * 64,
        10 * 4 * 63,
    )
    assert [r["input_tokens"] for r in steps] == [r["step"] * 4 * 64 for r in steps]
    # MFU with --peak_tflops 0.05 (no peak is known for a CPU): the PaLM count, 6N + 12 L H T FLOPs
    # per token (N: the tied head, not the embedding lookup), x tokens/s per device / peak
    hf = AutoConfig.from_pretrained(out / "final")
    assert (
        info["flops_per_token"]
        == 6 * info["n_params"] + 12 * hf.num_hidden_layers * hf.hidden_size * 64
    )
    for r in steps:
        assert r["mfu"] == pytest.approx(
            info["flops_per_token"] * r["tokens_per_second"] / 0.05e12, rel=1e-9
        )

    # The export: full-size safetensors that plain transformers reloads to the live model's logits,
    # with configs ready for inference (the KV cache that training turns off is on).
    final = out / "final"
    config_hf = AutoConfig.from_pretrained(final)
    assert config_hf.use_cache is True
    assert json.loads((final / "generation_config.json").read_text())["use_cache"] is True
    with safe_open(final / "model.safetensors", "pt") as f:
        emb = f.get_slice("model.embed_tokens.weight").get_shape()
        assert emb == [config_hf.vocab_size, config_hf.hidden_size]
        n_saved = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    assert n_saved == info["n_params"]
    mode = {
        f.name: f.stat().st_mode & 0o777
        for f in (
            final / "model.safetensors",
            final / "config.json",
            out / "final_logits.safetensors",
            out / "run_info.json",
        )
    }
    assert len(set(mode.values())) == 1, mode  # the umask's, not safetensors' own 0600
    model = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32).eval()
    probe = load_file(out / "final_logits.safetensors")
    with torch.no_grad():
        logits = model(input_ids=probe["input_ids"]).logits
    # bit-equal: measured 0 difference on all 6 configs (and the ZeRO-3 offload run), fp32, 2-core AVX-512
    # CPU: the export holds the live fp32 weights, and the reload runs the same kernels on them
    assert torch.equal(logits, probe["logits"]), (logits - probe["logits"]).abs().max()
