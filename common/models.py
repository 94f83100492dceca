"""Llama model presets (`transformers.LlamaConfig`), and what recipes/llama.py needs to train any
Hugging Face causal LM from its config: the model class, the context length, the token ids, and
the decoder blocks that FSDP must shard one by one."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from transformers import LlamaConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from common.errors import Stop

# Shapes follow the published configs (hf.co/meta-llama/*/config.json). The vocabulary comes
# from the tokenizer at build time, so a preset trains from scratch with any tokenizer.
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
        raise Stop(f"unknown --model_config {preset!r}; choose one of {sorted(PRESETS)}")
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
        and `{"params": vectors, "weight_decay": 0.0}`, each where it has any trainable parameter;
        shared (tied) parameters appear once.
    """
    params = {id(p): p for p in model.parameters() if p.requires_grad}.values()
    matrices = [p for p in params if len(getattr(p, "ds_shape", p.shape)) >= 2]
    vectors = [p for p in params if len(getattr(p, "ds_shape", p.shape)) < 2]
    groups = [
        {"params": matrices, "weight_decay": weight_decay},
        {"params": vectors, "weight_decay": 0.0},
    ]
    return [
        g for g in groups if g["params"]
    ]  # (LoRA trains no vectors: DeepSpeed drops an empty group)


def apply_overrides(config, overrides: str):
    """`config` changed by `--config_overrides` ("key=value,key=value", as in `run_clm.py`), validated.

    `update_from_string` converts each value to the type of the field it replaces; the config is
    then rebuilt, so that transformers validates it now rather than at model construction. A
    per-layer list derived from the depth (`layer_types`, Qwen2 and others) that the overrides
    change but do not name is derived again for the new `num_hidden_layers`.

    Returns:
        A new config of the same class.

    Raises:
        ValueError: an unknown key, a value of the wrong type or for a list field, or a config transformers rejects
            (one line, naming the overrides).
    """
    from huggingface_hub.errors import StrictDataclassError

    before = config.to_dict()
    try:
        config.update_from_string(overrides)
        values = config.to_dict()
        if values.get("num_hidden_layers") != before.get("num_hidden_layers") and values.get(
            "layer_types"
        ) == before.get("layer_types"):
            values.pop("layer_types", None)
        return type(config).from_dict(values)
    except (ValueError, TypeError, StrictDataclassError) as err:
        raise Stop(f"--config_overrides {overrides!r}: {' '.join(str(err).split())}") from None


def causal_lm_class(config) -> type:
    """The `AutoModelForCausalLM` class for `config` (`LlamaForCausalLM`, `GPT2LMHeadModel`, ...).

    Building with `cls(config)` instead of `AutoModelForCausalLM.from_config` gives the same
    weights for the same seed, and never a ZeRO-3-partitioned model.

    Raises:
        ValueError: the config's model type has no causal-LM class (names the type).
    """
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise Stop(
            f"model type {config.model_type!r} ({type(config).__name__}) has no causal-LM class in "
            "transformers (AutoModelForCausalLM); this recipe trains decoder-only language models"
        )
    return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]


def max_positions(config) -> int | None:
    """The longest sequence the model takes, in tokens: `max_position_embeddings` (also GPT-2's
    `n_positions`, through the config's `attribute_map`), `n_positions` or `max_seq_len`; None
    when the config names none (no fixed limit)."""
    for name in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    return None


