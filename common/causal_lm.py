"""What recipes/llama.py and recipes/sft.py need to train any Hugging Face causal LM: config
overrides, token ids, pretrained weights that must fit the model, tensor parallel, a digest of
the frozen base (LoRA), the resume record, a sample from the export, and the peak LR."""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

import torch

from common import checkpoint, data, models, workarounds
from common.errors import Stop


def apply_overrides(config, overrides: str):
    """A new `config` with `--config_overrides` ("key=value,key=value", as in `run_clm.py`)
    applied and validated now, not at model construction; Stop naming a bad key or value. A
    per-layer list that the overrides do not name (`layer_types`) follows a new depth."""
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


def set_token_ids(config, tokenizer, from_scratch: bool) -> list[str]:
    """Put the tokenizer's bos/eos/pad ids into `config` before the model is built; returns one
    "name: old -> new" per id changed.

    From scratch the tokenizer's ids replace the config's (GPT2Config's 50256 lies outside a small
    vocabulary). A pretrained model keeps its bos and pad; its eos becomes the tokenizer's, the
    separator the data is packed with (or joins its list of eos ids), so the export stops where
    training taught it to. A tokenizer's own pad (not its eos) replaces the model's. bos and pad
    fall back to eos.
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
    """The id a pretrained model's `name` (now `old`) takes from `tokenizer` (`set_token_ids`)."""
    eos = tokenizer.eos_token_id
    if name == "eos_token_id" and eos is not None:
        if isinstance(old, list):  # several stop tokens (chat models): add the trained one
            return old if eos in old else [eos, *old]
        return eos
    # (not a pad that is the eos: the embedding's padding_idx would stop the eos row's training)
    if name == "pad_token_id" and tokenizer.pad_token_id not in (None, eos):
        return tokenizer.pad_token_id
    return old


def _align_generation_ids(model, tokenizer) -> None:
    """A pretrained model's generation config (what `generate()` and the export use) given the eos
    and pad ids of `set_token_ids`, in place."""
    generation = getattr(model, "generation_config", None)
    for name in ("eos_token_id", "pad_token_id") if generation is not None else ():
        old = getattr(generation, name, None)
        new = getattr(model.config, name) if old is None else _pretrained_id(name, old, tokenizer)
        setattr(generation, name, new)


def weights_mismatch(missing, unexpected, fix: str) -> str | None:
    """One line naming the model's weights a checkpoint lacks (they would start random) and the
    checkpoint's weights the model has no place for (dropped), ending with `fix`; None if neither.
    Keys differing only in a layer number are one entry: "model.layers.{4,5}.* (18 tensors)"."""

    def summary(keys, limit=6) -> str:
        groups: dict[str, list | None] = {}  # "model.layers" -> [layer numbers, tensors]
        for key in sorted(keys):
            if (match := re.match(r"^(.*?)\.(\d+)\.", key)) is None:
                groups[key] = None
                continue
            entry = groups.setdefault(match[1], [set(), 0])
            entry[0].add(int(match[2]))
            entry[1] += 1
        items = [
            f"{name}.{{{','.join(map(str, sorted(e[0])))}}}.* ({e[1]} tensors)" if e else name
            for name, e in groups.items()
        ]
        more = f" and {len(items) - limit} more" if len(items) > limit else ""
        return ", ".join(items[:limit]) + more

    parts = []
    if missing:
        parts.append(
            f"the checkpoint lacks {len(missing)} of the model's weights, which would start random: "
            f"{summary(missing)}"
        )
    if unexpected:
        parts.append(
            f"{len(unexpected)} of the checkpoint's weights have no place in the model and would be "
            f"dropped: {summary(unexpected)}"
        )
    return f"{'; '.join(parts)}; {fix}" if parts else None


def _hub_file(name_or_path: str, filename: str) -> str | None:
    """The local path of `filename` in a model folder or a hub model already downloaded."""
    from transformers.utils import cached_file

    return cached_file(
        name_or_path,
        filename,
        _raise_exceptions_for_missing_entries=False,
        _raise_exceptions_for_connection_errors=False,
    )


