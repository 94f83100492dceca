r"""Activation (gradient) checkpointing, measured: memory traded for compute on the debug Llama.

    accelerate launch --config_file accelerate_configs/ddp.yaml recipes/gradient_checkpointing.py
    accelerate launch --config_file accelerate_configs/fsdp.yaml recipes/gradient_checkpointing.py
    accelerate launch --config_file accelerate_configs/ddp.yaml --mixed_precision no \
        recipes/gradient_checkpointing.py --num_layers 4,8,24 --max_steps 4

Checkpointing keeps only the input of each checkpointed block from the forward pass and
recomputes the block's activations during backward. Variants, all non-reentrant
(`use_reentrant=False`; the reentrant form runs a nested backward per block, which under DDP with
`find_unused_parameters=True` fails with "Expected to mark a variable ready only once ... marked
as ready twice", and it takes no keyword arguments):

    none    everything autograd saves stays until backward
    hf      `model.activation_checkpointing_enable(activation_checkpointing_kwargs=
            {"use_reentrant": False})` (the transformers >= 5 name; its deprecated alias is
            `gradient_checkpointing_enable(gradient_checkpointing_kwargs=...)`)
    manual  `torch.utils.checkpoint.checkpoint(layer.forward, ..., use_reentrant=False)` per block
    fsdp    (FSDP launches) Accelerate's own option, `fsdp_activation_checkpointing: true` in the
            config / `FullyShardedDataParallelPlugin(activation_checkpointing=True)`: a
            `checkpoint_wrapper` around every `fsdp_transformer_layer_cls_to_wrap` block

For each depth L (the debug preset with num_hidden_layers=L) every variant trains the same seeded
model on the same batches, one variant after the other in the same run, in --timing_rounds rounds
of alternating order. Step 1 is measured exactly: the bytes autograd saves for backward
(`torch.autograd.graph.saved_tensors_hooks`, unique storages, split into decoder blocks and the
rest: embedding, final norm, LM head and loss), and the gradients (compared with `none`). The
later steps are timed; the fastest counts (the least disturbed by other processes).

The peak column is the memory of forward + backward alone, at its worst moment, above what each
micro batch started with (parameters, Adam's state and, after a window's first micro batch, the
gradients): activations, gradients and temporaries. The optimizer step is left out (Adam's state and
its foreach temporaries would swamp the activations), and so is step 1 (it allocates Adam's state
and warms the allocator). On CUDA: the allocator's peak (`torch.cuda.max_memory_allocated`, reset
before each forward, read right after backward), on every later step. On CPU, which keeps no
allocator statistics: common/memory.py's PeakTensorBytes (the profiler's allocator events), on step
2 of the first round only, which the profiler slows, so it is not timed (--max_steps >= 3).

The rule of thumb (Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost"):
checkpointing every block stores L block inputs instead of L blocks' activations, cutting
activation memory about L-fold, for one extra forward pass, about +33% compute (a backward
costs about two forwards); the table states the measured figures next to it.

Flags: the core `transformers.TrainingArguments` flags (common/args.py) where a measurement has a
use for them; a step is --gradient_accumulation_steps micro batches (step 1's first is measured),
--max_steps counts steps per variant, depth and round (the first untimed), and --weight_decay never
applies to norm weights. It keeps no model and has no LR schedule: the schedule's flags,
--save_steps, --num_train_epochs, --logging_steps, --resume_from_checkpoint, the trackers' and
--dataloader_num_workers are refused, not ignored.

Outputs in --output_dir: results.json (every figure; standard JSON: a non-finite number is null,
named in the row's "nonfinite" list) and table.md. `# ADAPT:` marks the data, model and loss.
"""

import functools
import gc
import itertools
import json
import math
import sys
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

gc.collect()  # the process's earlier garbage (a notebook's), before imports_done freezes
gc.disable()  # the imports below run without it: launch.imports_done()
import torch
from accelerate import Accelerator
from accelerate.utils import (
    DataLoaderConfiguration,
    DistributedDataParallelKwargs,
    DistributedType,
    GradientAccumulationPlugin,
    set_seed,
)
from torch.utils.checkpoint import checkpoint
from transformers import LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere, no install
from common import checks, data, errors, grad_norm, launch, metrics, models
from common import precision, run_dir, workarounds
from common.errors import Stop
from common.args import flag, make_output_dir, parse_args
from common.memory import PeakTensorBytes, SavedTensorBytes

launch.imports_done()  # garbage collection back on, the imports' objects frozen

MIB = 2**20


