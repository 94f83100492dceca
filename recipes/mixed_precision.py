"""Mixed precision, measured: fp32 vs bf16 vs fp16 with dynamic loss scaling, on the debug Llama.

    # one precision per launch (one Accelerator per process has exactly one mixed_precision)
    accelerate launch --config_file accelerate_configs/ddp.yaml recipes/mixed_precision.py \
        --precision auto
    accelerate launch --config_file accelerate_configs/fsdp.yaml recipes/mixed_precision.py \
        --precision fp16
    # the comparison: the same config launched once per precision, then one table
    python recipes/mixed_precision.py --compare --config_file accelerate_configs/ddp.yaml \
        --max_steps 30

`--precision` decides (it overrides the config's `mixed_precision`); `auto` picks what the
hardware computes natively (common/precision.py): bf16 on Ampere/Hopper and CPUs with
AVX512-BF16 or AMX, fp16 on Volta/Turing, fp32 elsewhere, and says why in one line.
fp16 trains on `loss x scale` (a GradScaler): a step with inf/NaN gradients is skipped, the
scale halved and the LR schedule held; the scale and the skipped steps are logged and
checkpointed. `--inject_inf_grad_at_step N` is the drill: fp16 skips step N, fp32 and bf16
stop with an error naming it, before any checkpoint.

Outputs in --output_dir: metrics.jsonl, summary.json (a row of the table), checkpoint-N/; with
--compare, one folder per precision and comparison.md. More: docs/mixed_precision.md.
To change the data, model or loss, find the `# ADAPT:` markers.
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
from transformers import LlamaForCausalLM, get_cosine_schedule_with_warmup

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere, no install
from common import checkpoint, checks, data, errors, grad_norm, launch, metrics
from common import models, precision, run_dir, workarounds
from common.errors import Stop
from common.args import changed_flags, flag, make_output_dir, parse_args
from common.precision import MIN_LOSS_SCALE  # (Args.precision hides the module)
from common.memory import SavedTensorBytes, local_tensor_bytes

launch.imports_done()  # garbage collection back on, the imports' objects frozen


@dataclass
class Args:
    """The recipe's own flags; the core TrainingArguments ones come from common/args.py."""

    precision: str = flag("auto", "auto | no | bf16 | fp16 (overrides the config's)")
    compare: bool = flag(False, "launch no, bf16, fp16 with --config_file; print a table")
    config_file: str = flag("accelerate_configs/ddp.yaml", "--compare: accelerate config")
    model_config: str = flag("debug", f"preset: {', '.join(models.PRESETS)}")
    vocab_size: int = flag(4096, low=256)
    block_size: int = flag(128, low=2)
    validation_split_percentage: int = flag(5, "rows held out for validation, in %", low=1, high=99)
    max_eval_samples: int = flag(64, low=1)
    cache_dir: str = data.DEFAULT_CACHE_DIR
    per_device_eval_batch_size: int = flag(None, "default: --per_device_train_batch_size", low=1)
    # fp16 loss scaling (torch.amp.GradScaler arguments)
    init_scale: float = 2.0**16
    growth_interval: int = flag(2000, "clean steps before the scale doubles", low=1)
    min_loss_scale: float = flag(MIN_LOSS_SCALE, "stop when the fp16 loss scale falls below this")
    inject_inf_grad_at_step: int = flag(0, "drill: an inf in step N's gradients; 0: never", low=0)
    ddp_timeout: int = flag(1800, "collective timeout in seconds", low=1)


# This recipe's defaults for core flags (the rest keep common/args.py's).
DEFAULTS = dict(
    output_dir="runs/mixed_precision",
    per_device_train_batch_size=4,
    learning_rate=3e-3,
    weight_decay=0.1,
    warmup_steps=5,
    max_steps=30,
    logging_steps=5,
)


def poison_gradients(model):
    """The drill: one inf in the first gradient on every rank, as an overflow leaves it."""
    grad = next(p.grad for p in model.parameters() if p.grad is not None)
    with torch.no_grad():
        (grad.to_local() if hasattr(grad, "to_local") else grad).view(-1)[0] = float("inf")


