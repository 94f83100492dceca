"""What recovery costs: a killed rank, a preemption, a hung rank and a killed launcher, timed in one run.

    python benchmarks/recovery.py                    # accelerate_configs/ddp.yaml, about 4 minutes on 2 CPU cores
    python benchmarks/recovery.py --config fsdp --skip_hung

Each scenario is a real `accelerate launch` of `recipes/llama.py` in a fresh directory, with the
tests' RUN30 flags (30 fp32 steps, checkpoints every 10, blocks of 64, 2 per device x 2 ranks) on
the bundled corpus (`--max_eval_samples 8`):
  1. uninterrupted (the baseline);
  2. rank 1 SIGKILLed after checkpoint-10, under `--rdzv_backend c10d --max_restarts 1` and
     TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (common/launch.py refuses restarts without them);
  3. SIGTERM to the launcher at step 15, then the same command again (`--resume_from_checkpoint auto`);
  4. rank 1 SIGSTOPped after checkpoint-10, `--ddp_timeout 30`, without and with restarts (2.5 min);
  5. the launcher SIGKILLed.
Times are when a line first shows in the launcher's combined log (or metrics.jsonl), polled every
50 ms. Prints a markdown table and writes it to `--results`.
"""

import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from importlib.metadata import version
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parent.parent
RUN30 = [
    "--max_eval_samples",
    "8",
    "--block_size",
    "64",
    "--per_device_train_batch_size",
    "2",
    "--max_steps",
    "30",
    "--save_steps",
    "10",
    "--warmup_steps",
    "4",
    "--logging_steps",
    "1",
    "--eval_steps",
    "30",
    "--report_to",
    "none",
    "--ddp_timeout",
    "60",
]
RESTARTS = dict(
    launcher=["--rdzv_backend", "c10d", "--max_restarts", "1"],
    env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"},
)
# Log lines, in the order a failure produces them. torchrun logs "failed" only after it has stopped
# every worker (SIGTERM, then SIGKILL after 30 s), so "closing" is the moment it noticed.
PATTERNS = {
    "timed out": r"Timed out waiting (\d+)ms",
    "closing": r"Sending process (\d+) closing signal",
    "failed": r"failed \(exitcode: (-?\d+)\)",
    "resumed": r"resumed from \S+checkpoint-(\d+) at step",
    "preempted": r"preempted \(SIGTERM\) at step (\d+): saved",
}
parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--config", default="ddp", help="accelerate_configs/<name>.yaml")
parser.add_argument(
    "--skip_hung", action="store_true", help="leave out scenario 4 (about 2.5 minutes)"
)
parser.add_argument("--results", default=str(REPO / "benchmarks/results/recovery_cpu2.md"))
args = parser.parse_args()
work = Path(tempfile.mkdtemp(prefix="recovery-"))
cache = os.environ.get("ACCELERATE_RECIPES_CACHE") or str(
    work / "cache"
)  # tokenizer and packed blocks
jobs, rows = [], []


def losses(out):
    """{step: loss} from metrics.jsonl (the summary line has no loss)."""
    try:
        return {
            r["step"]: r["loss"]
            for r in map(json.loads, open(out / "metrics.jsonl"))
            if "loss" in r
        }
    except (FileNotFoundError, ValueError):  # not written yet, or caught mid-line
        return {}


