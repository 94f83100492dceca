"""The core `transformers.TrainingArguments` flags, shared by every recipe, and one parser for them.

Each recipe declares only its own flags in a dataclass and calls `parse_args(RecipeArgs,
**defaults)`: `HfArgumentParser` takes both dataclasses, so `--max_steps`, `--output_dir`, ...
exist in every recipe with the same meaning, and each recipe only chooses its defaults.
"""

from __future__ import annotations

import os
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import SimpleNamespace

from transformers import HfArgumentParser

from common.checkpoint import restart_note


@dataclass
class TrainingFlags:
    """The flags every recipe takes, named and meant as in `transformers.TrainingArguments`."""

    output_dir: str = field(default=None, metadata={"help": "where metrics, checkpoints and the export go"})
    overwrite_output_dir: bool = field(default=False, metadata={
        "help": "train into an --output_dir that already holds files: everything in it (an earlier run's "
                "checkpoints, final/, metrics, logits probe, ...) is deleted at start-up, on the first attempt only "
                "(a restarted or requeued job keeps its checkpoints); with --resume_from_checkpoint PATH inside "
                "it, that checkpoint is kept"})
    seed: int = 42
    per_device_train_batch_size: int = field(default=8, metadata={"help": "micro batch per rank"})
    gradient_accumulation_steps: int = 1
    learning_rate: float = field(default=3e-3, metadata={"help": "peak LR"})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW decay; never on biases and norm weights"})
    warmup_steps: int = 0
    max_steps: int = field(default=-1, metadata={"help": "optimizer steps; -1 derives them from num_train_epochs"})
    num_train_epochs: float = 1.0
    logging_steps: int = 10
    save_steps: int = field(default=0, metadata={"help": "checkpoint every N optimizer steps; 0 = never"})
    resume_from_checkpoint: str = field(default=None, metadata={
        "help": "a checkpoint path; 'latest' (the newest complete one); or 'auto' (the newest if there is one, else "
                "a fresh start: for jobs that restart or are requeued). Restarts default to 'auto'"})
    max_grad_norm: float = field(default=1.0, metadata={"help": "clip to this global norm; 0 logs it, clips nothing"})
    report_to: str = field(default="none", metadata={"help": "Accelerate tracker(s), e.g. tensorboard, or 'none'"})


