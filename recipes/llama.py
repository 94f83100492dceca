"""Train a Llama (or any Hugging Face causal LM) with DDP, FSDP2, FSDP1 or DeepSpeed ZeRO.

    accelerate launch --config_file accelerate_configs/fsdp.yaml recipes/llama.py
    accelerate launch --config_file accelerate_configs/deepspeed_zero3.yaml recipes/llama.py
    accelerate launch --config_file accelerate_configs/single.yaml --mixed_precision no \
        recipes/llama.py --max_steps 30
    accelerate launch --config_file accelerate_configs/fsdp.yaml recipes/llama.py \
        --config_name my_qwen2/config.json --config_overrides num_hidden_layers=4 \
        --train_file my_text.txt

The config file decides the strategy and the precision (bf16 where the device computes it,
else fp32, said in one line). Any causal LM that transformers builds from a config trains with
no code edits: --config_name (from scratch) or --model_name_or_path (fine-tuning). To adapt
the code, find the `# ADAPT:` markers: data, model, loss, export.

Defaults: the bundled Shakespeare corpus, a 4,096-token BPE trained on it, the ~4.2M-parameter
`debug` Llama, 300 optimizer steps of a 16-sequence global batch, where
    global batch = per_device_train_batch_size x gradient_accumulation_steps x world size.
Optimizer step k sees global-batch samples k*G .. (k+1)*G-1 of the epoch's permutation, whatever
the split. Outputs in --output_dir: metrics.jsonl, run_info.json, checkpoint-N/ (--save_steps),
final/ (HF format, safetensors), with --record_sample_ids sample_ids/rank{r}.json.
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
from accelerate.utils import DataLoaderConfiguration, DistributedType, GradientAccumulationPlugin
from accelerate.utils import set_seed
from tqdm.auto import tqdm
from transformers import AutoConfig, AutoModelForCausalLM, get_cosine_schedule_with_warmup

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere, no install
from common import checkpoint, checks, data, errors, grad_norm, launch  # noqa: E402
from common import metrics, models, precision, schedule, workarounds  # noqa: E402
from common.args import flag, make_output_dir, parse_args  # noqa: E402
from common.errors import Stop  # noqa: E402


@dataclass
class Args:
    """This recipe's own flags; the core TrainingArguments ones (--output_dir, --max_steps, ...)
    are common/args.py's, with the defaults set in main()."""
    # model and tokenizer
    model_config: str = field(default="debug", metadata={
        "help": f"Llama preset: {', '.join(models.PRESETS)}"})
    model_name_or_path: str = field(default=None, metadata=dict(help=
        "pretrained weights (fine-tuning) instead of a preset"))
    allow_new_weights: bool = field(default=False, metadata=dict(help=
        "let weights that --model_name_or_path lacks (e.g. layers added by --config_name) start "
        "from their init; without it a checkpoint that does not fit the model stops the run"))
    config_name: str = field(default=None, metadata=dict(help=
        "a model config (directory or config.json) to train from scratch, any causal-LM type"))
    config_overrides: str = field(default=None, metadata=dict(help=
        "on top of --config_name or the preset, e.g. 'n_embd=64,n_layer=2' "
        "(config.update_from_string)"))
    tokenizer_name_or_path: str = field(default=None, metadata=dict(help=
        "default: --model_name_or_path's, or without one a byte-level BPE trained on the text"))
    vocab_size: int = flag(4096, "size of the BPE trained when no tokenizer is given", low=256)
    # data (transformers run_clm conventions)
    dataset_name: str = None
    dataset_config_name: str = None
    train_file: str = field(default=None, metadata=dict(help=
        ".txt (one document, newlines kept), or .json/.jsonl/.parquet with a 'text' column (a "
        "row per document). A .txt without --validation_file holds out its start, about "
        "--validation_split_percentage % of its characters, cut at a blank line (or a line "
        "end), for validation"))
    validation_file: str = None
    validation_split_percentage: int = flag(
        5, "without a validation file or split: the % held out", low=1, high=99)
    block_size: int = flag(256, "tokens per sequence", low=2)
    packing: bool = field(default=True, metadata=dict(help=
        "concatenate rows into blocks; false: one padded row each"))
    max_eval_samples: int = flag(None, "cap on validation blocks per evaluation; default: all",
                                 low=1)
    cache_dir: str = data.DEFAULT_CACHE_DIR
    # optimisation, beyond the core flags
    per_device_eval_batch_size: int = flag(None, "default: --per_device_train_batch_size", low=1)
    scale_lr: bool = field(default=False, metadata=dict(help=
        "linear scaling rule vs --reference_global_batch"))
    reference_global_batch: int = flag(16, "global batch --learning_rate was tuned at", low=1)
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_epsilon: float = 1e-8
    gradient_checkpointing: bool = False
    # evaluation, checkpoints, hardware
    eval_steps: int = flag(100, "evaluate every N optimizer steps, and at the end", low=1)
    save_total_limit: int = flag(None, "keep only the newest N complete checkpoints (older ones "
                                 "are deleted after each save); default: keep all", low=1)
    peak_tflops: float = field(default=None, metadata=dict(help=
        "device peak for MFU; default from a GPU table"))
    ddp_timeout: int = flag(1800, "collective timeout in seconds", low=1)
    save_logits_probe: bool = field(default=False, metadata=dict(help=
        "write final_logits.safetensors (the live model's logits on 2 validation blocks; tests "
        "compare the export)"))
    sample_tokens: int = flag(None, "tokens sampled from the reloaded export at the end; default "
                              "40 below 1B parameters, else 0 (off)", low=0)
    record_sample_ids: bool = field(default=False, metadata=dict(help=
        "each rank writes the block ids it trained on"))


