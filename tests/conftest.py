"""Shared fixtures: launch a recipe for real with `accelerate launch`, read what it wrote."""

import gc
import json
import os
import re
import runpy
import signal
import subprocess
import sys
import time
from pathlib import Path

# The suite asserts the CPU paths (MULTI_CPU, gloo, the CPU GradScaler), so on a GPU host it hides
# the GPUs, before anything initialises CUDA, from itself and from every process it starts (which
# inherit os.environ: launches, subprocess.run, sbatch jobs), and opts in to CPU ranks, which
# common/launch.py otherwise refuses on a host with GPUs that torch cannot see.
HOST_CUDA_VISIBLE_DEVICES = os.environ.get(
    "CUDA_VISIBLE_DEVICES"
)  # for the GPU-only tests (test_gpu_syncs.py)
os.environ["CUDA_VISIBLE_DEVICES"] = ""
os.environ["ACCELERATE_RECIPES_ALLOW_CPU"] = "1"
# torch sets TORCHINDUCTOR_CACHE_DIR to its shared /tmp default in os.environ as soon as a module that
# loads inductor is imported (transformers' LlamaForCausalLM does, in test modules): read the caller's
# value now, before any test module, or every launch would inherit that default (`launch_env`).
CALLER_INDUCTOR_CACHE = os.environ.get("TORCHINDUCTOR_CACHE_DIR")

import accelerate  # noqa: E402  (only now: nothing may initialise CUDA before the lines above)
import pytest  # noqa: E402  (kept with the import above, after the environment lines)

REPO = Path(__file__).resolve().parent.parent
CONFIGS = ["single", "ddp", "fsdp", "fsdp1", "deepspeed_zero2", "deepspeed_zero3"]
# Small and fast, but the real corpus, tokenizer and model: 4 blocks of 128 tokens per rank.
FAST = [
    "--per_device_train_batch_size",
    "4",
    "--block_size",
    "128",
    "--max_eval_samples",
    "32",
    "--report_to",
    "none",
    "--ddp_timeout",
    "120",
]


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    """One tokenizer/packing cache for the whole session (built by the first run)."""
    path = os.environ.get("ACCELERATE_RECIPES_CACHE") or str(tmp_path_factory.mktemp("cache"))
    return path


@pytest.fixture(autouse=True)
def restore_environ():
    """Recipe code run in-process sets variables (ACCELERATE_USE_CPU for DDP on CPU, ...); none may
    reach a later test's launches (an inherited ACCELERATE_USE_CPU turns DeepSpeed configs into DDP)."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(autouse=True)
def collectable_heap():
    """A recipe run in this process freezes the whole heap at its imports (`launch.imports_done`): hand
    it back to the collector, so the session's later cyclic garbage is freed."""
    yield
    gc.unfreeze()
    gc.enable()


def launch_command(
    config, script, *args, num_processes=None, mixed_precision=None, launcher_args=(), root=REPO
):
    """`accelerate launch --config_file accelerate_configs/{config}.yaml [--num_processes N] [--mixed_precision P]
    {launcher_args} {script} {args}` as a list of strings, the config and script under `root` (this
    repository, or a copy of it); `config` may also be the path of a YAML file."""
    config_file = (
        config if isinstance(config, Path) else Path(root) / "accelerate_configs" / f"{config}.yaml"
    )
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config_file)]
    if num_processes is not None:
        cmd += ["--num_processes", str(num_processes)]
    if mixed_precision is not None:
        cmd += ["--mixed_precision", mixed_precision]
    return [*cmd, *map(str, launcher_args), str(Path(root) / script), *map(str, args)]


def launch_env(cache_dir, env=None, device_guard=True):
    """The environment of a launch: this one, the shared cache, torch.compile's kernels cached in it (a
    stale /tmp/torchinductor_<user> cannot reach the suite), unbuffered output, one thread per rank, and
    (device_guard) tests/device_guard first on PYTHONPATH; then `env` on top, where None removes a variable."""
    kernels = os.path.join(
        cache_dir, f"inductor_{os.environ.get('ATEN_CPU_CAPABILITY', 'native').lower()}"
    )
    base = {
        **os.environ,
        "ACCELERATE_RECIPES_CACHE": cache_dir,
        "PYTHONUNBUFFERED": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": "1",
        "TORCHINDUCTOR_CACHE_DIR": CALLER_INDUCTOR_CACHE or kernels,
    }
    if device_guard:  # every process runs tests/device_guard: project code may not hand a collective a host tensor
        base["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(REPO / "tests" / "device_guard"), os.environ.get("PYTHONPATH")])
        )
    return {k: v for k, v in {**base, **(env or {})}.items() if v is not None}


