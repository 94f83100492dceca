"""tools/smoke.py, the one-command cluster check, at its quick level on CPU ranks: a small subset passes
with its table, and a broken config beside them makes it exit 1 naming that config (one run); bad flags are one
line; slurm/smoke.sbatch passes on the local 2-node cluster (slurm/local_cluster.sh). (Every config:
`python tools/smoke.py`, about 3 minutes, docs/smoke.md.)"""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import torch
from common.precision import _cpu_native_dtypes
from conftest import REPO
from test_slurm import log_text, wait_ended

TIMEOUT = 600  # seconds for one smoke run (about 45 s for single + ddp here)


def smoke(*argv, out, cache_dir):
    """Run tools/smoke.py with 2 CPU ranks into `out`; (the CompletedProcess, its rows from smoke.json)."""
    cmd = [
        sys.executable,
        REPO / "tools/smoke.py",
        "--num_processes",
        2,
        "--output_dir",
        out,
        *argv,
    ]
    env = {**os.environ, "ACCELERATE_RECIPES_CACHE": cache_dir, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        list(map(str, cmd)), cwd=REPO, env=env, capture_output=True, text=True, timeout=TIMEOUT
    )
    rows = json.loads((out / "smoke.json").read_text()) if (out / "smoke.json").exists() else None
    return proc, rows and rows["rows"]


@pytest.fixture(scope="module")
def quick_with_a_broken_config(tmp_path_factory, cache_dir):
    """One smoke run serves both tests below: `--configs ddp` plus a copy of deepspeed_zero2.yaml
    whose DeepSpeed JSON sets a train_batch_size of 64 against the global batch of 4."""
    tmp_path = tmp_path_factory.mktemp("smoke")
    ds_json = tmp_path / "zero2.json"
    ds_json.write_text(
        (REPO / "ds_configs/zero2.json")
        .read_text()
        .replace('"train_batch_size": "auto"', '"train_batch_size": 64')
    )
    broken = tmp_path / "broken_zero2.yaml"
    broken.write_text(
        (REPO / "accelerate_configs/deepspeed_zero2.yaml")
        .read_text()
        .replace("ds_configs/zero2.json", str(ds_json))
    )
    out = tmp_path / "out"
    proc, rows = smoke("--configs", "ddp", "--config_file", broken, out=out, cache_dir=cache_dir)
    return proc, rows, out


def test_quick_level_passes_with_its_table(quick_with_a_broken_config):
    """Each config in the precision it declares (bf16) as the recipes resolve it on this CPU: bf16 with
    bf16 instructions, else fp32 (common/precision.py). The host, the versions and the all-reduce bus
    bandwidth over the 2 ranks head the table, in smoke.json too."""
    proc, rows, out = quick_with_a_broken_config
    assert [(r["config"], r["world"], r["status"]) for r in rows] == [
        ("single", 1, "PASS"),
        ("ddp", 2, "PASS"),
        ("broken_zero2", 2, "FAIL"),
    ], proc.stdout[-3000:]
    single, ddp = rows[:2]
    declared = "bf16" if "bf16" in _cpu_native_dtypes() else "no"
    assert single["precision"] == ddp["precision"] == declared, rows
    assert single["loss_gap"] == single["grad_norm_gap"] == 0  # the reference itself
    # parity with one process in the same precision: tests/test_parity.py's bounds
    bound = (5e-6, 5e-6) if declared == "no" else (1e-3, 2.5e-2)
    assert 0 < ddp["loss_gap"] < bound[0] and ddp["grad_norm_gap"] < bound[1], ddp
    about = json.loads((out / "smoke.json").read_text())
    assert set(about["versions"]) == {
        "torch",
        "cuda",
        "nccl",
        "driver",
        "accelerate",
        "deepspeed",
        "transformers",
    }
    assert about["versions"]["torch"] == torch.__version__ and about["host"]["cpu"]
    assert re.search(
        r"^Versions: torch \S+, cuda \S+, nccl \S+, driver \S+, accelerate", proc.stdout, re.M
    )
    bw = about["all_reduce"]
    # 2 ranks: busbw = algbw x 2(n-1)/n = algbw; gloo measured 1.15 GB/s on this host (the expected figure)
    assert (
        bw["ranks"] == 2 and bw["backend"] == "gloo" and bw["busbw"] == pytest.approx(bw["algbw"])
    )
    assert 0.05e9 < bw["busbw"] < 20e9 and bw["expected"] == 1.15e9, bw
    assert re.search(
        r"^All-reduce over 2 ranks \(gloo, 32 MiB\): bus bandwidth [\d.]+ GB/s", proc.stdout, re.M
    )
    docs_rows_match(proc.stdout, declared)
    for r in rows[:2]:
        assert r["resume_gap"] <= 1e-6 and r["export"] == "ok" and not r["problems"], r
        assert r["tokens_per_s"] > 0 and r["peak_mb"] > 0 and r["wall_s"] > 0, r
    # the printed table: a header, then one row per config with the same figures
    assert (
        "| config | ranks | precision | status | loss gap | grad-norm gap | resume gap | export |"
        in proc.stdout
    )
    assert re.search(
        rf"^\| ddp \| 2 \| {declared} \| PASS \| {ddp['loss_gap']:.1e} \| {ddp['grad_norm_gap']:.1e} \|",
        proc.stdout,
        re.M,
    ), proc.stdout
    assert (out / "smoke.md").read_text().startswith("Host: ")
    assert (out / "ddp" / "run" / "final" / "model.safetensors").is_file()


