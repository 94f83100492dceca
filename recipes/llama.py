r"""Train a Llama (or any Hugging Face causal LM) with DDP, FSDP2, FSDP1 or DeepSpeed ZeRO.

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
`debug` Llama, 150 optimizer steps of a 16-sequence global batch, where
    global batch = per_device_train_batch_size x gradient_accumulation_steps x world size.
Optimizer step k sees global-batch samples k*G .. (k+1)*G-1 of the epoch's permutation, whatever
the split. Outputs in --output_dir: metrics.jsonl, run_info.json, checkpoint-N/ (--save_steps),
final/ (HF format, safetensors), with --record_sample_ids sample_ids/rank{r}.json.
"""

import gc
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

gc.collect()  # the process's earlier garbage (a notebook's), before imports_done freezes
gc.disable()  # the imports below run without it: launch.imports_done()
import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, GradientAccumulationPlugin, set_seed
from tqdm.auto import tqdm
from transformers import AutoConfig, AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere, no install
from common import causal_lm, checkpoint, checks, data, errors, grad_norm, launch, run_dir
from common import metrics, models, precision, schedule, workarounds
from common.args import choice, flag, make_output_dir, parse_args

launch.imports_done()  # garbage collection back on, the imports' objects frozen


@dataclass
class Args:
    """Flags of this recipe (the data ones as in run_clm); common/args.py has the core ones."""

    model_config: str = flag("debug", f"Llama preset: {', '.join(models.PRESETS)}")
    model_name_or_path: str = flag(None, "pretrained weights (fine-tuning) instead of a preset")
    allow_new_weights: bool = flag(False, "init weights the checkpoint lacks, instead of stopping")
    config_name: str = flag(None, "a model config (directory or config.json) to train from scratch")
    config_overrides: str = flag(None, "e.g. 'n_embd=64,n_layer=2' (config.update_from_string)")
    tokenizer_name_or_path: str = flag(None, "default: the model's, else a BPE trained on the text")
    vocab_size: int = flag(4096, "size of the BPE trained when no tokenizer is given", low=256)
    dataset_name: str = None
    dataset_config_name: str = None
    train_file: str = flag(
        None,
        ".txt (one document; without --validation_file its start is held "
        "out), or .json/.jsonl/.parquet, a row each",
    )
    validation_file: str = None
    dataset_text_field: str = flag("text", "the column of the rows that holds the text")
    validation_split_percentage: int = flag(5, "% held out if no validation set", low=1, high=99)
    block_size: int = flag(256, "tokens per sequence", low=2)
    packing: str = choice(data.PACKING, data.PACKING_ALIASES, "see docs/llama.md#packing")
    preprocessing_num_workers: int = flag(None, "processes that tokenize; the same blocks", low=1)
    max_eval_samples: int = flag(None, "cap on validation blocks per eval; default: all", low=1)
    cache_dir: str = data.DEFAULT_CACHE_DIR
    per_device_eval_batch_size: int = flag(None, "default: --per_device_train_batch_size", low=1)
    scale_lr: bool = flag(False, "linear scaling rule vs --reference_global_batch")
    reference_global_batch: int = flag(16, "global batch --learning_rate was tuned at", low=1)
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_epsilon: float = 1e-8
    gradient_checkpointing: bool = False
    eval_steps: int = flag(100, "evaluate every N optimizer steps, and at the end", low=1)
    save_total_limit: int = flag(None, "keep only the newest N complete checkpoints", low=1)
    peak_tflops: float = flag(None, "device peak for MFU; default from a GPU table")
    ddp_timeout: int = flag(1800, "collective timeout in seconds", low=1)
    save_logits_probe: bool = flag(False, "write final_logits.safetensors (tests of the export)")
    sample_tokens: int = flag(None, "tokens sampled from the export (default 40; 0 from 1B)", low=0)
    record_sample_ids: bool = flag(False, "each rank writes the block ids it trained on")


