"""The DeepSpeed JSONs at any model size: communication buckets that follow the model's hidden
size, and gradients reduced and kept in fp32 as under FSDP, read from the engines DeepSpeed builds.

The old zero2.json asked for two 5e8-element reduce buckets (2 GB per rank in bf16 whatever the
model), and ZeRO reduced gradients in bf16 while the FSDP configs reduce in fp32.
"""

import json
import os
import socket
import subprocess
import sys

import pytest

from conftest import REPO

HIDDEN = 64  # a tiny Llama: Accelerate's "auto" gives buckets of HIDDEN**2 = 4096 elements
STAGES = {"zero2": 2, "zero3": 3, "zero3_offload": 3}

# One process, world size 1 (gloo): Accelerate fills the JSON's "auto" keys from the model and
# DeepSpeed builds the engine as in a launch; one backward allocates ZeRO-2's buckets. Run apart
# from pytest so that neither the process group nor Accelerate's singleton state leaks into it.
ENGINES = r"""
import json, os, sys
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from accelerate.utils import DeepSpeedPlugin, InitProcessGroupKwargs
from transformers import LlamaConfig, LlamaForCausalLM

from common import workarounds

workarounds.skip_deepspeed_shm_build()  # as the recipes do on CPU
results = {}
for path in sys.argv[2:]:
    accelerator = Accelerator(mixed_precision="bf16", deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=path),
                              kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")])
    config = LlamaConfig(hidden_size=int(sys.argv[1]), intermediate_size=96, num_hidden_layers=1,
                         num_attention_heads=2, vocab_size=128)
    model = LlamaForCausalLM(config)
    loader = torch.utils.data.DataLoader(torch.arange(4), batch_size=2)
    engine, _, _ = accelerator.prepare(model, torch.optim.AdamW(model.parameters()), loader)
    zero = engine.optimizer
    buckets = []
    if hasattr(zero, "setup_buckets"):  # ZeRO-1/2: allocated at each backward, freed after it
        setup = zero.setup_buckets
        def record():
            setup()
            buckets[:] = [(t.numel(), str(t.dtype)) for b in zero.ipg_buckets.values() for t in b.buffer]
        zero.setup_buckets = record
    else:  # ZeRO-3: one bucket per communication dtype, for the whole run
        buckets = [(b.buffer.numel(), str(b.buffer.dtype)) for b in zero.ipg_buckets.values()]
    x = torch.randint(0, 128, (2, 8))
    engine.backward(engine(input_ids=x, labels=x).loss)
    grads = zero.averaged_gradients[0] if hasattr(zero, "setup_buckets") else [zero.grad_partitions_flat_buffer]
    zc = engine._config.zero_config
    results[path] = {"reduce_bucket_size": zc.reduce_bucket_size, "prefetch_bucket_size": zc.prefetch_bucket_size,
                     "param_persistence_threshold": zc.param_persistence_threshold, "buckets": buckets,
                     "communication_data_type": str(engine.communication_data_type),
                     "gradient_partition_dtypes": sorted({str(g.dtype) for g in grads})}
    accelerator.free_memory()
    AcceleratorState._reset_state()  # the next JSON gets a fresh DeepSpeed plugin; the process group stays
print("RESULTS " + json.dumps(results))
"""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (for the engines' process group)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("name", STAGES)
def test_json_scales_buckets_and_reduces_in_fp32(name):
    ds = json.loads((REPO / "ds_configs" / f"{name}.json").read_text())
    zero = ds["zero_optimization"]
    assert zero["stage"] == STAGES[name]
    assert zero["reduce_bucket_size"] == "auto"
    assert (
        "allgather_bucket_size" not in zero
    )  # Accelerate has no "auto" for it; DeepSpeed's default allocates nothing
    if STAGES[name] == 3:
        assert (
            zero["stage3_prefetch_bucket_size"]
            == zero["stage3_param_persistence_threshold"]
            == "auto"
        )
    assert ds["communication_data_type"] == "fp32"
    assert ds["data_types"] == {"grad_accum_dtype": "fp32"}


def test_engines_size_buckets_from_the_model_and_keep_gradients_in_fp32(tmp_path):
    paths = [str(REPO / "ds_configs" / f"{name}.json") for name in ("zero2", "zero3")]
    env = {
        **os.environ,
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "OMP_NUM_THREADS": "1",
        "CUDA_VISIBLE_DEVICES": "",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    proc = subprocess.run(
        [sys.executable, "-c", ENGINES, str(HIDDEN), *paths],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(proc.stdout.split("RESULTS ", 1)[1])
    zero2, zero3 = (results[p] for p in paths)
    for r in (zero2, zero3):
        assert r["reduce_bucket_size"] == HIDDEN**2  # Accelerate's "auto": hidden_size**2, not 5e8
        assert r["communication_data_type"] == "torch.float32"
        assert r["gradient_partition_dtypes"] == [
            "torch.float32"
        ]  # the reduced gradient is not rounded to bf16
    # ZeRO-2 with overlap_comm: two buckets in the model's dtype (bf16), cast to fp32 to reduce.
    assert zero2["buckets"] == [[HIDDEN**2, "torch.bfloat16"]] * 2
    # ZeRO-3: one bucket in the communication dtype; prefetch and persistence also follow the model.
    assert zero3["buckets"] == [[HIDDEN**2, "torch.float32"]]
    assert zero3["prefetch_bucket_size"] == int(0.9 * HIDDEN**2)
    assert zero3["param_persistence_threshold"] == 10 * HIDDEN
