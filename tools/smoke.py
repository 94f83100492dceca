"""Check a host or a cluster in one command: every strategy trains, agrees with one process, resumes, exports.

    python tools/smoke.py                                  # every accelerate_configs/*.yaml
    python tools/smoke.py --configs ddp,deepspeed_zero3    # a subset (single, the reference, always runs)
    python tools/smoke.py --config_file my/zero2.yaml      # a config file of your own (repeatable)
    python tools/smoke.py --num_processes 8                # all ranks, as accelerate launch (default: the GPUs)
    python tools/smoke.py --perf                           # then benchmarks/gpu.sh (1B model, MFU, compile)
    sbatch --nodes 2 slurm/smoke.sbatch                    # across SLURM nodes (docs/smoke.md)

Each config runs recipes/llama.py as real `accelerate launch` subprocesses (NCCL on GPUs, gloo on
CPU ranks), debug model, in the precision the config declares as the recipe resolves it (bf16 on
GPUs; on a CPU bf16 where it has bf16 instructions, else fp32: common/precision.py), or
--mixed_precision's; global batch 2 per rank x ranks, blocks of 64 tokens: a straight run of --steps
steps with a checkpoint half-way, then new processes resuming from that checkpoint to the end.
Before them, one launch times an all-reduce over all the ranks: its bus bandwidth as nccl-tests
reports it (busbw = algbw x 2(n-1)/n) beside the figure expected for the interconnect (the
planner's, tools/planner.py), "slow" under half of it. Checks, one table row per config:
  parity  the straight run's loss, grad norm and eval loss against single.yaml (one process, the
          same global batch, the same precision) within --rtol (default: fp32 5e-6; bf16 1e-3 loss
          and eval loss, 2.5e-2 grad norm, tests/test_parity.py's), the LR exact;
  resume  the resumed steps equal the straight run's (relative 1e-6, as tests/test_checkpoint.py);
  export  final/ reloads with plain transformers to the live model's logits (final_logits.safetensors).
Also tokens/s (all ranks, median step after the first), peak memory (rank 0: CUDA max allocated, else
peak RSS) and the wall time of the config's launches. The host (CPU, GPUs, driver) and the versions
(torch, CUDA, NCCL, accelerate, deepspeed, transformers) head the table; --output_dir/smoke.md and
smoke.json hold them all. Exit status 0 only if every check passed; a failed config prints its
first error line and its log. Outputs and logs: --output_dir/<config>/.
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil
import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests" / "scripts"), str(REPO / "benchmarks")]
from compare_runs import FP32_RTOL, LR_ATOL, read_steps, worst_gaps  # noqa: E402

BF16_RTOL = {"loss": 1e-3, "grad_norm": 2.5e-2, "eval_loss": 1e-3}  # tests/test_parity.py's
SLOW = 0.5  # a bus bandwidth under this share of the expected one is flagged
# one all-reduce timed over all ranks (written to --output_dir, launched as the recipes are)
ALLREDUCE = """import json, os, sys, time
import torch, torch.distributed as dist
cuda = torch.cuda.is_available()
dist.init_process_group("nccl" if cuda else "gloo")  # (torchrun's environment)
device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
torch.cuda.set_device(device) if cuda else None
size, iters = int(sys.argv[2]), int(sys.argv[3])
x = torch.ones(size // 4, device=device)
sync = torch.cuda.synchronize if cuda else (lambda: None)
seconds = []
for i in range(iters + 2):  # the first 2: warm-up
    dist.barrier(); sync(); t = time.perf_counter(); dist.all_reduce(x); sync()
    seconds.append(time.perf_counter() - t)
n, t = dist.get_world_size(), sorted(seconds[2:])[iters // 2]
if dist.get_rank() == 0:
    json.dump({"ranks": n, "bytes": size, "seconds": t, "algbw": size / t,
               "busbw": size / t * 2 * (n - 1) / n, "backend": dist.get_backend()}, open(sys.argv[1], "w"))
dist.destroy_process_group()
"""

RESUME_RTOL, EXPORT_TOL = (
    1e-6,
    1e-4,
)  # tests/test_checkpoint.py's resume bound, tests/test_llama.py's export one
# bf16/fp16 runs: the live logits under the run's casts (bf16 parameters under FSDP and DeepSpeed), the
# reloaded ones under autocast; a missing or wrong tensor moves them by whole units
EXPORT_TOL_LOW = 5e-2
FLAGS = [
    "--block_size",
    64,
    "--logging_steps",
    1,
    "--warmup_steps",
    2,
    "--max_eval_samples",
    8,
    "--report_to",
    "none",
    "--sample_tokens",
    0,
    "--save_logits_probe",
]

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument(
    "--configs", help="comma-separated accelerate_configs/<name>.yaml names (default: all)"
)
parser.add_argument(
    "--config_file", action="append", default=[], help="a YAML path; may be given more than once"
)
parser.add_argument(
    "--num_processes",
    type=int,
    help="ranks on all machines, as accelerate launch (default: visible GPUs, else 2, per machine)",
)
parser.add_argument(
    "--mixed_precision",
    choices=["no", "bf16", "fp16"],
    help="run every config in this precision (default: the one each config declares)",
)
parser.add_argument(
    "--num_machines", type=int, default=1, help="machines per run (one launcher on each)"
)
parser.add_argument(
    "--machine_rank", type=int, default=0, help="this machine's rank (without --srun)"
)
parser.add_argument("--main_process_ip", default="127.0.0.1", help="machine 0's address")
parser.add_argument("--main_process_port", type=int, default=29511)
parser.add_argument(
    "--rdzv_timeout", type=int, default=60, help="seconds the machines wait for each other"
)
parser.add_argument(
    "--srun", action="store_true", help="start each multi-machine run on every node with srun"
)
parser.add_argument(
    "--steps", type=int, default=4, help="optimizer steps (even; checkpoint at half)"
)
parser.add_argument(
    "--rtol", type=float, help="parity bound, relative (default: by the precision run)"
)
parser.add_argument(
    "--timeout", type=int, default=300, help="seconds allowed per launch (start-up included)"
)
parser.add_argument("--output_dir", default="runs/smoke")
parser.add_argument("--perf", action="store_true", help="then run benchmarks/gpu.sh (one GPU)")


def fail(message):
    sys.exit(f"error: {message}")


parser.error = fail  # a bad flag: one line, not the usage
args = parser.parse_args()


def config_paths():
    """{name: YAML path}: single.yaml first (the reference), then the chosen configs."""
    known = {p.stem: p for p in sorted((REPO / "accelerate_configs").glob("*.yaml"))}
    names = (
        [n.strip() for n in args.configs.split(",") if n.strip()]
        if args.configs
        else []
        if args.config_file
        else list(known)
    )
    if unknown := [n for n in names if n not in known]:
        fail(f"--configs: no accelerate_configs/{unknown[0]}.yaml; known: {','.join(known)}")
    chosen = {"single": known["single"], **{n: known[n] for n in names}}
    for path in map(Path, args.config_file):
        if not path.is_file():
            fail(f"--config_file {path}: no such file")
        chosen[path.stem if path.stem not in chosen else str(path)] = path.resolve()
    return chosen


def first_error(log):
    """The first `error:` line of a log, else its first exception line, else its last line."""
    lines = [
        re.sub(r"^(\[rank\d+\]:|\d+:)\s*", "", x).strip()
        for x in Path(log).read_text(errors="replace").splitlines()
        if x.strip()
    ]
    return (
        next((x for x in lines if x.startswith("error:")), None)
        or next((x for x in lines if re.match(r"^[\w.]*(Error|Exception): ", x)), None)
        or (lines or ["(empty log)"])[-1]
    )


def tp_size(yaml_path):
    """The config's tensor-parallel size (tp.yaml: 2), 1 without one: the ranks of a tp group share a batch."""
    mesh = (yaml.safe_load(Path(yaml_path).read_text()) or {}).get("parallelism_config") or {}
    return int(mesh.get("parallelism_config_tp_size") or 1)


def launch(yaml_path, world, out, *extra, script=None):
    """One `accelerate launch ... recipes/llama.py` (or `script` with `extra` as its arguments) into
    `out` (log: out.log); None, or why it failed."""
    opts = ["--config_file", yaml_path, "--num_processes", world]
    opts += ["--mixed_precision", args.mixed_precision] if args.mixed_precision else []
    if (
        tp := tp_size(yaml_path)
    ) > 1:  # tensor parallel: FSDP2 over the tp groups (dp_shard = ranks / tp)
        opts += [
            "--parallelism_config_dp_replicate_size",
            1,
            "--parallelism_config_dp_shard_size",
            world // tp,
        ]
    elif "parallelism_config" in (
        yaml.safe_load(Path(yaml_path).read_text()) or {}
    ):  # HSDP: a replica per machine
        # and shards within it; on one machine 2 replicas when the ranks split in 2 groups of 2 or more; else FSDP
        machines = args.num_machines if world > 1 else 1
        replicas = (
            machines if world >= 2 * machines > 2 else 2 if world >= 4 and world % 2 == 0 else 1
        )
        opts += [
            "--parallelism_config_dp_replicate_size",
            replicas,
            "--parallelism_config_dp_shard_size",
            world // replicas,
        ]
    if (
        world > 1 and args.num_machines > 1
    ):  # a node that never joins: a rendezvous error, not a hang
        opts += [
            "--num_machines",
            args.num_machines,
            "--main_process_ip",
            args.main_process_ip,
            "--main_process_port",
            args.main_process_port,
            "--rdzv_conf",
            f"timeout={args.rdzv_timeout}",
            "--max_restarts",
            0,
        ]
    opts += (
        [script, *extra]
        if script
        else [
            REPO / "recipes" / "llama.py",
            "--output_dir",
            out,
            "--ddp_timeout",
            60,
            *FLAGS,
            *extra,
        ]
    )
    cmd = [sys.executable, "-m", "accelerate.commands.launch"]
    if (
        world > 1 and args.num_machines > 1 and args.srun
    ):  # one launcher per node (as slurm/llama.sbatch)
        cmd = [
            "srun",
            f"--nodes={args.num_machines}",
            "--ntasks-per-node=1",
            "--kill-on-bad-exit=1",
            "--label",
            "bash",
            "-c",
            'exec "$0" -m accelerate.commands.launch --machine_rank "$SLURM_NODEID" "$@"',
            sys.executable,
        ]
    elif world > 1 and args.num_machines > 1:
        cmd += ["--machine_rank", args.machine_rank]
    cmd += opts
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
    log = Path(f"{out}.log")
    with open(log, "w") as f:
        proc = subprocess.Popen(
            list(map(str, cmd)), cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT
        )
        try:
            status = proc.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            status = f"ran past --timeout {args.timeout} s"
        finally:  # torchrun starts each rank in a session of its own: end the whole tree
            for p in (
                [*psutil.Process(proc.pid).children(recursive=True), psutil.Process(proc.pid)]
                if proc.poll() is None
                else []
            ):
                p.kill()
            proc.wait()
    return None if status == 0 else f"{first_error(log)} (exit {status}; log: {log})"


def reloads(out, precision):
    """Whether final/ reloads with plain transformers to the logits the live model gave, computed in
    the run's `precision` (autocast on the CPU); why not."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()
    probe = load_file(out / "final_logits.safetensors")
    model = AutoModelForCausalLM.from_pretrained(out / "final", dtype=torch.float32).eval()
    low = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    bound = EXPORT_TOL if low is None else EXPORT_TOL_LOW
    with torch.no_grad(), torch.autocast("cpu", dtype=low or torch.bfloat16, enabled=bool(low)):
        gap = (model(input_ids=probe["input_ids"]).logits - probe["logits"]).abs().max().item()
    return None if gap <= bound else f"export: reloaded logits off by {gap:.1e} (bound {bound:.0e})"


def resume_gap(resumed, straight, half):
    """Worst relative gap of the resumed steps (and the LR, absolute) against the straight run."""
    got = read_steps(resumed)
    if sorted(got) != list(range(half + 1, args.steps + 1)):
        raise ValueError(f"resume: steps {sorted(got)} logged, not {half + 1}..{args.steps}")
    gaps = worst_gaps(resumed, straight)
    return max(gaps["loss"], gaps["grad_norm"], gaps["eval_loss"] or 0, gaps["lr"])


def check(name, yaml_path, world):
    """Run one config (straight, then resumed); its table row, the parity with one process still to come."""
    from compare_strategies import (
        median_step_seconds,
    )  # (imports torch: not before the flags are checked)

    out = Path(args.output_dir).resolve() / name.replace("/", "_")
    for path in [out / "run", out / "resumed"]:
        shutil.rmtree(path, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    t0, row, problems, half = time.time(), {"config": name, "world": world}, [], args.steps // 2
    tp = tp_size(
        yaml_path
    )  # tensor parallel: the world / tp data-parallel ranks split the global batch
    if tp > 1 and (world % tp or world // tp < 2):
        return {
            **row,
            "wall_s": 0,
            "problems": [],
            "skipped": f"tensor parallel {tp} needs a multiple of "
            f"{tp} ranks, {2 * tp} or more (FSDP over 2 tp "
            f"groups), not {world}",
        }
    per_device = 2 * world_size // (world // tp)  # global batch 2 x world_size
    batch = [
        "--max_steps",
        args.steps,
        "--eval_steps",
        args.steps,
        "--per_device_train_batch_size",
        per_device,
    ]
    if (why := launch(yaml_path, world, out / "run", *batch, "--save_steps", half)) is None:
        why = launch(
            yaml_path,
            world,
            out / "resumed",
            *batch,
            "--resume_from_checkpoint",
            out / "run" / f"checkpoint-{half}",
        )
    row["wall_s"] = round(time.time() - t0, 1)
    if why:
        return {**row, "problems": [why]}
    if args.machine_rank > 0 and not args.srun:  # machine 0 holds the metrics and the export
        return {**row, "problems": []}
    records, summary = (
        read_steps(out / "run"),
        json.loads((out / "run" / "metrics.jsonl").read_text().splitlines()[-1]),
    )
    step_s = median_step_seconds(
        list(records.values()), per_device * 64 / tp, skip=1
    )  # (a tp rank's share)
    row.update(
        precision=json.loads((out / "run" / "run_info.json").read_text())["mixed_precision"],
        tokens_per_s=round(2 * world_size * 64 / step_s),
        peak_mb=round(summary["peak_memory_bytes"] / 1e6),
    )
    row["dir"] = str(out / "run")  # compared with the reference once it has run
    try:
        row["resume_gap"] = resume_gap(out / "resumed", out / "run", half)
        problems += [f"resume: gap {row['resume_gap']:.1e} over {RESUME_RTOL:.0e}"] * (
            row["resume_gap"] > RESUME_RTOL
        )
        row["export"] = "ok" if not (why := reloads(out / "run", row["precision"])) else "FAIL"
        problems += [why] if why else []
    except (OSError, ValueError) as err:
        problems.append(str(err).splitlines()[0])
    return {**row, "problems": problems}


def parity(row, reference):
    """Add the loss and grad-norm gaps against the reference run to `row`, and their problems."""
    if row["config"] == "single":
        row.update(loss_gap=0.0, grad_norm_gap=0.0)  # the reference itself
    elif reference and row.get("dir"):
        gaps = worst_gaps(row["dir"], reference)
        row.update(loss_gap=gaps["loss"], grad_norm_gap=gaps["grad_norm"])
        keys = ("loss", "grad_norm", "eval_loss")
        low = row.get("precision", "no") != "no"
        bound = {k: args.rtol or (BF16_RTOL[k] if low else FP32_RTOL) for k in keys}
        over = [k for k in keys if (gaps[k] or 0) > bound[k]]
        row["problems"] += [
            f"parity: {k} gap {gaps[k]:.1e} over {bound[k]:.0e} vs single" for k in over
        ]
        row["problems"] += [f"parity: LR off by {gaps['lr']:.1e}"] if gaps["lr"] > LR_ATOL else []
    elif row.get("dir"):
        row["problems"].append("parity: no reference (single failed)")


def table(rows):
    fmt = lambda x, f: "-" if x is None else format(x, f)  # noqa: E731
    lines = [
        "| config | ranks | precision | status | loss gap | grad-norm gap | resume gap | export "
        "| tokens/s | peak MB | wall s |",
        "|---|---:|---|---|---:|---:|---:|---|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['config']} | {r['world']} | {r.get('precision', '-')} | {r['status']} "
            f"| {fmt(r.get('loss_gap'), '.1e')} "
            f"| {fmt(r.get('grad_norm_gap'), '.1e')} | {fmt(r.get('resume_gap'), '.1e')} "
            f"| {r.get('export', '-')} | {fmt(r.get('tokens_per_s'), ',')} | {fmt(r.get('peak_mb'), ',')} "
            f"| {r['wall_s']} |"
        )
    return "\n".join(
        lines
        + [
            f"{r['config']}: {p}"
            for r in rows
            for p in [
                *r["problems"],
                *filter(None, [r.get("skipped") and f"skipped: {r['skipped']}"]),
            ]
        ]
    )


def gpus():
    """GPUs this host shows (CUDA_VISIBLE_DEVICES if set, else nvidia-smi's list)."""
    if (visible := os.environ.get("CUDA_VISIBLE_DEVICES")) is not None:
        return len([x for x in visible.split(",") if x.strip()])
    try:
        out = subprocess.run(
            ["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return len([x for x in out.splitlines() if x.startswith("GPU ")])


def host():
    """{"host": CPU and GPUs, "versions": the stack one compares after an upgrade}."""
    import platform
    from importlib.metadata import PackageNotFoundError, version

    import torch

    from common import precision

    def pkg(name):
        try:
            return version(name)
        except PackageNotFoundError:
            return "not installed"

    cpu = next(
        (
            x.split(":", 1)[1].strip()
            for x in Path("/proc/cpuinfo").read_text().splitlines()
            if x.startswith("model name")
        ),
        platform.processor() or platform.machine(),
    )
    found = {
        "cpu": f"{cpu}, {os.cpu_count()} cores, {precision.device_name('cpu', None)}",
        "gpus": "none",
    }
    versions = {"torch": torch.__version__, "cuda": torch.version.cuda or "none", "nccl": "none"}
    if torch.cuda.is_available():
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        memory = torch.cuda.get_device_properties(0).total_memory
        found["gpus"] = f"{len(names)} x {names[0]} ({memory / 2**30:.1f} GiB)"
        versions["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    try:
        smi = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
        driver = subprocess.run(smi, capture_output=True, text=True, timeout=30).stdout.split()
    except (OSError, subprocess.TimeoutExpired):
        driver = []
    versions["driver"] = driver[0] if driver else "none"
    versions.update({k: pkg(k) for k in ("accelerate", "deepspeed", "transformers")})
    return {"host": found, "versions": versions}


def all_reduce(world):
    """The all-reduce bus bandwidth over all `world` ranks (one launch of ALLREDUCE under ddp.yaml) beside
    the one expected for this interconnect; a dict, or one with "error"."""
    from tools import planner  # (imports torch)

    gpu = planner.detect_gpu()
    device = planner.device_spec(gpu)
    per_node = world // args.num_machines
    if gpu != "cpu":
        device = planner.device_spec(gpu, gpus_per_node=per_node)
        where = (
            f"{gpu} NVLink inside a node" if args.num_machines == 1 else f"{gpu}, 400 Gb/s per GPU"
        )
    else:
        where = "gloo on this project's 2-core host (benchmarks/results/gloo_cpu2.md)"
    expected = planner.bus_bandwidth(device, "all_reduce", world)
    out = Path(args.output_dir).resolve() / "all_reduce"
    out.mkdir(parents=True, exist_ok=True)
    (out / "all_reduce.py").write_text(ALLREDUCE)
    size, iters = (256 * 2**20, 20) if gpu != "cpu" else (32 * 2**20, 5)
    result = out / "result.json"
    result.unlink(missing_ok=True)
    why = launch(
        REPO / "accelerate_configs" / "ddp.yaml",
        world,
        out / "run",
        result,
        size,
        iters,
        script=out / "all_reduce.py",
    )
    if why or not result.is_file():
        return {"error": why or f"no {result}", "expected": expected}
    got = json.loads(result.read_text())
    return {
        **got,
        "expected": expected,
        "expected_for": where,
        "slow": got["busbw"] < SLOW * expected,
    }


def all_reduce_line(r):
    if "error" in r:
        return f"All-reduce: not measured: {r['error']}"
    return (
        f"All-reduce over {r['ranks']} ranks ({r['backend']}, {r['bytes'] / 2**20:.0f} MiB): bus bandwidth "
        f"{r['busbw'] / 1e9:.2f} GB/s (algbw {r['algbw'] / 1e9:.2f}), expected {r['expected'] / 1e9:.2f} "
        f"for {r['expected_for']}" + (f": SLOW, under {SLOW:.0%} of it" if r["slow"] else "")
    )


configs = config_paths()
if args.steps < 2 or args.steps % 2:
    fail(f"--steps {args.steps}: give an even number >= 2 (the checkpoint is at half)")
if args.num_machines < 1 or not 0 <= args.machine_rank < args.num_machines:
    fail(f"--machine_rank {args.machine_rank} is not in 0..{args.num_machines - 1}")
if args.srun and "SLURM_JOB_ID" not in os.environ:
    fail("--srun needs a SLURM allocation (run it from slurm/smoke.sbatch)")
if args.num_processes is not None and args.num_processes < 1:
    fail(f"--num_processes {args.num_processes}: give 1 or more")
if args.num_processes and args.num_processes % args.num_machines:
    fail(
        f"--num_processes {args.num_processes} (all ranks, as accelerate launch) is not a multiple "
        f"of --num_machines {args.num_machines}"
    )
world_size = args.num_processes or (gpus() or 2) * args.num_machines  # the total, as accelerate
rows, start = [], time.time()
about = host()
print("Host: " + "; ".join(f"{k} {v}" for k, v in about["host"].items()))
print("Versions: " + ", ".join(f"{k} {v}" for k, v in about["versions"].items()), flush=True)
about["all_reduce"] = all_reduce(world_size) if world_size > 1 else {"error": "one rank"}
print(all_reduce_line(about["all_reduce"]), flush=True)
for name in [
    *list(configs)[1:],
    "single",
]:  # the reference last: the other machines do not wait for it
    path = configs[name]
    try:
        single = yaml.safe_load(path.read_text()).get("distributed_type") == "NO"
    except (OSError, yaml.YAMLError, AttributeError) as err:
        rows.append({"config": name, "world": "-", "wall_s": 0, "problems": [f"{path}: {err}"]})
        continue
    if single and args.machine_rank > 0 and not args.srun:
        continue  # one process: machine 0's
    print(f"[{name}] {args.steps} steps, resume from {args.steps // 2} ...", flush=True)
    rows.append(check(name, path, 1 if single else world_size))
rows = rows[-1:] + rows[:-1] if rows and rows[-1]["config"] == "single" else rows
reference = (
    rows[0]["dir"] if rows and rows[0]["config"] == "single" and not rows[0]["problems"] else None
)
for row in rows:
    parity(row, reference)
    row["status"] = "FAIL" if row["problems"] else "SKIP" if row.get("skipped") else "PASS"
text = "\n".join(
    [
        "Host: " + "; ".join(f"{k} {v}" for k, v in about["host"].items()),
        "Versions: " + ", ".join(f"{k} {v}" for k, v in about["versions"].items()),
        all_reduce_line(about["all_reduce"]),
        "",
        table(rows),
    ]
)
print(
    f"\n{text}\n\n{len(rows)} configs in {time.time() - start:.0f} s; outputs and logs in {args.output_dir}"
)
(Path(args.output_dir) / "smoke.md").write_text(text + "\n")
(Path(args.output_dir) / "smoke.json").write_text(
    json.dumps({**about, "rows": rows}, indent=1) + "\n"
)
passed = all(r["status"] in ("PASS", "SKIP") for r in rows)
if args.perf and passed:
    passed = subprocess.run(["bash", REPO / "benchmarks" / "gpu.sh"], timeout=3600).returncode == 0
sys.exit(0 if passed else 1)
