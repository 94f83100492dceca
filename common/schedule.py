"""The learning rate: its peak for a global batch, and its schedule (`transformers.get_scheduler`)."""

from __future__ import annotations

import json
import math

from transformers import SchedulerType, get_scheduler

from common.errors import Stop


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


# Schedules whose LR depends on --max_steps only through the warmup (any other decays over it);
# reduce_lr_on_plateau and greedy need an eval metric each step, which no recipe gives them.
STEP_FREE = ("constant", "constant_with_warmup", "inverse_sqrt")
SCHEDULES = tuple(
    t.value for t in SchedulerType if t.value not in ("reduce_lr_on_plateau", "greedy")
)


def warmup_count(warmup_steps: float, warmup_ratio: float, max_steps: int) -> int:
    """The warmup in steps, as `TrainingArguments.get_warmup_steps`: --warmup_steps from 1 on,
    below it a share of the run (transformers 5), else --warmup_ratio's share (transformers 4)."""
    share = warmup_steps if warmup_steps < 1 else 0
    return (
        int(warmup_steps) if warmup_steps >= 1 else math.ceil(max_steps * (share or warmup_ratio))
    )


def lr_scheduler(optimizer, args, max_steps: int):
    """`transformers.get_scheduler` with --lr_scheduler_type, its warmup and
    --lr_scheduler_kwargs, as `Trainer.create_scheduler` builds it."""
    warmup = warmup_count(args.warmup_steps, args.warmup_ratio, max_steps)
    try:
        kwargs = json.loads(args.lr_scheduler_kwargs or "{}")
        return get_scheduler(args.lr_scheduler_type, optimizer, warmup, max_steps, kwargs)
    except (TypeError, ValueError) as err:  # not JSON, or a keyword this schedule lacks or needs
        raise Stop(
            f"--lr_scheduler_type {args.lr_scheduler_type} --lr_scheduler_kwargs "
            f"'{args.lr_scheduler_kwargs or '{}'}': {err}"
        ) from None


def lr_decays_after(run_state: dict) -> int | None:
    """The warmup of an LR that decays over --max_steps, from a run's state (None: --max_steps
    does not move it)."""
    decays = run_state.get("lr_scheduler_type", "constant") not in STEP_FREE
    return run_state.get("warmup_steps", 0) if decays else None