def load_pretrained(name_or_path: str, config, allow_new_weights: bool = False) -> torch.nn.Module:
    """`AutoModelForCausalLM.from_pretrained` in fp32; Stop if the checkpoint does not fit.

    transformers starts the weights a checkpoint lacks at random and drops the ones the model has
    no place for, and only logs it: a config with more layers, or one that unties the embeddings
    (a random output head, loss ln V at the start), would train silently. `allow_new_weights`:
    missing weights start from their init on purpose (new layers). Under ZeRO-3 transformers
    reports no unexpected keys, so they come from the checkpoint's own key list.
    """
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM
    from transformers.integrations import is_deepspeed_zero3_enabled

    model, info = AutoModelForCausalLM.from_pretrained(
        name_or_path, config=config, dtype=torch.float32, output_loading_info=True
    )
    missing, unexpected = set(info["missing_keys"]), set(info["unexpected_keys"])
    if is_deepspeed_zero3_enabled():
        if index := _hub_file(name_or_path, "model.safetensors.index.json"):
            unexpected |= set(json.loads(Path(index).read_text())["weight_map"]) - set(
                model.state_dict()
            )
        elif single := _hub_file(name_or_path, "model.safetensors"):
            with safe_open(single, framework="pt") as f:
                unexpected |= set(f.keys()) - set(model.state_dict())
    fix = "pass a --config_name that matches the checkpoint (or none: its own config)"
    if missing and not allow_new_weights:
        fix += ", or --allow_new_weights to train new weights on purpose"
    if error := weights_mismatch([] if allow_new_weights else missing, unexpected, fix):
        raise Stop(error)
    return model


def load_pretrained_on_ranks(
    accelerator, name_or_path: str, config, allow_new_weights: bool, tokenizer=None
) -> torch.nn.Module:
    """`load_pretrained` on every rank, or on rank 0 alone where `prepare` broadcasts its weights
    (FSDP's `fsdp_cpu_ram_efficient_loading`: the others build the shapes in storage nothing
    writes, instead of a full fp32 copy each); then `tensor_parallel`. With `tokenizer`, the
    generation config takes the eos and pad ids of `set_token_ids`, and the embeddings grow to
    hold tokens added to the vocabulary. Stop on every rank if any
    rank failed, else the others would wait for rank 0's broadcast."""
    from accelerate.utils import gather_object
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    plugin = accelerator.state.fsdp_plugin if accelerator.distributed_type.value == "FSDP" else None
    model, error = None, None
    shapes_only = plugin and plugin.cpu_ram_efficient_loading and not accelerator.is_main_process
    try:
        if shapes_only:
            with no_init_weights():
                model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
            model.tie_weights()
        else:
            model = load_pretrained(name_or_path, config, allow_new_weights)
    except Stop as err:
        error = str(err)
    except Exception as err:  # noqa: BLE001  (one line on every rank, whatever went wrong)
        error = f"{type(err).__name__}: {err}".splitlines()[0]
    if failures := [e for e in gather_object([error]) if e]:
        raise Stop(f"cannot load --model_name_or_path {name_or_path}: {failures[0]}")
    if tokenizer is not None:
        _align_generation_ids(model, tokenizer)
    if tokenizer is not None and len(tokenizer) > model.get_input_embeddings().num_embeddings:
        # tokens added to its vocabulary (tokenizer_fits): new rows at the mean of the
        # loaded ones (shapes only: prepare brings rank 0's)
        model.resize_token_embeddings(len(tokenizer), mean_resizing=not shapes_only)
    return tensor_parallel(accelerator, model)


def tensor_parallel(accelerator, model: torch.nn.Module) -> torch.nn.Module:
    """`model` sharded on the `tp` dimension of Accelerate's mesh (tp.yaml) with transformers' own
    plan for it (`tp_plan`: attention and MLP projections colwise then rowwise, embedding and head
    by vocabulary rows), as `from_pretrained(..., tp_plan="auto")` would; unchanged without
    tensor parallel. Each rank keeps its slices, which `prepare` shards again over dp_shard."""
    config = getattr(accelerator, "parallelism_config", None)
    if config is None or not config.tp_enabled:
        return model
    from transformers.distributed import DistributedConfig
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism

    where = f"parallelism_config_tp_size {config.tp_size}"
    for key in ("num_attention_heads", "num_key_value_heads"):  # each tp rank computes whole heads
        if (heads := getattr(model.config, key, None)) and heads % config.tp_size:
            raise Stop(f"{where}: the model's {key} {heads} is not a multiple of it")
    try:
        plan, _, _ = model._resolve_parallel_plans(DistributedConfig(tp_size=config.tp_size))
    except (AttributeError, ValueError) as err:
        raise Stop(
            f"{where}: {type(model).__name__} has no tensor-parallel plan in transformers "
            f"({str(err).splitlines()[0]}); launch it with fsdp.yaml or hsdp.yaml"
        ) from None
    # A tied head shares the embedding's weight, which the plan shards once; tie_weights re-ties.
    own, every = (
        dict(model.named_parameters()),
        dict(model.named_parameters(remove_duplicate=False)),
    )
    plan = {name: style for name, style in plan.items() if name in own or name not in every}
    try:
        apply_tensor_parallelism(model, accelerator.torch_device_mesh["tp"], plan)
    except (RuntimeError, ValueError, AssertionError) as err:
        raise Stop(
            f"{where}: cannot slice {type(model).__name__} with its tensor-parallel plan: "
            f"{str(err).splitlines()[0] if str(err) else type(err).__name__}"
        ) from None
    model.tie_weights()
    model.to(accelerator.device)  # the slices are there already; norms and rotary buffers follow
    model._tp_size = config.tp_size  # what Accelerate's prepare reads (get_model_tp_size)
    return model