@dataclass
class Args:
    """The recipe's own flags; the core TrainingArguments ones come from common/args.py."""

    num_layers: str = flag("4,8,24", "comma-separated depths L to measure")
    variants: str = flag(
        "auto",
        "comma-separated subset of none,hf,manual,fsdp; auto = none,hf,manual (+ fsdp under FSDP)",
    )
    model_config: str = flag("debug", f"preset: {', '.join(models.PRESETS)}")
    vocab_size: int = flag(4096, low=256)
    block_size: int = flag(256, low=2)
    cache_dir: str = data.DEFAULT_CACHE_DIR
    timing_rounds: int = flag(2, "rounds over the variants, in alternating order", low=1)
    ddp_find_unused_parameters: bool = flag(
        False,
        "DDP: search the graph for unused parameters each step (with reentrant "
        "checkpointing this is what raises 'marked ready twice'; the non-reentrant "
        "variants here work either way)",
    )
    ddp_timeout: int = flag(1800, "collective timeout in seconds", low=1)


def build(accelerator, args, tokenizer, num_layers: int, variant: str):
    """The model and optimizer for one variant, prepared (wrapped in DDP or sharded by FSDP2)."""
    set_seed(args.seed)  # the same initial weights for every variant and on every rank
    eos = tokenizer.eos_token_id
    config = models.llama_config(
        args.model_config,
        vocab_size=len(tokenizer),
        num_hidden_layers=num_layers,
        use_cache=False,
        bos_token_id=eos,
        eos_token_id=eos,
        pad_token_id=eos,
    )
    model = LlamaForCausalLM(config)
    set_seed(args.seed, device_specific=True)  # from here each rank draws its own (dropout, if any)
    if variant == "hf":
        model.activation_checkpointing_enable(
            activation_checkpointing_kwargs={"use_reentrant": False}
        )
    elif variant == "manual":
        # Wrap forward, not the module: module hooks (DDP's, FSDP2's all-gathers) stay outside the
        # checkpoint and do not run again when backward recomputes the block.
        for layer in model.model.layers:
            layer.forward = functools.partial(checkpoint, layer.forward, use_reentrant=False)
    if accelerator.distributed_type == DistributedType.FSDP:  # applied in prepare(), per plugin
        accelerator.state.fsdp_plugin.activation_checkpointing = variant == "fsdp"
    optimizer = torch.optim.AdamW(
        models.param_groups(model, args.weight_decay), lr=args.learning_rate
    )
    model, optimizer = accelerator.prepare(model, optimizer)
    workarounds.patch_model(accelerator, model)  # autocast stays; no unread fp32 copy of the logits
    return model, optimizer


def local_grads(model) -> torch.Tensor:
    """This rank's gradients (FSDP2: its shards), flattened to one fp32 vector on the CPU."""
    grads = [
        p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
        for p in model.parameters()
        if p.grad is not None
    ]
    return torch.cat([g.detach().float().flatten().cpu() for g in grads])


def strict_row(row: dict) -> dict:
    """A results row as standard JSON: non-finite floats (also inside the losses list) -> null,
    their keys named in "nonfinite" (metrics.strict_json, which looks at top-level values only)."""
    losses = row["losses"]
    row = metrics.strict_json({**row, "losses": [x if math.isfinite(x) else None for x in losses]})
    if not all(math.isfinite(x) for x in losses):
        row = {**row, "nonfinite": [*row.get("nonfinite", []), "losses"]}
    return row


@contextmanager
def forward_backward_peak(run: dict, on: bool, device: torch.device):
    """Meter the forward + backward run inside (a no-op unless `on`): run["peak_bytes"] becomes the
    larger of its value (None: 0) and the bytes allocated at the worst moment inside, above what was
    allocated on entry (int, bytes). CUDA: the allocator's peak, reset on entry (no device sync:
    the allocator counts on the host); CPU: PeakTensorBytes, the profiler's allocator events."""
    if not on:
        yield
        return
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        start = torch.cuda.memory_allocated(device)
        yield
        peak = torch.cuda.max_memory_allocated(device) - start
    else:
        with PeakTensorBytes() as meter:
            yield
        peak = meter.peak
    run["peak_bytes"] = max(run["peak_bytes"] or 0, peak)


