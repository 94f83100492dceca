"""The core `transformers.TrainingArguments` flags every recipe takes, and one parser for them:
`parse_args(RecipeArgs, **defaults)`; an integer flag states its range (`flag(..., low=, high=)`)."""

from __future__ import annotations

import argparse
import copy
import dataclasses
import os
import re
import sys
import typing
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import SimpleNamespace

from transformers import HfArgumentParser

from common import errors, schedule
from common.errors import Stop
from common.run_dir import restart_note

SEED_MAX = 2**32 - 1  # numpy's seed range; set_seed seeds numpy too


def flag(default=None, help: str = "", *, low: float | None = None, high: float | None = None):
    """A dataclass field for a flag in [low, high] (None: open; a value of None always passes)."""
    return field(default=default, metadata={"help": help, "range": (low, high)})


def choice(choices: tuple[str, ...], aliases: dict[str, str] = {}, help: str = ""):
    """A dataclass field for one of `choices` (the first by default), any case, or an alias."""
    meta = {"help": help, "choices": choices, "value_aliases": aliases}
    return field(default=choices[0], metadata=meta)


def range_text(low, high) -> str:
    if low is not None and high is not None:
        return f"{low} to {high}"
    return f"at least {low}" if low is not None else f"at most {high}" if high is not None else ""


# --help's groups: the first its name matches, else training (core flags), else "this recipe"
GROUPS = {
    "model": r"model_|config_[no]|tokenizer|vocab|hidden|attention|intermediate|peft|lora|chat_|new_w|gradient_c",
    "data": r"data|_file$|split|block_size|max_length|packing|samples|cache_dir|assistant_only",
    "training": "^$",
    "output and checkpoints": r"output_dir|save_[st]|resume",
    "logging": r"logging|report_to|run_name|peak_tflops|record_sample_ids",
}
CACHE_HELP = "this project's tokenize/pack cache, not run_clm's Hub download cache (HF_HOME)"


class _FlagParser(HfArgumentParser):
    """`HfArgumentParser` with flag ranges and choices, `--help` grouped (with `TrainingFlags`),
    each default once, the `hidden` flags left out, and one `error:` line for a bad flag."""

    def __init__(self, types, hidden=(), defaults={}, **kwargs):
        super().__init__(types, usage="%(prog)s [-h] [--FLAG VALUE ...]", **kwargs)
        from transformers import TrainingArguments

        self.set_defaults(**defaults)
        theirs = {f.name: f.default for f in dataclasses.fields(TrainingArguments)}
        groups = {t: self.add_argument_group(t or "this recipe") for t in [*GROUPS, None]}
        for action in self._actions[1:]:  # -h aside, one per field
            name, other = action.dest, theirs.get(action.dest)
            action.option_strings = [n for n in action.option_strings if "-" not in n[2:]]
            hide = name in hidden or argparse.SUPPRESS in action.help  # refused, or help=SUPPRESS
            if hide or action.option_strings[0].startswith("--no_"):  # or `--x false`'s twin
                action.help = argparse.SUPPRESS
            elif not re.search("default|required", action.help):  # the default once, marked
                other = "" if other in (None, dataclasses.MISSING, action.default) else other
                other = f"; TrainingArguments: {other}" * (other != "")
                action.help = f"{action.help} (default: {action.default}{other})".lstrip()
            core = name in theirs or name in TrainingFlags.__dataclass_fields__
            title = next((t for t, r in GROUPS.items() if re.search(r, name)), core and "training")
            if TrainingFlags in self.dataclass_types:  # a recipe's flags
                self._optionals._group_actions.remove(action)
                groups[title or None]._group_actions.append(action)

    def _get_formatter(self):  # the docstring as written
        return argparse.RawDescriptionHelpFormatter(self.prog, max_help_position=36)

    def error(self, message):  # argparse would print the whole usage first
        raise Stop(message)

    @staticmethod
    def _parse_dataclass_field(parser, field):
        meta, field = dict(field.metadata), copy.copy(field)
        low, high = meta.pop("range", (None, None))
        if int in (field.type, *typing.get_args(field.type)) and "range" not in field.metadata:
            raise TypeError(f"--{field.name}: an integer flag needs a range (flag(low=, high=))")
        aliases = meta.pop("value_aliases", {})  # `choice`: any case, aliases mapped to a choice
        if "choices" in meta:
            field.type = lambda word: aliases.get(word.lower(), word.lower())
        notes = ", ".join(f"{a} = {c}" for a, c in aliases.items()), range_text(low, high)
        text = meta.get("help") or CACHE_HELP * (field.name == "cache_dir")
        # argparse %-formats help texts ("%(default)s"): a literal % must be doubled
        meta["help"] = " ".join([text, *(f"({n})" for n in notes if n)]).strip().replace("%", "%%")
        field.metadata = meta
        HfArgumentParser._parse_dataclass_field(parser, field)