def replicate_parallel_for_accelerate(accelerator) -> list[str]:
    """Tensor parallel: the `ReplicateParallel` Accelerate 1.15's `prepare` imports, which
    transformers 5.24 lacks (its `local_params` style here). Canary: still imported, still missing."""
    import transformers.integrations.tensor_parallel as hf_tp

    config = getattr(accelerator, "parallelism_config", None)
    if config is None or not config.tp_enabled or hasattr(hf_tp, "ReplicateParallel"):
        return []
    from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES

    class ReplicateParallel:
        def prepare_module_tp(self, module, mesh):
            if not getattr(module, "_replicated_params_local", False):  # once per module
                ALL_PARALLEL_STYLES["local_params"].install_forward(module, mesh)
                module._replicated_params_local = True

    hf_tp.ReplicateParallel = ReplicateParallel
    return ["replicate_parallel_for_accelerate"]


def gather_metrics_once_per_tp_group(accelerator) -> list[str]:
    """Tensor parallel: `gather_for_metrics` keeps one copy of each tp group's rows (Accelerate 1.15
    gathers every rank: the eval loss was 1.2e-3 off). Canary: it still gathers every rank's."""
    config = getattr(accelerator, "parallelism_config", None)
    if config is None or not config.tp_enabled:
        return []
    tp, plain = config.non_data_parallel_size, accelerator.gather_for_metrics

    def one_copy(t: torch.Tensor) -> torch.Tensor:  # [ranks x n, ...] -> [dp ranks x n, ...]
        n = t.shape[0] // accelerator.num_processes
        return t.reshape(-1, tp, n, *t.shape[1:])[:, 0].reshape(-1, *t.shape[1:])

    def gather_for_metrics(input_data, use_gather_object=False):
        from accelerate.utils import recursively_apply

        gather = type(accelerator).gather
        accelerator.gather = lambda data: recursively_apply(one_copy, gather(accelerator, data))
        try:
            return plain(input_data, use_gather_object=use_gather_object)
        finally:
            del accelerator.gather  # the class's own again

    accelerator.gather_for_metrics = gather_for_metrics
    return ["gather_metrics_once_per_tp_group"]


def patch_tensor_parallel(accelerator) -> list[str]:
    """Right after `patch_accelerator`, tp.yaml: `replicate_parallel_for_accelerate`,
    `gather_metrics_once_per_tp_group`."""
    return replicate_parallel_for_accelerate(accelerator) + gather_metrics_once_per_tp_group(
        accelerator
    )