# >>> shared: evaluate (tests/test_skeleton.py keeps the shared blocks identical across recipes)
@torch.no_grad()
def evaluate(model, eval_loader, accelerator) -> float:
    """Token-weighted mean eval loss in nats/token; each eval block counted exactly once."""
    model.eval()
    nats = torch.zeros((), device=accelerator.device)
    tokens = torch.zeros((), device=accelerator.device)
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
    # one `error:` line for a bad flag or a non-empty --output_dir, before anything is written
    args = parse_args(Args, description=__doc__, **DEFAULTS)
    make_output_dir(args.output_dir)  # a file in the way or an impossible path: one line, now
    checks.mixed_precision_flags(args)  # --precision, the scales; with --compare, its launch

    # ---------------------------------------------------------------------------------------------
    # --compare: one launch per precision with the same config and arguments, then the table. Each
    # launch is a whole job, so each mode gets its own process group, Accelerator and autocast.
    # ---------------------------------------------------------------------------------------------
    if args.compare:
        # Every flag that differs from its default goes to each launch (--overwrite_output_dir too:
        # each launch checks its own folder); the driver's own flags and the per-mode ones do not.
        passed = changed_flags(
            args, Args, DEFAULTS, skip={"compare", "config_file", "precision", "output_dir"}
        )
        rows = []
        for mode in ("no", "bf16", "fp16"):
            out = Path(args.output_dir) / mode
            cmd = [
                sys.executable,
                "-m",
                "accelerate.commands.launch",
                "--config_file",
                args.config_file,
                __file__,
                *passed,
                "--precision",
                mode,
                "--output_dir",
                str(out),
            ]
            print(f"=== {mode}: {' '.join(cmd)}", flush=True)
            ok = subprocess.run(cmd).returncode == 0 and (out / "summary.json").is_file()
            rows.append(
                json.loads((out / "summary.json").read_text())
                if ok
                else {"precision": mode, "failed": True}
            )
        table = metrics.comparison_table(rows, args.config_file, args.model_config, args.block_size)
        print(table)
        Path(args.output_dir, "comparison.md").write_text(table + "\n")
        return 1 if any(r.get("failed") for r in rows) else 0

    # ---------------------------------------------------------------------------------------------
    # Precision for this hardware, decided before the Accelerator exists (it fixes one per process).
    # The model is built on the meta device just to count its parameters.
    # ---------------------------------------------------------------------------------------------
    model_config = models.llama_config(args.model_config, args.vocab_size)
    with torch.device("meta"):
        n_params = sum(p.numel() for p in LlamaForCausalLM(model_config).parameters())
    device_type, capability = precision.detect_device()
    mode, reason = precision.choose_precision(args.precision, device_type, capability, n_params)

    startup = {
        "precision_used": mode,
        "model_cls": LlamaForCausalLM,
        "model_config": model_config,
    }
    handlers = [  # the Accelerator's kwargs_handlers besides the process group's
        GradScalerKwargs(init_scale=args.init_scale, growth_interval=args.growth_interval)
    ]
    config_mp = os.environ.get("ACCELERATE_MIXED_PRECISION")  # the config's; --precision wins
    # >>> shared: accelerator
    # Library workarounds (common/workarounds.py) return the names of those applied
    applied = workarounds.die_with_launcher()  # a SIGKILLed launcher takes its workers with it
    # The launch against the flags and the hardware, before any work (common/checks.py lists
    # the checks): a DeepSpeed JSON's batch, clipping or precision would win over the flags, ...
    guard = checks.Startup(args, **startup)
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
    accelerator.print(
        f"precision: {mode} ({reason})"
        + (
            f"; the launch config's mixed_precision={config_mp} is overridden"
            if config_mp and config_mp != mode
            else ""
        )
    )

    # ---------------------------------------------------------------------------------------------
    # ADAPT: data. The bundled corpus, packed; the seeded sampler gives every mode the same batches.
    # Each node's first rank builds the cache first (home directories are often node-local).
    # ---------------------------------------------------------------------------------------------
    with launch.node_first(accelerator):  # a missing or broken file: one error line on every rank
        raw = data.load_text_dataset(validation_split_percentage=args.validation_split_percentage)
        tokenizer = data.get_tokenizer(None, raw, args.vocab_size, args.cache_dir)
        lm_data = data.pack_dataset(raw, tokenizer, args.block_size, args.cache_dir).with_format(
            "torch"
        )
    train_set = lm_data["train"]
    n_eval = min(args.max_eval_samples, len(lm_data["validation"]))
    eval_set = lm_data["validation"].select(range(n_eval))
    updates_per_epoch = len(train_set) // global_batch  # whole global batches; the rest is dropped
    guard.data_ready(train_size=len(train_set), train_unit=f"blocks of {args.block_size} tokens")
    max_steps = (
        args.max_steps
        if args.max_steps > 0
        else math.ceil(args.num_train_epochs * updates_per_epoch)
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
    )
    eval_loader = torch.utils.data.DataLoader(
        eval_set,
        batch_size=args.per_device_eval_batch_size,
        generator=torch.Generator(),
        pin_memory=pin,
    )
    # <<< shared

    # ---------------------------------------------------------------------------------------------
    # ADAPT: model. fp32 master weights in every mode; the precision only changes the compute.
    # ---------------------------------------------------------------------------------------------
    eos = tokenizer.eos_token_id
    config = models.llama_config(
        args.model_config,
        vocab_size=len(tokenizer),
        bos_token_id=eos,
        eos_token_id=eos,
        pad_token_id=eos,
        use_cache=False,
    )
    set_seed(args.seed)  # the same initial weights in every mode and on every rank
    model = LlamaForCausalLM(config)
    # From here each rank draws its own random numbers (dropout, if a config has any); the data
    # order does not use them: the seedable sampler has its own generator, seeded by seed + epoch.
    set_seed(args.seed, device_specific=True)
    # Decay on weight matrices and embeddings only: a norm's gain is centred on 1, not 0.
    optimizer = torch.optim.AdamW(
        models.param_groups(model, args.weight_decay), lr=args.learning_rate
    )
    accelerator.print(metrics.weight_decay_line(optimizer))
    lr_scheduler = get_cosine_schedule_with_warmup(optimizer, args.warmup_steps, max_steps)

    model, optimizer, train_loader, eval_loader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_loader, eval_loader, lr_scheduler
    )
    workarounds.patch_model(accelerator, model)  # autocast stays; no unread fp32 copy of the logits

    # Resume only into the same kind of run: the data position follows from the step count, the
    # seed and the block size, and the scaler state means nothing to another precision.
    run_state = {
        "precision": mode,
        **checkpoint.precision_state(accelerator),  # + ZeRO's dtypes
        "distributed_type": checkpoint.strategy_name(accelerator),
        "world_size": world_size,
        "global_batch": global_batch,
        "seed": args.seed,
        "block_size": args.block_size,
        # the optimizer state brings its own LR and decay back, whatever the flags say
        "learning_rate": args.learning_rate,
        "weight_decay": args.weight_decay,
        "warmup_steps": args.warmup_steps,
        "max_grad_norm": args.max_grad_norm,
        "model_config": models.config_state(config),
        "max_steps": max_steps,
    }
    resume_path, saved = checkpoint.resume_or_start(  # all must match; --max_steps: within warmup
        accelerator, args, run_state, lr_decays_after=args.warmup_steps
    )
    step = saved["step"]
    # fp16 bookkeeping the scaler does not keep: skipped steps so far, and in a row (COMPLETE.json)
    skipped_steps = saved.get("skipped_steps", 0)
    skipped_in_a_row = saved.get("skipped_in_a_row", 0)
    if resume_path:  # model, optimizer, scheduler, RNG and the scaler's scale; micro steps follow
        checkpoint.load_checkpoint(accelerator, resume_path, model, optimizer, optimizer_steps=step)
    # metrics.jsonl: a resume keeps the lines up to its step, a fresh run starts it empty
    metrics_path = metrics.RunLog(
        accelerator, args, "mixed_precision", step if resume_path else None
    ).path
    scale = precision.loss_scale(accelerator, model)  # None without loss scaling
    accelerator.print(
        f"{str(accelerator.distributed_type).split('.')[-1]} x{world_size} | "
        f"{n_params / 1e6:.2f}M params | global batch {global_batch} | steps {step}..{max_steps}"
        + (f" | loss scale {scale:.0f}" if scale is not None else "")
        + (f" | skipped steps {skipped_steps}" if resume_path and scale is not None else "")
        + (f" | resumed from {resume_path} at step {step}" if resume_path else "")
        + (f" ({note})" if (note := run_dir.restart_note()) else "")
    )

    # ---------------------------------------------------------------------------------------------
    # Training loop. The first micro batch of the launch is measured: bytes saved for backward
    # (activations), parameters and gradients on this rank. Tokens/s counts the steps after it.
    # ---------------------------------------------------------------------------------------------
    model.train()
    start_step, sizes, nonfinite_losses, last_window_loss = step, {}, 0, float("nan")
    # an inf/NaN loss or norm stops the run, unless fp16 loss scaling skips the step
    guard = precision.NonFiniteGuard(accelerator, model)
    window_loss, window_batches, tokens, t0 = torch.zeros((), device=accelerator.device), 0, 0, None
    epoch = step // updates_per_epoch
    # SIGTERM (preemption, a time limit), Ctrl-C or SIGHUP: a checkpoint at the next step boundary
    preempted = checkpoint.stop_on_signal(accelerator, args.ddp_timeout)
    while step < max_steps:
        train_loader.set_epoch(epoch)  # a new permutation each epoch, the same on every rank
        done_in_epoch = step % updates_per_epoch  # > 0 only right after a mid-epoch resume
        batches = accelerator.skip_first_batches(
            train_loader, done_in_epoch * args.gradient_accumulation_steps
        )
        for batch in batches:
            measure = not sizes
            with accelerator.accumulate(model):
                with SavedTensorBytes() if measure else nullcontext() as saved:
                    loss = model(**batch).loss  # ADAPT: loss
                accelerator.backward(loss)  # under fp16: backward of loss x scale
                window_loss += loss.detach()
                window_batches += 1
                if accelerator.sync_gradients:
                    if step + 1 == args.inject_inf_grad_at_step:
                        poison_gradients(model)
                    # Under fp16 this unscales the gradients first, so the norm and the clip
                    # threshold are in true units; an inf/NaN norm means this step is skipped.
                    norm_before_clip = grad_norm.clip_grad_norm_(
                        accelerator, model, args.max_grad_norm
                    )
                if measure:  # autocast's weight casts apart from the activations
                    sizes = {
                        "activation_bytes": saved.bytes - saved.weight_copy_bytes,
                        "weight_copy_bytes": saved.weight_copy_bytes,
                        "parameter_bytes": local_tensor_bytes(model.parameters()),
                        "gradient_bytes": local_tensor_bytes(p.grad for p in model.parameters()),
                    }
                step_lr = lr_scheduler.get_last_lr()[0]  # the LR this optimizer step applies
                optimizer.step()  # under fp16: scaler.step (skipped on inf/NaN) then scaler.update
                if accelerator.sync_gradients and not accelerator.optimizer_step_was_skipped:
                    lr_scheduler.step()  # a skipped step did not happen: the schedule holds
                optimizer.zero_grad()
            tokens += batch["input_ids"].numel()
            if not accelerator.sync_gradients:
                continue
            step += 1
            # on the device: read at logging and saving steps
            guard.record(step, window_loss / window_batches, norm_before_clip)
            step_skipped = accelerator.optimizer_step_was_skipped
            skipped_steps += step_skipped
            skipped_in_a_row = skipped_in_a_row + 1 if step_skipped else 0
            # None in fp32/bf16 (no read); fp16: a host read, but scaler.step synced for its check
            scale = precision.loss_scale(accelerator, model)
            # the same verdict on every rank: the scale and the skips are the same everywhere
            stop = precision.loss_scale_verdict(scale, skipped_in_a_row, step, args.min_loss_scale)
            stop = stop and f"step {step}: {stop}"
            if step == start_step + 1:  # throughput clock starts after the measured, warm-up step
                tokens, t0 = 0, time.perf_counter()
            preempt = preempted()  # a collective: every rank stops at the same step
            save = preempt or (args.save_steps and step % args.save_steps == 0)
            log_now = step % args.logging_steps == 0 or step == max_steps
            if not stop and (save or log_now):
                stop = guard.problem()  # before any checkpoint of non-finite weights

            if log_now or stop:
                loss_mean = accelerator.reduce(window_loss, "mean").item() / window_batches
                record = {
                    "step": step,
                    "epoch": epoch,
                    "loss": loss_mean,
                    "lr": step_lr,
                    "grad_norm": float(norm_before_clip),  # read now: no sync on other steps
                    "loss_scale": scale,
                    "step_skipped": step_skipped,
                    "skipped_steps": skipped_steps,
                }
                nonfinite_losses += not math.isfinite(loss_mean)
                if not math.isfinite(loss_mean) and accelerator.is_main_process and not guard.on:
                    precision.warn_nonfinite_loss(step, loss_mean, mode)  # the run goes on (fp16)
                if accelerator.is_main_process:  # inf/NaN -> null, named in "nonfinite"
                    metrics.append_jsonl(metrics_path, record)
                accelerator.log({k: v for k, v in record.items() if v is not None}, step=step)
                accelerator.print(
                    " | ".join(
                        f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                        for k, v in record.items()
                    )
                )
                last_window_loss = loss_mean
                window_loss.zero_()
                window_batches = 0
            if save and not stop:  # + scaler.pt; the skip counts go into COMPLETE.json
                fp16 = {"skipped_steps": skipped_steps, "skipped_in_a_row": skipped_in_a_row}
                saved_to = checkpoint.save_checkpoint(
                    accelerator, args.output_dir, step, run_state={**run_state, **fp16}
                )
            if stop or preempt:
                if not stop:
                    accelerator.print(
                        f"preempted ({preempt}) at step {step}: saved {saved_to}; "
                        "relaunch with --resume_from_checkpoint auto to continue"
                    )
                del model, optimizer
                launch.teardown(accelerator)
                if stop:
                    raise Stop(stop)
                return checkpoint.PREEMPTED_EXIT_CODE
            if step >= max_steps or step % updates_per_epoch == 0:  # the epoch's last global batch
                break
        epoch += 1

    # ---------------------------------------------------------------------------------------------
    # Summary: one row of the comparison table (the main process writes it).
    # ---------------------------------------------------------------------------------------------
    elapsed = time.perf_counter() - t0 if t0 else float("nan")
    eval_loss = evaluate(model, eval_loader, accelerator)
    if accelerator.is_main_process:
        summary = metrics.strict_json(
            {  # a NaN loss becomes null, named in "nonfinite"
                **run_state,
                "requested": args.precision,
                "reason": reason,
                "device": accelerator.device.type,
                "steps": step,
                "train_loss": last_window_loss,
                "eval_loss": eval_loss,
                "tokens_per_second": tokens / elapsed
                if t0 and step > start_step + 1
                else float("nan"),
                "loss_scale": precision.loss_scale(accelerator, model),
                "skipped_steps": skipped_steps,
                "nonfinite_losses": nonfinite_losses,
                "n_params": n_params,
                **sizes,
            }
        )
        Path(args.output_dir, "summary.json").write_text(
            json.dumps(summary, indent=1, allow_nan=False)
        )
        accelerator.print(f"summary: {json.dumps(summary, allow_nan=False)}")
    del model, optimizer
    launch.teardown(accelerator)  # in order: the model before the process group
    accelerator.print(
        metrics.final_line(
            metrics_path, f"summary in {Path(args.output_dir, 'summary.json')}", eval_loss=eval_loss
        )
    )
    return 0


if __name__ == "__main__":
    errors.run(main)