def parse_flags(
    types: tuple, argv: list | None = None, description: str | None = None, hidden=(), **defaults
) -> tuple[tuple, set[str]]:
    """(one instance per dataclass of flags, the names given on the command line); Stop for an
    unknown flag, a wrong type or a value out of range. `hidden`: flags left out of `--help`."""
    _stop_launch_line_flags(types, argv)
    parser = _FlagParser(types, hidden, defaults, description=description)
    try:
        parsed = parser.parse_args_into_dataclasses(args=argv)
    except ValueError as err:  # "Some specified arguments are not used by the HfArgumentParser"
        raise Stop(str(err)) from None
    for f, value in ((f, getattr(i, f.name)) for i in parsed for f in dataclasses.fields(i)):
        lo, hi = f.metadata.get("range", (None, None))
        if value is not None and (lo is not None and value < lo or hi is not None and value > hi):
            raise Stop(f"--{f.name} must be {range_text(lo, hi)}, got {value}")
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
    lr_scheduler_type: str = choice(schedule.SCHEDULES, help="a transformers.get_scheduler name")
    lr_scheduler_kwargs: str = flag(None, """JSON, e.g. '{"min_lr_rate": 0.1}'""")
    warmup_steps: float = flag(0, "steps; below 1, a share of the run (transformers 5)", low=0)
    warmup_ratio: float = flag(0.0, "a share of the run, if --warmup_steps is 0", low=0, high=1)
    max_steps: int = flag(-1, "optimizer steps, not 0; -1: --num_train_epochs decides", low=-1)
    num_train_epochs: float = 1.0
    logging_steps: int = flag(10, low=1)
    save_steps: int = flag(0, "checkpoint every N optimizer steps; 0 = never", low=0)
    resume_from_checkpoint: str = flag(
        None, "a checkpoint path, 'latest', or 'auto' (the newest if any, else a fresh start)"
    )
    max_grad_norm: float = flag(1.0, "clip to this global norm; 0 logs it, clips nothing", low=0)
    report_to: str = flag("none", "Accelerate tracker(s): a name, a comma list, 'all' or 'none'")
    run_name: str = flag(None, "the run's name in wandb, mlflow, trackio, clearml")
    logging_dir: str = flag(None, "tracker folder (TensorBoard: DIR/<recipe>), else --output_dir")
    dataloader_num_workers: int = flag(0, "DataLoader worker processes per rank", low=0)


# TrainingArguments' flags that belong to the launch line here: each stops, saying where it goes.
LAUNCH_FLAGS = {
    p: f"precision is set on the launch line: accelerate launch --mixed_precision {p} ... "
    f"(or mixed_precision: {p} in the config)"
    for p in ("bf16", "fp16")
}
LAUNCH_FLAGS |= {
    "half_precision_backend": LAUNCH_FLAGS["fp16"],
    "tf32": "TF32 is PyTorch's: the recipes keep its default (off); in a copy, set "
    "torch.backends.cuda.matmul.allow_tf32 = True",
    "deepspeed": "DeepSpeed is set on the launch line: accelerate launch --config_file "
    "accelerate_configs/deepspeed_zero2.yaml (zero3, zero3_offload), or accelerate launch "
    "--use_deepspeed --deepspeed_config_file FILE",
    "fsdp": "FSDP is set on the launch line: accelerate launch --config_file "
    "accelerate_configs/fsdp.yaml (its fsdp_config: holds the FSDP settings)",
}
LAUNCH_FLAGS["fsdp_config"] = LAUNCH_FLAGS["fsdp"]


