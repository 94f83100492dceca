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


def param_groups(model, weight_decay: float) -> list[dict]:
    """AdamW parameter groups: decay on weight matrices and embeddings, none on biases and norm weights.

    Decay pulls a weight towards 0. A norm's gain is centred on 1 and a bias sets an offset, so
    decaying them only fights the model (with weight decay 100 and lr 1e-3, one AdamW step would
    scale every LayerNorm gain to 0.9). The rule is the usual one (nanoGPT, Megatron, HF Trainer
    in effect): parameters with fewer than 2 dimensions get no decay. Under ZeRO-3 with
    `zero3_init_flag` the parameters are built already partitioned (empty tensors); their real
    shape is `ds_shape`, which is what counts here.

    Args:
        model: the module before `accelerator.prepare` (FSDP would flatten it).
        weight_decay: the decay of the first group (`--weight_decay`), dimensionless.

    Returns:
        Two groups for `torch.optim.AdamW`: `{"params": matrices, "weight_decay": weight_decay}`
        and `{"params": vectors, "weight_decay": 0.0}`; shared (tied) parameters appear once.
    """
    params = {id(p): p for p in model.parameters() if p.requires_grad}.values()
    matrices = [p for p in params if len(getattr(p, "ds_shape", p.shape)) >= 2]
    vectors = [p for p in params if len(getattr(p, "ds_shape", p.shape)) < 2]
    return [{"params": matrices, "weight_decay": weight_decay}, {"params": vectors, "weight_decay": 0.0}]