def set_token_ids(config, tokenizer, from_scratch: bool) -> list[str]:
    """Put the tokenizer's bos/eos/pad ids into `config`, in place, before the model is built
    (its generation config copies them) and so before the export.

    A model trained from scratch (a preset or `--config_name`) learns the tokenizer's ids, so
    they replace whatever the config held (GPT2Config's default 50256 lies outside a small
    vocabulary). A pretrained model keeps its bos and pad ids where it has them; its eos becomes
    the tokenizer's, the separator the data is packed with (what the model learns to emit at a
    document's end), or joins its list of eos ids: the export then stops where training taught it
    to. A tokenizer's own pad token (not its eos) replaces another pad id too: padded positions
    train nothing either way. bos and pad fall back to eos when the model and tokenizer have none.
    `align_generation_ids` does the same to a pretrained model's own generation config.

    Returns:
        One `"name: old -> new"` entry per id changed (empty when none).
    """
    eos = tokenizer.eos_token_id
    wanted = {
        "bos_token_id": tokenizer.bos_token_id if tokenizer.bos_token_id is not None else eos,
        "eos_token_id": eos,
        "pad_token_id": tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos,
    }
    changed = []
    for name, value in wanted.items():
        old = getattr(config, name, None)
        if not from_scratch and old is not None:
            value = _pretrained_id(name, old, tokenizer)
        if old != value:
            setattr(config, name, value)
            changed.append(f"{name}: {old} -> {value}")
    return changed


def _pretrained_id(name: str, old, tokenizer):
    """The id a pretrained model's `name` takes from `tokenizer` (`set_token_ids`), given `old`."""
    eos = tokenizer.eos_token_id
    if name == "eos_token_id" and eos is not None:
        if isinstance(
            old, list
        ):  # several stop tokens (chat models): keep them, add the trained one
            return old if eos in old else [eos, *old]
        return eos
    # (not a pad that is the eos: the embedding's padding_idx would stop the eos row's training)
    if name == "pad_token_id" and tokenizer.pad_token_id not in (None, eos):
        return tokenizer.pad_token_id
    return old


def align_generation_ids(model, tokenizer) -> None:
    """A pretrained model's generation config (its generation_config.json, which `generate()` and
    the export use) given the eos and pad ids of `set_token_ids`, in place."""
    generation = getattr(model, "generation_config", None)
    for name in ("eos_token_id", "pad_token_id") if generation is not None else ():
        old = getattr(generation, name, None)
        setattr(
            generation,
            name,
            getattr(model.config, name) if old is None else _pretrained_id(name, old, tokenizer),
        )


def lora_copy(peft_model, state_dict: dict) -> torch.nn.Module:
    """A fresh peft model in host memory, fp32, holding `state_dict`: the live peft model's full
    (gathered) state dict, base and adapters, loaded strictly (a key missing or left over stops
    it: an adapter exported empty is a known failure under FSDP1). Its `save_pretrained` writes
    the adapter (peft's files) and its `merge_and_unload()` the plain model (W + B A alpha / r),
    the same way under every strategy. Call on the rank that holds the state dict."""
    from peft import get_peft_model

    config = peft_model.get_base_model().config
    fresh = get_peft_model(causal_lm_class(config)(config), peft_model.peft_config["default"])
    fresh.load_state_dict({k: v.float() for k, v in state_dict.items()})
    fresh.get_base_model().generation_config = peft_model.get_base_model().generation_config
    return fresh


def inference_ready(obj):
    """`obj` as an export writes it: a model or generation config (a copy) with the KV cache on
    (`use_cache`: training turns it off, and a reloaded model decodes several times slower without
    it); anything else (a tokenizer, None) as it is."""
    if not hasattr(obj, "use_cache"):
        return obj
    obj = copy.deepcopy(obj)
    obj.use_cache = True
    return obj


def decoder_blocks(model: torch.nn.Module) -> torch.nn.ModuleList | None:
    """The model's stack of decoder blocks: the `ModuleList` with `config.num_hidden_layers` items
    (`model.layers` in Llama/Qwen2/Mistral, `transformer.h` in GPT-2). Works on the unwrapped
    model and on an FSDP1/FSDP2-wrapped one. None when there is no such list."""
    config = getattr(model, "config", None) or getattr(
        getattr(model, "module", None), "config", None
    )
    n_layers = getattr(config, "num_hidden_layers", None)
    lists = [
        m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) == n_layers
    ]
    return lists[0] if lists else None


