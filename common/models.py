"""Llama presets, and what the recipes need of a Hugging Face model."""

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
    """The `LlamaConfig` of a key of `PRESETS` with `vocab_size` and `overrides`."""
    if preset not in PRESETS:
        raise Stop(f"unknown --model_config {preset!r}; choose one of {sorted(PRESETS)}")
    return LlamaConfig(**{**PRESETS[preset], "vocab_size": vocab_size, **overrides})


def param_groups(model, weight_decay: float) -> list[dict]:
    """AdamW groups of `model`'s trainable parameters (before `prepare`): `weight_decay` on matrices
    and embeddings, 0 on vectors (a norm's gain is centred on 1, as in nanoGPT and HF Trainer).
    ZeRO-3 init: shapes in `ds_shape`. An empty group is left out (DeepSpeed drops it)."""
    params = {id(p): p for p in model.parameters() if p.requires_grad}.values()
    matrices = [p for p in params if len(getattr(p, "ds_shape", p.shape)) >= 2]
    vectors = [p for p in params if len(getattr(p, "ds_shape", p.shape)) < 2]
    groups = [
        {"params": matrices, "weight_decay": weight_decay},
        {"params": vectors, "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


def causal_lm_class(config) -> type:
    """The `AutoModelForCausalLM` class for `config`: `cls(config)` gives `from_config`'s weights for
    a seed, never a ZeRO-3-partitioned model."""
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise Stop(
            f"model type {config.model_type!r} ({type(config).__name__}) has no causal-LM class in "
            "transformers (AutoModelForCausalLM); this recipe trains decoder-only language models"
        )
    return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]


def config_state(config) -> dict:
    """The model config as a checkpoint records it (what differs from the class defaults): another
    `--config_overrides` keeps the shapes and trains another model."""
    values = json.loads(config.to_json_string(use_diff=True))
    return {k: v for k, v in values.items() if k not in ("transformers_version", "_name_or_path")}


def for_inference(obj):
    """A copy of a model or generation config with the KV cache on; anything else as is."""
    if not hasattr(obj, "use_cache"):
        return obj
    obj = copy.deepcopy(obj)
    obj.use_cache = True
    return obj


def decoder_blocks(model: torch.nn.Module) -> torch.nn.ModuleList | None:
    """The `ModuleList` of decoder blocks of a bare or FSDP-wrapped model, or None."""
    config = getattr(model, "config", None) or getattr(
        getattr(model, "module", None), "config", None
    )
    n_layers = getattr(config, "num_hidden_layers", None)
    lists = [
        m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) == n_layers
    ]
    return lists[0] if lists else None
