"""`--help` of every script under recipes/ and tools/, as a user reads it: a recipe's flags in the
groups users look in, each default shown once, no dashed alias beside a flag, no flag the recipe
refuses. In-process: argparse prints the help and exits before any work."""

import re
import runpy
import sys
from pathlib import Path

import pytest

import common.args
from conftest import run_in_process

REPO = Path(__file__).resolve().parent.parent
RECIPES = sorted((REPO / "recipes").glob("*.py"))
TOOLS = sorted(
    p for p in (REPO / "tools").glob("*.py") if p.name not in ("__init__.py", "planner.py")
)
GROUPS = ["options", *common.args.GROUPS, "this recipe"]


def help_of(script: Path, monkeypatch, capsys) -> tuple[str, set[str]]:
    """(the --help text at 100 columns, the flags the script asked the parser to hide)."""
    hidden = set()
    parse_flags = common.args.parse_flags

    def recording(types, argv=None, description=None, hidden_flags=(), **defaults):
        hidden.update(hidden_flags)
        return parse_flags(types, argv, description, hidden_flags, **defaults)

    monkeypatch.setattr(common.args, "parse_flags", recording)
    monkeypatch.setattr(sys, "argv", [str(script), "--help"])
    monkeypatch.setenv("COLUMNS", "100")
    with pytest.raises(SystemExit) as exc:
        runpy.run_path(str(script), run_name="__main__")
    out = capsys.readouterr().out
    assert exc.value.code == 0, out
    return out, hidden


def entries(text: str) -> list[tuple[str, str, str]]:
    """(group title, the flag's invocation, its help) for each option, wrapped lines joined."""
    group, out = None, []
    for line in text.splitlines():
        if re.match(r"\S.*:$", line):
            group = line[:-1]
        elif group and re.match(r"  -", line):
            invocation, _, help_text = line.strip().partition("  ")
            out.append([group, invocation, help_text.strip()])
        elif group and out and line.startswith("    "):
            out[-1][2] = f"{out[-1][2]} {line.strip()}".strip()
    return [tuple(e) for e in out]


@pytest.mark.parametrize("script", RECIPES + TOOLS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_help_shows_each_flag_once_with_its_default_once(script, monkeypatch, capsys):
    text, hidden = help_of(script, monkeypatch, capsys)
    flags = entries(text)
    assert flags and flags[0][1] == "-h, --help", text
    names = [inv.split()[0].rstrip(",") for _, inv, _ in flags]
    for name in names:  # HfArgumentParser's --output-dir beside --output_dir
        assert name.replace("_", "-") == name or name.replace("_", "-") not in text, name
    assert len(names) == len(set(names)), names
    for group, invocation, help_text in flags:
        assert len(re.findall(r"\bdefault\b", help_text)) <= 1, (invocation, help_text)
    for name in hidden:
        assert f"--{name}" not in names, name
    if script.parent.name != "recipes":
        return
    titles = [re.sub(r" \(.*", "", g) for g in dict.fromkeys(g for g, _, _ in flags)]
    assert titles == [g for g in GROUPS if g in titles], titles  # the groups, in this order
    assert {"model", "training", "output and checkpoints"} <= set(titles), titles
    for group, invocation, help_text in flags[1:]:  # every flag but -h states its default
        assert re.search(r"\bdefault\b|\(required\)", help_text), (invocation, help_text)
    assert text.startswith(f"usage: {script.name} [-h] [--FLAG VALUE ...]\n"), (
        "a usage of every flag"
    )


def test_a_refused_flag_is_hidden_yet_still_refused(monkeypatch, capsys, tmp_path):
    """gradient_checkpointing.py refuses twelve core flags: --help leaves them out, a run stops."""
    script = REPO / "recipes" / "gradient_checkpointing.py"
    text, hidden = help_of(script, monkeypatch, capsys)
    assert hidden == {
        "warmup_steps",
        "warmup_ratio",
        "lr_scheduler_type",
        "lr_scheduler_kwargs",
        "num_train_epochs",
        "logging_steps",
        "save_steps",
        "resume_from_checkpoint",
        "report_to",
        "run_name",
        "logging_dir",
        "dataloader_num_workers",
    }
    names = [inv.split()[0] for _, inv, _ in entries(text)]
    assert "--learning_rate" in names and "--warmup_steps" not in names
    message = run_in_process(monkeypatch, script, "--output_dir", tmp_path, "--warmup_steps", 2)
    assert message.startswith("error: gradient_checkpointing.py does not take --warmup_steps: ")


def test_a_default_that_differs_from_training_arguments_is_marked(monkeypatch, capsys):
    text, _ = help_of(REPO / "recipes" / "llama.py", monkeypatch, capsys)
    helps = {inv.split()[0]: h for _, inv, h in entries(text)}
    assert helps["--adam_beta2"] == "(default: 0.95; TrainingArguments: 0.999)"
    assert helps["--learning_rate"] == "peak LR (default: 0.003; TrainingArguments: 5e-05)"
    assert helps["--adam_beta1"] == "(default: 0.9)"  # the same default: no mark
    assert "not run_clm's Hub download cache" in helps["--cache_dir"]
    assert (
        helps["--per_device_train_batch_size"] == "micro batch per rank (at least 1) (default: 8)"
    )


def test_the_dashed_spelling_still_parses():
    """HfArgumentParser's --output-dir spelling is hidden from --help, not refused."""
    parsed, given = common.args.parse_flags(
        (common.args.TrainingFlags,), ["--output-dir", "x", "--max-steps", "3"]
    )
    assert parsed[0].output_dir == "x" and parsed[0].max_steps == 3
    assert given == {"output_dir", "max_steps"}


def test_a_field_whose_help_is_suppress_is_hidden():
    """A core flag declared `flag(..., help=argparse.SUPPRESS)` (one every recipe refuses) stays
    out of `--help`, its range and default too."""
    import argparse
    import dataclasses

    @dataclasses.dataclass
    class Own:
        shown: int = common.args.flag(3, "a flag", low=0)
        refused: int = common.args.flag(0, argparse.SUPPRESS, low=0)

    parser = common.args._FlagParser((common.args.TrainingFlags, Own), prog="x.py")
    text = parser.format_help()
    assert "this recipe:\n  --shown SHOWN" in text, text
    assert "--refused" not in text and "SUPPRESS" not in text, text
    assert "a flag (at least 0) (default: 3)" in " ".join(text.split())