def fsdp_block_units(model: torch.nn.Module) -> dict:
    """How FSDP wrapped the decoder blocks of a prepared model (call after `accelerator.prepare`).

    Each block should be its own FSDP unit (FSDP2: the block is an `FSDPModule`; FSDP1: it sits
    in a `FullyShardedDataParallel` wrapper), so that one block's parameters are gathered at a
    time; with none wrapped, the whole model is one unit and every rank gathers all of it.

    Returns:
        `{"block_class": name, "blocks": n, "units": k}`: k of the n blocks are FSDP units
        (`blocks` 0 and `block_class` None when `decoder_blocks` finds no stack).
    """
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    blocks = decoder_blocks(model)
    if blocks is None:
        return {"block_class": None, "blocks": 0, "units": 0}
    inner = getattr(blocks[0], "_fsdp_wrapped_module", blocks[0])  # FSDP1 wrapper -> the block
    name = (
        type(inner).__name__.removeprefix("FSDP")
        if isinstance(inner, FSDPModule)
        else type(inner).__name__
    )
    units = sum(isinstance(b, (FSDPModule, FullyShardedDataParallel)) for b in blocks)
    return {"block_class": name, "blocks": len(blocks), "units": units}


def config_state(config) -> dict:
    """The model config as plain JSON values, for a checkpoint's marker (`checkpoint.resume_error`).

    `to_diff_dict` (what differs from the class defaults), without `transformers_version` and
    `_name_or_path`, which change with the install and the directory, not with the model. A resume
    under another `--config_overrides` (a norm epsilon, a dropout rate) loads the same tensor
    shapes and trains another model, silently: comparing this dict refuses it, naming the keys.
    """
    values = json.loads(config.to_json_string(use_diff=True))
    return {k: v for k, v in values.items() if k not in ("transformers_version", "_name_or_path")}


def uses_dropout(model) -> bool:
    """Whether the model draws random numbers in training: an `nn.Dropout` with p > 0, or a config
    field named like a dropout probability (`attention_dropout`, `hidden_dropout_prob`, GPT-2's
    `attn_pdrop`, ...) above 0 (some models apply dropout functionally, with no module).

    With dropout, the masks of a step depend on how its samples are split over ranks and micro
    batches, so a resume with another split cannot continue exactly.
    """
    import torch

    if any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules()):
        return True
    config = getattr(model, "config", None)
    fields = config.to_dict() if config is not None else {}
    return any(
        ("dropout" in k or "pdrop" in k) and isinstance(v, (int, float)) and v > 0
        for k, v in fields.items()
    )


def forward_error(model) -> str | None:
    """Run the freshly built model once on 2 tokens (its device, no grad, eval mode); the first line of the
    error if it fails, else None. `--config_overrides` can leave a config inconsistent
    (`hidden_size=60` with a `head_dim` of 16 kept from before): without this check the run starts
    and every rank dies with a deep traceback at the first training step."""
    import torch

    model.eval()
    try:
        with torch.no_grad():  # (on the model's device: a tensor-parallel model is on the mesh's)
            model(
                input_ids=torch.zeros(
                    1, 2, dtype=torch.long, device=next(model.parameters()).device
                )
            )
    except (RuntimeError, ValueError, IndexError, TypeError) as err:
        return str(err).splitlines()[0] if str(err) else type(err).__name__
    finally:
        model.train()
    return None


def key_summary(keys) -> str:
    """State-dict keys in a short line: keys that differ only in a layer number become one entry,
    e.g. 18 keys of layers 4 and 5 -> "model.layers.{4,5}.* (18 tensors)"; at most 6 entries."""
    import re

    limit = 6
    groups: dict[
        str, list
    ] = {}  # "model.layers" -> [layer numbers, tensor count]; a lone key -> None
    for key in sorted(keys):
        match = re.match(r"^(.*?)\.(\d+)\.", key)
        if match is None:
            groups[key] = None
            continue
        entry = groups.setdefault(match[1], [set(), 0])
        entry[0].add(int(match[2]))
        entry[1] += 1
    items = [
        name
        if entry is None
        else f"{name}.{{{','.join(map(str, sorted(entry[0])))}}}.* ({entry[1]} tensors)"
        for name, entry in groups.items()
    ]
    return ", ".join(items[:limit]) + (
        f" and {len(items) - limit} more" if len(items) > limit else ""
    )


