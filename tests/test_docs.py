"""The README and docs/ as a reader meets them: every relative link resolves (file and heading), the
README stays short, and no page but docs/measurements.md carries dates or names tracker issues.

In-process and fast: it reads markdown files only."""

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
MEASUREMENTS = REPO / "docs" / "measurements.md"
README_MAX_LINES = 150
README_MAX_COLUMNS = 120
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
ISSUE = re.compile(r"\bissues? #?\d+", re.IGNORECASE)
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")


def prose_lines(text: str):
    """(line number, line) outside fenced and indented code blocks, inline code spans removed."""
    fenced, in_indented, previous_blank = False, False, True
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            continue
        indented = line.startswith(("    ", "\t"))
        if indented and (previous_blank or in_indented):
            in_indented = True
            continue
        if line.strip():
            in_indented = False
        previous_blank = not line.strip()
        yield number, re.sub(r"`[^`]*`", "``", line)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lowercase, markup and punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip())  # a link keeps its text
    text = re.sub(r"[^\w\- ]", "", text.replace("`", "").lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Anchors of the headings as written (code spans keep their text, as GitHub renders them)."""
    seen: dict[str, int] = {}
    out = set()
    fenced = False
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        if fenced or not (m := re.match(r"#{1,6}\s+(.*?)\s*$", line)):
            continue
        base = slug(m.group(1))
        out.add(base if base not in seen else f"{base}-{seen[base]}")
        seen[base] = seen.get(base, 0) + 1
    return out


def relative_links(path: Path):
    """(line number, target) of every link in prose that is not a URL (http:, https:, mailto: ...)."""
    for number, line in prose_lines(path.read_text()):
        for target in LINK.findall(line):
            if not re.match(r"[a-z][a-z0-9+.-]*:", target):
                yield number, target


def test_the_pages_exist():
    assert (REPO / "docs").is_dir() and len(PAGES) > 1


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(page):
    broken = []
    for number, target in relative_links(page):
        file_part, _, anchor = target.partition("#")
        dest = (page.parent / file_part).resolve() if file_part else page
        if not dest.exists():
            broken.append(f"{page.name}:{number}: {target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{page.name}:{number}: {target} (no heading #{anchor} in {dest.name})")
    assert not broken, "\n".join(broken)


def test_the_readme_is_short():
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines, at most {README_MAX_LINES}"
    )
    text = (REPO / "README.md").read_text()
    raw = text.splitlines()
    wide = [
        f"{n}: {len(raw[n - 1])} columns"
        for n, _ in prose_lines(text)
        if len(raw[n - 1]) > README_MAX_COLUMNS
    ]
    assert not wide, "README.md lines over 120 columns outside code blocks:\n" + "\n".join(wide)


@pytest.mark.parametrize(
    "page", [p for p in PAGES if p != MEASUREMENTS], ids=lambda p: str(p.relative_to(REPO))
)
def test_no_issue_numbers_or_dates_outside_the_measurements_page(page):
    text = page.read_text()
    hits = [
        f"{page.name}:{n}: {m.group(0)}"
        for n, line in enumerate(text.splitlines(), 1)
        for m in [*ISSUE.finditer(line), *DATE.finditer(line)]
    ]
    assert not hits, "\n".join(hits)


def test_the_workarounds_page_lists_every_workaround_of_the_code():
    """docs/workarounds.md's first table names exactly the workaround functions of
    common/workarounds.py (its stage functions, which only call the others, aside)."""
    import ast

    tree = ast.parse((REPO / "common" / "workarounds.py").read_text())
    in_code = {
        n.name for n in tree.body if isinstance(n, ast.FunctionDef) and not n.name.startswith("_")
    }
    in_code -= {"patch_accelerator", "patch_model"}  # the stages: one call each from the recipes
    page = (REPO / "docs" / "workarounds.md").read_text().split("## Ways around")[0]
    in_docs = set(re.findall(r"^\| `(\w+)` \|", page, flags=re.M))
    assert len(in_code) >= 10 and in_docs == in_code, (
        sorted(in_code - in_docs),
        sorted(in_docs - in_code),
    )


def section(page: Path, heading: str) -> str:
    return page.read_text().split(f"\n## {heading}")[1].split("\n## ")[0]


def third_party_imports() -> set[str]:
    """Top-level modules the test suite's files import (tests/, and what they run), stdlib and this
    repository's own packages aside."""
    import ast
    import sys

    own = {p.stem for p in REPO.glob("*/*.py")} | {p.name for p in REPO.iterdir() if p.is_dir()}
    names = set()
    for path in [*REPO.glob("*/*.py"), *REPO.glob("tests/*/*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return names - set(sys.stdlib_module_names) - own - {"__future__"}


def test_the_readme_installs_what_its_test_command_runs():
    """The README's install lines, run as written, give its test command everything it runs: ruff at
    `.ci/run`'s pin, pytest, and every installed package the code imports (a pinned requirement or one
    of their dependencies), with torch at the requirements' pin."""
    import importlib.metadata as md

    readme, ci = REPO / "README.md", (REPO / ".ci" / "run").read_text()
    install = [line.split("#")[0].split() for line in section(readme, "Install").splitlines()]
    install = [words[2:] for words in install if words[:2] == ["pip", "install"]]
    test = [
        line.split("#")[0]
        for line in section(readme, "Test").splitlines()
        if line.startswith("    ")
    ]
    assert test and all(
        c.strip().startswith(("ruff ", "python -m pytest ")) for t in test for c in t.split("&&")
    )
    assert ["-r", "requirements.txt", re.search(r"ruff==[\d.]+", ci).group(0)] in install, install
    files = [w[i + 1] for w in install for i, word in enumerate(w) if word == "-r"]
    pins = dict(  # every requirements file the README installs (the trackers' too)
        line.split("==")
        for name in files
        for line in (REPO / name).read_text().splitlines()
        if "==" in line
    )
    assert "pytest" in pins and all(
        f"torch=={pins['torch']}" in w for w in install if "torch" in str(w)
    )

    def requires(dist: str) -> set[str]:
        found = md.requires(dist) or []
        return {re.split(r"[\s<>=!~;\[(]", r)[0].lower() for r in found if "extra ==" not in r}

    closure, todo = set(), [name.lower() for name in pins]
    while todo:
        if (name := todo.pop()) not in closure:
            closure.add(name)
            try:
                todo += requires(name)
            except md.PackageNotFoundError:
                pass
    by_module = md.packages_distributions()
    normal = lambda n: n.lower().replace("_", "-")  # noqa: E731
    missing = {
        module: dists
        for module in third_party_imports()
        if (dists := by_module.get(module))  # installed here; optional ones are skipped or guarded
        and not {normal(d) for d in dists} & {normal(c) for c in closure}
    }
    assert not missing, f"imported, yet not installed by the README's lines: {missing}"


def test_the_readme_lists_every_config():
    """The README's config table names every accelerate_configs/*.yaml, and nothing else."""
    readme = (REPO / "README.md").read_text().split("## Configs")[1].split("\n## ")[0]
    listed = set(re.findall(r"^\| `(\w+)\.yaml` \|", readme, flags=re.M))
    assert listed == {p.stem for p in (REPO / "accelerate_configs").glob("*.yaml")}


def test_the_quick_check_names_tests_that_exist():
    """tests/conftest.py's QUICK_LAUNCHES (the real launches of `pytest -m quick`) name test functions
    that exist, with parameters their files take."""
    from conftest import CONFIGS, QUICK_LAUNCHES

    for name in QUICK_LAUNCHES:
        file, function, param = re.fullmatch(r"(\w+\.py)::(\w+)\[(\w+)\]", name).groups()
        assert f"def {function}(" in (REPO / "tests" / file).read_text(), name
        assert param in CONFIGS, name


def test_the_docs_are_short():
    """docs/ at most 15,000 words: each page says what a user does and why."""
    words = sum(len(p.read_text().split()) for p in (REPO / "docs").glob("*.md"))
    assert 8000 < words <= 15000, words
