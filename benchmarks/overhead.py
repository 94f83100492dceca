"""What recipes/llama.py costs on top of the training loop a user would write by hand.

    python benchmarks/overhead.py                    # the table (single, ddp, fsdp, zero2): ~9 min on 2 CPU cores
    python benchmarks/overhead.py --configs single ddp --steps 40 --repeats 5
    python benchmarks/overhead.py --recipe recipes/llama.py /tmp/llama_variant.py   # attribute a cost
    python benchmarks/overhead.py --wait_quiet 10 --out benchmarks/results/overhead_cpu2.md
    python benchmarks/overhead.py --op_counts --fp32     # ops per step, bare vs recipe: not timing noise

Both sides train the same model (the `debug` Llama preset, common/models.py), on the same
blocks (the bundled corpus packed into 256-token blocks by common/data.py, as the recipe builds
them), with the same global batch (8 blocks per process), AdamW with the recipe's groups,
betas, eps, LR and weight decay, its warmup-cosine schedule, its precision (the configs' bf16
autocast where the device computes bf16, else fp32: common/precision.py) and clipping at 1.0:

- bare: `bare_loop` below, plain PyTorch in one process, or `DistributedDataParallel` over
  `--nproc` processes started by torchrun (gloo on CPU, NCCL on GPUs);
- recipe: `accelerate launch --config_file accelerate_configs/<config>.yaml recipes/llama.py`,
  with its defaults (logging every 10 steps, the tensorboard tracker, tqdm) except the step count,
  no checkpoints, no sample at the end and a short final evaluation (both after the timed steps).

Timing, the same for both: every process of a run gets `step_timer/sitecustomize.py` (written to
a temporary folder, put first on PYTHONPATH), which stamps `time.perf_counter()` after every
optimizer step through torch's global `register_optimizer_step_post_hook` (DeepSpeed and FSDP
step a torch AdamW too) and `time.process_time()`. Step time = the interval between consecutive
stamps, i.e. everything a training step does, data loading, logging and the recipe's checks
included. A run's figure is the median of its step times after `--warmup` steps (rank 0's
stamps); a configuration's figure is the best run median of its `--repeats` runs (`summarize`
says why). The runs are interleaved (bare single, recipe single, bare DDP, recipe DDP, recipe
FSDP, recipe ZeRO-2, then again), so slow drifts of the machine hit both. Ratio = recipe
tokens/s / bare tokens/s = bare step time / recipe step time, overall and per repeat (paired);
FSDP and ZeRO-2 are compared with bare DDP (same global batch). Mean step times are reported
too: they include the logging steps (every 10th) that the median skips. Each run also records
the share of the machine's CPU that other processes used meanwhile, since on a shared machine
those decide how far a figure can be trusted.

Threads: every run gets the same OMP_NUM_THREADS: all of `--cores` for one process, cores /
processes for several (what `accelerate launch` gives CPU ranks): in the environment of the bare
runs, and as `--num_cpu_threads_per_process` on the recipe's launch line (which sets it there and
wins over the config file's value). On a GPU host the step stamps do not wait for the GPU:
steady-state intervals still average to the GPU's pace once its queue is full, but use `--steps`
of 50 or more there.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CONFIGS = {"single": 1, "ddp": 2, "fsdp": 2, "deepspeed_zero2": 2}  # accelerate config -> processes
BLOCK_SIZE, PER_DEVICE_BATCH = 256, 8  # recipes/llama.py's defaults

# Runs in every Python process of a timed run (PYTHONPATH), before the script itself.
STEP_TIMER = """\
import os
if os.environ.get("OVERHEAD_STEP_TIMES"):
    import atexit, json, time
    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook
    _stamps = []

    def _stamp(optimizer, args, kwargs):
        if isinstance(optimizer, torch.optim.AdamW):  # not the wrappers around it
            _stamps.append((time.perf_counter(), time.process_time()))

    register_optimizer_step_post_hook(_stamp)

    @atexit.register
    def _write_stamps():
        if _stamps:  # the launcher process steps nothing
            path = f"{os.environ['OVERHEAD_STEP_TIMES']}.rank{os.environ.get('RANK', '0')}.json"
            with open(path, "w") as f:
                json.dump(_stamps, f)

