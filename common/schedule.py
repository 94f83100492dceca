"""The learning rate for a global batch."""

from __future__ import annotations

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
