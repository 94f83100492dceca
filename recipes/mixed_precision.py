r"""Mixed precision, measured: fp32 vs bf16 vs fp16 with dynamic loss scaling, on the debug Llama.

    accelerate launch --config_file accelerate_configs/fsdp.yaml recipes/mixed_precision.py \
        --precision fp16
    python recipes/mixed_precision.py --compare --config_file accelerate_configs/ddp.yaml \
        --max_steps 30

recipes/llama.py, adapted: the diff between the two files is the lesson.
`--precision` (auto, no, bf16, fp16) wins over the config's; `auto` picks what the hardware
computes natively, and says why. fp16 trains on `loss x scale` (a GradScaler): a step with
inf/NaN gradients is skipped, the scale halved, the LR held. `--inject_inf_grad_at_step N`
drills it (fp32 and bf16 stop there with an error). `--compare` launches the config once per
precision and prints one table. Outputs: as llama.py's, and summary.json (a row of the table).
More: docs/mixed_precision.md.
To adapt the code, find the `# ADAPT:` markers: data, model, loss, export.
"""

import gc
import json
import math
import os
import subprocess
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

gc.collect()  # the process's earlier garbage (a notebook's), before imports_done freezes
gc.disable()  # the imports below run without it: launch.imports_done()
import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, GradientAccumulationPlugin, GradScalerKwargs
from accelerate.utils import set_seed
from tqdm.auto import tqdm
from transformers import LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere, no install
from common import checkpoint, checks, data, errors, grad_norm, launch, run_dir
from common import metrics, models, precision, schedule, workarounds
from common.args import flag, make_output_dir, parse_args
from common.memory import SavedTensorBytes

launch.imports_done()  # garbage collection back on, the imports' objects frozen


@dataclass
class Args:
    """Flags of this recipe (the data ones as in run_clm); common/args.py has the core ones."""

    precision: str = flag("auto", "auto | no | bf16 | fp16 (overrides the config's)")
    compare: bool = flag(False, "launch no, bf16, fp16 with --config_file; print a table")
    config_file: str = flag("accelerate_configs/ddp.yaml", "--compare: accelerate config")
    model_config: str = flag("debug", f"Llama preset: {', '.join(models.PRESETS)}")
    vocab_size: int = flag(4096, "size of the BPE trained on the corpus", low=256)
    validation_split_percentage: int = flag(5, "% held out if no validation set", low=1, high=99)
    block_size: int = flag(128, "tokens per sequence", low=2)
    max_eval_samples: int = flag(64, "cap on validation blocks per eval", low=1)
    cache_dir: str = data.DEFAULT_CACHE_DIR
    per_device_eval_batch_size: int = flag(None, "default: --per_device_train_batch_size", low=1)
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    eval_steps: int = flag(100, "evaluate every N optimizer steps, and at the end", low=1)
    save_total_limit: int = flag(None, "keep only the newest N complete checkpoints", low=1)
    peak_tflops: float = flag(None, "device peak for MFU; default from a GPU table")
    ddp_timeout: int = flag(1800, "collective timeout in seconds", low=1)
    record_sample_ids: bool = flag(False, "each rank writes the block ids it trained on")
    # fp16 loss scaling (torch.amp.GradScaler arguments)
    init_scale: float = 2.0**16
    growth_interval: int = flag(2000, "clean steps before the scale doubles", low=1)
    min_loss_scale: float = flag(1.0, "stop when the fp16 loss scale falls below this")
    inject_inf_grad_at_step: int = flag(0, "drill: an inf in step N's gradients; 0: never", low=0)


def poison_gradients(model):
    """The drill: one inf in the first gradient on every rank, as an overflow leaves it."""
    grad = next(p.grad for p in model.parameters() if p.grad is not None)
    with torch.no_grad():
        (grad.to_local() if hasattr(grad, "to_local") else grad).view(-1)[0] = float("inf")


def local_bytes(tensors) -> int:
    """Bytes this rank holds for `tensors` (FSDP2's DTensors: the local shard; None counts 0)."""
    tensors = [t.to_local() if hasattr(t, "to_local") else t for t in tensors if t is not None]
    return sum(t.numel() * t.element_size() for t in tensors)


