"""Jobs that recover on their own: a killed rank under `--max_restarts`, SIGTERM (preemption) or
Ctrl-C saving at the next step boundary, a SIGKILLed launcher leaving no workers behind, a node-local
--output_dir refused, a second live job in one --output_dir refused, and `--resume_from_checkpoint auto`.
Every resumed run is compared with one uninterrupted run (`reference_run`, shared with
tests/test_slurm.py)."""

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

import psutil
import pytest

from common.args import parse_args
from common.checkpoint import PREEMPTED_EXIT_CODE, verify_checkpoint
from common.errors import Stop
from conftest import (
    REPO,
    RUN30,
    catches,
    corpus_args,
    finish,
    launch,
    launch_command,
    launch_env,
    read_metrics,
    wait_until,
    workers,
)
from conftest import start as start_recipe
from test_multinode import free_port


def start(
    config, out, corpus, cache_dir, *extra, launcher=(), env=None, log=None, device_guard=False
):
    """`accelerate launch` of llama.py in the background (conftest.start: in its own session, so a test
    can kill all of it), with the RUN30 flags in fp32, without the device guard unless asked (it
    records each rank's exit status with EXIT_STATUS_DIR); stdout and stderr go to `log` (default out.log)."""
    return start_recipe(
        config,
        "recipes/llama.py",
        "--output_dir",
        out,
        *corpus_args(corpus),
        *RUN30,
        *extra,
        cache_dir=cache_dir,
        log=log or f"{out}.log",
        env=env,
        device_guard=device_guard,
        mixed_precision="no",
        launcher_args=launcher,
    )


def ranks(job):
    """The worker processes of a launch, by rank."""
    return workers(job, "recipes/llama.py")


def last_step(out):
    try:
        return read_metrics(out)[0][-1]["step"]
    except (FileNotFoundError, IndexError, ValueError):
        return 0


def assert_same_run(out, reference):
    """steps 1..30 exactly once each, with the reference's losses and grad norms (1e-6 relative).

    Measured 0 (bit-exact, fp32, the two signal tests, 180 comparisons). metrics.jsonl holds full
    floats, so 1e-6 is not a print precision: ~10 fp32 ulps, far under any resume fault."""
    got, want = read_metrics(out)[0], {r["step"]: r for r in read_metrics(reference)[0]}
    assert [r["step"] for r in got] == list(range(1, 31))
    for r in got:
        for key in ("loss", "grad_norm", "lr"):
            assert r[key] == pytest.approx(want[r["step"]][key], rel=1e-6), (r["step"], key)


def kill_a_rank_after(job, out, save, log):
    """SIGKILL rank 1 once `checkpoint-{save}` is complete; torchrun (`--max_restarts 1`) restarts the worker
    group, which resumes on its own. Returns the step it resumed from (>= `save`)."""
    wait_until(
        lambda: (out / f"checkpoint-{save}" / "COMPLETE.json").exists(), job, f"checkpoint-{save}"
    )
    ranks(job)[1].send_signal(signal.SIGKILL)
    restarted = re.compile(r"resumed from (\S+) at step (\d+) \(torchrun restart 1\)")
    wait_until(lambda: restarted.search(open(log).read()), job, "the restarted group's resume")
    resumed = restarted.search(open(log).read())
    assert int(resumed.group(2)) >= save and resumed.group(1) == str(
        out / f"checkpoint-{resumed.group(2)}"
    )
    return int(resumed.group(2))


def signal_the_launcher(job, out, sig, when, statuses, log):
    """Send `sig` to the launcher (as SLURM, Kubernetes or a user would: Ctrl-C is SIGINT) `when` ("at step
    N" or "during the save of checkpoint-10"). Checks that it saves at the next step boundary and that the
    job ends as a preempted one: every rank exits 143 (whatever the signal), the launcher 1 after torchrun's
    SignalException (as conftest.preempt checks), no worker left. Returns the step it saved."""
    saving = out / "checkpoint-10.tmp"
    try:
        # both workers, found before the signal, so that the orphan check below has something to check
        wait_until(lambda: len(ranks(job)) == 2, job, "2 workers", poll=0.2)
        workers = list(ranks(job).values())
        if when.startswith("at step"):
            wait_until(lambda: last_step(out) >= int(when.split()[-1]), job, when)
        else:
            wait_until(
                lambda: saving.exists() or (out / "checkpoint-10").exists(),
                job,
                "the save of step 10",
                poll=0.005,
            )
        job.send_signal(sig)
        signalled_after, signalled_while_saving = last_step(out), saving.exists()
        status = finish(job, timeout=60)
        assert not psutil.wait_procs(workers, timeout=10)[1]
    finally:
        os.killpg(job.pid, signal.SIGKILL) if job.poll() is None else None
    text = open(log).read()
    assert status == 1 and "SignalException" in text, (status, text[-3000:])
    assert {p.name: p.read_text() for p in statuses.iterdir()} == {
        "rank0": "143",
        "rank1": "143",
    }, text[-3000:]
    preempted = re.search(rf"preempted \({sig.name}\) at step (\d+): saved (\S+);", text)
    assert preempted, text[-3000:]
    step = int(preempted.group(1))
    if when.startswith("at step"):
        assert (
            signalled_after <= step <= signalled_after + 2 and step % 10
        )  # the next boundary, not a --save_steps one
    else:  # the save it interrupted finished, and the next step saved again
        assert signalled_while_saving and step == 11
        assert verify_checkpoint(out / "checkpoint-10")["step"] == 10
    assert verify_checkpoint(out / f"checkpoint-{step}")["step"] == step
    assert f"Received {int(sig)} death signal" in text  # the launcher's
    return step