if os.environ.get("OVERHEAD_OP_COUNTS"):  # --op_counts: the ops of optimizer steps 3 to 6
    import json, torch
    from torch.optim.optimizer import register_optimizer_step_post_hook
    _prof = {"steps": 0}

    def _count(optimizer, args, kwargs):
        if not isinstance(optimizer, torch.optim.AdamW):
            return
        _prof["steps"] += 1
        if _prof["steps"] == 2:
            _prof["p"] = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            _prof["p"].__enter__()
        elif _prof["steps"] == 6:
            _prof["p"].__exit__(None, None, None)
            counts = {e.key: e.count / 4 for e in _prof["p"].key_averages() if e.key.startswith("aten::")}
            with open(os.environ["OVERHEAD_OP_COUNTS"], "w") as f:
                json.dump(counts, f)

    register_optimizer_step_post_hook(_count)
"""


def bare_loop(steps: int, fp32: bool = False, seed: int = 42) -> None:
    """The hand-written reference: `steps` optimizer steps of the debug Llama, one process or DDP.

    Distributed when torchrun started it (WORLD_SIZE > 1): gloo on CPU, NCCL on GPUs, each rank
    drawing 8 blocks per step from a DistributedSampler. Same model, data, optimizer, schedule,
    precision and clipping as recipes/llama.py's defaults; nothing else.
    """
    import torch
    import torch.distributed as dist
    from transformers import get_cosine_schedule_with_warmup

    sys.path.insert(0, str(REPO))
    from common import causal_lm, data, models, precision

    world = int(os.environ.get("WORLD_SIZE", "1"))
    device = torch.device(
        f"cuda:{os.environ.get('LOCAL_RANK', '0')}" if torch.cuda.is_available() else "cpu"
    )
    if world > 1:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    raw = (
        data.load_text_dataset()
    )  # the bundled corpus, tokenized and packed as the recipe does (cached)
    tokenizer = data.get_tokenizer(None, raw, 4096, data.DEFAULT_CACHE_DIR)
    blocks = data.pack_dataset(raw, tokenizer, BLOCK_SIZE, data.DEFAULT_CACHE_DIR).with_format(
        "torch"
    )["train"]
    config = models.llama_config("debug", vocab_size=len(tokenizer))
    causal_lm.set_token_ids(config, tokenizer, True)
    torch.manual_seed(seed)
    model = models.causal_lm_class(config)(config).to(device)
    model.config.use_cache = False
    optimizer = torch.optim.AdamW(
        models.param_groups(model, 0.1), lr=3e-3, betas=(0.9, 0.95), eps=1e-8
    )
    scheduler = get_cosine_schedule_with_warmup(optimizer, 30, steps)
    sampler = (
        torch.utils.data.DistributedSampler(blocks, seed=seed, drop_last=True)
        if world > 1
        else None
    )
    loader = torch.utils.data.DataLoader(
        blocks,
        batch_size=PER_DEVICE_BATCH,
        sampler=sampler,
        shuffle=sampler is None,
        drop_last=True,
        generator=torch.Generator().manual_seed(seed),
        pin_memory=device.type == "cuda",
    )
    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device] if device.type == "cuda" else None
        )
    # the configs' bf16 where the recipe keeps it (not forced: the YAML's value), else fp32
    mode, _ = precision.choose_precision(
        "bf16", *precision.detect_device(), n_params=0, forced=False
    )
    mode = "no" if fp32 else mode
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=mode == "bf16")
    model.train()
    step, epoch = 0, 0
    while step < steps:
        if sampler is not None:
            sampler.set_epoch(epoch)
        for batch in loader:
            input_ids = batch["input_ids"].to(device, non_blocking=True)
            labels = batch["labels"].to(device, non_blocking=True)
            with autocast:
                loss = model(input_ids=input_ids, labels=labels).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if step == steps:
                break
        epoch += 1
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _busy_seconds() -> float:
    """CPU seconds the whole machine has spent busy since boot (/proc/stat; 0.0 where it does not exist)."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except OSError:
        return 0.0
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf(
        "SC_CLK_TCK"
    )  # all but idle and iowait


