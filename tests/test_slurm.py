"""slurm/llama.sbatch on a real 2-node SLURM cluster (slurm/local_cluster.sh sets one up on this host):
one 2-node job, stopped by SIGTERM through SLURM and requeued, resumes from its preemption
checkpoint and ends with the losses of the 1-machine run, every step once."""

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from common.checkpoint import verify_checkpoint
from conftest import REPO, RUN30, corpus_args, read_metrics

pytestmark = pytest.mark.skipif(
    shutil.which("sbatch") is None,
    reason="no sbatch on PATH: run `bash slurm/local_cluster.sh` (as root) for a local SLURM",
)

ENDED = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "PREEMPTED",
    "BOOT_FAIL",
    "DEADLINE",
}
TIMEOUT = 300  # seconds for one 30-step job (about 40 s here), start-up included


def submit(out, log, corpus, cache_dir):
    """sbatch slurm/llama.sbatch on 2 nodes, DDP in fp32, the RUN30 flags; returns the job id."""
    env = {
        **os.environ,
        "CONFIG": "accelerate_configs/ddp.yaml",
        "PROCS_PER_NODE": "1",
        "LAUNCH_ARGS": "--mixed_precision no",
        "ACCELERATE_RECIPES_CACHE": str(cache_dir),
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
    }
    cmd = [
        "sbatch",
        "--parsable",
        "--nodes",
        "2",
        "--job-name",
        "test-slurm",
        "--output",
        str(log),
        str(REPO / "slurm/llama.sbatch"),
        "--output_dir",
        str(out),
        *map(str, corpus_args(corpus)),
        *map(str, RUN30),
    ]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, f"{' '.join(cmd)} exited {proc.returncode}: {proc.stderr}"
    return proc.stdout.strip().split(";")[0]


def job_info(job):
    """`scontrol show job` as a dict (JobState, ExitCode, Restarts, ...); {} once SLURM forgot the job."""
    proc = subprocess.run(["scontrol", "-o", "show", "job", job], capture_output=True, text=True)
    return (
        dict(f.split("=", 1) for f in proc.stdout.split() if "=" in f)
        if proc.returncode == 0
        else {}
    )


def log_text(log):
    return Path(log).read_text(errors="replace") if Path(log).exists() else "(no job log)"


def wait_ended(job, log, timeout=TIMEOUT):
    """Wait until the job has ended; returns its final `scontrol show job` fields."""
    deadline = time.time() + timeout
    while (info := job_info(job)) and info["JobState"] not in ENDED:
        if time.time() > deadline:
            subprocess.run(["scancel", job])
            pytest.fail(
                f"job {job} still {info['JobState']} after {timeout} s (cancelled); job log:\n"
                f"{log_text(log)[-8000:]}"
            )
        time.sleep(0.5)
    assert info, f"SLURM has no record of job {job}; job log:\n{log_text(log)[-8000:]}"
    return info


def last_step(out):
    """The newest step in metrics.jsonl so far (0 when none; a half-written last line is skipped)."""
    steps = [0]
    if (out / "metrics.jsonl").exists():
        for line in (out / "metrics.jsonl").read_text().splitlines():
            try:
                steps.append(json.loads(line).get("step") or 0)
            except json.JSONDecodeError:
                pass
    return max(steps)


def assert_same_losses(out, reference):
    # Two SLURM nodes against one machine at the same world size: the same reductions, so bit-equal is
    # expected; 1e-6 relative is ~10 fp32 ulps, far under a wrong sample or step.
    got, want = read_metrics(out)[0], {r["step"]: r["loss"] for r in read_metrics(reference)[0]}
    assert [r["step"] for r in got] == list(range(1, 31))  # every step exactly once
    for r in got:
        assert r["loss"] == pytest.approx(want[r["step"]], rel=1e-6), r["step"]


@pytest.fixture(scope="module")
def preempted_job(tmp_path_factory, cache_dir, small_corpus):
    """One 2-node job: SIGTERM through SLURM after step 13, then `scontrol requeue` to the end.
    Returns the output dir, the state and log after the stop, and after the requeued run."""
    base = tmp_path_factory.mktemp("slurm")
    out, log = base / "run", base / "job.log"
    job = submit(out, log, small_corpus, cache_dir)
    try:
        deadline = time.time() + TIMEOUT
        while last_step(out) < 13:
            info = job_info(job)
            if info.get("JobState") in ENDED or time.time() > deadline:
                subprocess.run(["scancel", job])
                pytest.fail(
                    f"no step 13 while the job ran ({info.get('JobState')}); job log:\n{log_text(log)[-8000:]}"
                )
            time.sleep(0.1)
        # Without --batch/--full, scancel signals the job steps: srun's tasks, the launchers and their workers.
        subprocess.run(["scancel", "--signal=TERM", job], check=True)
        stopped = wait_ended(job, log)
        stopped_text = log_text(log)
        saved = sorted(
            int(p.name.split("-")[1])
            for p in out.glob("checkpoint-*")
            if p.name.split("-")[1].isdigit()
        )
        final_before_requeue = (out / "final").exists()
        subprocess.run(["scontrol", "requeue", job], check=True)
        deadline = time.time() + 60  # requeue needs a moment to reach the job record
        while job_info(job).get("Restarts") != "1" and time.time() < deadline:
            time.sleep(0.2)
        ended = wait_ended(job, log)
        return {
            "out": out,
            "stopped": stopped,
            "stopped_text": stopped_text,
            "saved": saved,
            "final_before_requeue": final_before_requeue,
            "ended": ended,
            "text": log_text(log),
        }
    finally:
        subprocess.run(["scancel", job])


def test_two_node_job_matches_one_machine(preempted_job, small_corpus, reference_run):
    """Before the stop, and after the requeue: one launcher per node, each with its own machine rank
    (from SLURM_NODEID); the job ends COMPLETED with every step's loss of the 1-machine run."""
    reference = reference_run("ddp", *corpus_args(small_corpus), *RUN30)
    info, text, out = preempted_job["ended"], preempted_job["text"], preempted_job["out"]
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", f"{info}\n{text[-8000:]}"
    for restart in (0, 1):
        found = re.findall(
            rf"node n\d machine_rank (\d) of 2, world size 2, restart {restart}", text
        )
        assert sorted(found) == ["0", "1"], (restart, text[-8000:])
    run_info = json.loads((out / "run_info.json").read_text())
    assert (run_info["world_size"], run_info["mixed_precision"]) == (2, "no")
    assert_same_losses(out, reference)


def test_sigterm_through_slurm_then_requeue_resumes(preempted_job):
    out, text = preempted_job["out"], preempted_job["stopped_text"]
    assert preempted_job["stopped"]["JobState"] != "COMPLETED", (
        f"the job ignored SIGTERM: {preempted_job['stopped']}"
    )
    saved = preempted_job["saved"]
    assert saved, f"no checkpoint in {out}; job log:\n{text[-8000:]}"
    step = saved[-1]
    assert 13 <= step <= 29, (saved, text[-8000:])
    assert (
        verify_checkpoint(out / f"checkpoint-{step}")["step"] == step
    )  # COMPLETE.json, every file's size
    assert "preempted" in text and f"checkpoint-{step}" in text, text[-8000:]
    assert not preempted_job["final_before_requeue"]
    info, text = preempted_job["ended"], preempted_job["text"]
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", f"{info}\n{text[-8000:]}"
    assert f"resumed from {out / f'checkpoint-{step}'} at step {step}" in text, text[-8000:]