# One job per config serves both recoveries, each checked where it happens, and the run must still end as
# the reference: ddp is killed first (a fresh run without a resume flag: the restarted group resumes as with
# --resume_from_checkpoint auto), then signalled (SIGHUP, a closed terminal) at step 14, in the restarted
# group, and requeued with `auto`; fsdp is signalled (SIGINT, Ctrl-C) during its save of checkpoint-10,
# requeued with the same command, and that run's rank 1 is killed after checkpoint-20. SIGTERM through the
# launcher: conftest.preempt, in the other recipes' tests.
@pytest.mark.parametrize(
    "config, sig, when",
    [
        ("ddp", signal.SIGHUP, "at step 14"),
        ("fsdp", signal.SIGINT, "during the save of checkpoint-10"),
    ],
    ids=["ddp-SIGHUP at step 14", "fsdp-SIGINT during the save of checkpoint-10"],
)
def test_a_killed_rank_restarts_on_its_own_and_a_signal_saves_for_the_requeue(
    config, sig, when, tmp_path, cache_dir, small_corpus, reference_run
):
    reference = reference_run(config, *corpus_args(small_corpus), *RUN30)
    if (
        config == "ddp"
    ):  # torchrun's default shares one rendezvous store between attempts: refused at start-up
        job = start(
            config,
            tmp_path / "shared_store",
            small_corpus,
            cache_dir,
            launcher=["--max_restarts", 1],
        )
        assert finish(job) != 0
        assert (
            "error: --max_restarts with torchrun's shared rendezvous store"
            in open(f"{tmp_path}/shared_store.log").read()
        )
    out, statuses = tmp_path / "run", tmp_path / "exit"
    statuses.mkdir()  # each rank's exit status (tests/device_guard), which torchrun does not report
    restartable = {
        "launcher": ["--rdzv_backend", "c10d", "--max_restarts", 1],
        "device_guard": True,
        "env": {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "EXIT_STATUS_DIR": str(statuses)},
    }
    requeue = ["--resume_from_checkpoint", "auto"]
    if config == "ddp":
        job = start(config, out, small_corpus, cache_dir, log=tmp_path / "first.log", **restartable)
        try:
            kill_a_rank_after(job, out, 10, tmp_path / "first.log")
            for p in (
                statuses.iterdir()
            ):  # the killed attempt's; the signal's check below is the restarted group's
                p.unlink()
        except BaseException:
            os.killpg(job.pid, signal.SIGKILL) if job.poll() is None else None
            raise
        step = signal_the_launcher(job, out, sig, when, statuses, tmp_path / "first.log")
        # what would make the resumed run another one is refused, each named (reviewer's finds)
        train = small_corpus[0].read_text()
        (tmp_path / "other.txt").write_text(train[len(train) // 2 :] + train[: len(train) // 2])
        proc = launch(
            config,
            "recipes/llama.py",
            "--output_dir",
            out,
            *corpus_args(small_corpus),
            *RUN30,
            *requeue,
            "--max_grad_norm",
            0.5,
            "--config_overrides",
            "rms_norm_eps=1e-3",
            "--train_file",
            tmp_path / "other.txt",
            cache_dir=cache_dir,
            mixed_precision="no",
            check=False,
        )
        assert proc.returncode != 0
        for change in (
            "data_digest ",
            "(the data: --train_file, ",
            "max_grad_norm 1.0 -> 0.5",
            "model_config.rms_norm_eps 1e-06 -> 0.001",
        ):
            assert change in proc.stderr, proc.stderr[-3000:]
        # The requeue, with `auto` (the first command had no resume flag): it ends as if never stopped.
        proc = launch(
            config,
            "recipes/llama.py",
            "--output_dir",
            out,
            *corpus_args(small_corpus),
            *RUN30,
            *requeue,
            cache_dir=cache_dir,
            mixed_precision="no",
        )
        assert f"resumed from {out / f'checkpoint-{step}'} at step {step}" in proc.stdout
    else:
        job = start(
            config,
            out,
            small_corpus,
            cache_dir,
            *requeue,
            log=tmp_path / "first.log",
            **restartable,
        )
        step = signal_the_launcher(job, out, sig, when, statuses, tmp_path / "first.log")
        # The same command line again (a requeue): it resumes from that checkpoint, then loses a rank.
        job = start(
            config,
            out,
            small_corpus,
            cache_dir,
            *requeue,
            log=tmp_path / "requeue.log",
            **restartable,
        )
        try:
            kill_a_rank_after(job, out, 20, tmp_path / "requeue.log")
            assert finish(job) == 0
        finally:
            os.killpg(job.pid, signal.SIGKILL) if job.poll() is None else None
        assert (
            f"resumed from {out / f'checkpoint-{step}'} at step {step}\n"
            in open(tmp_path / "requeue.log").read()
        )
    assert_same_run(out, reference)


def test_a_preempted_process_exits_143(tmp_path, cache_dir, small_corpus):
    """The exit status SLURM, Kubernetes and shells read from a preempted process: 143 (128 + SIGTERM),
    after the save. One process without a launcher: torchrun, signalled, exits through its own
    exception and does not report its workers' status."""
    out = tmp_path / "run"
    env = {
        **os.environ,
        "ACCELERATE_RECIPES_CACHE": cache_dir,
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    with open(tmp_path / "run.log", "w") as log:
        job = subprocess.Popen(
            [
                sys.executable,
                str(REPO / "recipes/llama.py"),
                "--output_dir",
                str(out),
                *map(str, corpus_args(small_corpus)),
                *map(str, RUN30),
            ],
            cwd=REPO,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            wait_until(lambda: last_step(out) >= 2, job, "step 2")
            job.send_signal(signal.SIGTERM)
            assert finish(job, timeout=60) == PREEMPTED_EXIT_CODE == 143
        finally:
            os.killpg(job.pid, signal.SIGKILL) if job.poll() is None else None
    step = int(
        re.search(
            r"preempted \(SIGTERM\) at step (\d+): saved", (tmp_path / "run.log").read_text()
        ).group(1)
    )
    assert verify_checkpoint(out / f"checkpoint-{step}")["step"] == step


def test_one_live_job_per_output_dir_and_a_sigkilled_launcher_takes_its_workers_with_it(
    tmp_path, cache_dir, small_corpus
):
    # A double submission (or a requeue while the first job still runs): the same command twice.
    # Then the first job's launcher is SIGKILLed (one launch serves both checks).
    out = tmp_path / "run"
    job = start(
        "ddp",
        out,
        small_corpus,
        cache_dir,
        "--resume_from_checkpoint",
        "auto",
        "--max_steps",
        10_000,
    )
    workers = {}
    try:
        wait_until(lambda: last_step(out) >= 1, job, "step 1")
        workers = ranks(job)
        assert len(workers) == 2
        holder = workers[0].pid
        trained = last_step(out)
        proc = launch(
            "ddp",
            "recipes/llama.py",
            "--output_dir",
            out,
            *corpus_args(small_corpus),
            *RUN30,
            "--resume_from_checkpoint",
            "auto",
            cache_dir=cache_dir,
            check=False,
        )
        assert proc.returncode != 0
        assert (
            f"error: --output_dir {out} is in use by a live job: pid {holder} on {socket.gethostname()}"
            in proc.stderr
        )
        assert job.poll() is None  # the first job trains on, alone
        wait_until(lambda: last_step(out) > trained, job, f"step {trained + 1}")
        job.send_signal(signal.SIGKILL)  # the launcher only: nothing of it runs to stop the workers
        job.wait()
        t0 = time.time()
        # the kernel SIGKILLs the workers (launch.die_with_launcher): a crash, no exit handler runs
        gone, alive = psutil.wait_procs(list(workers.values()), timeout=60)
        assert not alive, (
            f"workers still running 60 s after their launcher died: {[p.pid for p in alive]}"
        )
        print(f"workers gone {time.time() - t0:.2f} s after the launcher")
    finally:
        os.killpg(job.pid, signal.SIGKILL) if job.poll() is None else None
        for p in workers.values():  # none left after a pass; after a failure, no orphans
            try:
                p.kill()
            except psutil.Error:
                pass
    steps = [r["step"] for r in read_metrics(out)[0]]
    assert steps == list(range(1, len(steps) + 1))  # one job's lines only
    # The crashed job's lock is not stale: the kernel dropped it with the process; the file names it still.
    assert f'"pid": {holder}' in (out / ".lock").read_text()
    taken = subprocess.run(
        [sys.executable, "-c", f"from common.run_dir import lock; print(lock({str(out)!r}))"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    assert taken.stdout.strip() == "None", taken.stderr[-2000:]


# Each recipe long enough to run on for minutes if its workers outlived the launcher, and a line it prints
# once training is under way: past start-up's uses of the launcher's rendezvous store (the process
# group, stop_on_signal's gloo group), which fail once the launcher is gone and would end the ranks
# even without die_with_launcher (checked: killed at "precision: no", they stopped in new_group).
LONG_RUNS = {
    "recipes/ddp_classifier.py": (
        [
            "--max_train_samples",
            64,
            "--max_eval_samples",
            16,
            "--per_device_train_batch_size",
            8,
            "--max_steps",
            10_000,
            "--logging_steps",
            1,
        ],
        "step 2/10000 |",
    ),
    "recipes/mixed_precision.py": (
        [
            "--precision",
            "no",
            "--per_device_train_batch_size",
            1,
            "--block_size",
            64,
            "--max_eval_samples",
            2,
            "--max_steps",
            10_000,
            "--logging_steps",
            1,
        ],
        "tok_s=",  # the progress bar, once step 1 is logged
    ),
    "recipes/gradient_checkpointing.py": (
        [
            "--num_layers",
            1,
            "--per_device_train_batch_size",
            1,
            "--block_size",
            64,
            "--max_steps",
            3,
            "--timing_rounds",
            1000,
        ],
        "L=1 none round 0:",
    ),
}


@pytest.mark.parametrize("recipe", LONG_RUNS)
def test_a_sigkilled_launcher_takes_every_recipes_workers_with_it(recipe, tmp_path, cache_dir):
    """llama.py's case above, for the other recipes that train under `accelerate launch` (sharded_data.py
    makes the same call, in the shared accelerator block that tests/test_skeleton.py keeps identical; no
    launch of it here): the kernel SIGKILLs each rank when its launcher dies (die_with_launcher).
    Measured: gone 1.2-1.9 s after the launcher (a killed rank counts until PID 1 reaps it); without
    die_with_launcher, all three recipes' ranks still ran 30 s later."""
    with training(recipe, tmp_path, cache_dir) as (job, ranks, _):
        job.send_signal(signal.SIGKILL)  # the launcher only: nothing of it runs to stop the workers
        job.wait()
        t0 = time.time()
        alive = psutil.wait_procs(list(ranks.values()), timeout=10)[1]
        assert not alive, (
            f"workers still running 10 s after their launcher died: {[p.pid for p in alive]}"
        )
        print(f"{recipe}: workers gone {time.time() - t0:.2f} s after the launcher")


@contextlib.contextmanager
def training(recipe, tmp_path, cache_dir):
    """A 2-rank DDP launch of one of LONG_RUNS, once it trains: yields (launcher, {rank: process}, log).
    On the way out nothing is left running: the launcher's group and every rank are SIGKILLed."""
    args, ready = LONG_RUNS[recipe]
    log = tmp_path / "run.log"
    job = start_recipe(
        "ddp",
        recipe,
        "--output_dir",
        tmp_path / "run",
        "--ddp_timeout",
        60,
        *args,
        cache_dir=cache_dir,
        log=log,
        num_processes=2,
        mixed_precision="no",
    )
    ranks = {}
    try:
        wait_until(lambda: ready in log.read_text(), job, repr(ready), timeout=120)
        ranks.update(workers(job, recipe))
        assert sorted(ranks) == [0, 1]
        yield job, ranks, log
    finally:
        os.killpg(job.pid, signal.SIGKILL) if job.poll() is None else None
        for p in ranks.values():  # none left after a pass; after a failure, no orphans
            try:
                p.kill()
            except psutil.Error:
                pass


def test_sigterm_ends_gradient_checkpointing(tmp_path, cache_dir):
    """docs/multinode.md: gradient_checkpointing.py keeps no checkpoints (a measurement), so SIGTERM to
    the launcher ends it: torchrun passes the signal on, no rank catches it, every rank is gone and the
    launcher exits 1 (torchrun's SignalException)."""
    recipe = "recipes/gradient_checkpointing.py"
    with training(recipe, tmp_path, cache_dir) as (job, ranks, log):
        assert not any(
            catches(p, signal.SIGTERM) for p in ranks.values()
        )  # no stop_on_signal handler
        t0 = time.time()
        job.send_signal(signal.SIGTERM)  # the launcher only, as SLURM or Kubernetes would
        status = finish(job, timeout=60)
        alive = psutil.wait_procs(list(ranks.values()), timeout=10)[1]
        assert not alive, f"ranks still running 10 s after SIGTERM: {[p.pid for p in alive]}"
        print(f"{recipe}: launcher and ranks gone {time.time() - t0:.2f} s after SIGTERM")
    assert status == 1 and "SignalException" in log.read_text(), (status, log.read_text()[-3000:])


@pytest.mark.parametrize("node_local", ["--output_dir", "--train_file"])
def test_a_node_local_path_is_refused_at_start_up(node_local, tmp_path, cache_dir, small_corpus):
    # Two "machines" on this host, each given its own path: what a node-local --output_dir is, or a
    # --train_file whose copy on the second node holds another text (of the same size).
    train = small_corpus[0].read_text()
    (tmp_path / "other.txt").write_text(train[len(train) // 2 :] + train[: len(train) // 2])
    port = free_port()

    def machine(rank):
        flags = {
            "--output_dir": tmp_path / (f"node{rank}" if node_local == "--output_dir" else "shared")
        }
        if node_local == "--train_file" and rank == 1:
            flags["--train_file"] = tmp_path / "other.txt"
        cmd = launch_command(
            "ddp",
            "recipes/llama.py",
            *corpus_args(small_corpus),
            *RUN30,
            *(x for kv in flags.items() for x in kv),  # later flags win
            num_processes=2,
            launcher_args=[
                "--num_machines",
                2,
                "--machine_rank",
                rank,
                "--main_process_ip",
                "127.0.0.1",
                "--main_process_port",
                port,
            ],
        )
        env = launch_env(
            cache_dir,
            {"PYTHONUNBUFFERED": None, "TOKENIZERS_PARALLELISM": None},
            device_guard=False,
        )
        return subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )

    jobs = [machine(0), machine(1)]
    outputs = [job.communicate(timeout=300)[0] for job in jobs]
    for rank, (job, output) in enumerate(zip(jobs, outputs)):
        assert job.returncode != 0
        if node_local == "--output_dir":
            want = (
                f"error: --output_dir {tmp_path / f'node{rank}'} is not one directory shared by every rank: "
                f"rank {rank}"
            )
        else:
            want = (
                "error: the data (train and validation text, tokenizer, block size, packing) differs between "
                "ranks: rank(s) 1 read"
            )
        assert want in output, output[-3000:]
    assert not list(tmp_path.glob("*/checkpoint-10"))


@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGTERM, signal.SIGINT])
def test_each_stop_signal_is_recorded_not_fatal(sig):
    """The handler the recipes install (one process here; the launches above send SIGTERM and
    SIGINT through torchrun): the signal is recorded and `preempted()` names it at the next step."""
    from types import SimpleNamespace

    from common.checkpoint import stop_on_signal

    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    try:
        preempted = stop_on_signal(SimpleNamespace(num_processes=1), timeout_s=5)
        assert preempted() is None
        os.kill(
            os.getpid(), sig
        )  # delivered before kill returns (to this thread), run at the next bytecode
        assert preempted() == sig.name
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)


def test_resume_auto_rules(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    out = tmp_path / "run"
    # A fresh directory: `auto` is an ordinary start.
    args = parse_args(Own, ["--output_dir", str(out), "--resume_from_checkpoint", "auto"])
    assert args.resume_from_checkpoint == "auto"
    # A directory with files but no checkpoint: refused, as a fresh run would be (run_clm.py's rule)...
    out.mkdir()
    (out / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(Stop, match="auto found no complete checkpoint"):
        parse_args(Own, ["--output_dir", str(out), "--resume_from_checkpoint", "auto"])
    # ...unless this is a restart of the same job, which died before its first checkpoint.
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    args = parse_args(Own, ["--output_dir", str(out), "--overwrite_output_dir"])
    # never wipes its own checkpoints
    assert (args.resume_from_checkpoint, args.overwrite_output_dir) == ("auto", False)
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")
    args = parse_args(
        Own,
        ["--output_dir", str(out), "--overwrite_output_dir", "--resume_from_checkpoint", "auto"],
    )
    assert (args.resume_from_checkpoint, args.overwrite_output_dir) == (
        None,
        True,
    )  # the first attempt overwrites


@dataclass
class Own:
    """A recipe with no flags of its own."""