def compare(args) -> int:
    """--compare: one launch (a whole job: process group, Accelerator, autocast) per precision
    with the same config and the flags given (--overwrite_output_dir too), then one table."""
    if "LOCAL_RANK" in os.environ:
        raise errors.Stop(
            "run --compare with plain `python`, not `accelerate launch`: it launches each "
            "precision itself"
        )
    if not os.path.isfile(args.config_file):
        raise errors.Stop(f"--config_file {args.config_file}: no such file")
    if args.resume_from_checkpoint not in (None, "latest", "auto"):
        raise errors.Stop(
            "--compare resumes each precision from its own folder: pass --resume_from_checkpoint "
            "latest or auto"
        )
    own = {"compare", "config_file", "precision", "output_dir"}
    passed = [s for k in sorted(args.given - own) for s in (f"--{k}", str(getattr(args, k)))]
    rows, mib = [], ("activation_bytes", "weight_copy_bytes", "parameter_bytes", "gradient_bytes")
    for mode in ("no", "bf16", "fp16"):
        out = Path(args.output_dir) / mode
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file"]
        cmd += [args.config_file, __file__, *passed, "--precision", mode, "--output_dir", str(out)]
        print(f"=== {mode}: {' '.join(cmd)}", flush=True)
        ok = subprocess.run(cmd).returncode == 0 and (out / "summary.json").is_file()
        rows.append(json.loads((out / "summary.json").read_text()) if ok else {"precision": mode})
    first = next((r for r in rows if "steps" in r), {})  # the launch, from one that succeeded
    lines = [
        f"{args.config_file}: {first.get('distributed_type')} x{first.get('world_size')} on "
        f"{first.get('device')}, {args.model_config} Llama, global batch "
        f"{first.get('global_batch')} x {args.block_size} tokens, {first.get('steps')} steps.",
        "",
        "| precision | train loss | eval loss | tokens/s per device | activations MiB | autocast "
        "weight copies MiB | parameters MiB | gradients MiB | loss scale | skipped steps |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:  # a null figure (not finite, named in "nonfinite") shows as nan
        cells = ["failed: see its output above"] + [""] * 8
        if "steps" in r:
            cells = [
                f"{r[k]:.4f}" if r[k] is not None else "nan" for k in ("train_loss", "eval_loss")
            ]
            cells += [f"{r['tokens_per_second']:.0f}"] + [f"{r[k] / 2**20:.2f}" for k in mib]
            cells += ["-" if r["loss_scale"] is None else r["loss_scale"], r["skipped_steps"]]
        lines.append(f"| {r['precision']} | " + " | ".join(map(str, cells)) + " |")
    table = "\n".join(lines)
    print(table)
    Path(args.output_dir, "comparison.md").write_text(table + "\n")
    return 0 if all("steps" in r for r in rows) else 1


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
        output_dir="runs/mixed_precision",
        per_device_train_batch_size=4,
        learning_rate=3e-3,
        weight_decay=0.1,
        warmup_steps=5,
        lr_scheduler_type="cosine",
        max_steps=30,
        logging_steps=5,
    )
    make_output_dir(args.output_dir)  # a file in the way or an impossible path: one line, now
    if args.precision not in precision.MODES:
        raise errors.Stop(
            f"--precision {args.precision!r}: choose one of {', '.join(precision.MODES)}"
        )
    if args.model_config not in models.PRESETS:
        raise errors.Stop(
            f"unknown --model_config {args.model_config!r}; choose one of {sorted(models.PRESETS)}"
        )
    for name in ("init_scale", "min_loss_scale"):
        if not getattr(args, name) > 0:
            raise errors.Stop(f"--{name} must be positive, got {getattr(args, name)}")
    if args.init_scale < args.min_loss_scale:
        raise errors.Stop(
            f"--init_scale {args.init_scale:g} is below --min_loss_scale {args.min_loss_scale:g}"
        )
    if args.compare:
        return compare(args)

    # The precision for this hardware, decided before the Accelerator (one per process). The
    # model is built on the meta device just to count its parameters.
    model_cls, config = LlamaForCausalLM, models.llama_config(args.model_config, args.vocab_size)
    with torch.device("meta"):
        n_params = sum(p.numel() for p in model_cls(config).parameters())
    device_type, capability = precision.detect_device()
    mode, reason = precision.choose_precision(args.precision, device_type, capability, n_params)
    scaler = GradScalerKwargs(init_scale=args.init_scale, growth_interval=args.growth_interval)
    startup = {"precision_used": mode}  # the model: in data_ready
    handlers = [scaler]  # the Accelerator's kwargs_handlers besides the process group's
    config_mp = os.environ.get("ACCELERATE_MIXED_PRECISION")  # the config's; --precision wins

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
    if mode == "fp16" and device_type == "cpu" and accelerator.scaler is not None:
        reason += "; fp16 on CPU: GradScaler('cpu') installed, Accelerate 1.15 builds none for CPU"
    if config_mp and config_mp != mode:
        reason += f"; the launch config's mixed_precision={config_mp} is overridden"
    accelerator.print(f"precision: {mode} ({reason})")

    # ADAPT: data. Tokenized and packed by each node's first rank; the others read its cache.
    with launch.node_first(accelerator):
        raw = data.load_text_dataset(validation_split_percentage=args.validation_split_percentage)
        tokenizer = data.get_tokenizer(None, raw, args.vocab_size, args.cache_dir)
        config.vocab_size = len(tokenizer)  # the preset's vocabulary is the tokenizer's
        config.bos_token_id = config.eos_token_id = config.pad_token_id = tokenizer.eos_token_id
        lm_data = data.pack_dataset(
            raw, tokenizer, args.block_size, args.cache_dir, "stream"
        ).with_format("torch")
    full_blocks = True  # one stream cut into blocks: every position a target, no count
    data_digest = data.same_data(accelerator, lm_data)  # every node's copy; resume fingerprint
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

    # ADAPT: model. fp32 master weights in every mode; the precision only changes the compute.
    set_seed(args.seed)  # the same initial weights in every mode and on every rank
    model = model_cls(config)
    model.config.use_cache = False
    n_params = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())  # ZeRO-3 too
    set_seed(args.seed, device_specific=True)  # from here on each rank draws its own (dropout)
    flops_per_token, flops_method = metrics.model_flops_per_token(model, args.block_size)

    peak_lr = args.learning_rate  # (llama.py scales it with --scale_lr)
    # AdamW without weight decay on norm weights and biases (1-D tensors), as most LLM recipes.
    optimizer = torch.optim.AdamW(
        models.param_groups(model, args.weight_decay),
        lr=peak_lr,
        betas=(args.adam_beta1, args.adam_beta2),
        eps=args.adam_epsilon,
    )
    accelerator.print(metrics.weight_decay_line(optimizer))
    lr_scheduler = schedule.lr_scheduler(optimizer, args, max_steps)  # --lr_scheduler_type

    order = {  # what fixes the data order; the step count gives the position in it
        "global_batch": global_batch,
        "seed": args.seed,
        "block_size": args.block_size,
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
        precision={"requested": args.precision, "used": mode, "reason": reason},
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
        accelerator.print(checkpoint.resumed_line(resume_path, step))
    run_info["workarounds"] = applied  # the library workarounds that ran, in order
    log = metrics.RunLog(
        accelerator, args, Path(__file__).stem, step if resume_path else None, run_info, saved
    )

    # ---- Training loop: one iteration = one optimizer step = one accumulation window ---------
    # The launch's first micro batch is measured: bytes saved for backward (activations),
    # parameters and gradients on this rank. Its tokens/s counts the steps after the first.
    model.train()
    progress = tqdm(
        total=max_steps, initial=step, desc="train", disable=not accelerator.is_local_main_process
    )
    t_start = log.start_clock(device, flops_per_token, args.peak_tflops)  # tokens/s, MFU
    epoch = step // updates_per_epoch
    # skipped fp16 steps (and in a row: below --min_loss_scale it stops), inf/NaN outside fp16
    health = precision.StepHealth(accelerator, model, saved, args.min_loss_scale)
    seen = metrics.SampleIds(args.record_sample_ids, epoch)  # epochs before a resume stay empty
    preempted = checkpoint.stop_on_signal(accelerator, args.ddp_timeout)  # SIGTERM, Ctrl-C, SIGHUP
    problem = preempt = None  # why the loop ends early: one error line, or a signal's name
    start, sizes, t_first, t_last, record = step, {}, None, None, {}
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
                    with SavedTensorBytes() if not sizes else nullcontext() as meter:
                        loss = model(**batch, num_items_in_batch=num_items).loss  # sum / num_items
                    loss_total += loss.detach()
                    accelerator.backward(loss * args.gradient_accumulation_steps * world_size)
                    if not sizes:  # the launch's first micro batch; autocast's weight copies apart
                        sizes = {
                            "activation_bytes": meter.bytes - meter.weight_copy_bytes,
                            "weight_copy_bytes": meter.weight_copy_bytes,
                            "parameter_bytes": local_bytes(model.parameters()),
                            "gradient_bytes": local_bytes(p.grad for p in model.parameters()),
                        }
                    if accelerator.sync_gradients and step + 1 == args.inject_inf_grad_at_step:
                        poison_gradients(model)  # fp16: unscaled by the clip, then skipped
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
            t_last = time.perf_counter()  # tokens/s: from the end of the first (measured) step
            t_first = t_first or t_last
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
            if record.get("step") == step and "loss_scale" in record:  # fp16: the run goes on
                if not math.isfinite(record["loss"]):
                    errors.warn(
                        f"step {step}: loss {record['loss']} in fp16; lower --learning_rate, "
                        "lengthen --warmup_steps or use --precision bf16 (fp32's range)"
                    )
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
    # The row of the comparison table: the last step's losses (it is evaluated), this rank's
    # tokens/s after its first step, the bytes of the first micro batch.
    trained = (step - start - 1) * global_batch // world_size * args.block_size
    elapsed = t_last - t_first if step > start + 1 else float("nan")
    if accelerator.is_main_process:
        last = json.loads(Path(log.path).read_text().splitlines()[-2])  # (the summary is [-1])
        summary = {
            **run_state,
            "precision": mode,
            **run_info["precision"],  # requested, used, reason
            "device": device.type,
            "steps": step,
            "train_loss": last.get("loss"),
            "eval_loss": last.get("eval_loss"),
            "tokens_per_second": trained / elapsed,
            "loss_scale": precision.loss_scale(accelerator, model),
            "skipped_steps": health.skipped_steps,
            "n_params": n_params,
            **sizes,
        }
        Path(args.output_dir, "summary.json").write_text(
            json.dumps(metrics.strict_json(summary), indent=1, allow_nan=False)
        )
    del model, optimizer
    launch.teardown(accelerator)  # in order: the model before the process group
    accelerator.print(log.final_line(f"model in {final_dir}, summary.json in {args.output_dir}"))
    return 0


if __name__ == "__main__":
    errors.run(main)