def weights_mismatch(missing, unexpected, fix: str) -> str | None:
    """One line naming the model's weights a checkpoint lacks (they would train from their random
    init) and the checkpoint's weights the model has no place for (dropped), ending with `fix`;
    None when both are empty."""
    parts = []
    if missing:
        parts.append(
            f"the checkpoint lacks {len(missing)} of the model's weights, which would start random: "
            f"{key_summary(missing)}"
        )
    if unexpected:
        parts.append(
            f"{len(unexpected)} of the checkpoint's weights have no place in the model and would be "
            f"dropped: {key_summary(unexpected)}"
        )
    return f"{'; '.join(parts)}; {fix}" if parts else None


def checkpoint_keys(name_or_path: str) -> set[str] | None:
    """The tensor names of a safetensors checkpoint (a directory or a hub name already downloaded),
    read from the file headers or the shard index; None when there is no safetensors file."""
    from safetensors import safe_open
    from transformers.utils import cached_file

    def find(name):
        return cached_file(
            name_or_path,
            name,
            _raise_exceptions_for_missing_entries=False,
            _raise_exceptions_for_connection_errors=False,
        )

    if index := find("model.safetensors.index.json"):
        with open(index) as f:
            return set(json.load(f)["weight_map"])
    if single := find("model.safetensors"):
        with safe_open(single, framework="pt") as f:
            return set(f.keys())
    return None


