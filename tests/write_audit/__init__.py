"""Count, per rank, the files a launched recipe writes (see sitecustomize.py in this folder)."""

import json
import os
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


@contextmanager
def audit_writes(root, log):
    """While active, every process started with this environment logs its writes under `root` to `log`."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(
            "PYTHONPATH", os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))
        )
        mp.setenv("WRITE_AUDIT_ROOT", str(root))
        mp.setenv("WRITE_AUDIT_LOG", str(log))
        yield


def writes_by_file(root, log):
    """{path relative to root: [rank of each write, in time order]}; rank is None for the launcher.

    A rename counts as a write of its target, and moves what was written under its source there
    (a folder written as `final.tmp/` and renamed: its files are listed under `final/`).
    """
    records = sorted(
        (
            json.loads(line)
            for path in Path(log).glob("*.jsonl")
            for line in path.read_text().splitlines()
        ),
        key=lambda rec: rec["t"],
    )
    out = defaultdict(list)
    for rec in records:
        if "src" in rec:
            src = rec["src"]
            for moved in [p for p in out if p == src or p.startswith(src + os.sep)]:
                out[rec["path"] + moved[len(src) :]] += out.pop(moved)
        out[rec["path"]].append(None if rec["rank"] is None else int(rec["rank"]))
    return {os.path.relpath(p, os.path.abspath(root)): ranks for p, ranks in out.items()}


def files_under(root):
    """Relative paths of every file under root."""
    return sorted(str(p.relative_to(root)) for p in Path(root).rglob("*") if p.is_file())