def main() -> int:
    # weight_decay 0.01: what torch's AdamW applied here before the flag existed (now matrices only)
    no_training_run = "it measures a few steps of each variant and keeps none of them"
    args = parse_args(
        Args,
        description=__doc__,
        refuse=dict(
            **dict.fromkeys(
                ("warmup_steps", "warmup_ratio", "lr_scheduler_type", "lr_scheduler_kwargs"),
                "it trains at a constant --learning_rate (no schedule)",
            ),
            num_train_epochs="it runs --max_steps steps per variant and depth, never whole epochs",
            logging_steps="it prints one line per variant and round, and the table",
            save_steps=f"it saves no checkpoints: {no_training_run}",
            resume_from_checkpoint=f"it saves no checkpoints: {no_training_run}",
            **dict.fromkeys(
                ("report_to", "run_name", "logging_dir"),
                "its figures go to results.json and table.md; there is no training curve to track",
            ),
            dataloader_num_workers="it reads its few batches once, before it measures",
        ),
        output_dir="runs/gradient_checkpointing",
        per_device_train_batch_size=2,
        learning_rate=1e-3,
        weight_decay=0.01,
        max_steps=4,
    )
    try:
        depths = [int(n) for n in args.num_layers.split(",")]
    except ValueError:
        raise Stop(
            f"--num_layers {args.num_layers!r}: expected comma-separated integers such as 4,8,24"
        )
    if min(depths) < 1 or args.max_steps < 2:
        raise Stop(
            f"need --num_layers >= 1 (got {args.num_layers}) "
            f"and --max_steps >= 2 (got {args.max_steps})"
        )
    if precision.detect_device()[0] == "cpu" and args.max_steps < 3:
        raise Stop(
            f"--max_steps {args.max_steps}: on CPU step 2 is metered for memory, "
            "not timed; need at least 3"
        )
    if args.model_config not in models.PRESETS:
        raise Stop(
            f"unknown --model_config {args.model_config!r}; choose one of {sorted(models.PRESETS)}"
        )
    make_output_dir(args.output_dir)  # before the measurements: a bad path fails now

    # ---------------------------------------------------------------------------------------------
    # Accelerator: strategy and precision come from the accelerate config, as in every recipe (bf16
    # only where the hardware computes it: common/precision.py).
    # ---------------------------------------------------------------------------------------------
    # the model is known before the data: a preset Llama (for the FSDP-wrap and ZeRO-3 checks)
    startup = {
        "model_cls": LlamaForCausalLM,
        "model_config": models.llama_config(args.model_config, args.vocab_size),
    }
    handlers = [  # the Accelerator's kwargs_handlers besides the process group's
        DistributedDataParallelKwargs(find_unused_parameters=args.ddp_find_unused_parameters)
    ]
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
    is_fsdp = accelerator.distributed_type == DistributedType.FSDP
    variants = (
        ["none", "hf", "manual"] + (["fsdp"] if is_fsdp else [])
        if args.variants == "auto"
        else args.variants.split(",")
    )
    if not set(variants) <= {"none", "hf", "manual", "fsdp"} or variants[0] != "none":
        raise Stop(
            f"--variants {args.variants!r}: a comma-separated list of none,hf,manual,fsdp, "
            "none first (the reference for gradients and ratios)"
        )
    if "fsdp" in variants and not (is_fsdp and accelerator.is_fsdp2):
        raise Stop(
            "--variants fsdp needs an FSDP2 launch (accelerate_configs/fsdp.yaml); "
            f"this one is {accelerator.distributed_type}"
        )
    device = accelerator.device

    # ---------------------------------------------------------------------------------------------
    # ADAPT: data. The first max_steps windows of the seeded epoch, for every variant and depth.
    # Each node's first rank builds the cache (home directories are often node-local).
    # ---------------------------------------------------------------------------------------------
    with launch.node_first(accelerator):  # a missing or broken file: one error line on every rank
        raw = data.load_text_dataset()
        tokenizer = data.get_tokenizer(None, raw, args.vocab_size, args.cache_dir)
        train_set = data.pack_dataset(raw, tokenizer, args.block_size, args.cache_dir)["train"]
    train_loader = accelerator.prepare(
        torch.utils.data.DataLoader(
            train_set.with_format("torch"),
            batch_size=args.per_device_train_batch_size,
            shuffle=True,
            drop_last=True,
            pin_memory=device.type == "cuda",
        )
    )  # page-locked: non-blocking copies
    train_loader.set_epoch(0)
    accumulation = args.gradient_accumulation_steps
    wanted = args.max_steps * accumulation
    micro_batches = list(itertools.islice(train_loader, wanted))  # this rank's share
    if len(micro_batches) < wanted:
        raise Stop(
            f"--max_steps {args.max_steps} x --gradient_accumulation_steps {accumulation}: "
            f"the corpus gives only {len(micro_batches)} batches per rank"
        )
    windows = [micro_batches[i : i + accumulation] for i in range(0, wanted, accumulation)]

    # ---------------------------------------------------------------------------------------------
    # ADAPT: model. One per variant, the same seeded weights; the variant picks what is recomputed.
    # ---------------------------------------------------------------------------------------------
    results = []
    for num_layers in depths:
        runs = {
            v: {"saved": SavedTensorBytes(), "times": [], "losses": [], "peak_bytes": None}
            for v in variants
        }
        # Rounds in alternating order (none,hf,manual then manual,hf,none, ...) so that a drift in
        # the machine's load does not favour one variant; one variant alive at a time, so each
        # memory reading is that variant's alone.
        for rnd in range(args.timing_rounds):
            for variant in variants if rnd % 2 == 0 else variants[::-1]:
                model, optimizer = build(accelerator, args, tokenizer, num_layers, variant)
                nonfinite = precision.NonFiniteGuard(accelerator, model)  # inf/NaN: stop
                run = runs[variant]
                saved = run["saved"]  # what the blocks save (whatever wraps them) vs the rest
                saved.tag = "rest"
                for layer in accelerator.unwrap_model(model).model.layers:
                    layer.register_forward_pre_hook(lambda *_, m=saved: setattr(m, "tag", "blocks"))
                    layer.register_forward_hook(lambda *_, m=saved: setattr(m, "tag", "rest"))

                # ---------------------------------------------------------------------------------
                # Training loop. Round 0, step 0 is measured (the saved-tensor hooks cost time);
                # the steps after each round's first (optimizer-state allocation) are timed. The
                # peak of forward + backward: every step but the first on CUDA (reading it is
                # free); on CPU, the second step of round 0 (the profiler slows it: not timed).
                # ---------------------------------------------------------------------------------
                model.train()
                for step, window in enumerate(windows):
                    cpu_metered = device.type == "cpu" and rnd == 0 and step == 1
                    meter_peak = step > 0 and (device.type == "cuda" or cpu_metered)
                    accelerator.wait_for_everyone()  # every rank starts the timed step together
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    step_loss = torch.zeros((), device=device)
                    for micro, batch in enumerate(window):
                        with accelerator.accumulate(model):  # backward divides the loss by steps
                            with forward_backward_peak(run, meter_peak, device):
                                with saved if rnd == step == micro == 0 else nullcontext():
                                    loss = model(**batch).loss  # ADAPT: loss
                                accelerator.backward(loss)
                            if accelerator.sync_gradients:
                                if rnd == 0 and step == 0:  # reduced, not yet clipped
                                    run["grads"] = local_grads(model)
                                norm = grad_norm.clip_grad_norm_(
                                    accelerator, model, args.max_grad_norm
                                )
                            optimizer.step()  # no-op until the window's last micro batch
                            optimizer.zero_grad()
                        step_loss += loss.detach() / accumulation
                    nonfinite.record(step + 1, step_loss, norm)
                    if device.type == "cuda":
                        torch.cuda.synchronize()  # time the step's kernels, not their launch
                    if step > 0 and not cpu_metered:
                        run["times"].append(time.perf_counter() - t0)
                    if rnd == 0:  # later rounds repeat the same steps from the same seed
                        run["losses"].append(accelerator.reduce(step_loss, reduction="mean").item())
                if problem := nonfinite.problem():
                    raise Stop(f"L={num_layers} {variant} round {rnd}: {problem}")
                accelerator.print(
                    f"L={num_layers} {variant} round {rnd}: saved for backward "
                    f"{saved.bytes / MIB:.2f} MiB, fastest step "
                    f"{min(run['times']):.3f} s, loss {run['losses'][-1]:.4f}"
                )
                del model, optimizer
                accelerator.free_memory()  # drop Accelerate's references before the next build

        # -----------------------------------------------------------------------------------------
        # Evaluation: what each variant saved, cost and computed, against `none`.
        # -----------------------------------------------------------------------------------------
        ref = runs["none"]
        for variant, run in runs.items():
            loss_diff = max(abs(x - y) for x, y in zip(run["losses"], ref["losses"]))
            diff, scale = (
                accelerator.gather(t.abs().max().reshape(1).to(device)).max().item()
                for t in (run["grads"] - ref["grads"], ref["grads"])
            )  # over all ranks
            results.append(
                {
                    "num_layers": num_layers,
                    "variant": variant,
                    "saved_bytes": run["saved"].bytes,
                    "saved_block_bytes": run["saved"].by_tag.get("blocks", 0),
                    "saved_rest_bytes": run["saved"].by_tag.get("rest", 0),
                    "step_seconds": min(run["times"]),
                    "time_ratio": min(run["times"]) / min(ref["times"]),
                    "max_abs_grad_diff": diff,
                    "max_abs_grad": scale,
                    "losses": run["losses"],
                    "max_abs_loss_diff": loss_diff,
                    "peak_bytes": run["peak_bytes"],
                }
            )

    # ---------------------------------------------------------------------------------------------
    # The table, with the rule of thumb next to the measurement. A = one block's saved bytes
    # without checkpointing (measured: the blocks' bytes / L); with checkpointing a block keeps only
    # its input x (measured), and backward recomputes one block at a time, so the blocks' memory at
    # the backward peak is about L*x + A (derived from the two): L-fold less only while L*x << A.
    # ---------------------------------------------------------------------------------------------
    lines = [
        f"{str(accelerator.distributed_type).split('.')[-1]} x{accelerator.num_processes}, "
        f"{accelerator.mixed_precision}, {args.model_config} Llama, per-device batch "
        f"{args.per_device_train_batch_size} x {args.block_size} tokens, {device.type}",
        "",
        "| L | variant | saved for backward MiB | blocks MiB | rest MiB "
        "| blocks at backward peak MiB (derived) | blocks ÷ (rule: ÷L) | step s "
        "| time × (rule: ×1.33) | max abs grad diff | forward+backward peak MiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        base = next(
            b for b in results if b["num_layers"] == r["num_layers"] and b["variant"] == "none"
        )
        recomputed = 0 if r["variant"] == "none" else base["saved_block_bytes"] / r["num_layers"]
        r["blocks_peak_bytes"] = r["saved_block_bytes"] + recomputed
        r["blocks_reduction"] = base["saved_block_bytes"] / r["blocks_peak_bytes"]
        peak = f"{r['peak_bytes'] / MIB:.1f}" if r["peak_bytes"] is not None else "n/a"
        lines.append(
            f"| {r['num_layers']} | {r['variant']} | {r['saved_bytes'] / MIB:.2f} | "
            f"{r['saved_block_bytes'] / MIB:.2f} | {r['saved_rest_bytes'] / MIB:.2f} | "
            f"{r['blocks_peak_bytes'] / MIB:.2f} | {r['blocks_reduction']:.1f} "
            f"(÷{r['num_layers']}) | {r['step_seconds']:.3f} | {r['time_ratio']:.2f} | "
            f"{r['max_abs_grad_diff']:.2e} | {peak} |"
        )
    ref = next(r for r in results if r["variant"] == "none")
    ckpt = next(
        (r for r in results if r["num_layers"] == ref["num_layers"] and r["variant"] != "none"),
        None,
    )
    if ckpt:
        a, x = (c["saved_block_bytes"] / c["num_layers"] for c in (ref, ckpt))
        lines += [
            "",
            f"Measured: one block saves A = {a / MIB:.2f} MiB without checkpointing "
            f"and keeps x = {x / MIB:.2f} MiB (its input) with it, A/x = {a / x:.0f}: "
            "the blocks shrink L*A -> L*x + A, about L-fold only while L << A/x. 'rest' "
            "(embedding, final norm, LM head, loss) is never checkpointed. Step time: the "
            "fastest timed step (the least disturbed by other processes) of this run; the "
            "+33% rule counts one extra forward of the blocks, the LM head and loss are not "
            "recomputed.",
        ]
    table = "\n".join(lines)
    if accelerator.is_main_process:
        print(table)
        Path(args.output_dir, "table.md").write_text(table + "\n")
        Path(args.output_dir, "results.json").write_text(
            json.dumps(
                {
                    "distributed_type": accelerator.distributed_type.value,
                    "world_size": world_size,
                    "mixed_precision": accelerator.mixed_precision,
                    "precision": guard.precision,
                    "global_batch": global_batch,
                    "device": device.type,
                    "args": vars(args),
                    "results": [strict_row(r) for r in results],
                },
                indent=1,
                allow_nan=False,
            )
        )
    launch.teardown(accelerator)  # the models (freed in the loop) before the process group
    accelerator.print(
        f"done: table in {Path(args.output_dir, 'table.md')}, "
        f"figures in {Path(args.output_dir, 'results.json')}"
    )
    return 0


if __name__ == "__main__":
    errors.run(main)
