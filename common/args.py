"""The core `transformers.TrainingArguments` flags every recipe takes, and one parser for them.

A recipe declares its own flags in a dataclass and calls `parse_args(RecipeArgs, **defaults)`.
Every integer flag declares its range with `flag(..., low=, high=)`: the parser checks it and
`--help` states it.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import os
import shutil
import sys
import typing
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import SimpleNamespace

from transformers import HfArgumentParser

from common import errors
from common.errors import Stop
from common.run_dir import restart_note

SEED_MAX = 2**32 - 1  # numpy's seed range; set_seed seeds numpy too


def flag(default=None, help: str = "", *, low: float | None = None, high: float | None = None):
    """A dataclass field for a flag in [low, high] (None: open; a value of None always passes)."""
    return field(default=default, metadata={"help": help, "range": (low, high)})


def choice(choices: tuple[str, ...], aliases: dict[str, str] | None = None, help: str = ""):
    """A dataclass field for a flag that takes one of `choices` (the first by default), any case;
    `aliases` maps other words to a choice, e.g. {"true": "stream"}."""
    return field(
        default=choices[0],
        metadata={"help": help, "choices": choices, "value_aliases": aliases or {}},
    )


def range_text(low, high) -> str:
    if low is not None and high is not None:
        return f"{low} to {high}"
    return f"at least {low}" if low is not None else f"at most {high}" if high is not None else ""


# --help's groups, as users look for a flag. Unlisted: a core flag goes to "training", a recipe's
# own flag to "this recipe" (the lesson's knobs).
GROUPS = {
    "model": "model_config model_name_or_path allow_new_weights config_name config_overrides "
    "tokenizer_name_or_path vocab_size chat_template hidden_size num_hidden_layers "
    "num_attention_heads intermediate_size use_peft lora_r lora_alpha lora_dropout "
    "lora_target_modules gradient_checkpointing",
    "data": "dataset_name dataset_config_name dataset_text_field train_file validation_file "
    "validation_split_percentage block_size max_length packing assistant_only_loss "
    "max_train_samples max_eval_samples cache_dir data_dir dataloader_num_workers "
    "dataloader_prefetch_factor dataloader_persistent_workers dataloader_pin_memory",
    "training": "",
    "output and checkpoints": "output_dir overwrite_output_dir save_steps save_total_limit "
    "resume_from_checkpoint",
    "logging": "logging_steps report_to run_name logging_dir peak_tflops record_sample_ids",
}
# help for a flag several recipes declare without one
SHARED_HELP = {
    "cache_dir": "this project's tokenize/pack cache (default: $ACCELERATE_RECIPES_CACHE, else "
    "~/.cache/accelerate-recipes); not the Hub download cache run_clm's --cache_dir sets (HF_HOME)",
}


class FlagParser(HfArgumentParser):
    """`HfArgumentParser` with flag ranges and choices, `--help` grouped (with `TrainingFlags`)
    and each default shown once, and one `error:` line (no usage block) for a bad flag.
    `hidden`: flags to leave out of `--help` (a recipe's refused flags)."""

    class Formatter(argparse.RawDescriptionHelpFormatter):
        def __init__(self, prog):
            super().__init__(
                prog, max_help_position=36, width=min(shutil.get_terminal_size()[0], 100)
            )

        def _format_action_invocation(self, action):  # --output_dir, not also --output-dir
            given = action.option_strings
            names = [
                n
                for n in given
                if n.replace("-", "_").replace("__", "--", 1) == n
                or n.replace("-", "_").replace("__", "--", 1) not in given
            ]
            if not names or action.nargs == 0:
                return ", ".join(names) or super()._format_action_invocation(action)
            return f"{names[0]} {self._format_args(action, action.metavar)}"

        def _format_action(self, action):
            if action.option_strings and action.default is not argparse.SUPPRESS:
                action = copy.copy(action)
                action.help = _help_text(action)
            return super()._format_action(action)

    def __init__(self, types, hidden=(), **kwargs):
        super().__init__(types, usage="%(prog)s [-h] [--FLAG VALUE ...]", **kwargs)
        fields = {f.name: f for t in self.dataclass_types for f in dataclasses.fields(t)}
        core = {f.name for f in dataclasses.fields(TrainingFlags)}
        grouped = TrainingFlags in self.dataclass_types
        groups = {title: self.add_argument_group(title) for title in GROUPS if grouped}
        own = grouped and self.add_argument_group(f"this recipe ({self.prog})")
        for action in list(self._optionals._group_actions):
            f = fields.get(action.dest)
            if f is None:
                continue
            action.range = f.metadata.get("range", (None, None))
            action.help = action.help or SHARED_HELP.get(f.name, "")
            if action.metavar is None and not action.choices and action.nargs != 0:
                action.metavar = {int: "INT", float: "FLOAT"}.get(
                    action.type, "BOOL" if action.nargs == "?" else "TEXT"
                )
            if f.name in hidden or action.option_strings[0].startswith("--no_"):  # `--x false`
                action.help = argparse.SUPPRESS
            if grouped:  # listed, else a core or TrainingArguments flag to training, else own
                title = next((t for t, names in GROUPS.items() if f.name in names.split()), None)
                core_flag = f.name in core or f.name in _trainer_defaults()
                group = groups[title or "training"] if title or core_flag else own
                self._optionals._group_actions.remove(action)
                group._group_actions.append(action)

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
        meta.pop("range", None)
        if int in (field.type, *typing.get_args(field.type)) and "range" not in field.metadata:
            raise TypeError(
                f"--{field.name}: an integer flag needs a range (common.args.flag(low=, high=))"
            )
        # argparse %-formats help texts ("%(default)s"): a literal % must be doubled
        if meta.get("help") != argparse.SUPPRESS:
            meta["help"] = meta.get("help", "").replace("%", "%%")
        field = copy.copy(field)
        field.metadata = meta
        HfArgumentParser._parse_dataclass_field(parser, field)


@functools.cache
def _trainer_defaults() -> dict:
    from transformers import TrainingArguments

    return {f.name: f.default for f in dataclasses.fields(TrainingArguments)}


def _help_text(action) -> str:
    """The flag's help, its range, and its default once (unless the help states it), marked where
    `transformers.TrainingArguments` defaults otherwise."""
    text = action.help or ""
    notes = [range_text(*getattr(action, "range", (None, None)))]
    if "default" not in text and "required" not in text:
        notes.append(f"default: {action.default}".replace("%", "%%"))
        other = _trainer_defaults().get(action.dest)
        if other not in (None, dataclasses.MISSING, action.default):
            notes.append(f"TrainingArguments: {other}")
    notes = "; ".join(n for n in notes if n)
    return f"{text} ({notes})".strip() if notes else text


def parse_flags(
    types: tuple,
    argv: list[str] | None = None,
    description: str | None = None,
    hidden: tuple = (),
    **defaults,
) -> tuple[tuple, set[str]]:
    """(one instance per dataclass of flags, the names given on the command line); Stop for an
    unknown flag, a wrong type or a value out of range. `hidden`: flags left out of `--help`."""
    parser = FlagParser(
        types, hidden, description=description, formatter_class=FlagParser.Formatter
    )
    parser.set_defaults(**defaults)
    try:
        parsed = parser.parse_args_into_dataclasses(args=argv)
    except ValueError as err:  # "Some specified arguments are not used by the HfArgumentParser"
        raise Stop(str(err)) from None
    for instance in parsed:
        for f in dataclasses.fields(instance):
            low, high = f.metadata.get("range", (None, None))
            value = getattr(instance, f.name)
            if value is not None and (
                low is not None and value < low or high is not None and value > high
            ):
                raise Stop(f"--{f.name} must be {range_text(low, high)}, got {value}")
    # what the user typed: the same parser with every default suppressed
    parser._defaults.clear()  # set_defaults' copies would fill the namespace
    for action in parser._actions:
        action.default = argparse.SUPPRESS
    given, _ = parser.parse_known_args(argv)
    return tuple(parsed), set(vars(given))


@dataclass
class TrainingFlags:
    """The flags every recipe takes, named and meant as in `transformers.TrainingArguments`."""

    output_dir: str = flag(None, "where metrics, checkpoints and the export go")
    overwrite_output_dir: bool = flag(
        False,
        "delete everything in --output_dir at start-up (first attempt only; a "
        "--resume_from_checkpoint PATH inside it is kept)",
    )
    seed: int = flag(42, low=0, high=SEED_MAX)
    per_device_train_batch_size: int = flag(8, "micro batch per rank", low=1)
    gradient_accumulation_steps: int = flag(1, low=1)
    learning_rate: float = flag(3e-3, "peak LR")
    weight_decay: float = flag(0.0, "AdamW decay; never on biases and norm weights", low=0)
    warmup_steps: int = flag(0, low=0)
    max_steps: int = flag(-1, "optimizer steps; -1: --num_train_epochs decides", low=-1)
    num_train_epochs: float = 1.0
    logging_steps: int = flag(10, low=1)
    save_steps: int = flag(0, "checkpoint every N optimizer steps; 0 = never", low=0)
    resume_from_checkpoint: str = flag(
        None, "a checkpoint path, 'latest', or 'auto' (the newest if any, else a fresh start)"
    )
    max_grad_norm: float = flag(1.0, "clip to this global norm; 0 logs it, clips nothing", low=0)
    report_to: str = flag("none", "Accelerate tracker(s): a name, a comma list, 'all' or 'none'")


class Flags(SimpleNamespace):
    """Every flag as an attribute, and `given`: the names the user passed (a slot: not in `vars()`)."""

    __slots__ = ("given",)


def parse_args(
    recipe_args: type,
    argv: list[str] | None = None,
    description: str | None = None,
    refuse: dict[str, str] | None = None,
    **defaults,
) -> Flags:
    """`TrainingFlags` and the recipe's own dataclass of flags, parsed into one namespace.

    `refuse`: core flags this recipe cannot honour -> why; left out of `--help`, and `unsupported`
    stops a run that sets one.

    `defaults`: the recipe's defaults for any flag (e.g. `learning_rate=1e-3`), which never
    override a flag the user gave: `--num_train_epochs` alone sets `max_steps` to -1 (the epochs
    decide); with both, `--max_steps` wins, as in `TrainingArguments`. A restarted job (torchrun's
    `--max_restarts`, a SLURM requeue) resumes as with `auto`, and `--overwrite_output_dir` applies
    to the first attempt only: it would delete the checkpoints the job restarts from.
    """
    refuse = refuse or {}
    (core, own), given = parse_flags(
        (TrainingFlags, recipe_args), argv, description, tuple(refuse), **defaults
    )
    args = Flags(**asdict(core), **asdict(own))
    args.given = given
    unsupported(args, Path(sys.argv[0]).name, **refuse)
    if "num_train_epochs" in given and args.max_steps > 0:
        if "max_steps" in given:
            errors.warn(
                f"--max_steps {args.max_steps} and --num_train_epochs {args.num_train_epochs:g} "
                "both given: --max_steps wins (as in transformers.TrainingArguments)"
            )
        else:
            args.max_steps = -1  # a recipe's default step count yields to the user's epochs
    if getattr(args, "per_device_eval_batch_size", 1) is None:  # a recipe's flag(None, ...)
        args.per_device_eval_batch_size = args.per_device_train_batch_size
    if args.max_steps == 0:
        raise Stop("--max_steps must be positive, or -1 to train --num_train_epochs, got 0")
    if args.max_steps == -1 and args.num_train_epochs <= 0:
        raise Stop(f"--num_train_epochs must be positive, got {args.num_train_epochs}")
    args.report_to = _resolve_trackers(args.report_to)
    if args.output_dir is None:
        raise Stop("--output_dir is required")
    restarted = bool(restart_note())
    if restarted and args.resume_from_checkpoint is None:
        args.resume_from_checkpoint = "auto"
    if args.resume_from_checkpoint == "auto" and args.overwrite_output_dir:
        if restarted:
            args.overwrite_output_dir = False  # not this job's own checkpoints
        else:
            args.resume_from_checkpoint = None  # the first attempt writes over the directory
    _check_output_dir(
        args.output_dir, args.overwrite_output_dir, args.resume_from_checkpoint, restarted
    )
    return args


def _resolve_trackers(text: str) -> str:
    """--report_to resolved: the comma list of trackers to start, or "none"; 'all' is every
    installed tracker Accelerate supports. Stop for an unknown name, or one whose package is not
    installed (Accelerate would skip it silently)."""
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
        pip = {"comet_ml": "comet-ml", "aim": "'aim<4'"}  # (Accelerate checks for aim < 4)
        raise Stop(
            f"--report_to {text}: the {' and '.join(missing)} "
            f"package{'s are' if len(missing) > 1 else ' is'} not installed "
            f"(pip install {' '.join(pip.get(n, n) for n in missing)})"
        )
    if "all" in names:
        names = list(dict.fromkeys(m for n in names for m in (installed if n == "all" else [n])))
        if not names:
            errors.warn(
                f"--report_to {text}: no tracker Accelerate supports is installed; metrics.jsonl only"
            )
    return ",".join(names) or "none"


def make_output_dir(output_dir: str) -> None:
    """Create `output_dir` and its parents; Stop if that is impossible (a file in the way, a
    read-only filesystem, no permission)."""
    try:
        os.makedirs(output_dir, exist_ok=True)
    except OSError as err:
        raise Stop(f"--output_dir {output_dir}: cannot create it ({err.strerror})") from None


def _check_output_dir(
    output_dir: str, overwrite: bool, resume_from_checkpoint: str | None, restarted: bool
) -> None:
    """Stop if `output_dir` is a file, or if a fresh run would write into a directory that holds
    files (`run_clm.py`'s rule: that needs `--overwrite_output_dir` or a resume). `auto` resumes
    when there is a complete checkpoint, or on a restart (the first attempt wrote the files and
    died before its first checkpoint). Call on every rank before anything is written."""
    if os.path.exists(output_dir) and not os.path.isdir(output_dir):
        raise Stop(f"--output_dir {output_dir} is a file, not a directory")
    held = sorted(set(os.listdir(output_dir)) - {".lock"}) if os.path.isdir(output_dir) else []
    resumable = any(Path(output_dir).glob("checkpoint-*/COMPLETE.json"))
    auto = resume_from_checkpoint == "auto"
    if overwrite or not held or resume_from_checkpoint and (not auto or resumable or restarted):
        return
    raise Stop(
        f"--output_dir {output_dir} already holds files ({', '.join(held[:4])}"
        f"{', ...' if len(held) > 4 else ''}): a fresh run would overwrite them"
        + (" (--resume_from_checkpoint auto found no complete checkpoint)" if auto else "")
        + ". Pass "
        + ("--resume_from_checkpoint latest to continue that run, " if resumable else "")
        + "--overwrite_output_dir to delete them and start over, or another --output_dir"
    )


def unsupported(args: SimpleNamespace, recipe: str, **why: str) -> None:
    """Stop if a core flag this recipe cannot honour was given or differs from `TrainingFlags`'
    default; `why`: flag name -> the reason, e.g. `save_steps="it saves no checkpoints"`."""
    defaults = TrainingFlags()
    for flag, reason in why.items():
        if flag in getattr(args, "given", ()) or getattr(args, flag) != getattr(defaults, flag):
            raise Stop(f"{recipe} does not take --{flag}: {reason}")