def weights_digest(name_or_path: str | None, sample_bytes: int = 4096) -> str | None:
    """A cheap identity of a pretrained model's weights: 16 hex digits of a sha256 over its folder's
    weight files, each file's name and size, and for a `*.safetensors` file its header (names,
    shapes, dtypes, offsets) and the first `sample_bytes` of every tensor; for a `*.bin` file
    `sample_bytes` at its start, middle and end. About a megabyte read for a 300-tensor model: a
    moved copy gives the same digest, other weights of the same shapes another one (another
    fine-tune; a base with a LoRA merged into some projections). `name_or_path`: a directory, or a
    hub name already downloaded.

    Returns:
        The digest, or None where no weight files are found (a model built from a config).
    """
    import hashlib

    from transformers.utils import cached_file

    if not name_or_path:
        return None
    folder = Path(name_or_path)
    if not folder.is_dir():
        config = cached_file(
            name_or_path,
            "config.json",
            _raise_exceptions_for_missing_entries=False,
            _raise_exceptions_for_connection_errors=False,
        )
        if not config:
            return None
        folder = Path(config).parent
    files = sorted(
        f for pattern in ("*.safetensors", "*.bin") for f in folder.glob(pattern) if f.is_file()
    )
    if not files:
        return None
    digest = hashlib.sha256()
    for f in files:
        size = f.stat().st_size
        digest.update(f"{f.name}:{size}".encode())
        with open(f, "rb") as stream:
            if f.suffix == ".safetensors" and size >= 8:
                header_size = int.from_bytes(stream.read(8), "little")
                header = stream.read(header_size)
                digest.update(header)
                tensors = json.loads(header)
                offsets = sorted(
                    8 + header_size + v["data_offsets"][0]
                    for k, v in tensors.items()
                    if k != "__metadata__"
                )
            else:
                offsets = sorted(
                    {0, max(0, size // 2 - sample_bytes // 2), max(0, size - sample_bytes)}
                )
            for offset in offsets:
                stream.seek(offset)
                digest.update(stream.read(sample_bytes))
    return digest.hexdigest()[:16]


def load_pretrained(
    name_or_path: str, config, allow_new_weights: bool = False
) -> tuple[torch.nn.Module, str | None]:
    """`AutoModelForCausalLM.from_pretrained` in fp32, and whether the checkpoint fits the model.

    transformers initialises the model's weights that the checkpoint lacks at random, and drops the
    checkpoint's weights that the model has no place for; it only logs a load report. Both train
    another model than the one asked for, silently: a config with more layers (the new ones train
    from random values), or one that unties the embeddings (a random output head, loss ln V at
    the start). Under DeepSpeed ZeRO-3 transformers reports no unexpected keys (its partitioned
    load assumes a matching checkpoint), so they are taken from the checkpoint's own key list.

    Args:
        config: the model config (from --config_name, or the checkpoint's own).
        allow_new_weights: weights missing from the checkpoint are meant to start from their
            init (new layers on purpose); unexpected weights are refused all the same.

    Returns:
        (model, None), or (model, one line naming the keys and the fix) when it does not fit.
    """
    from transformers import AutoModelForCausalLM
    from transformers.integrations import is_deepspeed_zero3_enabled

    model, info = AutoModelForCausalLM.from_pretrained(
        name_or_path, config=config, dtype=torch.float32, output_loading_info=True
    )
    missing, unexpected = set(info["missing_keys"]), set(info["unexpected_keys"])
    if is_deepspeed_zero3_enabled() and (saved := checkpoint_keys(name_or_path)) is not None:
        unexpected |= saved - set(model.state_dict())
    fix = "pass a --config_name that matches the checkpoint (or none: its own config)" + (
        ""
        if allow_new_weights or not missing
        else ", or --allow_new_weights to train new weights on purpose"
    )
    return model, weights_mismatch([] if allow_new_weights else missing, unexpected, fix)


def load_pretrained_on_ranks(
    accelerator, name_or_path: str, config, allow_new_weights: bool, tokenizer=None
) -> torch.nn.Module:
    """`load_pretrained` on every rank, or on rank 0 alone where prepare broadcasts its weights; with
    `tokenizer`, its generation config takes the eos and pad ids (`align_generation_ids`), and its
    embeddings grow to hold tokens added to the vocabulary.

    Under FSDP with `fsdp_cpu_ram_efficient_loading` (accelerate_configs/fsdp.yaml) `prepare` sends
    rank 0's weights to the others, so they only build the shapes, in storage nothing writes (no
    host RAM until sharded); transformers 5 would read the checkpoint on every rank, a full fp32
    copy each. Non-persistent buffers (rotary `inv_freq`) are computed by `__init__`, not loaded.

    Raises:
        Stop: on every rank, if the checkpoint failed to load or does not fit the model on any
            rank (a damaged file, other shapes, missing or unexpected weights): else the others
            would wait for rank 0's broadcast.
    """
    from accelerate.utils import gather_object
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    plugin = accelerator.state.fsdp_plugin if accelerator.distributed_type.value == "FSDP" else None
    model, error = None, None
    shapes_only = plugin is not None and plugin.cpu_ram_efficient_loading
    shapes_only = shapes_only and not accelerator.is_main_process
    try:
        if shapes_only:
            with no_init_weights():
                model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
            model.tie_weights()
        else:
            model, error = load_pretrained(name_or_path, config, allow_new_weights)
    except Exception as err:  # noqa: BLE001  (one line on every rank, whatever went wrong)
        error = f"{type(err).__name__}: {err}".splitlines()[0]
    if failures := [e for e in gather_object([error]) if e]:
        raise Stop(f"cannot load --model_name_or_path {name_or_path}: {failures[0]}")
    if tokenizer is not None:
        align_generation_ids(model, tokenizer)
    if tokenizer is not None and len(tokenizer) > model.get_input_embeddings().num_embeddings:
        # tokens added to its vocabulary (checks.tokenizer_fits): new rows at the mean of the
        # loaded ones (shapes only: prepare brings rank 0's)
        model.resize_token_embeddings(len(tokenizer), mean_resizing=not shapes_only)
    return tensor_parallel(accelerator, model)  # tp.yaml: each rank keeps its slices


def sample_from_export(
    export_dir: str,
    first_block: dict,
    tokenizer,
    max_new_tokens: int,
    device,
    prompt_tokens: int | None = 16,
) -> str:
    """Reload `export_dir` with plain transformers (no project code) and sample `max_new_tokens`
    (top-k 50) after the first `prompt_tokens` tokens (None: all) of `first_block` (a validation
    block): proof that the export works. Returns the lines to print."""
    from transformers import AutoModelForCausalLM
    from transformers.integrations import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()  # else from_pretrained would build a ZeRO-3-partitioned model
    reloaded = AutoModelForCausalLM.from_pretrained(export_dir, device_map=device)
    ids = first_block["input_ids"]
    if "attention_mask" in first_block:
        ids = ids[first_block["attention_mask"].bool()]
    prompt = ids[:prompt_tokens].to(device)
    sample = reloaded.generate(
        prompt[None],
        attention_mask=torch.ones_like(prompt[None]),
        max_new_tokens=max_new_tokens,
        do_sample=True,
        top_k=50,
        pad_token_id=reloaded.config.pad_token_id,
    )
    return (
        f"--- sample from {export_dir}, prompt from the validation data ---\n"
        f"{tokenizer.decode(prompt)}|{tokenizer.decode(sample[0, len(prompt) :])}\n---"
    )


def tensor_parallel(accelerator, model: torch.nn.Module) -> torch.nn.Module:
    """Shard `model` on the `tp` dimension of Accelerate's device mesh with its own tensor-parallel
    plan (transformers' `tp_plan`: attention and MLP projections colwise then rowwise, embedding and
    LM head by vocabulary rows), before `accelerator.prepare`, which requires it; unchanged without a
    `parallelism_config_tp_size` above 1 (accelerate_configs/tp.yaml has 2).

    The model is built whole and seeded as on one process, then each rank keeps its slices (DTensor
    parameters, `Shard` on tp); `prepare` then shards them again with FSDP2 over dp_shard. This is
    what `from_pretrained(..., tp_plan="auto")` does after init, with Accelerate's mesh.

    Raises:
        Stop: the model type has no tensor-parallel plan in transformers.
    """
    config = getattr(accelerator, "parallelism_config", None)
    if config is None or not config.tp_enabled:
        return model
    from transformers.distributed import DistributedConfig
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism

    for key in ("num_attention_heads", "num_key_value_heads"):  # each tp rank computes whole heads
        if (heads := getattr(model.config, key, None)) and heads % config.tp_size:
            raise Stop(
                f"parallelism_config_tp_size {config.tp_size}: the model's {key} {heads} is not a multiple of "
                "it, and each tp rank computes whole attention heads"
            )
    distributed = DistributedConfig(tp_size=config.tp_size)
    try:
        plan, _, _ = model._resolve_parallel_plans(distributed)
    except (AttributeError, ValueError) as err:
        raise Stop(
            f"parallelism_config_tp_size {config.tp_size}: {type(model).__name__} has no tensor-parallel plan "
            f"in transformers ({str(err).splitlines()[0]}); launch it with fsdp.yaml or hsdp.yaml"
        ) from None
    # A tied LM head shares the embedding's weight, which the plan shards once (both by vocabulary rows);
    # tie_weights points the head at the sharded tensor again.
    own = dict(model.named_parameters())
    plan = {
        name: style
        for name, style in plan.items()
        if name in own or name not in dict(model.named_parameters(remove_duplicate=False))
    }
    try:
        apply_tensor_parallelism(model, accelerator.torch_device_mesh["tp"], plan)
    except (
        RuntimeError,
        ValueError,
        AssertionError,
    ) as err:  # e.g. heads that tp ranks cannot split evenly
        raise Stop(
            f"parallelism_config_tp_size {config.tp_size}: cannot slice {type(model).__name__} with its "
            f"tensor-parallel plan: {str(err).splitlines()[0] if str(err) else type(err).__name__}"
        ) from None
    model.tie_weights()
    # The slices are on the mesh's device already (distribute_tensor moves each whole tensor there, then
    # keeps this rank's part); the rest (RMSNorm weights, rotary buffers) follows, so the model is on one device.
    model.to(accelerator.device)
    model._tp_size = config.tp_size  # what Accelerate's prepare reads (get_model_tp_size)
    return model