# >>> shared: evaluate (tests/test_skeleton.py keeps the shared blocks identical across recipes)
@torch.no_grad()
def evaluate(model, eval_loader, accelerator) -> float:
    """Token-weighted mean eval loss in nats/token; each eval block counted exactly once."""
    model.eval()
    nats = torch.zeros((), device=accelerator.device)
    tokens = torch.zeros((), device=accelerator.device)
    for batch in eval_loader:
        logits = model(input_ids=batch["input_ids"],
                       attention_mask=batch.get("attention_mask")).logits
        # nats and target tokens per block, in fp32 slices: no fp32 copy of the whole logits
        per_block, targets = metrics.token_nll(logits, batch["labels"])
        del logits
        # gather_for_metrics drops the blocks Accelerate duplicated to even out the last batch
        per_block, targets = accelerator.gather_for_metrics((per_block, targets))
        nats += per_block.sum()
        tokens += targets.sum()
    model.train()
    return (nats / tokens).item()
# <<< shared


def main() -> int:
    args = parse_args(Args, description=__doc__, output_dir="runs/llama",
                      per_device_train_batch_size=8, learning_rate=3e-3, weight_decay=0.1,
                      warmup_steps=30, max_steps=300, logging_steps=10, report_to="tensorboard")
    make_output_dir(args.output_dir)  # a file in the way or an impossible path: one line, now
    args.per_device_eval_batch_size = args.per_device_eval_batch_size or \
        args.per_device_train_batch_size
    from_scratch = args.model_name_or_path is None  # else fine-tuning pretrained weights
    checks.llama_flags(args, from_scratch)
    startup = {"compiles": True}  # torch.compile: eager key names in checkpoints and the export

    # -----------------------------------------------------------------------------------------
    # Accelerator. The accelerate config decides the strategy; the recipe says how to accumulate
    # and keeps the data order seeded and identical on every rank.
    # -----------------------------------------------------------------------------------------
    # >>> shared: accelerator
    # Library workarounds (common/workarounds.py) return the names of those applied
    applied = workarounds.die_with_launcher()  # a SIGKILLed launcher takes its workers with it
    # The launch against the flags and the hardware, before any work (common/checks.py lists
    # the checks): a DeepSpeed JSON's batch, clipping or precision would win over the flags, ...
    guard = checks.Startup(args, **startup)
    accelerator = Accelerator(
        mixed_precision=guard.precision["used"],
        # we fetch whole accumulation windows: sync on the step count, not the loader's end
        gradient_accumulation_plugin=GradientAccumulationPlugin(
            num_steps=args.gradient_accumulation_steps, sync_with_dataloader=False),
        # non_blocking: batches go to the GPU from pinned memory without waiting for the last step
        dataloader_config=DataLoaderConfiguration(
            use_seedable_sampler=True, data_seed=args.seed, non_blocking=True),
        step_scheduler_with_optimizer=False,  # one LR step per optimizer step, on any world size
        log_with=None if args.report_to == "none" else args.report_to,
        project_dir=args.output_dir,
        kwargs_handlers=guard.handlers,
    )
    guard.accelerator_built(accelerator, args)  # really distributed; this job's output dir
    # Startup's (real gloo ranks on a CPU-only host), then a GradScaler for fp16 on CPU ranks
    # and FSDP's gradient reduction in fp32
    applied += guard.workarounds + workarounds.accelerator_built(accelerator)
    set_seed(args.seed)  # the same seed on every rank: identical initial weights, no broadcast
    world_size = accelerator.num_processes
    global_batch = args.per_device_train_batch_size * args.gradient_accumulation_steps * world_size
    # <<< shared

    # -----------------------------------------------------------------------------------------
    # Model config and data: tokenized and packed once per node (its first rank, then the others
    # read the cache: home directories are often node-local; common/data.py renames atomically).
    # -----------------------------------------------------------------------------------------
    # ADAPT: data. Bad input (a missing file, a broken tokenizer, a tiny corpus): one error line
    # on every rank, the first rank's after it released the others (launch.node_first).
    with launch.node_first(accelerator):
        if args.config_name or args.model_name_or_path:  # any causal-LM type: Qwen2, GPT-2, ...
            config = AutoConfig.from_pretrained(args.config_name or args.model_name_or_path)
        else:  # a preset; its vocabulary becomes the tokenizer's (set_token_ids)
            config = models.llama_config(args.model_config, vocab_size=args.vocab_size)
        if args.config_overrides:  # "key=value,key=value", as run_clm
            config = models.apply_overrides(config, args.config_overrides)
        model_cls = models.causal_lm_class(config)
        raw = data.load_text_dataset(args.dataset_name, args.dataset_config_name, args.train_file,
                                     args.validation_file, args.validation_split_percentage)
        tokenizer_source = args.tokenizer_name_or_path or args.model_name_or_path
        tokenizer = data.get_tokenizer(tokenizer_source, raw, args.vocab_size, args.cache_dir)
        if not (args.config_name or args.model_name_or_path):
            config.vocab_size = len(tokenizer)  # a preset's vocabulary is the tokenizer's
        checks.tokenizer_fits(tokenizer, tokenizer_source, raw, config, args.block_size)
        token_id_changes = models.set_token_ids(config, tokenizer, from_scratch)
        lm_data = data.pack_dataset(raw, tokenizer, args.block_size, args.cache_dir,
                                    args.packing).with_format("torch")
    # Each node reads --train_file from its own path: another copy there trains on other samples.
    data_digest = data.packing_digest(raw, tokenizer, args.block_size, args.packing)
    checks.same_on_every_rank(accelerator, "data (train and validation text, tokenizer, block "
                              "size)", data_digest)
    if token_id_changes and (args.config_name or args.model_name_or_path):  # (presets have none)
        accelerator.print("token ids from the tokenizer into the model config: "
                          + ", ".join(token_id_changes))
    train_set, eval_set = lm_data["train"], lm_data["validation"]
    if args.record_sample_ids:  # each block's index in the training set, to check the data order
        train_set = train_set.add_column("sample_id", list(range(len(train_set))))
    if args.max_eval_samples:
        eval_set = eval_set.select(range(min(args.max_eval_samples, len(eval_set))))
    updates_per_epoch = len(train_set) // global_batch
    max_steps = args.max_steps if args.max_steps > 0 else \
        math.ceil(args.num_train_epochs * updates_per_epoch)
    # the training set against the global batch, warmup against the run, the FSDP wrap class
    # and a ZeRO-3 config against the model (common/plan.py)
    guard.data_ready(train_size=len(train_set), train_unit=f"blocks of {args.block_size} tokens",
                     steps=max_steps, model_cls=model_cls, model_config=config)
    # >>> shared: loaders
    # shuffle=True + the seedable sampler: one permutation per epoch (set_epoch), the same on all
    # ranks; rank r gets every world_size-th micro batch of it. drop_last: full global batches.
    # Private generators: each iter() of a loader draws a seed from its generator, else from the
    # global RNG that dropout uses, and a resume opens an extra iterator mid-epoch.
    pin = accelerator.device.type == "cuda"  # page-locked host memory, for non-blocking copies
    train_loader = torch.utils.data.DataLoader(
        train_set, batch_size=args.per_device_train_batch_size, shuffle=True, drop_last=True,
        generator=torch.Generator(), pin_memory=pin)
    eval_loader = torch.utils.data.DataLoader(
        eval_set, batch_size=args.per_device_eval_batch_size, generator=torch.Generator(),
        pin_memory=pin)
    # <<< shared

    # -----------------------------------------------------------------------------------------
    # Model
    # -----------------------------------------------------------------------------------------
    # ADAPT: model. fp32 master weights; the launch config picks the compute precision.
    zero3_init = accelerator.distributed_type == DistributedType.DEEPSPEED and \
        accelerator.state.deepspeed_plugin.zero3_init_flag
    if args.model_name_or_path:  # missing or unexpected weights stop the run
        model = models.load_pretrained_on_ranks(accelerator, args.model_name_or_path, config,
                                                args.allow_new_weights)
    elif zero3_init:  # built sharded (deepspeed.zero.Init): another random init than below
        model = AutoModelForCausalLM.from_config(config)
    else:
        model = model_cls(config)  # e.g. LlamaForCausalLM
    if args.gradient_checkpointing:
        model.activation_checkpointing_enable(
            activation_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    if args.config_overrides and not zero3_init:
        checks.model_runs(model, args.config_overrides)  # overrides can leave shapes inconsistent
    n_params = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())  # ZeRO-3 too
    # From here on each rank draws its own random numbers (dropout, if the model has any).
    set_seed(args.seed, device_specific=True)
    flops_per_token, flops_method = metrics.model_flops_per_token(model, args.block_size)

    # A bigger global batch averages away gradient noise, so it tolerates a bigger LR (linear
    # scaling rule), but only after a warmup. Without either, a large batch just trains slower.
    peak_lr = schedule.scaled_learning_rate(args.learning_rate, global_batch,
                                            args.reference_global_batch) \
        if args.scale_lr else args.learning_rate
    accelerator.print(f"LR: base {args.learning_rate:g} (tuned at global batch "
                      f"{args.reference_global_batch}), effective {peak_lr:g} at global batch "
                      f"{global_batch}, {args.warmup_steps} warmup steps")
    # AdamW without weight decay on norm weights and biases (1-D tensors), as most LLM recipes.
    optimizer = torch.optim.AdamW(models.param_groups(model, args.weight_decay), lr=peak_lr,
                                  betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon)
    lr_scheduler = get_cosine_schedule_with_warmup(optimizer, args.warmup_steps, max_steps)

    # Resume: the data position follows from the step count, so the global batch must be the
    # same (its split may change); sharded states (FSDP, ZeRO) need the same world size.
    # What fixes the data order besides the global batch: the seed, the blocks and their number.
    data_state = {"seed": args.seed, "block_size": args.block_size, "packing": args.packing,
                  "train_blocks": len(train_set), "data_digest": data_digest}
    # What a resume restores whatever the flags say: the optimizer's LR, decay and betas; with
    # dropout, masks that depend on how each step's samples are split over ranks.
    same_run = {"learning_rate": peak_lr, "max_grad_norm": args.max_grad_norm,
                **{k: getattr(args, k) for k in ("weight_decay", "adam_beta1", "adam_beta2",
                                                 "adam_epsilon", "warmup_steps")},
                **checkpoint.precision_state(accelerator),  # another precision is another run
                "model_config": models.config_state(model.config),
                **({"per_device_train_batch_size": args.per_device_train_batch_size,
                    "gradient_accumulation_steps": args.gradient_accumulation_steps,
                    "world_size": world_size} if models.uses_dropout(model) else {})}
    run_state = {"world_size": world_size, "global_batch": global_batch, "max_steps": max_steps,
                 "distributed_type": checkpoint.strategy_name(accelerator),  # e.g. "FSDP2"
                 **data_state, **same_run}
    resume_path, saved = checkpoint.resume_or_start(accelerator, args, run_state,
                                                    ["global_batch", *data_state, *same_run])
    step = saved["step"]

    # -----------------------------------------------------------------------------------------
    # accelerator.prepare: wraps/shards the model (DDP, FSDP, ZeRO), the optimizer, the loaders.
    # -----------------------------------------------------------------------------------------
    model, optimizer, train_loader, eval_loader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_loader, eval_loader, lr_scheduler)
    # no unread fp32 copy of the logits; under torch.compile, eager state-dict key names
    applied += workarounds.prepared(accelerator, model)
    compiled = metrics.compile_settings(accelerator)  # torch.compile's backend, or None
    device = accelerator.device
    run_info = {
        "distributed_type": accelerator.distributed_type.value, "world_size": world_size,
        "mixed_precision": accelerator.mixed_precision, "precision": guard.precision,
        "global_batch": global_batch, "n_params": n_params,
        "local_param_elements": metrics.gathered_parameter_elements(accelerator, model),
        "updates_per_epoch": updates_per_epoch, "max_steps": max_steps,
        "model_type": config.model_type, "model_class": model_cls.__name__,
        "flops_per_token": flops_per_token, "flops_per_token_method": flops_method,
        **guard.prepared(accelerator, model, model_cls, global_batch),  # FSDP units, DeepSpeed
        "data": data.pack_stats(lm_data),  # tokens per split, and what packing dropped
        "torch_compile": compiled, "args": vars(args)}
    accelerator.print(metrics.start_line(run_info))
    if resume_path:  # + scheduler, scaler, per-rank RNG; micro steps follow this accumulation
        applied += checkpoint.load_checkpoint(accelerator, resume_path, model, optimizer,
                                              optimizer_steps=step)
        accelerator.print(f"resumed from {resume_path} at step {step}"
                          + (f" ({note})" if (note := checkpoint.restart_note()) else ""))
    run_info["workarounds"] = applied  # the library workarounds that ran, in order
    log = metrics.RunLog(accelerator, args, "llama", step if resume_path else None, run_info)

    # -----------------------------------------------------------------------------------------
    # Training loop. One iteration = one optimizer step = one accumulation window.
    # -----------------------------------------------------------------------------------------
    model.train()
    progress = tqdm(total=max_steps, initial=step, desc="train",
                    disable=not accelerator.is_local_main_process)
    log.start_clock(device, flops_per_token, args.peak_tflops)
    t_start = time.perf_counter()
    epoch = step // updates_per_epoch
    # Windows that changed nothing, counted across resumes: fp16 steps skipped for inf/NaN
    # gradients, and windows without one target token (--packing false and empty rows).
    skipped_steps, empty_windows = saved.get("skipped_steps", 0), saved.get("empty_windows", 0)
    skipped_in_a_row = 0
    seen = [[] for _ in range(epoch)]  # --record_sample_ids: epochs before a resume stay empty
    nonfinite = precision.NonFiniteGuard(accelerator, model)  # inf/NaN loss or norm: stop
    tokens_seen = (step - empty_windows) * global_batch * args.block_size
    # SIGTERM (preemption, a time limit), Ctrl-C or SIGHUP: checkpoint at the next step boundary.
    preempted = checkpoint.stop_on_signal(accelerator, args.ddp_timeout)
    problem = preempt = None  # why the loop ends early: one error line, or a signal's name
    while step < max_steps and not (problem or preempt):
        train_loader.set_epoch(epoch)  # a new permutation each epoch, the same on every rank
        done_in_epoch = step % updates_per_epoch  # > 0 only right after a mid-epoch resume
        batches = iter(accelerator.skip_first_batches(
            train_loader, done_in_epoch * args.gradient_accumulation_steps))
        seen.append([])
        for _ in range(done_in_epoch, updates_per_epoch):
            lr = lr_scheduler.get_last_lr()[0]  # the LR this optimizer step applies
            t0 = time.perf_counter()
            window = [next(batches) for _ in range(args.gradient_accumulation_steps)]
            log.count(data_wait=time.perf_counter() - t0)
            if args.record_sample_ids:  # kept on the device: a host copy would wait for the GPU
                seen[-1] += [b.pop("sample_id") for b in window]
            # ADAPT: loss. Token-weighted accumulation: normalise by the target tokens of the
            # whole window on all ranks, so the gradient is the full global batch's even with
            # padding. Scaling by (accumulation x world size) undoes backward's and the
            # all-reduce's means.
            if args.packing:  # every block has block_size - 1 targets: no collective, no sync
                num_items, has_targets = global_batch * (args.block_size - 1), True
            else:  # padded rows: count on every rank (one sync per step, to see empty windows)
                local_items = sum((b["labels"][:, 1:] != -100).sum() for b in window)
                # a tensor: a changing int would recompile a compiled model each step
                num_items = accelerator.reduce(local_items.clone(), reduction="sum")
                has_targets = num_items.item() > 0
            loss_total = torch.zeros((), device=device)
            norm_before_clip = float("nan")
            if not has_targets:
                # Nothing to learn from: a loss of 0/0 would step AdamW on zero gradients (its
                # moments and weight decay still move the weights). Skip the window whole.
                empty_windows += 1
                loss_total.fill_(float("nan"))
                if empty_windows == 1:
                    accelerator.print(f"warning: step {step + 1}: no target tokens in the whole "
                                      "window; skipped (no optimizer, scheduler or weight-decay "
                                      "update)")
            for batch in window if has_targets else []:
                with accelerator.accumulate(model):
                    loss = model(**batch, num_items_in_batch=num_items).loss  # sum / num_items
                    loss_total += loss.detach()
                    accelerator.backward(loss * args.gradient_accumulation_steps * world_size)
                    # >>> shared: step
                    if accelerator.sync_gradients:  # the window's last micro batch
                        # the global norm in fp64: every strategy clips with the same number
                        norm_before_clip = grad_norm.clip_grad_norm_(accelerator, model,
                                                                     args.max_grad_norm)
                    optimizer.step()  # no-op until the window's last micro batch; fp16 may skip
                    if accelerator.sync_gradients and not accelerator.optimizer_step_was_skipped:
                        lr_scheduler.step()  # a skipped step did not happen: the LR holds
                    optimizer.zero_grad()
                    # <<< shared
            scale_error = None
            if has_targets:  # fp16: a skipped step changes nothing; a long run of them is fatal
                skipped = accelerator.optimizer_step_was_skipped
                skipped_steps += skipped
                skipped_in_a_row = skipped_in_a_row + 1 if skipped else 0
                warning, scale_error = precision.loss_scale_verdict(
                    precision.loss_scale(accelerator, model), skipped_in_a_row)
                if warning:
                    accelerator.print(warning)
            step += 1
            progress.update(1)
            if has_targets:  # an empty window trained on nothing
                nonfinite.record(step, loss_total, norm_before_clip)  # on the device
                log.count(tokens=sum(b["input_ids"].numel() for b in window))  # this rank's
                tokens_seen += global_batch * args.block_size

            do_eval = step % args.eval_steps == 0 or step == max_steps
            if step % args.logging_steps == 0 or do_eval:
                scale = precision.loss_scale(accelerator, model)  # fp16 only, else None
                record = log.record(  # + tokens/s, data wait, memory, MFU of the window
                    step=step, epoch=epoch, lr=lr, empty_windows=empty_windows,
                    loss=accelerator.reduce(loss_total, reduction="sum").item(),  # nats/token
                    grad_norm=float(norm_before_clip),  # a device tensor until now
                    **({} if scale is None else {"loss_scale": scale,
                                                 "skipped_steps": skipped_steps}))
                if do_eval:
                    record["eval_loss"] = evaluate(model, eval_loader, accelerator)
                log.log(record)  # NaN (an empty window) is written as null
                progress.set_postfix(loss=f"{record['loss']:.3f}",
                                     tok_s=f"{record['tokens_per_second']:.0f}")
            preempt = preempted()  # a collective: every rank stops at the same step, or none
            save = preempt or (args.save_steps and step % args.save_steps == 0)
            # a non-finite loss or norm stops before any checkpoint or export of its weights
            problem = f"step {step}: {scale_error}" if scale_error else (
                (save or step >= max_steps or step % args.logging_steps == 0)
                and nonfinite.problem())
            if save and not problem:
                saved_to = checkpoint.save_checkpoint(
                    accelerator, args.output_dir, step, args.save_total_limit,
                    {**run_state, "skipped_steps": skipped_steps, "empty_windows": empty_windows},
                    hf_files=(accelerator.unwrap_model(model, keep_torch_compile=False).config,
                              tokenizer))
            if preempt and not problem:
                accelerator.print(f"preempted ({preempt}) at step {step}: saved {saved_to}; "
                                  "relaunch with --resume_from_checkpoint auto to continue")
            if problem or preempt or step >= max_steps:
                break
        if args.record_sample_ids:  # one host copy per epoch
            seen[-1] = torch.cat(seen[-1]).tolist() if seen[-1] else []
        epoch += 1
    progress.close()
    if problem or preempt:  # in order: the model before the process group, then the exit
        del model, optimizer
        launch.teardown(accelerator)
        if problem:
            raise Stop(problem)
        return checkpoint.PREEMPTED_EXIT_CODE
    if args.record_sample_ids:  # one file per rank, each written by its own rank only
        os.makedirs(os.path.join(args.output_dir, "sample_ids"), exist_ok=True)
        rank = accelerator.process_index
        with open(os.path.join(args.output_dir, "sample_ids", f"rank{rank}.json"), "w") as f:
            json.dump({"rank": rank, "world_size": world_size, "epochs": seen}, f)
    if empty_windows:
        accelerator.print(f"warning: {empty_windows} of {step} windows had no target tokens and "
                          "were skipped")
    if skipped_steps:
        accelerator.print(f"warning: {skipped_steps} of {step} "
                          f"{precision.precision_name(accelerator.mixed_precision)} steps were "
                          "skipped for inf/NaN gradients")

    # -----------------------------------------------------------------------------------------
    # ADAPT: export. Gather the full state dict on every rank (a collective); rank 0 writes.
    # -----------------------------------------------------------------------------------------
    final_dir = checkpoint.export_model(accelerator, model, tokenizer, args.output_dir)
    if args.save_logits_probe:  # the live (still sharded) model's logits, for tests of the export
        metrics.save_logits_probe(accelerator, model, eval_set, args.output_dir)
    accelerator.wait_for_everyone()
    log.summary({"step": step, "total_tokens": tokens_seen,
                 "wall_seconds": time.perf_counter() - t_start,
                 **metrics.memory_summary(device), "empty_windows": empty_windows,
                 # rotary inv_freq: fp32 under every strategy
                 "buffer_dtypes": metrics.buffer_dtypes(
                     accelerator.unwrap_model(model, keep_torch_compile=False)),
                 **({"skipped_steps": skipped_steps}
                    if precision.loss_scale(accelerator, model) is not None else {})})
    # Reload with plain transformers (no project code) and sample: proof that the export works.
    # Rank 0 alone, while the others wait at the final barrier; off by default above 1B.
    sample_tokens = args.sample_tokens if args.sample_tokens is not None else \
        40 if n_params < 1e9 else 0
    if accelerator.is_main_process and sample_tokens > 0:
        print(models.sample_from_export(final_dir, eval_set[0], tokenizer, sample_tokens, device))
    del model, optimizer
    launch.teardown(accelerator)  # in order: the model before the process group
    accelerator.print(log.final_line(f"model in {final_dir}, metrics in {log.path}"))
    return 0


if __name__ == "__main__":
    errors.run(main)
