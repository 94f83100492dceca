"""Train a Llama (or any Hugging Face causal LM) with DDP, FSDP2, FSDP1 or DeepSpeed ZeRO: the config file decides.

    accelerate launch --config_file accelerate_configs/fsdp.yaml recipes/llama.py
    accelerate launch --config_file accelerate_configs/ddp.yaml recipes/llama.py --max_steps 30
    accelerate launch --config_file accelerate_configs/deepspeed_zero3.yaml recipes/llama.py
    accelerate launch --config_file accelerate_configs/single.yaml --mixed_precision no recipes/llama.py
    accelerate launch --config_file accelerate_configs/fsdp.yaml recipes/llama.py --config_name my_qwen2/config.json \\
        --config_overrides num_hidden_layers=4 --train_file my_text.txt

Any causal LM that transformers builds from a config (Llama, Qwen2, Mistral, GPT-2, ...) trains
with no code edits: --config_name (from scratch) or --model_name_or_path (fine-tuning).

Defaults: the bundled Shakespeare corpus, a 4,096-token byte-level BPE trained on it, and the
~4.2M-parameter `debug` Llama; 300 optimizer steps of a 16-sequence global batch. On a CPU-only
host the same commands run 2 real ranks over gloo (see common/launch.py).

Precision: the config's mixed_precision (bf16 in every YAML) where the device computes it natively,
else fp32, said in one line and in run_info.json (common/precision.py); `accelerate launch
--mixed_precision bf16` on the launch line forces it, emulated if need be.

Batch arithmetic (the names used throughout):
    global batch = per_device_train_batch_size x gradient_accumulation_steps x world size
Optimizer step k always sees global-batch samples k*G .. (k+1)*G-1 of the epoch's permutation,
whatever the split between micro batch, accumulation and world size (see README).

Outputs in --output_dir: metrics.jsonl (one line per logging step, then a summary), run_info.json
(what the run really was), checkpoint-N/ (--save_steps), final/ (HF format, safetensors), and with
--record_sample_ids, sample_ids/rank{r}.json (written by rank r alone: per epoch, the training
block ids it consumed, in order).
"""

import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, DistributedType, GradientAccumulationPlugin, gather_object, set_seed
from tqdm.auto import tqdm
from transformers import AutoConfig, AutoModelForCausalLM, get_cosine_schedule_with_warmup
from transformers.initialization import no_init_weights

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere, no install step
from common import checkpoint, checks, data, errors, grad_norm, launch, metrics, models, precision, schedule  # noqa: E402
from common.errors import Stop  # noqa: E402
from common import run_dir  # noqa: E402
from common.args import flag, make_output_dir, parse_args  # noqa: E402


@dataclass
class Args:
    """This recipe's own flags; the core TrainingArguments ones (--output_dir, --max_steps, ...) are
    common/args.py's, with the defaults set below."""
    # model and tokenizer
    model_config: str = field(default="debug", metadata={"help": f"Llama preset: {', '.join(models.PRESETS)}"})
    model_name_or_path: str = field(default=None, metadata={"help": "pretrained weights (fine-tuning) instead of a preset"})
    allow_new_weights: bool = field(default=False, metadata={
        "help": "let weights that --model_name_or_path lacks (e.g. layers added by --config_name) start from their "
                "init; without it a checkpoint that does not fit the model stops the run"})
    config_name: str = field(default=None, metadata={
        "help": "a model config (directory or config.json) to train from scratch, any causal-LM type"})
    config_overrides: str = field(default=None, metadata={
        "help": "on top of --config_name or the preset, e.g. 'n_embd=64,n_layer=2' (config.update_from_string)"})
    tokenizer_name_or_path: str = field(default=None, metadata={
        "help": "default: --model_name_or_path's, or without one a byte-level BPE trained on the training text"})
    vocab_size: int = flag(4096, "size of the BPE trained when no tokenizer is given", low=256)
    # data (transformers run_clm conventions)
    dataset_name: str = None
    dataset_config_name: str = None
    train_file: str = field(default=None, metadata={
        "help": ".txt (one document, newlines kept), or .json/.jsonl/.parquet with a 'text' column (a row per "
                "document). A .txt without --validation_file holds out its start, about --validation_split_percentage "
                "% of its characters, cut at a blank line (or a line end), for validation"})
    validation_file: str = None
    validation_split_percentage: int = flag(5, "without a validation file or split: the % held out", low=1, high=99)
    block_size: int = flag(256, "tokens per sequence", low=2)
    packing: bool = field(default=True, metadata={"help": "concatenate rows into blocks; false: one padded row each"})
    max_eval_samples: int = flag(None, "cap on validation blocks per evaluation; default: all", low=1)
    cache_dir: str = data.DEFAULT_CACHE_DIR
    # optimisation, beyond the core flags
    per_device_eval_batch_size: int = flag(None, "default: --per_device_train_batch_size", low=1)
    scale_lr: bool = field(default=False, metadata={"help": "linear scaling rule vs --reference_global_batch"})
    reference_global_batch: int = flag(16, "global batch --learning_rate was tuned at", low=1)
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_epsilon: float = 1e-8
    gradient_checkpointing: bool = False
    # evaluation, checkpoints, hardware
    eval_steps: int = flag(100, "evaluate every N optimizer steps, and at the end", low=1)
    save_total_limit: int = flag(None, "keep only the newest N complete checkpoints (older ones are deleted after "
                                 "each save); default: keep all", low=1)
    peak_tflops: float = field(default=None, metadata={"help": "device peak for MFU; default from a GPU table"})
    ddp_timeout: int = flag(1800, "collective timeout in seconds", low=1)
    save_logits_probe: bool = field(default=False, metadata={
        "help": "write final_logits.safetensors (the live model's logits on 2 validation blocks; tests compare the export)"})
    sample_tokens: int = flag(None, "tokens sampled from the reloaded export at the end; default 40 below 1B "
                              "parameters, else 0 (off)", low=0)
    record_sample_ids: bool = field(default=False, metadata={"help": "each rank writes the block ids it trained on"})