def weights_digest(name_or_path: str | None, sample_bytes: int = 4096) -> str | None:
    """16 hex digits of a sha256 over a pretrained model's weight files: names and sizes, a
    safetensors file's header (names, shapes, dtypes, offsets) and the first `sample_bytes` of
    each tensor, a `*.bin` file's start, middle and end. About a megabyte read for 300 tensors; a
    moved copy digests the same, other weights of the same shapes (another fine-tune) do not.
    None where there are no weight files (a model built from a config)."""
    if not name_or_path:
        return None
    folder = Path(name_or_path)
    if not folder.is_dir():
        if not (config := _hub_file(name_or_path, "config.json")):
            return None
        folder = Path(config).parent
    files = sorted(f for p in ("*.safetensors", "*.bin") for f in folder.glob(p) if f.is_file())
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
                offsets = sorted(
                    8 + header_size + v["data_offsets"][0]
                    for k, v in json.loads(header).items()
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


def record_resume(run_info: dict, path: Path, step: int, saved: dict) -> str:
    """Record the resume in `run_info["resumed"]` (checkpoint, step, saved_world_size, resharded:
    how, or None for a full state or the same world size); returns the line to print, which on
    another world size says how: ": resharded from 2 to 3 ranks through DCP"."""
    n, m = saved.get("world_size"), run_info["world_size"]
    how = checkpoint.RESHARDS.get(saved.get("distributed_type"))
    moved = n is not None and n != m
    run_info["resumed"] = {
        "checkpoint": str(path),
        "step": step,
        "saved_world_size": n,
        "resharded": how if moved else None,
    }
    line = checkpoint.resumed_line(path, step)
    if not moved:
        return line
    if how:
        return f"{line}: resharded from {n} to {m} ranks through {how}"
    return f"{line}: written by {n} rank(s), loaded whole on each of {m}"


def sample_from_export(
    export_dir: str, first_block: dict, tokenizer, max_new_tokens: int, device, prompt_tokens=16
) -> str:
    """Lines to print: `export_dir` reloaded with plain transformers and sampled (top-k 50) after
    the first `prompt_tokens` tokens (None: all) of a validation block, proof that it works."""
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


def scaled_learning_rate(base_lr: float, global_batch: int, reference_global_batch: int) -> float:
    """base_lr x global_batch / reference_global_batch (sequences per optimizer step).

    The linear scaling rule of Goyal et al. 2017 (arXiv 1706.02677, section 2.1), which needs a
    warmup (section 2.2); Adam is also scaled by the square root (Malladi et al. 2022, arXiv
    2205.10287). Stops on a non-positive LR or batch.
    """
    if base_lr <= 0:
        raise Stop(f"--learning_rate must be positive, got {base_lr}")
    if global_batch <= 0 or reference_global_batch <= 0:
        raise Stop(
            f"batches must be positive, got global batch {global_batch}, "
            f"--reference_global_batch {reference_global_batch}"
        )
    return base_lr * global_batch / reference_global_batch


def peak_learning_rate(args, global_batch: int) -> tuple[float, str]:
    """The peak LR and the line that says how it was chosen: with --scale_lr, --learning_rate
    (tuned at --reference_global_batch) scaled by the linear rule, else as given."""
    share = args.warmup_steps if args.warmup_steps < 1 else 0  # a share of the run
    warmup = (
        f"a warmup of {share or args.warmup_ratio:g} of the steps"
        if share or args.warmup_ratio and not args.warmup_steps
        else f"{args.warmup_steps:g} warmup steps"
    )
    peak = (
        scaled_learning_rate(args.learning_rate, global_batch, args.reference_global_batch)
        if args.scale_lr
        else args.learning_rate
    )
    return peak, (
        f"LR: base {args.learning_rate:g} (tuned at global batch "
        f"{args.reference_global_batch}), effective {peak:g} at global batch "
        f"{global_batch}, {warmup}"
    )


def llama_flags(args, from_scratch: bool) -> None:
    """recipes/llama.py's flag combinations that cannot mean what they say."""
    if from_scratch and args.config_name is None and args.model_config not in models.PRESETS:
        raise Stop(
            f"unknown --model_config {args.model_config!r}; choose one of {sorted(models.PRESETS)}"
        )
    if args.config_overrides and not from_scratch:
        raise Stop(
            "--config_overrides changes a model trained from scratch (--config_name or the preset); "
            "pretrained weights (--model_name_or_path) keep their shapes"
        )
    if args.allow_new_weights and from_scratch:
        raise Stop(
            "--allow_new_weights concerns the weights loaded by --model_name_or_path, and there is none"
        )


def sft_flags(args) -> None:
    """recipes/sft.py's flag combinations that cannot mean what they say."""
    if not args.model_name_or_path:
        raise Stop(
            "sft.py fine-tunes a pretrained model: pass --model_name_or_path (e.g. runs/llama/final, "
            "the export of recipes/llama.py)"
        )
    if not args.use_peft and (lora := sorted(f for f in args.given if f.startswith("lora_"))):
        raise Stop(f"--{lora[0]} sets LoRA, which is off: add --use_peft, or drop the LoRA flags")


def lora_targets_found(model, targets: str) -> None:
    """Stop unless each name of --lora_target_modules (a comma list, or all-linear) adapted some
    module of the peft `model`: peft stops only when no name matches, so a misspelt one would
    leave its modules untrained, silently."""
    adapted = model.targeted_module_names
    names = [] if targets == "all-linear" else targets.split(",")
    if missing := [t for t in names if not any(n == t or n.endswith(f".{t}") for n in adapted)]:
        raise Stop(
            f"--lora_target_modules {targets}: no module named {', '.join(missing)} in the model "
            f"(adapted: {', '.join(sorted({n.rsplit('.', 1)[-1] for n in adapted}))})"
        )


def tokenizer_fits(
    tokenizer, source: str | None, raw, config, block_size: int, pretrained: bool = False
) -> None:
    """Stop unless the tokenizer and `block_size` fit the model config, before packing. An empty
    tokenizer trains on end-of-text tokens alone (and looks like fast learning); ids past the
    embedding (but tokens added to a `pretrained` model, whose embeddings
    `load_pretrained_on_ranks` grows) or blocks past the positions fail deep in the first forward."""
    if source:
        _stop_unless_tokenizer_encodes(tokenizer, source, data.sample_text(raw["train"]))
    added = sum(i >= config.vocab_size for i in tokenizer.added_tokens_decoder) if pretrained else 0
    if len(tokenizer) - added > config.vocab_size:
        raise Stop(
            f"the tokenizer has {len(tokenizer)} entries but the model's vocab_size is "
            f"{config.vocab_size}: pass a matching --tokenizer_name_or_path, or raise vocab_size "
            "(--config_overrides vocab_size=N, from scratch) or lower --vocab_size (trained BPE)"
        )
    names = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length")
    model_max = next((v for n in names if isinstance(v := getattr(config, n, None), int)), None)
    if model_max is not None and block_size > model_max:
        raise Stop(
            f"--block_size {block_size} exceeds the model's max_position_embeddings {model_max}"
        )


def _stop_unless_tokenizer_encodes(tokenizer, source: str, texts: list[str]) -> None:
    """Stop if `tokenizer` (from `source`) has under 256 entries (a byte-level BPE's bytes) or gives
    under 1 token per 50 characters of the first 20,000 of `texts` (BPEs give 3-5): transformers
    5.24 loads a model directory without tokenizer files as an empty tokenizer."""
    sample, n = [], 0
    for text in texts:
        sample.append(text[: 20_000 - n])
        n += len(sample[-1])
        if n >= 20_000:
            break
    n_tokens = sum(len(ids) for ids in tokenizer(sample, add_special_tokens=False)["input_ids"])
    if len(tokenizer) < 256 or n_tokens * 50 < n:
        raise Stop(
            f"the tokenizer loaded from {source} has {len(tokenizer)} entries and encodes {n:,} "
            f"characters of the training text into {n_tokens:,} tokens (a working one has at "
            "least 256 and 1 token per 50 characters; a model directory without tokenizer files "
            "gives an empty one): pass --tokenizer_name_or_path with the tokenizer's directory or name"
        )


def model_runs(model, overrides: str) -> None:
    """Stop unless one forward on 2 tokens runs: `--config_overrides` can leave a config
    inconsistent (`hidden_size=60` with a `head_dim` of 16 kept), which would fail deep in the first
    step on every rank."""
    model.eval()
    device = next(model.parameters()).device  # (a tensor-parallel model is on the mesh's)
    try:
        with torch.no_grad():
            model(input_ids=torch.zeros(1, 2, dtype=torch.long, device=device))
    except (RuntimeError, ValueError, IndexError, TypeError) as err:
        error = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise Stop(
            f"the model built with --config_overrides {overrides!r} does not run: {error}"
        ) from None
    finally:
        model.train()


def save_logits_probe(accelerator, model, eval_set, output_dir: str) -> None:
    """final_logits.safetensors: the live model's fp32 logits on the first 2 validation blocks, for
    tests of the export (2.1 GB at 2048 tokens, 128k vocabulary). Every rank; rank 0 writes."""
    from safetensors.torch import save_file

    with torch.no_grad():
        probe = eval_set[:2]["input_ids"].to(accelerator.device)
        model.eval()
        # evaluate()'s keywords: a compiled model reuses its graph
        logits = model(input_ids=probe, attention_mask=None, position_ids=None).logits.float().cpu()
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        path = os.path.join(output_dir, "final_logits.safetensors")
        save_file({"input_ids": probe.cpu(), "logits": logits}, path)
        workarounds.safetensors_mode_from_umask(path)
