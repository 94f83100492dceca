"""The core `transformers.TrainingArguments` flags, shared by every recipe, and one parser for them.

Each recipe declares only its own flags in a dataclass and calls `parse_args(RecipeArgs,
**defaults)`: `HfArgumentParser` takes both dataclasses, so `--max_steps`, `--output_dir`, ...
exist in every recipe with the same meaning, and each recipe only chooses its defaults.

Every integer flag declares its range with `flag(..., low=, high=)`: the parser checks it (one
`error:` line), `--help` states it, and a parser refuses to build for an integer flag without one.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import os
import typing
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import SimpleNamespace

from transformers import HfArgumentParser

from common.checkpoint import restart_note
from common.errors import Stop

SEED_MAX = 2**32 - 1  # numpy's seed range; set_seed seeds numpy too


def flag(default=None, help: str = "", *, low: float | None = None, high: float | None = None):
    """A dataclass field for a flag whose value must lie in [low, high] (either may be None: open).

    `parse_flags` checks the range (None, "not set", always passes) and appends it to the help.
    """
    return field(default=default, metadata={"help": help, "range": (low, high)})


def choice(choices: tuple[str, ...], aliases: dict[str, str] | None = None, help: str = ""):
    """A dataclass field for a flag that takes one of `choices`, the first by default; `aliases` maps
    other words to one of them (e.g. {"true": "stream"}), any case. The parser stores the choice,
    never the alias, and refuses any other word in one `error:` line naming the choices."""
    return field(
        default=choices[0],
        metadata={"help": help, "choices": choices, "value_aliases": aliases or {}},
    )


def range_text(low, high) -> str:
    """'at least 1', 'at most 9', '1 to 99' or '' for a (low, high) range."""
    if low is not None and high is not None:
        return f"{low} to {high}"
    return f"at least {low}" if low is not None else f"at most {high}" if high is not None else ""


class FlagParser(HfArgumentParser):
    """`HfArgumentParser` with flag ranges, a literal '%' in help texts, the module docstring kept
    as written, and one `error:` line (no usage block) for a bad flag."""

    class Formatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
        pass

    def __init__(self, dataclass_types, **kwargs):
        super().__init__(dataclass_types, formatter_class=self.Formatter, **kwargs)

    def error(self, message):  # argparse would print the whole usage first
        raise Stop(message)

    @staticmethod
    def _parse_dataclass_field(parser, field):
        meta = dict(field.metadata)
        if "choices" in meta:  # `choice`: one word of a list, aliases mapped to it before the check
            aliases = meta["value_aliases"]
            alias_text = ", ".join(f"{a} = {c}" for a, c in aliases.items())
            parser.add_argument(
                f"--{field.name}",
                default=field.default,
                choices=meta["choices"],
                type=lambda word: aliases.get(word.lower(), word.lower()),
                help=(meta["help"] + (f" ({alias_text})" if aliases else "")).replace("%", "%%"),
            )
            return
        low, high = meta.pop("range", (None, None))
        if int in (field.type, *typing.get_args(field.type)) and "range" not in field.metadata:
            raise TypeError(
                f"--{field.name}: an integer flag needs a range (common.args.flag(low=, high=))"
            )
        # argparse %-formats help texts ("%(default)s"): a literal % must be doubled
        text = " ".join(
            filter(
                None,
                [
                    meta.get("help", ""),
                    f"({range_text(low, high)})" if range_text(low, high) else "",
                ],
            )
        )
        meta["help"] = text.replace("%", "%%")
        field = copy.copy(field)
        field.metadata = meta
        HfArgumentParser._parse_dataclass_field(parser, field)


def check_ranges(instance) -> None:
    """Raise `Stop` for the first flag of a dataclass instance outside its `flag` range."""
    for f in dataclasses.fields(instance):
        low, high = f.metadata.get("range", (None, None))
        value = getattr(instance, f.name)
        if value is not None and (
            (low is not None and value < low) or (high is not None and value > high)
        ):
            raise Stop(f"--{f.name} must be {range_text(low, high)}, got {value}")


def parse_flags(
    types: tuple, argv: list[str] | None = None, description: str | None = None, **defaults
) -> tuple[tuple, set[str]]:
    """Parse dataclasses of flags: one `error:` line for an unknown flag, a wrong type or a value out of range.

    Returns:
        (one instance per dataclass, the names of the flags given on the command line).
    """
    parser = FlagParser(types, description=description)
    parser.set_defaults(**defaults)
    try:
        parsed = parser.parse_args_into_dataclasses(args=argv)
    except (
        ValueError
    ) as err:  # e.g. "Some specified arguments are not used by the HfArgumentParser: [...]"
        raise Stop(str(err)) from None
    for instance in parsed:
        check_ranges(instance)
    # what the user typed: the same parser with every default suppressed (abbreviations and --no_x included)
    parser._defaults.clear()  # set_defaults' copies would fill the namespace
    for action in parser._actions:
        action.default = argparse.SUPPRESS
    given, _ = parser.parse_known_args(argv)
    return tuple(parsed), set(vars(given))


@dataclass
class TrainingFlags:
    """The flags every recipe takes, named and meant as in `transformers.TrainingArguments`."""

    output_dir: str = field(
        default=None, metadata={"help": "where metrics, checkpoints and the export go"}
    )
    overwrite_output_dir: bool = field(
        default=False,
        metadata={
            "help": "train into an --output_dir that already holds files: everything in it (an earlier run's "
            "checkpoints, final/, metrics, logits probe, ...) is deleted at start-up, on the first attempt only "
            "(a restarted or requeued job keeps its checkpoints); with --resume_from_checkpoint PATH inside "
            "it, that checkpoint is kept"
        },
    )
    seed: int = flag(42, low=0, high=SEED_MAX)
    per_device_train_batch_size: int = flag(8, "micro batch per rank", low=1)
    gradient_accumulation_steps: int = flag(1, low=1)
    learning_rate: float = field(default=3e-3, metadata={"help": "peak LR"})
    weight_decay: float = flag(0.0, "AdamW decay; never on biases and norm weights", low=0)
    warmup_steps: int = flag(0, low=0)
    max_steps: int = flag(
        -1,
        "optimizer steps; -1: --num_train_epochs decides. Given with --num_train_epochs, "
        "--max_steps wins; --num_train_epochs alone overrides a recipe's default --max_steps",
        low=-1,
    )
    num_train_epochs: float = 1.0
    logging_steps: int = flag(10, low=1)
    save_steps: int = flag(0, "checkpoint every N optimizer steps; 0 = never", low=0)
    resume_from_checkpoint: str = field(
        default=None,
        metadata={
            "help": "a checkpoint path; 'latest' (the newest complete one); or 'auto' (the newest "
            "if there is one, else a fresh start: for jobs that restart or are requeued). Restarts default to 'auto'"
        },
    )
    max_grad_norm: float = flag(1.0, "clip to this global norm; 0 logs it, clips nothing", low=0)
    report_to: str = field(
        default="none",
        metadata={
            "help": "Accelerate tracker(s): one name (e.g. tensorboard), a comma list, 'all' (the installed ones) or "
            "'none'. One that is not installed is refused"
        },
    )


class Flags(SimpleNamespace):
    """Every flag as an attribute, and `given`: the names the user passed (a slot: not in `vars()`)."""

    __slots__ = ("given",)


def parse_args(
    recipe_args: type, argv: list[str] | None = None, description: str | None = None, **defaults
) -> Flags:
    """Parse `TrainingFlags` plus a recipe's own dataclass; a bad flag raises `Stop`.

    Args:
        recipe_args: the recipe's dataclass of its own flags (no field may repeat a core flag).
        argv: the arguments (default `sys.argv[1:]`).
        description: what `--help` prints first (the recipe's docstring).
        defaults: recipe defaults for any flag, core or own (e.g. `learning_rate=1e-3`).

    Returns:
        One namespace with every flag of both dataclasses as an attribute.

    Raises:
        Stop: one line for an unknown flag, a value of the wrong type or outside its
            `flag` range, a `--report_to` tracker unknown or not installed (`report_to`), an
            `--output_dir` that is a file, or an `--output_dir` that already holds files while
            neither `--overwrite_output_dir` nor `--resume_from_checkpoint` is given (a fresh run
            would overwrite the earlier run's metrics, export and, through `--save_total_limit`,
            its checkpoints).

    A recipe default never overrides a flag the user gave: `--num_train_epochs` without
    `--max_steps` sets `max_steps` to -1 (the epochs decide); with both, `--max_steps` wins, as in
    `TrainingArguments`, and rank 0 says so. A recipe's `per_device_eval_batch_size` left at None
    takes `--per_device_train_batch_size`.

    On a restart (torchrun's `--max_restarts`, a SLURM requeue: `checkpoint.restart_note`), a run
    without `--resume_from_checkpoint` resumes as with `auto`, and `--overwrite_output_dir`
    applies to the first attempt only (it would delete the checkpoints the job is restarting from).
    """
    (core, own), given = parse_flags((TrainingFlags, recipe_args), argv, description, **defaults)
    args = Flags(**asdict(core), **asdict(own))
    args.given = given
    if "num_train_epochs" in given and args.max_steps > 0:
        if "max_steps" in given:
            if os.environ.get("RANK", "0") == "0":
                print(
                    f"--max_steps {args.max_steps} and --num_train_epochs {args.num_train_epochs:g} both given: "
                    f"--max_steps wins (as in transformers.TrainingArguments)"
                )
        else:
            args.max_steps = (
                -1
            )  # the recipe's default step count must not override the epochs the user asked for
    if getattr(args, "per_device_eval_batch_size", 1) is None:  # a recipe's flag(None, ...)
        args.per_device_eval_batch_size = args.per_device_train_batch_size
    if args.max_steps == 0:
        raise Stop(
            f"--max_steps must be positive, or -1 to train --num_train_epochs, got {args.max_steps}"
        )
    if args.max_steps == -1 and args.num_train_epochs <= 0:
        raise Stop(f"--num_train_epochs must be positive, got {args.num_train_epochs}")
    args.report_to = report_to(args.report_to)
    if args.output_dir is None:
        raise Stop("--output_dir is required")
    restarted = bool(restart_note())
    if restarted and args.resume_from_checkpoint is None:
        args.resume_from_checkpoint = "auto"  # a restarted job continues; it never starts over
    if args.resume_from_checkpoint == "auto" and args.overwrite_output_dir:
        if restarted:
            args.overwrite_output_dir = (
                False  # meant for the first attempt, not for this job's own checkpoints
            )
        else:
            args.resume_from_checkpoint = None  # the first attempt writes over the directory
    if error := output_dir_error(
        args.output_dir, args.overwrite_output_dir, args.resume_from_checkpoint, restarted
    ):
        raise Stop(error)
    return args


# pip's name for a tracker's package, where it is not the tracker's (Accelerate checks for aim < 4)
TRACKER_PIP = {"comet_ml": "comet-ml", "aim": "'aim<4'"}


def report_to(text: str) -> str:
    """--report_to as `TrainingArguments` takes it (one tracker, a comma list, 'all', 'none'), checked
    and resolved: the comma list of the trackers to start, or "none". 'all' is every installed
    tracker Accelerate supports ("none" if there is none: rank 0 says so).

    Raises:
        Stop: an unknown name, 'none' with another name, or a tracker whose package is not installed
            (Accelerate's own check, `accelerate.utils.is_{name}_available`: it would skip it silently).
    """
    import accelerate.utils
    from accelerate.utils import LoggerType

    names = list(dict.fromkeys(n.strip().lower() for n in text.split(",") if n.strip())) or ["none"]
    known = [k.value for k in LoggerType if k.value != "all"]
    if bad := [n for n in names if n not in (*known, "all", "none")]:
        raise Stop(
            f"--report_to {text}: unknown tracker {', '.join(bad)}; choose 'none', 'all' or from "
            f"{', '.join(known)}"
        )
    if names == ["none"]:
        return "none"
    if "none" in names:
        raise Stop(f"--report_to {text}: 'none' cannot be combined with a tracker")
    installed = [n for n in known if getattr(accelerate.utils, f"is_{n}_available")()]
    if missing := [n for n in names if n != "all" and n not in installed]:
        packages = " and ".join(missing)
        raise Stop(
            f"--report_to {text}: the {packages} package{'s are' if len(missing) > 1 else ' is'} not "
            f"installed (pip install {' '.join(TRACKER_PIP.get(n, n) for n in missing)})"
        )
    if "all" in names:
        names = list(dict.fromkeys(m for n in names for m in (installed if n == "all" else [n])))
        if not names and os.environ.get("RANK", "0") == "0":
            print(
                f"--report_to {text}: no tracker Accelerate supports is installed; metrics.jsonl only"
            )
    return ",".join(names) or "none"


def make_output_dir(output_dir: str) -> None:
    """Create `output_dir` and its parents; raise `Stop` if that is impossible."""
    try:
        os.makedirs(output_dir, exist_ok=True)
    except (
        OSError
    ) as err:  # a file in the way, a read-only or virtual filesystem (/proc), no permission
        raise Stop(f"--output_dir {output_dir}: cannot create it ({err.strerror})")


def output_dir_error(
    output_dir: str, overwrite: bool, resume_from_checkpoint: str | None, restarted: bool = False
) -> str | None:
    """A message if `output_dir` is a file, or a fresh run would write into a directory that already
    holds files, else None.

    Call on every rank before anything is written (before the `Accelerator`: its process-group
    set-up waits for every rank, so no rank can have written yet). The rule is `run_clm.py`'s:
    a non-empty `output_dir` needs `--overwrite_output_dir` or a resume. `auto` counts as a resume
    when there is a complete checkpoint to take, or when this is a restart of the same job
    (`restarted`: its first attempt wrote the files, and died before its first checkpoint).
    """
    if os.path.exists(output_dir) and not os.path.isdir(output_dir):
        return f"--output_dir {output_dir} is a file, not a directory"
    resumable = os.path.isdir(output_dir) and any(
        Path(output_dir).glob("checkpoint-*/COMPLETE.json")
    )
    resuming = resume_from_checkpoint not in (None, "auto") or (
        resume_from_checkpoint == "auto" and (resumable or restarted)
    )
    held = (
        sorted(set(os.listdir(output_dir)) - {".lock"}) if os.path.isdir(output_dir) else []
    )  # (common/run_dir.py)
    if overwrite or resuming or not held:
        return None
    return (
        f"--output_dir {output_dir} already holds files ({', '.join(held[:4])}"
        f"{', ...' if len(held) > 4 else ''}): a fresh run would overwrite them"
        + (
            " (--resume_from_checkpoint auto found no complete checkpoint to resume from)"
            if resume_from_checkpoint == "auto"
            else ""
        )
        + ". Pass "
        + ("--resume_from_checkpoint latest to continue that run, " if resumable else "")
        + "--overwrite_output_dir to delete them and start over, or another --output_dir"
    )


def unsupported(args: SimpleNamespace, recipe: str, **why: str) -> None:
    """Raise `Stop` if a core flag this recipe cannot honour was given, or changed from its default.

    The default compared against is `TrainingFlags`'s, so a recipe must not give a refused flag a
    default of its own. A flag given at its default value is refused too: it would be ignored.

    Args:
        args: the parsed flags.
        recipe: the recipe's file name, for the message.
        why: flag name -> the reason it does not apply (e.g. `save_steps="it saves no checkpoints"`).
    """
    defaults = TrainingFlags()
    for flag, reason in why.items():
        if flag in getattr(args, "given", ()) or getattr(args, flag) != getattr(defaults, flag):
            raise Stop(f"{recipe} does not take --{flag}: {reason}")


def changed_flags(
    args: SimpleNamespace, recipe_args: type, defaults: dict, skip: set[str]
) -> list[str]:
    """The command-line words that pass every flag of `args` that differs from its default on to
    another launch, e.g. ["--max_steps", "4", "--overwrite_output_dir", "True"]; `skip` left out.

    Args:
        recipe_args: the recipe's dataclass; defaults: the recipe's own defaults for any flag (as
            given to `parse_args`), which win over `TrainingFlags`' and `recipe_args`' own.
    """
    default = {
        **asdict(TrainingFlags()),
        **{f.name: f.default for f in dataclasses.fields(recipe_args)},
        **defaults,
    }
    return [
        s
        for name, value in vars(args).items()
        if name not in skip and value != default[name]
        for s in (f"--{name}", str(value))
    ]