def launch(
    config,
    script,
    *args,
    cache_dir,
    num_processes=None,
    mixed_precision=None,
    timeout=900,
    check=True,
    launcher_args=(),
    env=None,
    device_guard=True,
    root=REPO,
):
    """Run `accelerate launch --config_file accelerate_configs/{config}.yaml {launcher_args} {script} {args}`
    (`launch_command`) in `root`, with `launch_env(cache_dir, env, device_guard)`.

    Returns the CompletedProcess; with check=True, fails the test with the output tail on error.
    """
    cmd = launch_command(
        config,
        script,
        *args,
        num_processes=num_processes,
        mixed_precision=mixed_precision,
        launcher_args=launcher_args,
        root=root,
    )
    proc = subprocess.run(
        cmd,
        cwd=root,
        env=launch_env(cache_dir, env, device_guard),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if check and proc.returncode != 0:
        pytest.fail(
            f"{' '.join(cmd)} exited {proc.returncode}\n--- stdout ---\n{proc.stdout[-4000:]}\n"
            f"--- stderr ---\n{proc.stderr[-8000:]}"
        )
    return proc


def start(config, script, *args, cache_dir, log, env=None, device_guard=True, **launch_options):
    """`launch` in the background: a Popen in its own session (so that a test can kill all of it), stdout
    and stderr into the file `log`. `launch_options`: num_processes, mixed_precision, launcher_args."""
    cmd = launch_command(config, script, *args, **launch_options)
    with open(log, "w") as out:
        return subprocess.Popen(
            cmd,
            cwd=REPO,
            env=launch_env(cache_dir, env, device_guard),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def workers(job, script):
    """The recipe processes of a background launch, by rank: the launcher's own children running
    `script` (torchrun runs inside `accelerate launch`), not their DataLoader workers."""
    import psutil

    found = {}
    for p in psutil.Process(job.pid).children():
        try:
            if Path(script).name in " ".join(p.cmdline()):
                found[int(p.environ()["RANK"])] = p
        except (psutil.Error, KeyError):
            pass
    return found


def wait_until(condition, job, what, timeout=300, poll=0.05):
    """Poll `condition()` until it holds; fail if the background `job` ends first or `timeout` s pass."""
    deadline = time.time() + timeout
    while not condition():
        assert job.poll() is None, f"the job ended (exit {job.returncode}) before {what}"
        assert time.time() < deadline, f"no {what} within {timeout} s"
        time.sleep(poll)


def finish(job, timeout=300):
    """Wait for the background job; on timeout kill its whole session and fail."""
    try:
        return job.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        pytest.fail(f"the job did not end within {timeout} s")


def catches(process, sig):
    """Whether `process` (a psutil.Process) has a handler installed for `sig` (/proc/PID/status, SigCgt)."""
    try:
        with open(f"/proc/{process.pid}/status") as f:
            mask = next(line for line in f if line.startswith("SigCgt:")).split()[1]
    except (OSError, StopIteration):
        return False
    return bool(int(mask, 16) >> (int(sig) - 1) & 1)


def preempt(config, script, *args, out, cache_dir, world=2, **launch_options):
    """Launch `script --output_dir out args` in the background and SIGTERM the launcher (as SLURM or
    Kubernetes would) as soon as every rank has installed the recipe's handler
    (checkpoint.stop_on_signal, right before the training loop), so during step 1. Checks what
    README.md's failure table promises: every rank saves `checkpoint-N` at the next step boundary
    (complete: COMPLETE.json verified), prints `preempted (SIGTERM) at step N: saved ...` and exits
    143 (tests/device_guard records each rank's exit status); the launcher exits 1 after torchrun's
    SignalException; no rank is left running. Returns (N, the launch's output)."""
    import psutil

    from common.checkpoint import PREEMPTED_EXIT_CODE, verify_checkpoint

    statuses, log = Path(f"{out}.exit"), Path(f"{out}.log")
    statuses.mkdir()
    job = start(
        config,
        script,
        "--output_dir",
        out,
        *args,
        cache_dir=cache_dir,
        log=log,
        env={"EXIT_STATUS_DIR": str(statuses)},
        **launch_options,
    )
    ranks = {}

    def started():
        ranks.update(workers(job, script))  # (a scan of every process: slow, so polled slowly)
        return len(ranks) == world

    try:
        wait_until(started, job, f"{world} ranks", poll=0.2)
        wait_until(
            lambda: all(catches(p, signal.SIGTERM) for p in ranks.values()),
            job,
            "every rank's SIGTERM handler",
            poll=0.005,
        )
        job.send_signal(signal.SIGTERM)  # the launcher only: torchrun passes it on to every rank
        status = finish(job, timeout=120)
        assert not psutil.wait_procs(list(ranks.values()), timeout=10)[1], "ranks left running"
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    output = log.read_text()
    assert status == 1 and "SignalException" in output, (status, output[-3000:])
    assert (
        PREEMPTED_EXIT_CODE == 143
    )  # 128 + SIGTERM, what SLURM and shells read as "ended by SIGTERM"
    assert {p.name: p.read_text() for p in statuses.iterdir()} == {
        f"rank{r}": "143" for r in range(world)
    }, output[-3000:]
    preempted = re.search(r"preempted \(SIGTERM\) at step (\d+): saved (\S+);", output)
    assert preempted, output[-3000:]
    step = int(preempted.group(1))
    assert preempted.group(2) == str(Path(out) / f"checkpoint-{step}")
    assert verify_checkpoint(Path(out) / f"checkpoint-{step}")["step"] == step
    return step, output


def read_metrics(output_dir):
    """(per-step records, summary record) from metrics.jsonl."""
    lines = [json.loads(line) for line in open(Path(output_dir) / "metrics.jsonl")]
    return [r for r in lines if not r.get("summary")], [r for r in lines if r.get("summary")]


def host_reads(log_dir):
    """The launch's reads of tensor values, logged with HOST_READS_DIR=log_dir (tests/device_guard/host_reads.py).

    Returns {rank: [[origin ("project" | "library"), name, "file:line", step, via], ...]}, one entry
    per recipe process (a relaunched rank keeps its last log).
    """
    logs = {}
    for path in sorted(Path(log_dir).glob("rank*.json")):
        logs[int(path.name[4:].split("-")[0])] = json.loads(path.read_text())["reads"]
    return logs


def ordinary_step_reads(reads, logging_steps, max_steps, start=0, save_steps=0):
    """The reads made during ordinary steps: neither logging, evaluation nor checkpoint steps.

    A read made while optimizer step k trains sees the recipe's `step` = k - 1; one made after
    step k's update (logging, saving) sees k. So a `step` value s between `start` and `max_steps`
    that is not a multiple of `logging_steps` (nor of `save_steps`) covers only the rest of the
    ordinary step s and the training of step s + 1 (which, if it logs, does so seeing s + 1).
    """
    return [
        r
        for r in reads
        if r[3] is not None
        and start < r[3] < max_steps
        and r[3] % logging_steps
        and not (save_steps and r[3] % save_steps == 0)
    ]


@pytest.fixture(scope="session")
def small_corpus(tmp_path_factory, cache_dir):
    """A small slice of the real corpus for runs of several epochs, with the shared tokenizer.

    Returns (train.txt, valid.txt, tokenizer dir): about 45 blocks of 64 tokens to train on.
    """
    from common import data

    root = tmp_path_factory.mktemp("small")
    raw = data.load_text_dataset()
    tok = data.get_tokenizer(None, raw, 4096, cache_dir)
    tok.save_pretrained(root / "tokenizer")
    hamlet = next(t for t, w in zip(raw["train"]["text"], raw["train"]["work"]) if w == "hamlet")
    (root / "train.txt").write_text(hamlet[20_000:31_000])
    (root / "valid.txt").write_text(hamlet[40_000:43_000])
    return root / "train.txt", root / "valid.txt", root / "tokenizer"


def strict_json(text):
    """json.loads that refuses NaN/Infinity, which Python's json writes and standard JSON forbids."""
    return json.loads(text, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))


def strict_lines(path):
    """A .jsonl file, every line parsed by `strict_json`."""
    return [strict_json(line) for line in open(path)]


def run_in_process(monkeypatch, recipe, *argv):
    """Run `recipe` in this process up to its first exit (the flag checks come before any launch work).

    Returns the exit message. Past its checks the recipe would build an Accelerator and train in
    this process: the stubbed Accelerator fails the test at once instead.
    """
    monkeypatch.setattr(sys, "argv", [str(REPO / recipe), *map(str, argv)])
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setattr(
        accelerate,
        "Accelerator",
        lambda *a, **k: pytest.fail("the recipe got past its flag checks"),
    )
    from common import errors

    lines = []  # what errors.run writes to stderr
    monkeypatch.setattr(
        errors.os, "write", lambda fd, data: lines.append(data.decode()) or len(data)
    )
    with pytest.raises(SystemExit) as exc:
        runpy.run_path(str(REPO / recipe), run_name="__main__")
    return "".join(lines).strip() if exc.value.code == 1 and lines else str(exc.value.code)


def corpus_args(corpus):
    """`small_corpus` as recipe flags: --train_file, --validation_file, --tokenizer_name_or_path."""
    train, valid, tok = corpus
    return ["--train_file", train, "--validation_file", valid, "--tokenizer_name_or_path", tok]


# The 30-step fp32 run that the recovery, preemption and SLURM tests compare with (global batch 4:
# 2 per device x 2 ranks): checkpoints at 10, 20 and 30. Pass it after corpus_args.
RUN30 = [
    "--block_size",
    64,
    "--per_device_train_batch_size",
    2,
    "--max_steps",
    30,
    "--save_steps",
    10,
    "--warmup_steps",
    4,
    "--logging_steps",
    1,
    "--eval_steps",
    30,
    "--report_to",
    "none",
    "--ddp_timeout",
    60,
    "--sample_tokens",
    0,
]  # the export's reload and sample: tests/test_llama.py


# The 10-step runs that tests/test_llama.py checks and tests/test_parity.py compares: global batch 4
# on every config (4 per device on one process, 2 x 2 ranks), logged every 2nd step so that the odd
# steps are ordinary ones for the host-read check.
SHORT = [
    "--max_steps",
    10,
    "--warmup_steps",
    3,
    "--learning_rate",
    3e-3,
    "--logging_steps",
    2,
    "--eval_steps",
    10,
    "--block_size",
    64,
    "--max_eval_samples",
    13,
    "--per_device_eval_batch_size",
    4,
    "--save_logits_probe",
    "--report_to",
    "none",
    "--ddp_timeout",
    120,
    "--sample_tokens",
    0,
    "--peak_tflops",
    0.05,
]  # MFU on a CPU


@pytest.fixture(scope="session")
def short_run(tmp_path_factory, cache_dir):
    """`run(config, precision="no")`: `recipes/llama.py` with SHORT under `config` (a name or a YAML
    path), once per session; returns (output dir, its host reads as `host_reads` gives them). The
    launch's stderr is `stderr.log` beside the output dir."""
    done = {}

    def run(config, precision="no"):
        key = (str(config), precision)
        if key not in done:
            base = tmp_path_factory.mktemp(f"short-{getattr(config, 'stem', config)}-{precision}")
            out, reads = base / "run", base / "reads"
            reads.mkdir()
            with pytest.MonkeyPatch.context() as mp:
                mp.setenv(
                    "HOST_READS_DIR", str(reads)
                )  # tests/device_guard/host_reads.py logs every read
                proc = launch(
                    config,
                    "recipes/llama.py",
                    "--output_dir",
                    out,
                    "--per_device_train_batch_size",
                    4 if config == "single" else 2,
                    *SHORT,
                    cache_dir=cache_dir,
                    mixed_precision=precision,
                )
            (base / "stderr.log").write_text(proc.stderr)
            done[key] = out, host_reads(reads)
        return done[key]

    return run


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory, cache_dir):
    """`run(config, *args)`: launch `recipes/llama.py` in fp32 once per (config, args) for the whole
    session, and return its output directory, so that several tests compare with one run."""
    done = {}

    def run(config, *args):
        key = (config, tuple(map(str, args)))
        if key not in done:
            out = tmp_path_factory.mktemp(f"reference-{config}")
            launch(
                config,
                "recipes/llama.py",
                "--output_dir",
                out,
                "--overwrite_output_dir",
                *args,
                cache_dir=cache_dir,
                mixed_precision="no",
            )
            done[key] = out
        return done[key]

    return run


