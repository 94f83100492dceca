"""Learning-rate helpers for large global batches."""

from __future__ import annotations

from common.errors import Stop


def scaled_learning_rate(base_lr: float, global_batch: int, reference_global_batch: int) -> float:
    """The linear scaling rule: multiply the LR by global_batch / reference_global_batch.

    Source: Goyal et al. 2017, "Accurate, Large Minibatch SGD: Training ImageNet in 1 Hour"
    (arXiv 1706.02677), section 2.1, which pairs it with a gradual warmup (section 2.2): a large
    scaled LR from step 0 diverges. For Adam-type optimizers a square-root rule is also used
    (Malladi et al. 2022, arXiv 2205.10287), which scales less; linear is the classic rule.

    Args:
        base_lr: LR tuned at `reference_global_batch` (sequences per optimizer step).
        global_batch: this run's sequences per optimizer step.
        reference_global_batch: the batch `base_lr` was tuned for.

    Returns:
        The effective LR.

    Raises:
        ValueError: a non-positive LR or batch (names it).
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
    """The peak LR of a run and the line that says how it was chosen.

    A bigger global batch averages away gradient noise, so it tolerates a bigger LR, but only
    after a warmup: with --scale_lr, --learning_rate (tuned at --reference_global_batch) is
    scaled by the linear rule (`scaled_learning_rate`); without, it is used as given.
    """
    peak = (
        scaled_learning_rate(args.learning_rate, global_batch, args.reference_global_batch)
        if args.scale_lr
        else args.learning_rate
    )
    return peak, (
        f"LR: base {args.learning_rate:g} (tuned at global batch "
        f"{args.reference_global_batch}), effective {peak:g} at global batch "
        f"{global_batch}, {args.warmup_steps} warmup steps"
    )