@torch.no_grad()
def evaluate(model, eval_loader, accelerator) -> float:
    """Token-weighted mean eval loss in nats/token; each eval block counted exactly once."""
    model.eval()
    loss_sum, n_tokens = torch.zeros((), device=accelerator.device), torch.zeros((), device=accelerator.device)
    for batch in eval_loader:
        logits = model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask")).logits
        # nats and target tokens per block, in fp32 slices: no fp32 copy of the whole logits
        per_sample, targets = metrics.token_nll(logits, batch["labels"])
        del logits
        # gather_for_metrics drops the samples Accelerate duplicated to even out the last batch
        sums, counts = accelerator.gather_for_metrics((per_sample, targets))
        loss_sum += sums.sum()
        n_tokens += counts.sum()
    model.train()
    return (loss_sum / n_tokens).item()


def main() -> int:
    args = parse_args(Args, description=__doc__, output_dir="runs/llama", per_device_train_batch_size=8,
                      learning_rate=3e-3, weight_decay=0.1, warmup_steps=30, max_steps=300, logging_steps=10,
                      report_to="tensorboard")
    make_output_dir(args.output_dir)  # a file in the way or an impossible path: one error line, now
    if args.per_device_eval_batch_size is None:
        args.per_device_eval_batch_size = args.per_device_train_batch_size
    from_scratch = args.model_name_or_path is None  # else fine-tuning pretrained weights
    if from_scratch and args.config_name is None and args.model_config not in models.PRESETS:
        raise Stop(f"unknown --model_config {args.model_config!r}; choose one of {sorted(models.PRESETS)}")
    if args.config_overrides and not from_scratch:
        raise Stop("--config_overrides changes a model trained from scratch (--config_name or the preset); "
                   "pretrained weights (--model_name_or_path) keep their shapes")
    if args.allow_new_weights and from_scratch:
        raise Stop("--allow_new_weights concerns the weights loaded by --model_name_or_path, and there is none")

    # ---------------------------------------------------------------------------------------------
    # Accelerator. Everything about the strategy comes from the accelerate config; the recipe only
    # says how to accumulate and keeps the data order seeded and identical on every rank.
    # ---------------------------------------------------------------------------------------------
    launch.die_with_launcher()  # a SIGKILLed launcher takes its workers with it
    # The launch against the flags and the hardware, before any work (common/checks.py lists the checks):
    # a DeepSpeed JSON's explicit batch sizes, clipping or precision would silently win over the flags,
    # bf16 on a GPU without it (V100, T4) is emulated, FSDP settings these recipes cannot use, ...
    launch_config = checks.launch_config_from_env()
    check_flags = {k: getattr(args, k) for k in ("per_device_train_batch_size", "gradient_accumulation_steps",
                                                 "max_grad_norm", "warmup_steps", "reference_global_batch", "scale_lr",
                                                 "block_size", "gradient_checkpointing")}
    hardware = checks.detect_hardware()
    # the config's bf16 where the hardware computes it, else fp32 with one line; --mixed_precision forces it
    run_precision = precision.for_launch(launch_config, hardware)
    check_flags["mixed_precision"] = run_precision["used"]
    ds_config, ds_where = checks.deepspeed_settings(launch_config)
    facts = dict(ds=ds_config, ds_where=ds_where, flags=check_flags, hardware=hardware,
                 compiles=True)  # torch.compile: eager key names in checkpoints and the export (below)
    checks.stop_on(checks.config_problems(launch_config, **facts))
    pg_kwargs = launch.cpu_process_group_kwargs(args.ddp_timeout)  # the collective timeout; gloo ranks on CPU
    accelerator = Accelerator(
        mixed_precision=run_precision["used"],
        # we prefetch whole accumulation windows, so sync on the step count, not the dataloader end
        gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=args.gradient_accumulation_steps,
                                                                sync_with_dataloader=False),
        # non_blocking: batches go to the GPU from pinned memory without waiting for the previous step
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=args.seed, non_blocking=True),
        step_scheduler_with_optimizer=False,  # we step the LR once per optimizer update, on every world size
        log_with=None if args.report_to == "none" else args.report_to,
        project_dir=args.output_dir,
        kwargs_handlers=[pg_kwargs],
    )
    is_fsdp = accelerator.distributed_type == DistributedType.FSDP
    is_deepspeed = accelerator.distributed_type == DistributedType.DEEPSPEED
    launch.check_distributed(accelerator)  # refuse to "train distributed" as independent processes
    launch.install_cpu_grad_scaler(accelerator)  # fp16 on CPU ranks: Accelerate builds no GradScaler there
    # FSDP: compute in bf16/fp16 but reduce gradients (and return the loss) in fp32; summing
    # low-precision gradients across ranks is where most of the precision is lost.
    precision.keep_fp32_reduction(accelerator)
    set_seed(args.seed)  # same seed on every rank: identical initial weights, so no broadcast needed
    # this job's alone (locked), emptied by --overwrite_output_dir, one folder shared by every node
    run_dir.claim(accelerator, args)

    # ---------------------------------------------------------------------------------------------
    # Model config, then data: tokenize and pack once per node (each node's first rank, then the
    # others read its cache): home directories are often node-local. On a shared filesystem the nodes
    # build at the same time, and the first complete cache wins (common/data.py renames atomically).
    # ---------------------------------------------------------------------------------------------
    # Bad input (missing file, broken tokenizer, tiny corpus, oversized block): one error line on every
    # rank, the first rank's after it released the others (common/launch.py node_first).
    with launch.node_first(accelerator):
        if args.config_name or args.model_name_or_path:  # any causal-LM type: Qwen2, GPT-2, Mistral, ...
            config = AutoConfig.from_pretrained(args.config_name or args.model_name_or_path)
        else:
            config = models.llama_config(args.model_config, vocab_size=args.vocab_size)  # vocab: the tokenizer's, below
        if args.config_overrides:
            config = models.apply_overrides(config, args.config_overrides)  # "key=value,key=value", as run_clm
        model_cls = models.causal_lm_class(config)
        raw = data.load_text_dataset(args.dataset_name, args.dataset_config_name, args.train_file,
                                     args.validation_file, args.validation_split_percentage)
        tokenizer_source = args.tokenizer_name_or_path or args.model_name_or_path
        tokenizer = data.get_tokenizer(tokenizer_source, raw, args.vocab_size, args.cache_dir)
        # A tokenizer that loads but cannot encode (a model directory without tokenizer files)
        # would train on nothing but end-of-text tokens, and look like fast learning.
        if tokenizer_source and (problem := data.tokenizer_error(tokenizer, tokenizer_source, raw["train"][:100]["text"])):
            raise Stop(problem)
        if not (args.config_name or args.model_name_or_path):
            config.vocab_size = len(tokenizer)  # a preset's vocabulary is the tokenizer's
        if len(tokenizer) > config.vocab_size:  # token ids past the embedding: IndexError at the first forward
            raise Stop(f"the tokenizer has {len(tokenizer)} entries but the model's vocab_size is "
                       f"{config.vocab_size}: pass a matching --tokenizer_name_or_path, or raise vocab_size "
                       "(--config_overrides vocab_size=N, from scratch) or lower --vocab_size (trained BPE)")
        token_id_changes = models.set_token_ids(config, tokenizer, from_scratch)
        model_max = models.max_positions(config)
        if model_max is not None and args.block_size > model_max:
            raise Stop(f"--block_size {args.block_size} exceeds the model's max_position_embeddings {model_max}")
        lm_data = data.pack_dataset(raw, tokenizer, args.block_size, args.cache_dir, args.packing).with_format("torch")
    # Each node reads --train_file from its own path: another copy there would train on other samples.
    data_digest = data.packing_digest(raw, tokenizer, args.block_size, args.packing)
    if mismatch := checks.rank_mismatch(accelerator, "data (train and validation text, tokenizer, block size)", data_digest):
        raise Stop(mismatch)
    if token_id_changes and (args.config_name or args.model_name_or_path):  # (a preset has none of its own)
        accelerator.print(f"token ids from the tokenizer into the model config: {', '.join(token_id_changes)}")
    train_set, eval_set = lm_data["train"], lm_data["validation"]
    if args.record_sample_ids:  # each block's index in the training set, to check the data order
        train_set = train_set.add_column("sample_id", list(range(len(train_set))))
    if args.max_eval_samples:
        eval_set = eval_set.select(range(min(args.max_eval_samples, len(eval_set))))

    world_size = accelerator.num_processes
    global_batch = args.per_device_train_batch_size * args.gradient_accumulation_steps * world_size
    updates_per_epoch = len(train_set) // global_batch
    max_steps = args.max_steps if args.max_steps > 0 else math.ceil(args.num_train_epochs * updates_per_epoch)
    # Now that the data and the model config exist: the training set against the global batch, warmup
    # against the run, the batch against --reference_global_batch, the FSDP wrap class against the model,
    # and a ZeRO-3 config against the plan (common/plan.py). Warnings already printed are not repeated.
    facts.update(train_size=len(train_set), train_unit=f"blocks of {args.block_size} tokens", steps=max_steps,
                 **checks.model_facts(launch_config, ds_config, model_cls, config))
    checks.stop_on(checks.config_problems(launch_config, **facts), accelerator.is_main_process)
    # shuffle=True + the seedable sampler: one permutation per epoch (set_epoch), the same on all
    # ranks; Accelerate gives rank r every world_size-th micro batch of it. drop_last keeps every
    # optimizer step a full global batch.
    # Private generators: each iter() of a loader draws a seed from its generator, else from the global
    # RNG that dropout uses, and a resume opens an extra iterator mid-epoch (every later mask would shift).
    pin = accelerator.device.type == "cuda"  # page-locked host memory, for the non-blocking copies
    train_loader = torch.utils.data.DataLoader(train_set, batch_size=args.per_device_train_batch_size,
                                               shuffle=True, drop_last=True, generator=torch.Generator(), pin_memory=pin)
    eval_loader = torch.utils.data.DataLoader(eval_set, batch_size=args.per_device_eval_batch_size,
                                              generator=torch.Generator(), pin_memory=pin)

    # ---------------------------------------------------------------------------------------------
    # Model
    # ---------------------------------------------------------------------------------------------
    if args.model_name_or_path:
        # fsdp_cpu_ram_efficient_loading (accelerate_configs/fsdp.yaml): prepare broadcasts rank 0's weights,
        # so the other ranks only build the shapes, in storage nothing writes (no host RAM until sharded).
        # transformers 5 would read the checkpoint on every rank: a bf16 one in fp32 is a full copy each.
        # Non-persistent buffers (rotary inv_freq) are computed by __init__, not loaded.
        rank0_loads = is_fsdp and accelerator.state.fsdp_plugin.cpu_ram_efficient_loading
        error = None
        try:
            if rank0_loads and not accelerator.is_main_process:
                with no_init_weights():
                    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
                model.tie_weights()
            else:  # missing or unexpected weights (another depth, untied embeddings) stop the run
                model, error = models.load_pretrained(args.model_name_or_path, config, args.allow_new_weights)
        except Exception as err:  # noqa: BLE001  (a damaged file, mismatched shapes: one line, on every rank)
            error = f"{type(err).__name__}: {err}".splitlines()[0]
        if failures := [e for e in gather_object([error]) if e]:  # else the others would wait for rank 0's broadcast
            raise Stop(f"cannot load --model_name_or_path {args.model_name_or_path}: {failures[0]}")
    elif is_deepspeed and accelerator.state.deepspeed_plugin.zero3_init_flag:
        # built already sharded (deepspeed.zero.Init), for models too big for one device; its
        # random init differs from the plain one, so the strategies no longer start identical
        model = AutoModelForCausalLM.from_config(config)
    else:
        model = model_cls(config)  # e.g. LlamaForCausalLM; fp32 master weights, the launch config picks compute precision
    if args.gradient_checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    if args.config_overrides and not (is_deepspeed and accelerator.state.deepspeed_plugin.zero3_init_flag):
        if error := models.forward_error(model):  # overrides can leave the shapes inconsistent
            raise Stop(f"the model built with --config_overrides {args.config_overrides!r} does not run: {error}")
    n_params = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())  # ds_numel: ZeRO-3 pre-sharded
    # From here on each rank draws its own random numbers (dropout, if the model has any): the
    # weights are already identical, and the data order has its own seeded generator.
    set_seed(args.seed, device_specific=True)
    flops_per_token, flops_method = metrics.model_flops_per_token(model, args.block_size)

    # A bigger global batch averages away gradient noise, so it tolerates a bigger LR (linear
    # scaling rule), but only after a warmup. Without either, a large batch just trains slower.
    peak_lr = schedule.scaled_learning_rate(args.learning_rate, global_batch, args.reference_global_batch) \
        if args.scale_lr else args.learning_rate
    accelerator.print(f"LR: base {args.learning_rate:g} (tuned at global batch {args.reference_global_batch}), "
                      f"effective {peak_lr:g} at global batch {global_batch}, {args.warmup_steps} warmup steps")

    # AdamW without weight decay on norm weights and biases (1-D tensors), as in most LLM recipes.
    optimizer = torch.optim.AdamW(models.param_groups(model, args.weight_decay), lr=peak_lr,
                                  betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon)
    lr_scheduler = get_cosine_schedule_with_warmup(optimizer, args.warmup_steps, max_steps)

    # Resume: a verified, complete checkpoint; the data position follows from the step count, so the
    # global batch must be unchanged (its split may change), and sharded states (FSDP, ZeRO) need the
    # same world size. Checked before prepare, so a refused resume leaves before any wrapped model exists.
    try:
        resume_path, saved = checkpoint.resolve_checkpoint(args.output_dir, args.resume_from_checkpoint, accelerator)
    except Stop as err:
        raise Stop(f"cannot resume: {err}") from None
    step = saved["step"]
    strategy = checkpoint.strategy_name(accelerator)  # "FSDP2", "DEEPSPEED_ZERO3": the sharded layout
    # What fixes the data order besides the global batch: the seed, the blocks and their number.
    data_state = {"seed": args.seed, "block_size": args.block_size, "packing": args.packing, "train_blocks": len(train_set),
                  "data_digest": data_digest}
    # What a resume restores whatever the flags say: the optimizer's own LR, decay and betas; and with
    # dropout, masks that depend on how each step's samples are split over ranks and micro batches.
    same_run = {"learning_rate": peak_lr, "weight_decay": args.weight_decay, "adam_beta1": args.adam_beta1,
                "adam_beta2": args.adam_beta2, "adam_epsilon": args.adam_epsilon, "warmup_steps": args.warmup_steps,
                **checkpoint.precision_state(accelerator),  # another precision (or ZeRO reduction dtype) is another run
                "max_grad_norm": args.max_grad_norm, "model_config": models.config_state(model.config),
                **({"per_device_train_batch_size": args.per_device_train_batch_size, "world_size": world_size,
                    "gradient_accumulation_steps": args.gradient_accumulation_steps} if models.uses_dropout(model) else {})}
    run_state = {"world_size": world_size, "global_batch": global_batch, "distributed_type": strategy,
                 "max_steps": max_steps, **data_state, **same_run}
    if resume_path:
        # the data position, and what the optimizer state restores whatever the flags say, must match
        if error := checkpoint.resume_error(resume_path, saved, run_state, ["global_batch", *data_state, *same_run]):
            raise Stop(error)
        if saved.get("max_steps", max_steps) != max_steps:  # allowed (training longer), but not exact
            accelerator.print(f"warning: {resume_path} was saved by a {saved['max_steps']}-step run, this one has "
                              f"{max_steps}: the LR schedule follows the new length from here, which matches the old "
                              "run only while both are still in warmup")
    else:
        checkpoint.start_fresh(accelerator, args.output_dir)  # an overwritten run's checkpoints must not be resumed

    # ---------------------------------------------------------------------------------------------
    # accelerator.prepare: wraps/shards the model (DDP, FSDP, ZeRO), the optimizer and the loaders.
    # ---------------------------------------------------------------------------------------------
    model, optimizer, train_loader, eval_loader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_loader, eval_loader, lr_scheduler)
    precision.drop_fp32_output_copy(accelerator, model)  # autocast stays; no unread fp32 copy of the logits
    device = accelerator.device
    # torch.compile (`accelerate launch --dynamo_backend inductor`, or dynamo_config in the accelerate
    # config): prepare compiled the model, whole or block by block (--dynamo_use_regional_compilation).
    # The compile wrapper prefixes every state-dict key with "_orig_mod.": keep the eager names, so the
    # export reloads and checkpoints move between compiled and eager runs (FSDP2's state dicts do it).
    dynamo = accelerator.state.dynamo_plugin
    compiled = dynamo.backend.value.lower() if dynamo.backend.value != "NO" else None
    if compiled and not accelerator.is_fsdp2:
        checkpoint.eager_state_dict_keys(model)
    # FSDP: the configs name no block class, so Accelerate wraps the model's _no_split_modules
    # (LlamaDecoderLayer, Qwen2DecoderLayer, GPT2Block, ...). Each decoder block must be one unit.
    fsdp_units = models.fsdp_block_units(model) if is_fsdp else None
    if fsdp_units and fsdp_units["units"] != fsdp_units["blocks"]:
        raise Stop(f"FSDP made {fsdp_units['units']} of the {fsdp_units['blocks']} {fsdp_units['block_class']} "
                   f"blocks their own unit (the model's _no_split_modules is {model_cls._no_split_modules}); set "
                   f"fsdp_transformer_layer_cls_to_wrap: {fsdp_units['block_class']} in the accelerate config")
    run_info = {
        "distributed_type": accelerator.distributed_type.value, "world_size": world_size,
        "mixed_precision": accelerator.mixed_precision, "precision": run_precision,
        "global_batch": global_batch, "n_params": n_params,
        "local_param_elements": accelerator.gather(
            torch.tensor([metrics.local_parameter_elements(model)], device=device)).tolist(),
        "updates_per_epoch": updates_per_epoch, "max_steps": max_steps, "model_type": config.model_type,
        "model_class": model_cls.__name__, "flops_per_token": flops_per_token, "flops_per_token_method": flops_method,
        "fsdp_units": fsdp_units, "data": data.pack_stats(lm_data),  # tokens per split, and what packing dropped
        "deepspeed": launch.deepspeed_in_use(accelerator), "torch_compile": compiled and {
            "backend": compiled, "mode": dynamo.mode, "regional": bool(dynamo.use_regional_compilation)},
        "args": vars(args),
    }
    if (ds_used := run_info["deepspeed"]) and ds_used["train_batch_size"] != global_batch:  # (checks.py refuses the causes)
        raise Stop(f"DeepSpeed runs a batch of {ds_used['train_batch_size']} samples per step, the recipe counts "
                   f"{global_batch}: {ds_used}")
    offload = ds_used and ", ".join(f"{part} to {ds_used[f'offload_{part}_device']}" for part in ("optimizer", "param")
                                    if ds_used[f"offload_{part}_device"] != "none")
    zero = ds_used and f" | ZeRO-{ds_used['zero_stage']}" + (f" (offload: {offload})" if offload else "")
    accelerator.print(f"{run_info['distributed_type']} x{world_size}{zero or ''} | {accelerator.mixed_precision} | "
                      f"{n_params / 1e6:.2f}M params | global batch {global_batch} | {max_steps} steps"
                      + (f" | torch.compile {compiled}" if compiled else ""))

    if resume_path:
        # + scheduler, scaler, per-rank RNG; the micro-step count follows this run's accumulation
        checkpoint.load_checkpoint(accelerator, resume_path, model, optimizer, optimizer_steps=step)
        accelerator.print(f"resumed from {resume_path} at step {step}"
                          + (f" ({note})" if (note := checkpoint.restart_note()) else ""))
    metrics_path = os.path.join(args.output_dir, "metrics.jsonl")
    if accelerator.is_main_process:
        with open(os.path.join(args.output_dir, "run_info.json"), "w") as f:
            json.dump(run_info, f, indent=1)
        # tracker continuity: keep the step lines up to the resumed step, drop later ones and summaries
        kept = [] if not (resume_path and os.path.exists(metrics_path)) else [
            line for line in open(metrics_path) if not json.loads(line).get("summary") and json.loads(line)["step"] <= step]
        with open(metrics_path, "w") as f:
            f.writelines(kept)
    accelerator.init_trackers("llama", config={k: v for k, v in vars(args).items() if v is not None})


    # ---------------------------------------------------------------------------------------------
    # Training loop. One iteration = one optimizer step = one accumulation window of micro batches.
    # ---------------------------------------------------------------------------------------------
    model.train()
    progress = tqdm(total=max_steps, initial=step, disable=not accelerator.is_local_main_process, desc="train")
    window_tokens, data_wait, t_window, t_start = 0, 0.0, time.perf_counter(), time.perf_counter()
    epoch = step // updates_per_epoch
    # Windows that changed nothing, counted across resumes: fp16 steps skipped for inf/NaN gradients,
    # and windows without a single target token (possible with --packing false and empty rows).
    skipped_steps, empty_windows = saved.get("skipped_steps", 0), saved.get("empty_windows", 0)
    skipped_in_a_row = 0
    seen = [[] for _ in range(epoch)]  # --record_sample_ids: epochs before a resume stay empty
    guard = precision.NonFiniteGuard(accelerator, model)  # an inf/NaN loss or norm outside fp16 loss scaling stops the run
    tokens_seen = (step - empty_windows) * global_batch * args.block_size
    # SIGTERM (preemption, a time limit), Ctrl-C or SIGHUP: save a checkpoint at the next step boundary.
    preempted = checkpoint.stop_on_signal(accelerator, args.ddp_timeout)
    while step < max_steps:
        train_loader.set_epoch(epoch)  # new permutation each epoch, the same on every rank
        done_in_epoch = step % updates_per_epoch  # > 0 only right after a mid-epoch resume
        loader = accelerator.skip_first_batches(train_loader, done_in_epoch * args.gradient_accumulation_steps)
        batches = iter(loader)
        seen.append([])
        for _ in range(done_in_epoch, updates_per_epoch):
            lr = lr_scheduler.get_last_lr()[0]  # the LR this optimizer step applies
            t0 = time.perf_counter()
            window = [next(batches) for _ in range(args.gradient_accumulation_steps)]
            data_wait += time.perf_counter() - t0
            if args.record_sample_ids:  # kept on the device: a host copy here would wait for the GPU every step
                seen[-1] += [b.pop("sample_id") for b in window]
            # Token-weighted accumulation: normalise by the target tokens of the whole window on all
            # ranks, so the gradient equals the one of the full global batch even with padding.
            # Scaling by (accumulation x world size) undoes the mean that backward/all-reduce apply.
            if args.packing:  # every packed block has block_size - 1 targets: no collective, no GPU sync
                num_items, has_targets = global_batch * (args.block_size - 1), True
            else:  # padded rows: count on every rank; seeing an empty window costs one sync per step
                local_items = sum((b["labels"][:, 1:] != -100).sum() for b in window)
                # the model gets the count as a tensor: a changing int would recompile a compiled model each step
                num_items = accelerator.reduce(local_items.clone(), reduction="sum")
                has_targets = num_items.item() > 0
            loss_total = torch.zeros((), device=device)
            norm_before_clip = float("nan")
            if not has_targets:
                # Nothing to learn from: a loss of 0/0 would step AdamW on zero gradients (its moments
                # and weight decay still move the weights) and advance the schedule. Skip it whole.
                empty_windows += 1
                loss_total.fill_(float("nan"))
                if empty_windows == 1:
                    accelerator.print(f"warning: step {step + 1}: no target tokens in the whole window; skipped "
                                      "(no optimizer, scheduler or weight-decay update)")
            for batch in window if has_targets else []:
                with accelerator.accumulate(model):
                    loss = model(**batch, num_items_in_batch=num_items).loss  # sum of token losses / num_items
                    loss_total += loss.detach()
                    accelerator.backward(loss * args.gradient_accumulation_steps * world_size)
                    if accelerator.sync_gradients:  # the last micro batch of the window
                        # The global norm in fp64, so every strategy reports and clips with the same number
                        norm_before_clip = grad_norm.clip_grad_norm_(accelerator, model, args.max_grad_norm)
                    optimizer.step()  # no-op until the window's last micro batch; skipped on fp16 overflow
                    if accelerator.sync_gradients and not accelerator.optimizer_step_was_skipped:
                        lr_scheduler.step()  # a skipped step did not happen: the schedule holds, as Accelerate's does
                    optimizer.zero_grad()
            scale_error = None
            if has_targets:  # fp16: a skipped step leaves weights and LR as they were; a long run of them is fatal
                skipped = accelerator.optimizer_step_was_skipped
                skipped_steps, skipped_in_a_row = skipped_steps + skipped, skipped_in_a_row + 1 if skipped else 0
                warning, scale_error = precision.loss_scale_verdict(precision.loss_scale(accelerator, model),
                                                                    skipped_in_a_row)
                if warning:
                    accelerator.print(warning)
            step += 1
            progress.update(1)
            if has_targets:  # an empty window trained on nothing
                guard.record(step, loss_total, norm_before_clip)  # on the device: read at logging and saving steps
                window_tokens += sum(b["input_ids"].numel() for b in window)  # tokens this rank trained on
                tokens_seen += global_batch * args.block_size

            do_eval = step % args.eval_steps == 0 or step == max_steps
            if step % args.logging_steps == 0 or do_eval:
                # read the loss first: on a GPU it waits for the window's last kernels, so the clock covers them
                window_loss = accelerator.reduce(loss_total, reduction="sum").item()  # mean nats/token of the window
                elapsed = time.perf_counter() - t_window
                record = {
                    "step": step, "epoch": epoch,
                    "loss": window_loss,
                    "lr": lr,
                    "grad_norm": float(norm_before_clip),  # a device tensor until now: no sync on other steps
                    "tokens_per_second": window_tokens / elapsed,  # per device
                    "data_wait_share": data_wait / elapsed,
                    "peak_memory_bytes": metrics.peak_memory_bytes(device),
                    "empty_windows": empty_windows,
                }
                if (scale := precision.loss_scale(accelerator, model)) is not None:  # fp16 only
                    record.update(loss_scale=scale, skipped_steps=skipped_steps)
                peak = metrics.peak_flops(device, args.peak_tflops)
                if peak:
                    record["mfu"] = flops_per_token * record["tokens_per_second"] / peak
                if do_eval:
                    record["eval_loss"] = evaluate(model, eval_loader, accelerator)
                accelerator.log({k: v for k, v in record.items() if math.isfinite(v)}, step=step)
                if accelerator.is_main_process:
                    metrics.append_jsonl(metrics_path, record)  # NaN (an empty window) is written as null
                progress.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_second']:.0f}")
                window_tokens, data_wait, t_window = 0, 0.0, time.perf_counter()
            preempt = preempted()  # a collective: every rank stops at the same step (a signal name, or None)
            save = preempt or (args.save_steps and step % args.save_steps == 0)
            # a non-finite loss or norm stops before any checkpoint or export of its weights
            problem = f"step {step}: {scale_error}" if scale_error else (
                (save or step >= max_steps or step % args.logging_steps == 0) and guard.problem())
            if save and not problem:
                saved_to = checkpoint.save_checkpoint(
                    accelerator, args.output_dir, step, args.save_total_limit,
                    {**run_state, "skipped_steps": skipped_steps, "empty_windows": empty_windows},
                    hf_files=(accelerator.unwrap_model(model, keep_torch_compile=False).config, tokenizer))
            if problem or preempt:
                progress.close()
                if not problem:
                    accelerator.print(f"preempted ({preempt}) at step {step}: saved {saved_to}; "
                                      "relaunch with --resume_from_checkpoint auto to continue")
                del model, optimizer
                launch.teardown(accelerator)
                if problem:
                    raise Stop(problem)
                return checkpoint.PREEMPTED_EXIT_CODE
            if step >= max_steps:
                break
        if args.record_sample_ids:  # one host copy per epoch
            seen[-1] = torch.cat(seen[-1]).tolist() if seen[-1] else []
        epoch += 1
    progress.close()
    if args.record_sample_ids:  # one file per rank, each written by its own rank only
        os.makedirs(os.path.join(args.output_dir, "sample_ids"), exist_ok=True)
        with open(os.path.join(args.output_dir, "sample_ids", f"rank{accelerator.process_index}.json"), "w") as f:
            json.dump({"rank": accelerator.process_index, "world_size": world_size, "epochs": seen}, f)
    if empty_windows:
        accelerator.print(f"warning: {empty_windows} of {step} windows had no target tokens and were skipped")
    if skipped_steps:
        accelerator.print(f"warning: {skipped_steps} of {step} {precision.precision_name(accelerator.mixed_precision)} "
                          "steps were skipped for inf/NaN gradients")

    # ---------------------------------------------------------------------------------------------
    # Export: gather the full state dict on every rank (a collective), write from rank 0 only.
    # ---------------------------------------------------------------------------------------------
    final_dir = os.path.join(args.output_dir, "final")
    unwrapped = accelerator.unwrap_model(model, keep_torch_compile=False)  # (True re-points a compiled DDP model)
    # Replicated (single, DDP): the bare model's own state dict. Accelerate's get_state_dict returned the
    # DDP wrapper's ("module." keys) under regional compilation, and the export reloaded untrained.
    state_dict = launch.full_state_dict(accelerator, model) if is_fsdp or is_deepspeed else unwrapped.state_dict()
    if state_dict and unwrapped.config.tie_word_embeddings:  # (non-zero ranks may hold none)
        state_dict.pop("lm_head.weight", None)  # gathered copies no longer share storage: store the tie once, as HF does
    with checkpoint.atomic_export(accelerator, args.output_dir) as export_dir:  # final/ is never half written
        unwrapped.save_pretrained(export_dir, is_main_process=accelerator.is_main_process,
                                  save_function=accelerator.save, state_dict=state_dict)
        if accelerator.is_main_process:
            tokenizer.save_pretrained(export_dir)
    # --save_logits_probe: a fixed batch's logits from the live (still sharded) model, for tests that
    # compare the export to them (2 x block x vocab fp32: 2.1 GB at 2048 tokens and a 128k vocabulary).
    if args.save_logits_probe:
        with torch.no_grad():
            probe = eval_set[:2]["input_ids"].to(device)
            model.eval()
            live_logits = model(input_ids=probe).logits.float().cpu()
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        if args.save_logits_probe:
            from safetensors.torch import save_file
            save_file({"input_ids": probe.cpu(), "logits": live_logits},
                      os.path.join(args.output_dir, "final_logits.safetensors"))
        summary = {"summary": True, "step": step, "total_tokens": tokens_seen, "wall_seconds": time.perf_counter() - t_start,
                   "peak_memory_bytes": metrics.peak_memory_bytes(device), "empty_windows": empty_windows,
                   "buffer_dtypes": metrics.buffer_dtypes(unwrapped),  # rotary inv_freq: fp32 under every strategy
                   # CUDA: the most the caching allocator held (allocated + cached blocks), beside the allocated peak
                   **({"peak_memory_reserved_bytes": torch.cuda.max_memory_reserved(device)}
                      if device.type == "cuda" else {}),
                   **({"skipped_steps": skipped_steps} if precision.loss_scale(accelerator, model) is not None else {})}
        metrics.append_jsonl(metrics_path, summary)
    # Reload with plain transformers (no project code) and sample, proving the export works. Rank 0
    # alone, on its device, while the others wait at the final barrier: off by default above 1B.
    sample_tokens = args.sample_tokens if args.sample_tokens is not None else 40 if n_params < 1e9 else 0
    if accelerator.is_main_process and sample_tokens > 0:
        if is_deepspeed:
            from transformers.integrations import unset_hf_deepspeed_config
            unset_hf_deepspeed_config()  # else from_pretrained would build a ZeRO-3-partitioned model
        reloaded = AutoModelForCausalLM.from_pretrained(final_dir, device_map=device)
        first = eval_set[0]  # prompt: the first 16 tokens of the validation data, whatever the corpus
        prompt = first["input_ids"][first["attention_mask"].bool()][:16] if "attention_mask" in first else first["input_ids"][:16]
        prompt = prompt.to(device)
        sample = reloaded.generate(prompt[None], attention_mask=torch.ones_like(prompt[None]), max_new_tokens=sample_tokens,
                                   do_sample=True, top_k=50, pad_token_id=config.pad_token_id)
        print(f"--- sample from {final_dir}, prompt from the validation data ---\n"
              f"{tokenizer.decode(prompt)}|{tokenizer.decode(sample[0, len(prompt):])}\n---")
    del model, optimizer
    launch.teardown(accelerator)  # in order: the model before the process group
    accelerator.print(metrics.final_line(metrics_path, f"model in {final_dir}, metrics in {metrics_path}"))
    return 0


if __name__ == "__main__":
    errors.run(main)
