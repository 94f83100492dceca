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
        mp.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")])))
        mp.setenv("WRITE_AUDIT_ROOT", str(root))
        mp.setenv("WRITE_AUDIT_LOG", str(log))
        yield


def writes_by_file(root, log):
    """{path relative to root: [rank of each write, in log order]}; rank is None for the launcher."""
    out = defaultdict(list)
    for path in sorted(Path(log).glob("*.jsonl")):
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            rank = None if rec["rank"] is None else int(rec["rank"])
            out[os.path.relpath(rec["path"], os.path.abspath(root))].append(rank)
    return dict(out)


def files_under(root):
    """Relative paths of every file under root."""
    return sorted(str(p.relative_to(root)) for p in Path(root).rglob("*") if p.is_file())
