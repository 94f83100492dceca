"""Throughput, MFU and memory figures, torchtitan-style, plus the metrics.jsonl writer."""

from __future__ import annotations

import json
import math
import resource
import sys

import torch

# Peak dense bf16 FLOP/s per device. Source: torchtitan `torchtitan/tools/utils.py`
# (`get_peak_flops`). Order matters: "H100 NVL" must match before "H100".
PEAK_BF16_FLOPS = [
    ("H200", 989e12),
    ("H100 NVL", 835e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("A100", 312e12),
]


def flops_per_token(config, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward) of a decoder-only transformer.

    6·N + 12·L·H·Q·T, with N the parameter count *excluding* the token embedding, L layers,
    H heads, Q head dimension and T the sequence length. Source: PaLM (Chowdhery et al. 2022),
    appendix B, as computed by torchtitan (`torchtitan/models/llama3/model/args.py`).

    Args:
        config: a `LlamaConfig` (or any config with the same fields).
        seq_len: tokens per sequence (`--block_size`).

    Returns:
        FLOPs per trained token.
    """
    h, layers, heads = config.hidden_size, config.num_hidden_layers, config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or h // heads
    kv = config.num_key_value_heads * head_dim
    attn = h * (h + 2 * kv) + h * h  # q, k, v, o projections
    mlp = 3 * h * config.intermediate_size  # gate, up, down
    norms = 2 * h
    # + final norm + the output head: a real matmul even when tied to the input embedding
    # (the embedding lookup itself does no FLOPs, so its parameters are left out)
    n = layers * (attn + mlp + norms) + h + config.vocab_size * h
    return 6 * n + 12 * layers * heads * head_dim * seq_len


def peak_flops(device: torch.device, override_tflops: float | None = None) -> float | None:
    """Peak dense bf16 FLOP/s of one device, for MFU.

    Args:
        device: the training device.
        override_tflops: `--peak_tflops`, in TFLOP/s; wins over the table.

    Returns:
        FLOP/s, or None when unknown (CPUs, unlisted GPUs): MFU is then not reported.
    """
    if override_tflops:
        return override_tflops * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((flops for key, flops in PEAK_BF16_FLOPS if key in name), None)


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this process in bytes: CUDA max allocated, else the peak resident set size."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024  # Linux reports KiB


def local_parameter_elements(model: torch.nn.Module) -> int:
    """Number of parameter elements this rank actually holds.

    Handles FSDP2 DTensors (`to_local`), DeepSpeed ZeRO-3 partitions (`ds_tensor`) and FSDP1
    `use_orig_params` views (already local). Plain modules count every element.
    """
    total = 0
    for p in model.parameters():
        if hasattr(p, "ds_tensor"):
            total += p.ds_tensor.numel()
        elif hasattr(p, "to_local"):
            total += p.to_local().numel()
        else:
            total += p.numel()
    return total


def strict_json(record: dict) -> dict:
    """`record` with every non-finite float (NaN, inf) replaced by None, and the names of those
    keys listed under `"nonfinite"`, so that the result is standard JSON (Python's `json` would
    write the literals `NaN` and `Infinity`, which strict parsers reject)."""
    bad = [k for k, v in record.items() if isinstance(v, float) and not math.isfinite(v)]
    if not bad:
        return record
    return {**{k: (None if k in bad else v) for k, v in record.items()}, "nonfinite": bad}


def append_jsonl(path: str, record: dict) -> None:
    """Append one JSON object as a line to `path` (call on the main process only).

    Non-finite floats are written as null, named in the line's `"nonfinite"` list (`strict_json`).
    """
    with open(path, "a") as f:
        f.write(json.dumps(strict_json(record), allow_nan=False) + "\n")
