"""Shared fixtures: launch a recipe for real with `accelerate launch`, read what it wrote."""

import json
import os
import runpy
import subprocess
import sys
from pathlib import Path

# The suite asserts the CPU paths (MULTI_CPU, gloo, the CPU GradScaler), so on a GPU host it hides
# the GPUs, before anything initialises CUDA, from itself and from every process it starts (which
# inherit os.environ: launches, subprocess.run, sbatch jobs), and opts in to CPU ranks, which
# common/launch.py otherwise refuses on a host with GPUs that torch cannot see.
HOST_CUDA_VISIBLE_DEVICES = os.environ.get("CUDA_VISIBLE_DEVICES")  # for the GPU-only tests (test_gpu_syncs.py)
os.environ["CUDA_VISIBLE_DEVICES"] = ""
os.environ["ACCELERATE_RECIPES_ALLOW_CPU"] = "1"

import accelerate  # only now: nothing may initialise CUDA before the lines above
import pytest

REPO = Path(__file__).resolve().parent.parent
CONFIGS = ["single", "ddp", "fsdp", "fsdp1", "deepspeed_zero2", "deepspeed_zero3"]
# Small and fast, but the real corpus, tokenizer and model: 4 blocks of 128 tokens per rank.
FAST = ["--per_device_train_batch_size", "4", "--block_size", "128", "--max_eval_samples", "32",
        "--report_to", "none", "--ddp_timeout", "120"]


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    """One tokenizer/packing cache for the whole session (built by the first run)."""
    path = os.environ.get("ACCELERATE_RECIPES_CACHE") or str(tmp_path_factory.mktemp("cache"))
    return path


def launch(config, script, *args, cache_dir, num_processes=None, mixed_precision=None, timeout=900, check=True,
           launcher_args=()):
    """Run `accelerate launch --config_file accelerate_configs/{config}.yaml {launcher_args} {script} {args}`
    (`config` may also be the path of a YAML file).

    Returns the CompletedProcess; with check=True, fails the test with the output tail on error.
    """
    config_file = config if isinstance(config, Path) else REPO / "accelerate_configs" / f"{config}.yaml"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config_file)]
    if num_processes is not None:
        cmd += ["--num_processes", str(num_processes)]
    if mixed_precision is not None:
        cmd += ["--mixed_precision", mixed_precision]
    cmd += [*map(str, launcher_args), str(REPO / script), *map(str, args)]
    env = {**os.environ, "ACCELERATE_RECIPES_CACHE": cache_dir, "PYTHONUNBUFFERED": "1",
           "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1",
           # every process runs tests/device_guard: project code may not hand a collective a host tensor
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO / "tests" / "device_guard"), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} exited {proc.returncode}\n--- stdout ---\n{proc.stdout[-4000:]}\n"
                    f"--- stderr ---\n{proc.stderr[-8000:]}")
    return proc


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
    return [r for r in reads if r[3] is not None and start < r[3] < max_steps and r[3] % logging_steps
            and not (save_steps and r[3] % save_steps == 0)]


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
    monkeypatch.setattr(accelerate, "Accelerator", lambda *a, **k: pytest.fail("the recipe got past its flag checks"))
    from common import errors

    lines = []  # what errors.run writes to stderr
    monkeypatch.setattr(errors.os, "write", lambda fd, data: lines.append(data.decode()) or len(data))
    with pytest.raises(SystemExit) as exc:
        runpy.run_path(str(REPO / recipe), run_name="__main__")
    return "".join(lines).strip() if exc.value.code == 1 and lines else str(exc.value.code)


def corpus_args(corpus):
    """`small_corpus` as recipe flags: --train_file, --validation_file, --tokenizer_name_or_path."""
    train, valid, tok = corpus
    return ["--train_file", train, "--validation_file", valid, "--tokenizer_name_or_path", tok]


# The 30-step fp32 run that the recovery, preemption and SLURM tests compare with (global batch 4:
# 2 per device x 2 ranks): checkpoints at 10, 20 and 30. Pass it after corpus_args.
RUN30 = ["--block_size", 64, "--per_device_train_batch_size", 2, "--max_steps", 30, "--save_steps", 10,
         "--warmup_steps", 4, "--logging_steps", 1, "--eval_steps", 30, "--report_to", "none", "--ddp_timeout", 60,
         "--sample_tokens", 0]  # the export's reload and sample: tests/test_llama.py


# The 10-step runs that tests/test_llama.py checks and tests/test_parity.py compares: global batch 4
# on every config (4 per device on one process, 2 x 2 ranks), logged every 2nd step so that the odd
# steps are ordinary ones for the host-read check.
SHORT = ["--max_steps", 10, "--warmup_steps", 3, "--learning_rate", 3e-3, "--logging_steps", 2, "--eval_steps", 10,
         "--block_size", 64, "--max_eval_samples", 13, "--per_device_eval_batch_size", 4, "--save_logits_probe",
         "--report_to", "none", "--ddp_timeout", 120, "--sample_tokens", 0, "--peak_tflops", 0.05]  # MFU on a CPU


@pytest.fixture(scope="session")
def short_run(tmp_path_factory, cache_dir):
    """`run(config, precision="no")`: `recipes/llama.py` with SHORT under `config` (a name or a YAML
    path), once per session; returns (output dir, its host reads as `host_reads` gives them)."""
    done = {}

    def run(config, precision="no"):
        key = (str(config), precision)
        if key not in done:
            base = tmp_path_factory.mktemp(f"short-{getattr(config, 'stem', config)}-{precision}")
            out, reads = base / "run", base / "reads"
            reads.mkdir()
            with pytest.MonkeyPatch.context() as mp:
                mp.setenv("HOST_READS_DIR", str(reads))  # tests/device_guard/host_reads.py logs every read
                launch(config, "recipes/llama.py", "--output_dir", out,
                       "--per_device_train_batch_size", 4 if config == "single" else 2, *SHORT,
                       cache_dir=cache_dir, mixed_precision=precision)
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
            launch(config, "recipes/llama.py", "--output_dir", out, "--overwrite_output_dir", *args,
                   cache_dir=cache_dir, mixed_precision="no")
            done[key] = out
        return done[key]
    return run