def parse_args(recipe_args: type, argv: list[str] | None = None, **defaults) -> SimpleNamespace:
    """Parse `TrainingFlags` plus a recipe's own dataclass; bad flags exit with one `error:` line.

    Args:
        recipe_args: the recipe's dataclass of its own flags (no field may repeat a core flag).
        argv: the arguments (default `sys.argv[1:]`).
        defaults: recipe defaults for any flag, core or own (e.g. `learning_rate=1e-3`).

    Returns:
        One namespace with every flag of both dataclasses as an attribute.

    Raises:
        SystemExit: `error: ...` for an unknown flag, a value of the wrong type, a count below
            its minimum, or an `--output_dir` that already holds files while neither
            `--overwrite_output_dir` nor `--resume_from_checkpoint` is given (a fresh run would
            overwrite the earlier run's metrics, export and, through `--save_total_limit`, its
            checkpoints).

    On a restart (torchrun's `--max_restarts`, a SLURM requeue: `checkpoint.restart_note`), a run
    without `--resume_from_checkpoint` resumes as with `auto`, and `--overwrite_output_dir`
    applies to the first attempt only (it would delete the checkpoints the job is restarting from).
    """
    parser = HfArgumentParser((TrainingFlags, recipe_args))
    parser.error = lambda message: sys.exit(f"error: {message}")  # argparse would print the whole usage first
    parser.set_defaults(**defaults)
    try:
        core, own = parser.parse_args_into_dataclasses(args=argv)
    except ValueError as err:  # e.g. "Some specified arguments are not used by the HfArgumentParser: [...]"
        sys.exit(f"error: {err}")
    args = SimpleNamespace(**asdict(core), **asdict(own))
    for flag in ("per_device_train_batch_size", "gradient_accumulation_steps", "logging_steps"):
        if getattr(args, flag) < 1:
            sys.exit(f"error: --{flag} must be at least 1, got {getattr(args, flag)}")
    for flag in ("save_steps", "warmup_steps", "max_grad_norm", "weight_decay"):
        if getattr(args, flag) < 0:
            sys.exit(f"error: --{flag} must not be negative, got {getattr(args, flag)}")
    if args.max_steps == 0 or args.max_steps < -1:
        sys.exit(f"error: --max_steps must be positive, or -1 to train --num_train_epochs, got {args.max_steps}")
    if args.max_steps == -1 and args.num_train_epochs <= 0:
        sys.exit(f"error: --num_train_epochs must be positive, got {args.num_train_epochs}")
    from accelerate.utils import LoggerType

    trackers = [t.strip() for t in args.report_to.split(",")]
    if args.report_to != "none" and (bad := [t for t in trackers if t not in {k.value for k in LoggerType}]):
        sys.exit(f"error: --report_to {args.report_to}: unknown tracker {', '.join(bad)}; choose 'none' or from "
                 f"{', '.join(k.value for k in LoggerType)}")
    if args.output_dir is None:
        sys.exit("error: --output_dir is required")
    restarted = bool(restart_note())
    if restarted and args.resume_from_checkpoint is None:
        args.resume_from_checkpoint = "auto"  # a restarted job continues; it never starts over
    if args.resume_from_checkpoint == "auto" and args.overwrite_output_dir:
        if restarted:
            args.overwrite_output_dir = False  # meant for the first attempt, not for this job's own checkpoints
        else:
            args.resume_from_checkpoint = None  # the first attempt writes over the directory
    if error := output_dir_error(args.output_dir, args.overwrite_output_dir, args.resume_from_checkpoint, restarted):
        sys.exit(f"error: {error}")
    return args


def output_dir_error(output_dir: str, overwrite: bool, resume_from_checkpoint: str | None,
                     restarted: bool = False) -> str | None:
    """A message if a fresh run would write into a directory that already holds files, else None.

    Call on every rank before anything is written (before the `Accelerator`: its process-group
    set-up waits for every rank, so no rank can have written yet). The rule is `run_clm.py`'s:
    a non-empty `output_dir` needs `--overwrite_output_dir` or a resume. `auto` counts as a resume
    when there is a complete checkpoint to take, or when this is a restart of the same job
    (`restarted`: its first attempt wrote the files, and died before its first checkpoint).
    """
    resumable = os.path.isdir(output_dir) and any(Path(output_dir).glob("checkpoint-*/COMPLETE.json"))
    resuming = resume_from_checkpoint not in (None, "auto") or (resume_from_checkpoint == "auto" and
                                                                 (resumable or restarted))
    held = sorted(set(os.listdir(output_dir)) - {".lock"}) if os.path.isdir(output_dir) else []  # (common/run_dir.py)
    if overwrite or resuming or not held:
        return None
    return (f"--output_dir {output_dir} already holds files ({', '.join(held[:4])}"
            f"{', ...' if len(held) > 4 else ''}): a fresh run would overwrite them"
            + (" (--resume_from_checkpoint auto found no complete checkpoint to resume from)"
               if resume_from_checkpoint == "auto" else "") + ". Pass "
            + ("--resume_from_checkpoint latest to continue that run, " if resumable else "")
            + "--overwrite_output_dir to delete them and start over, or another --output_dir")


def unsupported(args: SimpleNamespace, recipe: str, **why: str) -> None:
    """Exit with one `error:` line if a core flag this recipe cannot honour was changed from its default.

    The default compared against is `TrainingFlags`'s, so a recipe must not give a refused flag a
    default of its own.

    Args:
        args: the parsed flags.
        recipe: the recipe's file name, for the message.
        why: flag name -> the reason it does not apply (e.g. `save_steps="it saves no checkpoints"`).
    """
    defaults = TrainingFlags()
    for flag, reason in why.items():
        if getattr(args, flag) != getattr(defaults, flag):
            sys.exit(f"error: {recipe} does not take --{flag}: {reason}")