def _stop_launch_line_flags(types: tuple, argv: list[str] | None) -> None:
    """Stop on a flag of `LAUNCH_FLAGS` not in `types` (the recipe's own), naming where it goes."""
    own = {f.name for t in types for f in dataclasses.fields(t)}  # mixed_precision's --precision
    for word in map(str, sys.argv[1:] if argv is None else argv):
        name = word.removeprefix("--").split("=")[0].replace("-", "_")
        if word[:2] == "--" and name in LAUNCH_FLAGS and name not in own:
            hint = LAUNCH_FLAGS[name]
            if "precision" in own and hint.startswith("precision"):
                hint = "this recipe sets the precision with --precision (auto, no, bf16, fp16)"
            raise Stop(f"--{name}: {hint}")


class Flags(SimpleNamespace):
    """Every flag as an attribute, and `given`: the names the user passed (a slot: not in `vars()`)."""

    __slots__ = ("given",)


def parse_args(
    recipe_args: type, argv: list | None = None, description=None, refuse: dict = {}, **defaults
) -> Flags:
    """`TrainingFlags` and the recipe's own flags in one namespace. `defaults`: the recipe's, never
    over a flag the user gave (`--num_train_epochs` alone sets `max_steps` to -1; with both,
    `--max_steps` wins, as in `TrainingArguments`). `refuse`: core flags it cannot honour -> why:
    hidden from `--help`, refused if set. A restarted job (torchrun's `--max_restarts`, a SLURM
    requeue) resumes as with `auto`; `--overwrite_output_dir` applies to its first attempt only."""
    types = (TrainingFlags, recipe_args)
    (core, own), given = parse_flags(types, argv, description, refuse, **defaults)
    args = Flags(**asdict(core), **asdict(own))
    args.given = given
    for flag, why in refuse.items():  # given, or a recipe default other than TrainingFlags'
        if flag in given or getattr(args, flag) != getattr(TrainingFlags(), flag):
            raise Stop(f"{Path(sys.argv[0]).name} does not take --{flag}: {why}")
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
    if "warmup_ratio" in given and "warmup_steps" not in given:
        args.warmup_steps = 0  # a recipe's default step count yields to the user's ratio
    elif "warmup_ratio" in given and args.warmup_steps and args.warmup_ratio:
        errors.warn(
            f"--warmup_steps {args.warmup_steps:g} and --warmup_ratio {args.warmup_ratio:g} both "
            "given: --warmup_steps wins (as in transformers 4's TrainingArguments)"
        )
    if args.lr_scheduler_type == "constant" and (args.warmup_steps or args.warmup_ratio):
        errors.warn(
            "--lr_scheduler_type constant has no warmup (transformers.get_scheduler ignores "
            "--warmup_steps and --warmup_ratio): constant_with_warmup has one"
        )
    import torch  # a dry run: a keyword the schedule lacks or needs stops now, not after the data

    schedule.lr_scheduler(torch.optim.SGD([torch.zeros(1)]), args, max_steps=10)
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
    """--report_to as the trackers to start ("none"; 'all': those installed); Stop for an unknown
    name or one not installed (Accelerate would skip it silently)."""
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
    """Create `output_dir` and its parents, or Stop (a file in the way, read-only, no permission)."""
    try:
        os.makedirs(output_dir, exist_ok=True)
    except OSError as err:
        raise Stop(f"--output_dir {output_dir}: cannot create it ({err.strerror})") from None


def _check_output_dir(
    output_dir: str, overwrite: bool, resume_from_checkpoint: str | None, restarted: bool
) -> None:
    """Stop if `output_dir` is a file, or if a fresh run would write over its files (`run_clm.py`'s
    rule); `auto` resumes from a complete checkpoint, or on a restart. On every rank, first."""
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