# The contributor's quick check, `python -m pytest -m quick tests` (docs/testing.md). Every test
# carries the marker; under `-m quick` a test is skipped the moment it would start a process (a
# launch, a tool, a script), except QUICK_LAUNCHES: the main recipe for real on one process and on
# 2 FSDP2 ranks, then their parity. Those run last, after the in-process tests.
QUICK_LAUNCHES = {
    "test_llama.py::test_every_config_trains_and_exports[single]",
    "test_llama.py::test_every_config_trains_and_exports[fsdp]",
    "test_parity.py::test_fp32_parity[fsdp]",
}
_in_quick_check = {"starts_no_process": False}  # True while a test outside QUICK_LAUNCHES runs


def _quick_check(config) -> bool:
    return (config.getoption("markexpr", "") or "").strip() == "quick"


def _popen_in_quick_check(popen_init):
    def init(self, args, *rest, **kwargs):
        if _in_quick_check["starts_no_process"]:
            pytest.skip(f"starts a process (the full suite runs it): {str(args)[:120]}")
        popen_init(self, args, *rest, **kwargs)

    return init


def pytest_configure(config):
    if _quick_check(config):
        subprocess.Popen.__init__ = _popen_in_quick_check(subprocess.Popen.__init__)


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config, items):
    for item in items:
        item.add_marker(pytest.mark.quick)
    if _quick_check(config):  # the launches last (a stable sort)
        items.sort(key=lambda item: item.nodeid.rsplit("/", 1)[-1] in QUICK_LAUNCHES)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _in_quick_check["starts_no_process"] = (
        _quick_check(item.config) and item.nodeid.rsplit("/", 1)[-1] not in QUICK_LAUNCHES
    )
    try:
        yield
    finally:
        _in_quick_check["starts_no_process"] = False