# >>> shared: evaluate (tests/test_skeleton.py keeps the shared blocks identical across recipes)
@torch.no_grad()
def evaluate(model, eval_loader, accelerator) -> float:
    """Token-weighted mean eval loss in nats/token; each eval block counted exactly once."""
    model.eval()
    nats, tokens = torch.zeros(2, device=accelerator.device)  # (one buffer, two views)
    for batch in eval_loader:
        logits = model(
            input_ids=batch["input_ids"],
            attention_mask=batch.get("attention_mask"),
            position_ids=batch.get("position_ids"),
        ).logits  # --packing documents
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
    args = parse_args(
        Args,
        description=__doc__,
        output_dir="runs/llama",
        per_device_train_batch_size=8,
        learning_rate=3e-3,
        weight_decay=0.1,
        warmup_steps=15,
        lr_scheduler_type="cosine",
        max_steps=150,
        logging_steps=10,
        report_to="tensorboard",
    )
    make_output_dir(args.output_dir)  # a file in the way or an impossible path: one line, now
    from_scratch = args.model_name_or_path is None  # else fine-tuning pretrained weights
    causal_lm.llama_flags(args, from_scratch)
    startup = {"compiles": True, "tensor_parallel": True}  # compile: eager keys; tp.yaml: TP
    handlers = []  # the Accelerator's kwargs_handlers besides the process group's

    # >>> shared: accelerator
    applied = workarounds.die_with_launcher()  # a SIGKILLed launcher takes its workers with it
    guard = checks.Startup(args, **startup)  # the flags and the hardware, before any work
    group, patched = launch.process_group(args.ddp_timeout)  # timeout; gloo ranks on CPU
    accelerator = Accelerator(
        mixed_precision=guard.precision["used"],
        # we fetch whole accumulation windows: sync on the step count, not the loader's end
        gradient_accumulation_plugin=GradientAccumulationPlugin(
            num_steps=args.gradient_accumulation_steps, sync_with_dataloader=False
        ),
        # non_blocking: batches go to the GPU from pinned memory without waiting for the last step
        dataloader_config=DataLoaderConfiguration(
            use_seedable_sampler=True, data_seed=args.seed, non_blocking=True
        ),
        step_scheduler_with_optimizer=False,  # one LR step per optimizer step, on any world size
        log_with=None if args.report_to == "none" else args.report_to.split(","),
        project_dir=args.output_dir,
        kwargs_handlers=[group, *handlers],
    )
    launch.check_distributed(accelerator)  # distributed for real, as the launcher asked
    run_dir.claim(accelerator, args)  # this job's output dir: locked, one for every node
    # a GradScaler for fp16 on CPU ranks, FSDP's gradient reduction in fp32
    applied += patched + workarounds.patch_accelerator(accelerator)
    set_seed(args.seed)  # the same seed on every rank: identical initial weights, no broadcast
    world_size = launch.data_parallel_size(accelerator)  # tensor parallel: ranks / tp size
    global_batch = args.per_device_train_batch_size * args.gradient_accumulation_steps * world_size
    # <<< shared
    applied += causal_lm.patch_tensor_parallel(accelerator)  # tp.yaml: prepare, eval gather

    # ADAPT: data. Tokenized and packed by each node's first rank; the others read its cache.
    with launch.node_first(accelerator):
        if args.config_name or args.model_name_or_path:  # any causal-LM type: Qwen2, GPT-2, ...
            config = AutoConfig.from_pretrained(args.config_name or args.model_name_or_path)
        else:  # a preset; its vocabulary becomes the tokenizer's (set_token_ids)
            config = models.llama_config(args.model_config, vocab_size=args.vocab_size)
        if args.config_overrides:  # "key=value,key=value", as run_clm
            config = causal_lm.apply_overrides(config, args.config_overrides)
        model_cls = models.causal_lm_class(config)
        raw = data.load_text_dataset(
            args.dataset_name,
            args.dataset_config_name,
            args.train_file,
            args.validation_file,
            args.validation_split_percentage,
            text_field=args.dataset_text_field,
        )
        tokenizer_source = args.tokenizer_name_or_path or args.model_name_or_path
        tokenizer = data.get_tokenizer(tokenizer_source, raw, args.vocab_size, args.cache_dir)
        if not (args.config_name or args.model_name_or_path):
            config.vocab_size = len(tokenizer)  # a preset's vocabulary is the tokenizer's
        causal_lm.tokenizer_fits(
            tokenizer, tokenizer_source, raw, config, args.block_size, pretrained=not from_scratch
        )
        ids = causal_lm.set_token_ids(config, tokenizer, from_scratch)  # ["eos_token_id: 2 -> 0"]
        lm_data = data.pack_dataset(
            raw,
            tokenizer,
            args.block_size,
            args.cache_dir,
            args.packing,
            num_proc=args.preprocessing_num_workers,
        ).with_format("torch")
    full_blocks = args.packing == "stream"  # every position a target: the loss need not count
    data_digest = data.same_data(accelerator, lm_data)  # every node's copy; resume fingerprint
    if ids and (args.config_name or args.model_name_or_path):  # (presets: nothing to report)
        accelerator.print(f"token ids from the tokenizer into the model config: {', '.join(ids)}")
    train_set, eval_set = data.train_and_eval_sets(  # + each block's index: --record_sample_ids
        lm_data, args.max_eval_samples, sample_ids=args.record_sample_ids
    )
    updates_per_epoch = len(train_set) // global_batch
    epoch_steps = math.ceil(args.num_train_epochs * updates_per_epoch)  # --num_train_epochs
    max_steps = args.max_steps if args.max_steps > 0 else epoch_steps  # --max_steps wins
    # the data against the global batch, warmup against the run, FSDP and ZeRO-3 against the model
    guard.data_ready(
        train_size=len(train_set),
        train_unit=f"blocks of {args.block_size} tokens",
        steps=max_steps,
        model_cls=model_cls,
        model_config=config,
    )
    # >>> shared: loaders
    # shuffle=True + the seedable sampler: one permutation per epoch (set_epoch), the same on all
    # ranks; rank r gets every world_size-th micro batch of it. drop_last: full global batches.
    # Private generators: each iter() of a loader draws a seed from its generator, else from the
    # global RNG that dropout uses, and a resume opens an extra iterator mid-epoch.
    pin = accelerator.device.type == "cuda"  # page-locked host memory, for non-blocking copies
    train_loader = torch.utils.data.DataLoader(
        train_set,
        batch_size=args.per_device_train_batch_size,
        shuffle=True,
        drop_last=True,
        generator=torch.Generator(),
        pin_memory=pin,
        num_workers=args.dataloader_num_workers,  # the sampler, in this process, sets the order
        worker_init_fn=checkpoint.leave_signals_to_the_rank,  # a signal: the rank saves first
    )
    eval_loader = torch.utils.data.DataLoader(
        eval_set,
        batch_size=args.per_device_eval_batch_size,
        generator=torch.Generator(),
        pin_memory=pin,
        num_workers=args.dataloader_num_workers,
        worker_init_fn=checkpoint.leave_signals_to_the_rank,
    )
    # <<< shared

    # ADAPT: model. fp32 master weights; the launch config picks the compute precision.
    zero3_init = getattr(accelerator.state.deepspeed_plugin, "zero3_init_flag", False)
    if args.model_name_or_path:  # missing or unexpected weights stop the run
        model = causal_lm.load_pretrained_on_ranks(
            accelerator, args.model_name_or_path, config, args.allow_new_weights, tokenizer
        )
    elif zero3_init:  # built sharded (deepspeed.zero.Init): another random init than below
        model = AutoModelForCausalLM.from_config(config)
    else:
        model = causal_lm.tensor_parallel(accelerator, model_cls(config))  # tp.yaml: sliced
    if args.gradient_checkpointing:
        model.activation_checkpointing_enable(
            activation_checkpointing_kwargs={"use_reentrant": False}
        )
    model.config.use_cache = False
    if args.config_overrides and not zero3_init:
        causal_lm.model_runs(model, args.config_overrides)  # overrides can break the shapes
    n_params = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())  # ZeRO-3 too
    set_seed(args.seed, device_specific=True)  # from here on each rank draws its own (dropout)
    flops_per_token, flops_method = metrics.model_flops_per_token(model, args.block_size)

    peak_lr, lr_line = causal_lm.peak_learning_rate(args, global_batch)  # --scale_lr: linear rule
    accelerator.print(lr_line)
    # AdamW without weight decay on norm weights and biases (1-D tensors), as most LLM recipes.
    optimizer = torch.optim.AdamW(
        models.param_groups(model, args.weight_decay),
        lr=peak_lr,
        betas=(args.adam_beta1, args.adam_beta2),
        eps=args.adam_epsilon,
    )
    lr_scheduler = schedule.lr_scheduler(optimizer, args, max_steps)  # --lr_scheduler_type

    order = {  # what fixes the data order; the step count gives the position in it
        "global_batch": global_batch,
        "seed": args.seed,
        "block_size": args.block_size,
        "packing": args.packing,
        "train_blocks": len(train_set),
        "data_digest": data_digest,
    }
    # >>> shared: run state
    run_state, checked = checkpoint.run_state(accelerator, args, model, peak_lr, max_steps, **order)
    # <<< shared
    resume_path, saved = checkpoint.resume_or_start(accelerator, args, run_state, checked)
    step = saved["step"]

    model, optimizer, train_loader, eval_loader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_loader, eval_loader, lr_scheduler
    )
    applied += workarounds.patch_model(accelerator, model)  # logits copy; torch.compile key names
    device = accelerator.device
    run_info = metrics.run_info(  # + strategy, ranks' parameter elements, torch.compile, flags
        accelerator,
        model,
        args,
        precision=guard.precision,
        global_batch=global_batch,
        n_params=n_params,
        updates_per_epoch=updates_per_epoch,
        max_steps=max_steps,
        model_type=config.model_type,
        model_class=model_cls.__name__,
        data=data.pack_stats(lm_data),
        flops_per_token=flops_per_token,
        flops_per_token_method=flops_method,
        **guard.prepared(accelerator, model, model_cls, global_batch),
    )  # FSDP units, DeepSpeed
    accelerator.print(metrics.start_line(run_info))
    if resume_path:  # + scheduler, scaler, per-rank RNG; micro steps follow this accumulation
        applied += checkpoint.load_checkpoint(accelerator, resume_path, model, optimizer, step)
        accelerator.print(causal_lm.record_resume(run_info, resume_path, step, saved))
    run_info["workarounds"] = applied  # the library workarounds that ran, in order
    log = metrics.RunLog(
        accelerator, args, Path(__file__).stem, step if resume_path else None, run_info, saved
    )

    # ---- Training loop: one iteration = one optimizer step = one accumulation window ---------
    model.train()
    progress = tqdm(
        total=max_steps, initial=step, desc="train", disable=not accelerator.is_local_main_process
    )
    t_start = log.start_clock(device, flops_per_token, args.peak_tflops)  # tokens/s, MFU
    epoch = step // updates_per_epoch
    health = precision.StepHealth(accelerator, model, saved)  # skipped steps, inf/NaN: stop
    seen = metrics.SampleIds(args.record_sample_ids, epoch)  # epochs before a resume stay empty
    preempted = checkpoint.stop_on_signal(accelerator, args.ddp_timeout)  # SIGTERM, Ctrl-C, SIGHUP
    problem = preempt = None  # why the loop ends early: one error line, or a signal's name
    while step < max_steps and not (problem or preempt):
        train_loader.set_epoch(epoch)  # a new permutation each epoch, the same on every rank
        done_in_epoch = step % updates_per_epoch  # > 0 only right after a mid-epoch resume
        batches = iter(
            accelerator.skip_first_batches(
                train_loader, done_in_epoch * args.gradient_accumulation_steps
            )
        )
        for _ in range(done_in_epoch, updates_per_epoch):
            lr = lr_scheduler.get_last_lr()[0]  # the LR this optimizer step applies
            t0 = time.perf_counter()
            window = [next(batches) for _ in range(args.gradient_accumulation_steps)]
            log.count(data_wait=time.perf_counter() - t0)
            seen.take(epoch, window)  # --record_sample_ids: pops the ids, kept on the device
            # >>> shared: loss
            # ADAPT: loss. Token-weighted accumulation: normalise by the target tokens of the whole
            # window on all ranks, so the gradient is the full global batch's even with padding.
            # Scaling by (accumulation x world size) undoes backward's and the all-reduce's means.
            if full_blocks:  # block length - 1 targets a block: no collective, no sync
                num_items, has_targets = global_batch * (window[0]["labels"].shape[1] - 1), True
            else:  # padding, masks, document starts: count on every rank (one sync a step)
                local_items = sum((b["labels"][:, 1:] != -100).sum() for b in window)
                # a tensor: a changing int would recompile a compiled model each step
                num_items = launch.data_parallel_sum(accelerator, local_items)  # (tp: once)
                has_targets = num_items.item() > 0
            # No targets: a loss of 0/0 would step AdamW on zero gradients (its moments and weight
            # decay still move the weights). Skip the window whole; its loss is NaN.
            loss_total = torch.full((), 0.0 if has_targets else float("nan"), device=device)
            norm_before_clip = float("nan")
            # <<< shared
            for batch in window if has_targets else []:
                with accelerator.accumulate(model):
                    loss = model(**batch, num_items_in_batch=num_items).loss  # sum / num_items
                    loss_total += loss.detach()
                    accelerator.backward(loss * args.gradient_accumulation_steps * world_size)
                    # >>> shared: step
                    if accelerator.sync_gradients:  # the window's last micro batch
                        # the global norm in fp64: every strategy clips with the same number
                        norm_before_clip = grad_norm.clip_grad_norm_(
                            accelerator, model, args.max_grad_norm
                        )
                    optimizer.step()  # no-op until the window's last micro batch; fp16 may skip
                    if accelerator.sync_gradients and not accelerator.optimizer_step_was_skipped:
                        lr_scheduler.step()  # a skipped step did not happen: the LR holds
                    optimizer.zero_grad()
                    # <<< shared
            # >>> shared: end of step
            step += 1
            progress.update(1)
            health.after_step(step, has_targets, loss_total, norm_before_clip)  # fp16 skips
            if has_targets:  # this rank's tokens, padding left out; an empty window trained none
                log.count(window)
            do_eval = step % args.eval_steps == 0 or step == max_steps
            if step % args.logging_steps == 0 or do_eval:
                record = log.record(  # + tokens/s, data wait, memory, MFU of the window
                    step=step,
                    epoch=epoch,
                    lr=lr,
                    empty_windows=health.empty_windows,
                    loss=launch.data_parallel_sum(accelerator, loss_total).item(),  # nats/token
                    grad_norm=float(norm_before_clip),
                    **health.scale_fields(),
                )  # fp16 scale
                if do_eval:
                    record["eval_loss"] = evaluate(model, eval_loader, accelerator)
                log.log(record)  # NaN (an empty window) is written as null
                progress.set_postfix(
                    loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_second']:.0f}"
                )
            preempt = preempted()  # a collective: every rank stops at the same step, or none
            save = preempt or (args.save_steps and step % args.save_steps == 0)
            # <<< shared
            # >>> shared: save or stop
            # a non-finite loss or norm stops before any checkpoint or export of its weights
            problem = health.problem(save or step >= max_steps or step % args.logging_steps == 0)
            if save and not problem:
                hf_config = accelerator.unwrap_model(model, keep_torch_compile=False).config
                saved_to = checkpoint.save_checkpoint(
                    accelerator,
                    args.output_dir,
                    step,
                    args.save_total_limit,
                    {**run_state, **health.state(), **log.tokens_seen()},  # (a collective)
                    hf_files=(hf_config, tokenizer),
                )
            if preempt and not problem:
                accelerator.print(
                    f"preempted ({preempt}) at step {step}: saved {saved_to}; "
                    "relaunch with --resume_from_checkpoint auto to continue"
                )
            if problem or preempt or step >= max_steps:
                break
            # <<< shared
        epoch += 1
    # >>> shared: export
    progress.close()
    if problem or preempt:  # in order: the model before the process group, then the exit
        del model, optimizer
        launch.teardown(accelerator)
        if problem:
            raise errors.Stop(problem)
        return checkpoint.PREEMPTED_EXIT_CODE
    skipped = health.end_of_run(step)  # one warning for each kind of skipped step
    # ADAPT: export. Gather the full state dict on every rank (a collective); rank 0 writes.
    final_dir = checkpoint.export_model(accelerator, model, tokenizer, args.output_dir)
    # <<< shared
    seen.write(accelerator, args.output_dir)  # --record_sample_ids: each rank its own file
    if args.save_logits_probe:  # the live (still sharded) model's logits, for tests of the export
        causal_lm.save_logits_probe(accelerator, model, eval_set, args.output_dir)
    accelerator.wait_for_everyone()
    log.summary(
        {
            "step": step,
            "wall_seconds": time.perf_counter() - t_start,
            **skipped,
            **log.tokens_seen(),  # input (padding left out) and target tokens, all ranks
            **metrics.end_figures(accelerator, model),
        }
    )  # peak memory, buffer dtypes
    # Proof that the export works: rank 0 reloads it with plain transformers and samples.
    sample_tokens = 40 if args.sample_tokens is None and n_params < 1e9 else args.sample_tokens or 0
    if accelerator.is_main_process and sample_tokens > 0:
        print(
            causal_lm.sample_from_export(final_dir, eval_set[0], tokenizer, sample_tokens, device)
        )
    del model, optimizer
    launch.teardown(accelerator)  # in order: the model before the process group
    accelerator.print(log.final_line(f"model in {final_dir}, metrics in {log.path}"))
    return 0


if __name__ == "__main__":
    errors.run(main)