class Job:
    """One `accelerate launch` in its own session, watched: when each PATTERNS line first appears in
    its log, the highest step logged before the launcher noticed a failure, its workers by rank."""

    def __init__(self, name, *extra, launcher=(), env=None, out=None):
        self.out, self.log = out or work / name, work / f"{name}.log"
        cmd = [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--config_file",
            str(REPO / f"accelerate_configs/{args.config}.yaml"),
            "--mixed_precision",
            "no",
            *launcher,
            str(REPO / "recipes/llama.py"),
            "--output_dir",
            str(self.out),
            *RUN30,
            *extra,
        ]  # later flags win
        env = {
            **os.environ,
            "ACCELERATE_RECIPES_CACHE": cache,
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
            "TOKENIZERS_PARALLELISM": "false",
            **(env or {}),
        }
        self.seen, self.last_step, self.workers, self.end = {}, 0, {}, None
        self.t0 = time.time()
        self.proc = subprocess.Popen(
            cmd,
            cwd=REPO,
            env=env,
            stdout=open(self.log, "w"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        jobs.append(self)

    def tick(self):
        now, text = time.time(), self.log.read_text(errors="replace")
        for name, pattern in PATTERNS.items():
            if name not in self.seen and (m := re.search(pattern, text)):
                self.seen[name] = (now, int(m.group(1)))
        if (
            not {"closing", "failed"} & self.seen.keys()
        ):  # a restart rewrites metrics.jsonl from its checkpoint
            self.last_step = max([self.last_step, *losses(self.out)])
        try:  # torchrun starts each worker in its own session: killpg of the launcher's would miss them
            for w in psutil.Process(self.proc.pid).children(recursive=True):
                if "llama.py" in " ".join(w.cmdline()):
                    self.workers[w.pid] = (int(w.environ()["RANK"]), w)
        except (psutil.Error, KeyError):
            pass
        if self.end is None and self.proc.poll() is not None:
            self.end = now

    def wait(self, until=lambda: False, timeout=600):
        """Poll every 50 ms until `until()` holds or the job has ended."""
        deadline = time.time() + timeout
        self.tick()
        while not (until() or self.end):
            if time.time() > deadline:
                raise TimeoutError(f"{self.log}: still waiting after {timeout} s")
            time.sleep(0.05)
            self.tick()

    def signal_rank1_after_checkpoint_10(self, sig):
        """Send `sig` to rank 1 as soon as checkpoint-10 is complete; returns when."""
        self.wait(lambda: (self.out / "checkpoint-10/COMPLETE.json").exists())
        [w for rank, w in self.workers.values() if rank == 1][-1].send_signal(sig)
        return time.time()

    def since(self, name, t):
        return f"{self.seen[name][0] - t:.1f} s" if name in self.seen else "never"

    def noticed(self, t):
        return f"{self.since('closing', t)} / {self.since('failed', t)} (exitcode {self.value('failed')})"

    def value(self, name):
        return self.seen.get(name, (None, "-"))[1]


def all_exited(procs, timeout=60):
    """Poll every 10 ms until every process has exited; the time, or None. A zombie counts as exited:
    here PID 1 reaps orphans 1-2 s late, which psutil.wait_procs would count."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if all(not p.is_running() or p.status() == psutil.STATUS_ZOMBIE for p in procs):
                return time.time()
        except psutil.NoSuchProcess:  # gone between the two calls: look again
            continue
        time.sleep(0.01)


def gap(job):
    """Exit code, and the max relative loss gap to the baseline (or the steps, if not 1..30 once each)."""
    got = losses(job.out)
    if sorted(got) != list(range(1, 31)):
        return f"{job.proc.returncode} / steps {sorted(got)}"
    return f"{job.proc.returncode} / {max(abs(got[s] - base[s]) / abs(base[s]) for s in got):.1e}"


def add(scenario, *pairs):
    rows.extend([scenario if i == 0 else "", what, value] for i, (what, value) in enumerate(pairs))


def lost(last, resumed):
    return f"{resumed} / {last - resumed}" if resumed != "-" else "- / -"


try:
    Job(
        "warm_up", "--max_steps", "2", "--save_steps", "2"
    ).wait()  # builds the cache, so no scenario pays for it
    baseline = Job("1_baseline")
    baseline.wait()
    base, base_wall = losses(baseline.out), baseline.end - baseline.t0
    add(
        "1 uninterrupted",
        ("launch → exit / exit code", f"{base_wall:.1f} s / {baseline.proc.returncode}"),
    )

    job = Job("2_sigkill_rank1", **RESTARTS)
    t = job.signal_rank1_after_checkpoint_10(signal.SIGKILL)
    job.wait()
    add(
        f"2 SIGKILL rank 1 at step {job.last_step}, --max_restarts 1",
        ("kill → launcher's 'closing signal' / 'failed'", job.noticed(t)),
        ("kill → 'resumed from ... (torchrun restart 1)'", job.since("resumed", t)),
        ("kill → exit", f"{job.end - t:.1f} s"),
        ("resumed from step / steps lost", lost(job.last_step, job.value("resumed"))),
        ("extra wall time vs 1", f"{job.end - job.t0 - base_wall:+.1f} s"),
        ("exit code / max loss gap vs 1", gap(job)),
    )

    job = Job("3_sigterm", "--resume_from_checkpoint", "auto")
    job.wait(lambda: max(losses(job.out), default=0) >= 15)
    everyone, at = (
        [psutil.Process(job.proc.pid), *(w for _, w in job.workers.values())],
        max(losses(job.out)),
    )
    job.proc.send_signal(signal.SIGTERM)  # to the launcher, as SLURM, Kubernetes or a user would
    t = time.time()
    job.wait()
    exited, last = (
        all_exited(everyone),
        max(losses(job.out)),
    )  # before the rerun appends to metrics.jsonl
    again = Job(
        "3_rerun", "--resume_from_checkpoint", "auto", out=job.out
    )  # a requeue: the same command
    again.wait()
    add(
        f"3 SIGTERM launcher at step {at}",
        (
            "signal → launcher and workers all exited",
            f"{exited - t:.1f} s" if exited else "not within 60 s",
        ),
        ("saved checkpoint at step / steps lost", lost(last, job.value("preempted"))),
        ("launcher's exit code", job.proc.returncode),
        (
            "rerun: launch → 'resumed from' / exit",
            f"{again.since('resumed', again.t0)} / {again.end - again.t0:.1f} s",
        ),
        ("rerun: resumed from step", again.value("resumed")),
        ("rerun: exit code / max loss gap vs 1", gap(again)),
    )

    for label, kwargs in (
        [] if args.skip_hung else [("no restarts", {}), ("--max_restarts 1", RESTARTS)]
    ):
        job = Job(
            f"4_sigstop_rank1_{'restarts' if kwargs else 'plain'}", "--ddp_timeout", "30", **kwargs
        )
        t = job.signal_rank1_after_checkpoint_10(
            signal.SIGSTOP
        )  # alive but silent: a stuck kernel, a dead link
        job.wait()
        add(
            f"4 SIGSTOP rank 1 at step {job.last_step}, --ddp_timeout 30, {label}",
            ("stop → rank 0's 'Timed out waiting 30000ms'", job.since("timed out", t)),
            ("stop → launcher's 'closing signal' / 'failed'", job.noticed(t)),
            ("stop → 'resumed from' / exit", f"{job.since('resumed', t)} / {job.end - t:.1f} s"),
            ("resumed from step / steps lost", lost(job.last_step, job.value("resumed"))),
            ("exit code / max loss gap vs 1", gap(job) if kwargs else f"{job.proc.returncode} / -"),
        )

    job = Job("5_sigkill_launcher", "--max_steps", "10000")
    job.wait(lambda: max(losses(job.out), default=0) >= 1)
    workers = [w for _, w in job.workers.values()]
    job.proc.send_signal(signal.SIGKILL)  # nothing of the launcher runs to stop its workers
    job.proc.wait()
    t = time.time()
    exited = all_exited(workers)
    add(
        "5 SIGKILL launcher",
        (
            f"launcher gone → its {len(workers)} workers exited",
            f"{exited - t:.2f} s" if exited else "still running after 60 s",
        ),
    )
finally:  # whatever happened, nothing keeps running
    for job in jobs:
        if job.proc.poll() is None:
            os.killpg(job.proc.pid, signal.SIGKILL)
        for _, w in job.workers.values():
            with contextlib.suppress(psutil.Error):
                w.kill()  # psutil checks that the pid was not reused since
        job.proc.wait()

report = (
    f"# Recovery costs, `accelerate_configs/{args.config}.yaml`\n\n"
    f"`{' '.join(['python benchmarks/recovery.py', *sys.argv[1:]])}`, {datetime.now():%Y-%m-%d %H:%M}: "
    f"{os.cpu_count()} CPU cores, 2 gloo ranks, torch {version('torch')}, accelerate {version('accelerate')}; "
    "the bundled corpus with the RUN30 flags (30 fp32 steps, checkpoints every 10). One run each on a host "
    f"shared with other jobs (load average {os.getloadavg()[0]:.1f} at the end): the timings are noisy.\n\n"
    "| scenario | measured | value |\n|---|---|---|\n"
    + "".join(f"| {a} | {b} | {c} |\n" for a, b, c in rows)
)
print(report)
Path(args.results).write_text(report)
print(f"logs and outputs in {work}")
