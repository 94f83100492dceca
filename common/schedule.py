"""The LR schedule: `transformers.get_scheduler` with the flags `TrainingArguments` has."""

from __future__ import annotations

import json
import math

from transformers import SchedulerType, get_scheduler

from common.errors import Stop


# Schedules whose LR depends on --max_steps only through the warmup (any other decays over it);
# reduce_lr_on_plateau and greedy need an eval metric each step, which no recipe gives them.
STEP_FREE = ("constant", "constant_with_warmup", "inverse_sqrt")
SCHEDULES = tuple(
    t.value for t in SchedulerType if t.value not in ("reduce_lr_on_plateau", "greedy")
)


def warmup_count(warmup_steps: float, warmup_ratio: float, max_steps: int) -> int:
    """The warmup in steps, as `TrainingArguments.get_warmup_steps`: --warmup_steps from 1 on,
    below it a share of the run (transformers 5), else --warmup_ratio's share (transformers 4)."""
    if warmup_steps >= 1:
        return int(warmup_steps)
    return math.ceil(max_steps * (warmup_steps or warmup_ratio))


def lr_scheduler(optimizer, args, max_steps: int):
    """`transformers.get_scheduler` from the flags, as `Trainer.create_scheduler` builds it."""
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
    """The warmup of a run's LR if it decays over --max_steps, else None (`check_resume`)."""
    decays = run_state.get("lr_scheduler_type", "constant") not in STEP_FREE
    return run_state.get("warmup_steps", 0) if decays else None
