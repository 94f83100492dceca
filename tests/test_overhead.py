"""benchmarks/overhead.py's step timer: the sitecustomize every timed run gets writes one stamp per
AdamW step (a run with no stamps fails the benchmark, so a timer that never writes breaks it)."""

import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from overhead import STEP_TIMER  # noqa: E402

THREE_STEPS = """
import torch
p = torch.nn.Parameter(torch.ones(3))
opt = torch.optim.AdamW([p], lr=0.1)
for _ in range(3):
    p.sum().backward()
    opt.step()
"""


def test_step_timer_writes_a_stamp_per_adamw_step(tmp_path):
    (tmp_path / "timer").mkdir()
    (tmp_path / "timer" / "sitecustomize.py").write_text(STEP_TIMER)
    stamps = tmp_path / "run"
    env = {
        **os.environ,
        "OVERHEAD_STEP_TIMES": str(stamps),
        "PYTHONPATH": str(tmp_path / "timer"),
        "RANK": "0",
    }
    subprocess.run([sys.executable, "-c", THREE_STEPS], env=env, check=True, timeout=120)
    got = json.loads(Path(f"{stamps}.rank0.json").read_text())
    assert len(got) == 3
    wall, cpu = zip(*got)
    assert list(wall) == sorted(wall) and list(cpu) == sorted(cpu)
