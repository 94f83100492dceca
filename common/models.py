"""Llama presets, and what every recipe needs of a Hugging Face model: its AdamW groups, its
class, its decoder blocks and its config as a checkpoint records it."""

from __future__ import annotations

import copy
import json

import torch
from transformers import LlamaConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from common.errors import Stop

# Shapes of the published configs (hf.co/meta-llama/*/config.json); the vocabulary is the
# tokenizer's, so a preset trains from scratch with any tokenizer.
PRESETS: dict[str, dict] = {
    # ~4.2M parameters with a 4,096-token vocabulary: trains in minutes on 2 CPU cores.
    "debug": dict(
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
    ),
    # Llama-3.2-1B shapes (1.24B parameters with its 128,256-token vocabulary).
    "llama-3.2-1b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=131072,
        tie_word_embeddings=True,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    ),
    # Llama-3-8B shapes (8.03B parameters with its 128,256-token vocabulary).
    "llama-3-8b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
    ),
}


def llama_config(preset: str, vocab_size: int, **overrides) -> LlamaConfig:
    """The `LlamaConfig` of a key of `PRESETS` (`--model_config`), with `vocab_size` (normally
    `len(tokenizer)`) and any `LlamaConfig` field in `overrides`; token ids are the caller's."""
    if preset not in PRESETS:
        raise Stop(f"unknown --model_config {preset!r}; choose one of {sorted(PRESETS)}")
    return LlamaConfig(**{**PRESETS[preset], "vocab_size": vocab_size, **overrides})


def param_groups(model, weight_decay: float) -> list[dict]:
    """AdamW groups of the trainable parameters of `model` (before `prepare`: FSDP flattens):
    `weight_decay` on matrices and embeddings, 0 on vectors (biases, norm gains).

    A norm's gain is centred on 1: decaying it towards 0 only fights the model (nanoGPT, Megatron
    and HF Trainer do the same). Under ZeRO-3's `zero3_init_flag` parameters are built empty; their
    shape is `ds_shape`. Tied parameters appear once; an empty group is left out (DeepSpeed drops
    it, and LoRA trains no vectors).
    """
    params = {id(p): p for p in model.parameters() if p.requires_grad}.values()
    matrices = [p for p in params if len(getattr(p, "ds_shape", p.shape)) >= 2]
    vectors = [p for p in params if len(getattr(p, "ds_shape", p.shape)) < 2]
    groups = [
        {"params": matrices, "weight_decay": weight_decay},
        {"params": vectors, "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


def causal_lm_class(config) -> type:
    """The `AutoModelForCausalLM` class for `config` (`LlamaForCausalLM`, `GPT2LMHeadModel`, ...).
    `cls(config)` gives the same weights for the same seed as `from_config`, and never a
    ZeRO-3-partitioned model."""
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise Stop(
            f"model type {config.model_type!r} ({type(config).__name__}) has no causal-LM class in "
            "transformers (AutoModelForCausalLM); this recipe trains decoder-only language models"
        )
    return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]


def config_state(config) -> dict:
    """The model config as a checkpoint records it (`checkpoint.check_resume` compares it): what
    differs from the class defaults, without `transformers_version` and `_name_or_path`. Another
    `--config_overrides` (a norm epsilon, a dropout rate) keeps the shapes and trains another
    model: the resume is refused, naming the keys."""
    values = json.loads(config.to_json_string(use_diff=True))
    return {k: v for k, v in values.items() if k not in ("transformers_version", "_name_or_path")}


def for_inference(obj):
    """A copy of a model or generation config with the KV cache on (`use_cache`: training turns it
    off, and a reloaded model decodes several times slower without it); anything else as it is."""
    if not hasattr(obj, "use_cache"):
        return obj
    obj = copy.deepcopy(obj)
    obj.use_cache = True
    return obj


def decoder_blocks(model: torch.nn.Module) -> torch.nn.ModuleList | None:
    """The `ModuleList` of `config.num_hidden_layers` decoder blocks (`model.layers` in Llama,
    `transformer.h` in GPT-2), of a bare or FSDP-wrapped model; None if there is none."""
    config = getattr(model, "config", None) or getattr(
        getattr(model, "module", None), "config", None
    )
    n_layers = getattr(config, "num_hidden_layers", None)
    lists = [
        m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) == n_layers
    ]
    return lists[0] if lists else None


def fsdp_block_units(model: torch.nn.Module) -> dict:
    """`{"block_class": name, "blocks": n, "units": k}`: k of the n decoder blocks of a prepared
    model are FSDP units of their own (FSDP2: an `FSDPModule`; FSDP1: in a wrapper). With none,
    the whole model is one unit and every rank gathers all of it at once."""
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    blocks = decoder_blocks(model)
    if blocks is None:
        return {"block_class": None, "blocks": 0, "units": 0}
    inner = getattr(blocks[0], "_fsdp_wrapped_module", blocks[0])  # FSDP1 wrapper -> the block
    name = type(inner).__name__
    name = name.removeprefix("FSDP") if isinstance(inner, FSDPModule) else name
    units = sum(isinstance(b, (FSDPModule, FullyShardedDataParallel)) for b in blocks)
    return {"block_class": name, "blocks": len(blocks), "units": units}