def _children_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def wait_for_quiet(max_wait_s: float, below: float = 0.1, sample_s: float = 2.0) -> float:
    """Wait until other processes use less than `below` of the machine's CPU over `sample_s`
    seconds, or `max_wait_s` passed; returns the last share seen (0..1). On a shared machine it
    keeps the runs out of other jobs' busiest moments; it cannot keep those jobs away."""
    deadline = time.perf_counter() + max_wait_s
    while True:
        busy, t0 = _busy_seconds(), time.perf_counter()
        time.sleep(sample_s)
        share = (_busy_seconds() - busy) / ((time.perf_counter() - t0) * os.cpu_count())
        if share < below or time.perf_counter() >= deadline:
            return share


def _env(timer_dir: Path, stamps: Path, threads: int) -> dict:
    return {
        **os.environ,
        "OVERHEAD_STEP_TIMES": str(stamps),
        "OMP_NUM_THREADS": str(threads),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(timer_dir), os.environ.get("PYTHONPATH")])),
        "ACCELERATE_RECIPES_ALLOW_CPU": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONUNBUFFERED": "1",
    }


def run_once(
    kind: str,
    config: str,
    steps: int,
    threads: int,
    work: Path,
    timer_dir: Path,
    tag: str,
    recipe: Path,
    extra: list[str],
    fp32: bool = False,
) -> tuple[list[float], float]:
    """One timed run; returns rank 0's optimizer-step stamps (seconds, `time.perf_counter`) and the
    share of the machine's CPU time that other processes used meanwhile (0..1, noise indicator:
    busy CPU seconds of the whole machine minus this run's, over wall time x cores).

    kind "bare": `bare_loop` (torchrun for more than one process); kind "recipe": `recipe` under
    accelerate_configs/`config`.yaml. Raises RuntimeError with the output tail if the run fails
    or stamps a number of steps other than `steps`.
    """
    nproc = CONFIGS[config]
    stamps = work / tag
    if kind == "bare":
        script = [
            str(Path(__file__).resolve()),
            "--bare_steps",
            str(steps),
            *(["--fp32"] if fp32 else []),
        ]
        cmd = (
            [sys.executable, *script]
            if nproc == 1
            else [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nproc_per_node",
                str(nproc),
                "--master_addr",
                "127.0.0.1",
                "--master_port",
                str(_free_port()),
                *script,
            ]
        )
    else:
        out_dir = work / f"{tag}_out"
        # the thread count on the launch line: it wins over single.yaml's (which wins over OMP_NUM_THREADS)
        cmd = [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--config_file",
            str(REPO / "accelerate_configs" / f"{config}.yaml"),
            "--num_cpu_threads_per_process",
            str(threads),
        ]
        if nproc > 1:
            cmd += ["--main_process_port", str(_free_port())]
        if fp32:  # a launch flag: it wins over the config's mixed_precision
            cmd += ["--mixed_precision", "no"]
        cmd += [
            str(recipe),
            "--max_steps",
            str(steps),
            "--output_dir",
            str(out_dir),
            "--save_steps",
            "0",
            "--sample_tokens",
            "0",
            "--max_eval_samples",
            "16",
            "--eval_steps",
            str(10 * steps),
            *extra,
        ]
    busy, own, t0 = _busy_seconds(), _children_seconds(), time.perf_counter()
    proc = subprocess.run(
        cmd, cwd=REPO, env=_env(timer_dir, stamps, threads), capture_output=True, text=True
    )
    wall = time.perf_counter() - t0
    foreign = max(0.0, (_busy_seconds() - busy) - (_children_seconds() - own)) / (
        wall * os.cpu_count()
    )
    if proc.returncode != 0:
        raise RuntimeError(
            f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
        )
    path = Path(f"{stamps}.rank0.json")
    got = json.loads(path.read_text()) if path.exists() else []
    # DeepSpeed ZeRO-1/2 steps AdamW once per parameter group (stage_1_and_2.py `_optimizer_step`):
    # 2 stamps per training step here (decay, no decay); keep each step's last.
    if got and len(got) % steps == 0:
        got = got[len(got) // steps - 1 :: len(got) // steps]
    if len(got) != steps:
        raise RuntimeError(
            f"{tag}: {len(got)} optimizer-step stamps, expected {steps} ({' '.join(cmd)})"
        )
    if kind == "recipe":
        shutil.rmtree(work / f"{tag}_out", ignore_errors=True)
    return got, foreign


def step_times(stamps: list[list[float]], warmup: int) -> tuple[list[float], list[float]]:
    """(wall, CPU) seconds of each step after the first `warmup`: the differences of consecutive
    `[perf_counter, process_time]` stamps. CPU time is the process's, all its threads."""
    pairs = list(zip(stamps[warmup - 1 :], stamps[warmup:]))
    return [b[0] - a[0] for a, b in pairs], [b[1] - a[1] for a, b in pairs]


def summarize(
    results: dict, recipes: list[str], tokens_per_step: int, busy: float = 0.1
) -> list[dict]:
    """One row per (configuration, recipe): step times and tokens/s of bare and recipe, and their ratio.

    `results[(kind, config, script)]` (script None for bare runs) is a list of runs, one per repeat,
    each `{"wall": [...], "cpu": [...], "other": share}`: step times in seconds and the share of
    the machine's CPU that other processes used meanwhile. A run's figure is its median step
    time; a configuration's is the best (lowest) run median over the repeats: other jobs on a
    shared machine only ever slow a run down (measured: 2-thread steps 8x slower with another
    job on the second core), so the best run is the one they disturbed least. Ratio = bare step
    time / recipe step time = recipe tokens/s / bare tokens/s; also per repeat (paired, `*` where
    other processes used more than `busy` of the CPU in either run). The CPU ratio is the same with
    rank 0's CPU seconds per step, which other jobs stretch less than wall time (1-thread runs).
    `tokens_per_step` counts the tokens one process trains on per optimizer step.
    """
    rows = []
    for config in CONFIGS:
        ref = _reference(config)
        for script in recipes:
            if (key := ("recipe", config, script)) not in results:
                continue
            bare, recipe = results[("bare", ref, None)], results[key]
            med = {
                name: [statistics.median(run["wall"]) for run in runs]
                for name, runs in (("bare", bare), ("recipe", recipe))
            }
            cpu = {
                name: min(statistics.median(run["cpu"]) for run in runs)
                for name, runs in (("bare", bare), ("recipe", recipe))
            }
            mean = {
                name: min(statistics.fmean(run["wall"]) for run in runs)
                for name, runs in (("bare", bare), ("recipe", recipe))
            }
            paired = [
                (b / r, max(rb["other"], rr["other"]) > busy)
                for b, r, rb, rr in zip(med["bare"], med["recipe"], bare, recipe)
            ]
            rows.append(
                {
                    "config": config,
                    "recipe": Path(script).name,
                    "processes": CONFIGS[config],
                    "bare": "bare DDP" if ref == "ddp" else "bare loop",
                    "bare_step_s": min(med["bare"]),
                    "recipe_step_s": min(med["recipe"]),
                    "bare_mean_s": mean["bare"],
                    "recipe_mean_s": mean["recipe"],
                    "bare_tokens_per_s": tokens_per_step / min(med["bare"]),
                    "recipe_tokens_per_s": tokens_per_step / min(med["recipe"]),
                    "ratio": min(med["bare"]) / min(med["recipe"]),
                    "paired_ratios": paired,
                    "bare_cpu_s": cpu["bare"],
                    "recipe_cpu_s": cpu["recipe"],
                    "cpu_ratio": cpu["bare"] / cpu["recipe"],
                }
            )
    return rows


def table(rows: list[dict]) -> str:
    """The markdown table of `summarize`'s rows (a recipe column only when several scripts were timed)."""
    several = len({r["recipe"] for r in rows}) > 1
    head = [
        "config",
        *(["recipe"] if several else []),
        "processes",
        "reference",
        "bare tok/s per process",
        "recipe tok/s per process",
        "recipe ÷ bare",
        "per repeat (* busy machine)",
        "median step bare / recipe (ms)",
        "mean step bare / recipe (ms)",
        "CPU per step bare / recipe (ms)",
        "CPU ratio",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [
            r["config"],
            *([r["recipe"]] if several else []),
            str(r["processes"]),
            r["bare"],
            f"{r['bare_tokens_per_s']:,.0f}",
            f"{r['recipe_tokens_per_s']:,.0f}",
            f"**{r['ratio']:.3f}**",
            ", ".join(f"{p:.3f}{'*' if busy else ''}" for p, busy in r["paired_ratios"]),
            f"{1e3 * r['bare_step_s']:.1f} / {1e3 * r['recipe_step_s']:.1f}",
            f"{1e3 * r['bare_mean_s']:.1f} / {1e3 * r['recipe_mean_s']:.1f}",
            f"{1e3 * r['bare_cpu_s']:.1f} / {1e3 * r['recipe_cpu_s']:.1f}",
            f"{r['cpu_ratio']:.3f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def op_counts(args) -> str:
    """--op_counts: aten calls per optimizer step (mean of steps 3-6) of the bare single-process
    loop and of each `--recipe` under single.yaml, one thread each; a markdown table of the
    totals and of every op whose count differs."""
    counts = {}
    with tempfile.TemporaryDirectory(prefix="overhead_ops_") as tmp:
        work, timer_dir = Path(tmp), Path(tmp) / "step_timer"
        timer_dir.mkdir()
        (timer_dir / "sitecustomize.py").write_text(STEP_TIMER)
        for kind, script in [("bare", None)] + [("recipe", r) for r in args.recipe]:
            out = work / f"{kind}_{len(counts)}.json"
            os.environ["OVERHEAD_OP_COUNTS"] = str(out)
            run_once(
                kind,
                "single",
                8,
                1,
                work,
                timer_dir,
                f"ops_{len(counts)}",
                Path(script or "-"),
                args.recipe_args.split(),
                args.fp32,
            )
            counts["bare" if script is None else Path(script).name] = json.loads(out.read_text())
        del os.environ["OVERHEAD_OP_COUNTS"]
    names, ops = list(counts), sorted({op for c in counts.values() for op in c})
    differ = [op for op in ops if len({c.get(op, 0) for c in counts.values()}) > 1]
    lines = [
        "| aten op | " + " | ".join(names) + " |",
        "|---" * (len(names) + 1) + "|",
        "| all | " + " | ".join(f"{sum(c.values()):,.0f}" for c in counts.values()) + " |",
    ]
    lines += [
        f"| {op} | " + " | ".join(f"{c.get(op, 0):g}" for c in counts.values()) + " |"
        for op in differ
    ]
    return "\n".join(lines)


def _reference(config: str) -> str:
    """The bare run a config is compared with: the plain loop for one process, DDP for several."""
    return "single" if CONFIGS[config] == 1 else "ddp"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--steps", type=int, default=30, help="optimizer steps per run (default 30)"
    )
    parser.add_argument(
        "--warmup", type=int, default=5, help="first steps left out of the step times (default 5)"
    )
    parser.add_argument(
        "--repeats", type=int, default=3, help="interleaved repeats of every run (default 3)"
    )
    parser.add_argument(
        "--configs",
        nargs="+",
        default=list(CONFIGS),
        choices=list(CONFIGS),
        help="accelerate configs to time the recipe under (default: all four)",
    )
    parser.add_argument(
        "--cores",
        type=int,
        default=None,
        help="CPU cores to share among each run's processes (OMP_NUM_THREADS = cores / processes); "
        "default: os.cpu_count()",
    )
    parser.add_argument(
        "--recipe",
        nargs="+",
        default=[str(REPO / "recipes" / "llama.py")],
        help="the script(s) to time, each against the same bare runs (default recipes/llama.py; "
        "modified copies attribute costs)",
    )
    parser.add_argument("--recipe_args", default="", help="extra flags for the recipe, one string")
    parser.add_argument(
        "--wait_quiet",
        type=float,
        default=0,
        help="before each run, wait up to this many seconds for other processes to use less than "
        "10%% of the CPU (shared machines; default 0: no wait)",
    )
    parser.add_argument(
        "--out",
        default=None,
        help="also write the table, the runs and their step times (markdown) here",
    )
    parser.add_argument(
        "--fp32",
        action="store_true",
        help="both sides in fp32 (the recipe launched with --mixed_precision no): what a CPU without "
        "native bf16 trains in, measured on any CPU",
    )
    parser.add_argument(
        "--op_counts",
        action="store_true",
        help="instead of timing: count the aten ops of 4 optimizer steps, bare single against "
        "the recipe, one process (torch.profiler): cost that is not noise",
    )
    parser.add_argument(
        "--bare_steps", type=int, default=None, help=argparse.SUPPRESS
    )  # worker mode
    args = parser.parse_args(argv)
    if args.bare_steps is None and not (1 <= args.warmup < args.steps - 1):
        parser.error(
            f"--warmup must be at least 1 and leave 2 or more timed steps of --steps {args.steps}"
        )
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    for script in args.recipe:
        if not Path(script).is_file():
            parser.error(f"--recipe {script}: no such file")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.bare_steps is not None:
        bare_loop(args.bare_steps, args.fp32)
        return
    if args.op_counts:
        print(op_counts(args))
        return
    cores = args.cores or os.cpu_count()
    threads = {c: max(1, cores // n) for c, n in CONFIGS.items()}
    # Per repeat: each bare reference, then every recipe run compared with it.
    order = []
    for ref in sorted({_reference(c) for c in args.configs}, key=list(CONFIGS).index):
        order.append(("bare", ref, None))
        order += [
            ("recipe", c, r) for c in args.configs if _reference(c) == ref for r in args.recipe
        ]
    results = {key: [] for key in order}
    foreign, log = [], []
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="overhead_") as tmp:
        work, timer_dir = Path(tmp), Path(tmp) / "step_timer"
        timer_dir.mkdir()
        (timer_dir / "sitecustomize.py").write_text(STEP_TIMER)
        for rep in range(args.repeats):
            for i, (kind, config, script) in enumerate(order):
                if args.wait_quiet > 0:
                    wait_for_quiet(args.wait_quiet)
                stamps, other = run_once(
                    kind,
                    config,
                    args.steps,
                    threads[config],
                    work,
                    timer_dir,
                    f"{kind}_{config}_{i}_{rep}",
                    Path(script or "-"),
                    args.recipe_args.split(),
                    args.fp32,
                )
                wall, cpu = step_times(stamps, args.warmup)
                results[(kind, config, script)].append({"wall": wall, "cpu": cpu, "other": other})
                foreign.append(other)
                name = "bare" if script is None else Path(script).name
                log.append(
                    f"[{time.perf_counter() - t0:4.0f} s] repeat {rep + 1}/{args.repeats} {name} {config}, "
                    f"{threads[config]} thread(s) per process: "
                    f"median step {1e3 * statistics.median(wall):.1f} ms, "
                    f"mean {1e3 * statistics.fmean(wall):.1f} ms, CPU {1e3 * statistics.median(cpu):.1f} ms; "
                    f"other processes used {100 * other:.0f}% of the machine's CPU"
                )
                print(log[-1], flush=True)
    rows = summarize(results, args.recipe, PER_DEVICE_BATCH * BLOCK_SIZE)
    text = table(rows)
    setup = (
        f"{args.steps} steps per run, the first {args.warmup} left out, {args.repeats} interleaved repeats; "
        f"{cores} cores: OMP_NUM_THREADS {threads['single']} for one process, {threads['ddp']} per process for 2; "
        f"{PER_DEVICE_BATCH} x {BLOCK_SIZE} tokens per process per step; recipe flags: "
        f"{args.recipe_args or '(defaults)'}{'; fp32 on both sides (--fp32)' if args.fp32 else ''}; "
        f"waited up to {args.wait_quiet:g} s for a quiet machine before "
        f"each run; other processes used {100 * min(foreign):.0f}-{100 * max(foreign):.0f}% "
        "of the machine's CPU during the runs"
    )
    print(f"\n{setup}\n\n{text}\n\nwall time {time.perf_counter() - t0:.0f} s")
    if args.out:
        runs_text = "\n".join(
            f"{kind} {config} {Path(script).name if script else ''}".strip()
            + f" repeat {i + 1}: other "
            f"processes {100 * run['other']:.0f}%, CPU median {1e3 * statistics.median(run['cpu']):.1f} ms, wall ms "
            + json.dumps([round(1e3 * x, 1) for x in run["wall"]])
            for (kind, config, script), runs in results.items()
            for i, run in enumerate(runs)
        )
        Path(args.out).write_text(
            f"{setup}\n\n{text}\n\nRuns, in order:\n\n```\n" + "\n".join(log) + "\n```\n\n"
            f"Step times after warmup, per run:\n\n```\n{runs_text}\n```\n"
        )


if __name__ == "__main__":
    main()
