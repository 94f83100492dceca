"""Command outputs shown in README.md and docs/*.md are today's: a fenced block after

    <!-- output of: COMMAND -->

is what COMMAND prints (stdout and stderr, from the repository root, 100 columns; only commands
that take seconds). An optional line `<!-- masked: REGEX -->` between the two masks what a host
measures or names (timings, tokens/s, the CPU): REGEX's matches compare as equal, every other
character must match. `UPDATE_DOCS=1 python -m pytest tests/test_doc_outputs.py` rewrites the
blocks (keeping the page's text where masked). Outputs of long runs say who checks them instead:

    <!-- output of a run: checked by tests/test_X.py -->
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
MARKER = re.compile(r"<!-- output of(?:: (?P<command>.+?)| a run: checked by (?P<test>\S+)) -->")
MASK = re.compile(r"<!-- masked: (?P<regex>.+) -->")


def blocks(page: Path) -> list[dict]:
    """Each marked block: its command (or checking test), mask, text and line span on the page."""
    lines, found = page.read_text().splitlines(), []
    for n, line in enumerate(lines):
        if not (m := MARKER.fullmatch(line.strip())):
            continue
        rest = [i for i in range(n + 1, len(lines)) if lines[i].strip()]  # blank lines aside
        mask = (k := MASK.fullmatch(lines[rest[0]].strip())) and k.group("regex")
        start = rest[1] if mask else rest[0]
        assert lines[start].startswith("```"), f"{page.name}:{n + 1}: a fenced block must follow"
        end = next(i for i in range(start + 1, len(lines)) if lines[i].startswith("```"))
        text = "\n".join(lines[start + 1 : end])
        found.append({**m.groupdict(), "mask": mask, "text": text, "span": (start + 1, end)})
    return found


MARKED = [(page, b) for page in PAGES for b in blocks(page)]


def run(command: str) -> str:
    env = {**os.environ, "COLUMNS": "100", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        command, shell=True, cwd=REPO, env=env, timeout=120, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    return proc.stdout.rstrip("\n")


def masked(text: str, regex: str | None) -> str:
    return re.sub(regex, "<masked>", text) if regex else text


def keep_masked(page_text: str, output: str, regex: str | None) -> str:
    """`output` with each masked span replaced by the page's own, in order (when they pair up)."""
    theirs = list(re.finditer(regex or "$^", output))
    ours = [m.group(0) for m in re.finditer(regex or "$^", page_text)]
    if not regex or len(theirs) != len(ours):
        return output
    for m, kept in reversed(list(zip(theirs, ours))):
        output = output[: m.start()] + kept + output[m.end() :]
    return output


@pytest.mark.parametrize(
    "page, block",
    [(p, b) for p, b in MARKED if b["command"]],
    ids=lambda x: x.name if isinstance(x, Path) else x["command"][:60],
)
def test_a_shown_output_is_what_the_command_prints(page, block):
    output = run(block["command"])
    if os.environ.get("UPDATE_DOCS") == "1":
        lines = page.read_text().splitlines()
        start, end = block["span"]
        new = keep_masked(block["text"], output, block["mask"]).splitlines()
        page.write_text("\n".join([*lines[:start], *new, *lines[end:]]) + "\n")
        return
    assert masked(output, block["mask"]) == masked(block["text"], block["mask"]), (
        f"{page.name}: run `UPDATE_DOCS=1 python -m pytest tests/test_doc_outputs.py`, or fix the "
        f"code; `{block['command']}` prints:\n{output}"
    )


def test_a_run_output_names_a_test_that_exists():
    for page, block in MARKED:
        if block["test"]:
            test_file = REPO / block["test"].split("::")[0]
            assert test_file.is_file() and block["text"].strip(), (page, block)


def test_the_blocks_are_found():
    """The markers this file reads are where it expects them (a marker it missed checks nothing)."""
    pages = {page.name for page, _ in MARKED}
    assert {"README.md", "mixed_precision.md"} <= pages, pages
    comments = sum(p.read_text().count("<!-- output of") for p in PAGES)
    assert comments == len(MARKED)


def test_the_readme_sample_is_what_the_export_prints():
    """README's sample comes from a long run; its frame is `causal_lm.sample_from_export`'s, and
    its prompt is the start of the validation data (the first held-out work)."""
    sys.path.insert(0, str(REPO))
    import inspect

    from common import causal_lm, data

    (sample,) = [
        b
        for p, b in MARKED
        if p.name == "README.md" and b["test"] == Path(__file__).relative_to(REPO).as_posix()
    ]
    head, body, foot = (
        sample["text"].split("\n", 1)[0],
        *sample["text"].split("\n", 1)[1].rsplit("\n", 1),
    )
    source = inspect.getsource(causal_lm.sample_from_export)
    frame = re.search(r'f"(--- sample from \{export_dir\}[^"]*)\\n"', source).group(1)
    assert head == frame.replace("{export_dir}", "runs/llama/final") and foot == "---"
    prompt = body.split("|", 1)[0]
    first_held_out = data.load_text_dataset(None, None, None, None, 5)["validation"][0]["text"]
    assert " ".join(first_held_out.split()).startswith(" ".join(prompt.split())), prompt