def test_broken_config_fails_naming_it(quick_with_a_broken_config):
    """The broken copy: exit 1 for the whole check, its row FAIL, its first error line and its log path."""
    proc, rows, out = quick_with_a_broken_config
    assert proc.returncode == 1, proc.stdout[-3000:]
    assert rows[-1]["config"] == "broken_zero2" and rows[-1]["status"] == "FAIL"
    assert re.search(r"^\| broken_zero2 \| 2 \| \S+ \| FAIL \|", proc.stdout, re.M), proc.stdout
    line = next(x for x in proc.stdout.splitlines() if x.startswith("broken_zero2: "))
    assert "error: the DeepSpeed JSON" in line and "train_batch_size: 64" in line, line
    assert str(out / "broken_zero2" / "run.log") in line, line


def test_bad_flags_are_one_line(tmp_path):
    for argv, says in [
        (["--configs", "nope"], "no accelerate_configs/nope.yaml"),
        (["--steps", "3"], "--steps 3: give an even number"),
        (["--config_file", tmp_path / "absent.yaml"], "no such file"),
        (["--steps", "x"], "invalid int value"),
    ]:
        proc = subprocess.run(
            [sys.executable, str(REPO / "tools/smoke.py"), *map(str, argv)],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 1 and proc.stderr.startswith("error: ") and says in proc.stderr, (
            proc.stderr
        )
        assert len(proc.stderr.strip().splitlines()) == 1 and not proc.stdout, proc.stderr


@pytest.mark.skipif(
    shutil.which("sbatch") is None,
    reason="no sbatch on PATH: run `bash slurm/local_cluster.sh` (as root) for a local SLURM",
)
def test_slurm_job_checks_across_two_nodes(tmp_path, cache_dir):
    """sbatch --nodes 2 slurm/smoke.sbatch --configs ddp: the job completes with exit 0, and ddp's runs
    had one launcher on each node (srun --label: node 1's lines start with "1: ")."""
    log, out = tmp_path / "job.log", tmp_path / "out"
    env = {
        **os.environ,
        "PROCS_PER_NODE": "1",
        "ACCELERATE_RECIPES_CACHE": str(cache_dir),
        "OMP_NUM_THREADS": "1",
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
    }
    cmd = [
        "sbatch",
        "--parsable",
        "--nodes",
        "2",
        "--job-name",
        "test-smoke",
        "--output",
        str(log),
        str(REPO / "slurm/smoke.sbatch"),
        "--configs",
        "ddp",
        "--output_dir",
        str(out),
    ]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    info = wait_ended(proc.stdout.strip().split(";")[0], log, timeout=TIMEOUT)
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), log_text(log)[-4000:]
    assert "on 2 node(s)" in log_text(log) and re.search(
        r"^\| ddp \| 2 \| \S+ \| PASS \|", log_text(log), re.M
    )
    rows = json.loads((out / "smoke.json").read_text())["rows"]
    assert [(r["config"], r["world"], r["status"]) for r in rows] == [
        ("single", 1, "PASS"),
        ("ddp", 2, "PASS"),
    ]
    for run in ("run", "resumed"):
        lines = (out / "ddp" / f"{run}.log").read_text().splitlines()
        assert any(x.startswith("0: ") for x in lines) and any(
            x.startswith("1: ") for x in lines
        ), run


MEASURED = re.compile(r"^\d[\d.,e+-]*$")  # a gap, tokens/s, MB or seconds: what varies run to run


def docs_rows_match(stdout, declared):
    """docs/smoke.md's example table (`python tools/smoke.py --configs ddp`) has the rows this run printed
    for single and ddp, the measured numbers masked; its precision column is this host's (bf16), which
    an AVX2 host runs as fp32 ("no") by the rule."""

    def cells(text, config):
        line = next(x for x in text.splitlines() if x.startswith(f"| {config} |"))
        return ["#" if MEASURED.match(c.strip()) else c.strip() for c in line.strip("|").split("|")]

    docs = (REPO / "docs" / "smoke.md").read_text()
    assert (
        "<!-- rows checked by tests/test_smoke.py: python tools/smoke.py --configs ddp -->" in docs
    )
    header = next(x for x in stdout.splitlines() if x.startswith("| config |"))
    assert header in docs
    for config in ("single", "ddp"):
        want = cells(docs, config)
        assert want[2] == "bf16", want
        assert cells(stdout, config) == [*want[:2], declared, *want[3:]], (config, want)
