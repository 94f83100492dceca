"""Llama model presets, built from `transformers.LlamaConfig`."""

from __future__ import annotations

from transformers import LlamaConfig

# Shapes follow the published configs (hf.co/meta-llama/*/config.json). The vocabulary comes
# from the tokenizer at build time, so a preset trains from scratch with any tokenizer.
PRESETS: dict[str, dict] = {
    # ~4.2M parameters with a 4,096-token vocabulary: trains in minutes on 2 CPU cores.
    "debug": dict(
        hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=1024, tie_word_embeddings=True,
    ),
    # Llama-3.2-1B shapes (1.24B parameters with its 128,256-token vocabulary).
    "llama-3.2-1b": dict(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, max_position_embeddings=131072, tie_word_embeddings=True,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
    ),
    # Llama-3-8B shapes (8.03B parameters with its 128,256-token vocabulary).
    "llama-3-8b": dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, max_position_embeddings=8192, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
    ),
}


def llama_config(preset: str, vocab_size: int, **overrides) -> LlamaConfig:
    """Build a `LlamaConfig` from a named preset.

    Args:
        preset: a key of `PRESETS` (`--model_config`).
        vocab_size: number of token ids, normally `len(tokenizer)`.
        overrides: any `LlamaConfig` field, e.g. `num_hidden_layers=8`.

    Returns:
        The config. Token ids for bos/eos/pad are left for the caller to set.

    Raises:
        ValueError: naming the unknown preset and listing the known ones.
    """
    if preset not in PRESETS:
        raise ValueError(f"unknown --model_config {preset!r}; choose one of {sorted(PRESETS)}")
    return LlamaConfig(**{**PRESETS[preset], "vocab_size": vocab_size, **overrides})
