"""benchmarks/gpu.sh --cpu-smoke: the GPU benchmark script itself, on a CPU (debug model, 4 steps, 2 runs)."""

import os
import re
import subprocess
import sys

from conftest import REPO


def test_gpu_sh_cpu_smoke_writes_the_table(tmp_path, cache_dir):
    env = {
        **os.environ,
        "OUT": str(tmp_path / "out"),
        "WORK_DIR": str(tmp_path / "work"),
        "PYTHON": sys.executable,
        "ACCELERATE_RECIPES_CACHE": cache_dir,
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    proc = subprocess.run(
        ["bash", str(REPO / "benchmarks" / "gpu.sh"), "--cpu-smoke"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "torch 2." in proc.stdout and "accelerate" in proc.stdout  # the environment check ran
    text = (tmp_path / "out" / "gpu_benchmark.md").read_text()
    rows = [
        [c.strip() for c in line.strip("|").split("|")]
        for line in text.splitlines()
        if line.startswith("| DDP") or line.startswith("| FSDP2")
    ]
    compiled = "aot_eager, per block"
    assert [(r[0], r[1]) for r in rows] == [
        ("DDP", "eager"),
        ("FSDP2", compiled),
    ]  # the smoke's two runs
    for strategy, compile_, batch, tps, mfu, allocated, reserved, overhead, loss in rows:
        assert batch == "2 x 64"
        assert float(tps.replace(",", "")) > 0
        assert mfu.startswith("-")  # no peak FLOP/s known for a CPU
        assert re.fullmatch(r"\d+\.\d\d GiB", allocated) and float(allocated.split()[0]) > 0
        assert reserved == "-"  # CUDA's reserved memory only
        assert float(overhead) > -1
        assert 6 < float(loss) < 8.4  # trained 4 steps from ln(4096) = 8.3
    # DDP eager and FSDP2 compiled trained the same model on the same data (one process each):
    # the same last loss, up to bf16 rounding
    eager, compiled_fsdp = (float(r[8]) for r in rows)
    assert abs(eager - compiled_fsdp) < 0.01, rows  # measured 0.001 (7.442, 7.443)
    assert (tmp_path / "work" / "fsdp_aot_eager.log").exists()


def test_gpu_sh_refuses_unknown_arguments():
    proc = subprocess.run(
        ["bash", str(REPO / "benchmarks" / "gpu.sh"), "--fast"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "error: unknown argument '--fast' (benchmarks/gpu.sh takes none, --cpu-smoke or --help)"
    )
