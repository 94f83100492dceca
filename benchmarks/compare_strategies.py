"""Profile before picking ZeRO-3: the same recipe, model and data under DDP, FSDP and DeepSpeed ZeRO.

    python benchmarks/compare_strategies.py --steps 20
    python benchmarks/compare_strategies.py --steps 50 --num_processes 8 --output_dir runs/compare_8gpu
    python benchmarks/compare_strategies.py --strategies ddp,deepspeed_zero3,deepspeed_zero3_offload

For each strategy (an `accelerate_configs/<name>.yaml`) it runs, as real `accelerate launch`
subprocesses with `--num_processes` ranks (gloo on a CPU-only host, NCCL on GPUs, no change):
  1. `recipes/llama.py` for `--steps` optimizer steps, logging every step. Step time is the
     median over the steps after the first WARMUP_STEPS, from its metrics.jsonl (per-device
     tokens/s of rank 0); tokens/s is for all ranks together.
  2. `benchmarks/measure_model_states.py`: the same model and optimizer, prepared under the
     same config; per-rank bytes of parameters, gradients and optimizer state (fp32 master
     copy + Adam moments) counted from the live tensors, and the dtypes the run communicates in.
Then it prints a markdown table (ratios against the first strategy, measured in this one run)
and writes `compare_strategies.md`, `.json` and `.png` to `--output_dir`.

Communication volume per optimizer step and per rank, as predicted by the ZeRO paper
(Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models",
arXiv 1910.02054, section 7), Ψ = number of parameters:
  - DDP: one all-reduce of the gradients = reduce-scatter + all-gather, 2Ψ elements;
  - ZeRO-1/2 (and FSDP SHARD_GRAD_OP): reduce-scatter of gradients Ψ + all-gather of the
    updated parameters Ψ = 2Ψ, the same as DDP;
  - ZeRO-3 (and FSDP FULL_SHARD): reduce-scatter Ψ + a parameter all-gather in the forward
    and again in the backward pass 2Ψ = 3Ψ, 1.5x DDP.
Each term is priced in the dtype the run really sends (e.g. FSDP here all-gathers bf16
parameters but reduce-scatters fp32 gradients). The paper rounds a ring collective's
(N-1)/N share to 1; the "ring" column keeps it: each rank sends (N-1)/N of the buffer per
reduce-scatter or all-gather (NVIDIA nccl-tests, doc/PERFORMANCE.md, "bus bandwidth").
These are predictions, not measured traffic; the timings are this machine's, noisy when the
host is shared, and not a ranking for other hardware.
"""

import json
import os
import platform
import statistics
import subprocess
import sys
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path


REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from common import errors  # noqa: E402
from common.args import flag, parse_flags  # noqa: E402
from tools.planner import COMM_KINDS, comm_pattern, predicted_comm_bytes  # noqa: E402,F401  (the ZeRO paper's volumes)

WARMUP_STEPS = 2  # first steps excluded from step time (allocation, first collectives, JIT)
STATE_CATEGORIES = ("params", "grads", "fp32_master", "adam_moments")


@dataclass
class Args:
    steps: int = flag(20, "optimizer steps per strategy (K)", low=1)
    strategies: str = field(
        default="ddp,fsdp,deepspeed_zero2,deepspeed_zero3",
        metadata={"help": "comma-separated accelerate_configs/<name>.yaml names"},
    )
    output_dir: str = "runs/compare_strategies"
    num_processes: int = flag(2, "ranks per run (GPUs, or CPU processes)", low=1)
    mixed_precision: str = field(
        default="auto",
        metadata={
            "help": "no, bf16 or fp16 (forced on the launch line); auto: the config's bf16 "
            "where the device computes it, else fp32 (common/precision.py)"
        },
    )
    model_config: str = "debug"
    per_device_train_batch_size: int = flag(8, low=1)
    block_size: int = flag(256, low=2)
    timeout: int = flag(1800, "seconds allowed per launched run", low=1)


def median_step_seconds(
    records: list[dict], tokens_per_step: int, skip: int = WARMUP_STEPS
) -> float:
    """Median step time in seconds from the recipe's per-step metrics.jsonl records.

    Args:
        records: per-step records (logging_steps=1), each with `step` and `tokens_per_second`
            (tokens per second per device).
        tokens_per_step: tokens one device trains on per optimizer step
            (per_device_train_batch_size x gradient_accumulation_steps x block_size).
        skip: steps 1..skip are warm-up and left out.

    Raises:
        ValueError: no record left after the warm-up steps.
    """
    times = [tokens_per_step / r["tokens_per_second"] for r in records if r["step"] > skip]
    if not times:
        raise ValueError(f"no logged step after the {skip} warm-up steps: use more --steps")
    return statistics.median(times)


def describe_machine() -> str:
    """One line: accelerator (or CPU model and cores), torch version, OS."""
    import torch

    if torch.cuda.is_available():
        device = f"{torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}"
    else:
        model = (
            next(
                (
                    line.split(":", 1)[1].strip()
                    for line in open("/proc/cpuinfo")
                    if line.startswith("model name")
                ),
                platform.processor(),
            )
            if os.path.exists("/proc/cpuinfo")
            else platform.processor()
        )
        device = f"CPU only, {os.cpu_count()} cores ({model}), no GPU"
    return f"{device}; torch {torch.__version__}; {platform.system()} {platform.release()}"


def accelerate_launch(
    config: str, script: str, script_args: list, args: Args, log_path: Path
) -> None:
    """Run `accelerate launch --config_file accelerate_configs/{config}.yaml script ...`; exit with its log tail on
    failure."""
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(REPO / "accelerate_configs" / f"{config}.yaml"),
        "--num_processes",
        str(args.num_processes),
        *(["--mixed_precision", args.mixed_precision] if args.mixed_precision != "auto" else []),
        str(REPO / script),
        *map(str, script_args),
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
    with open(log_path, "w") as log:
        try:
            proc = subprocess.run(
                cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=args.timeout
            )
        except subprocess.TimeoutExpired:
            sys.exit(
                f"error: {script} under {config} ran past --timeout {args.timeout}s (log: {log_path})"
            )
    if proc.returncode != 0:
        tail = "".join(open(log_path).readlines()[-30:])
        sys.exit(
            f"error: {script} under {config} exited {proc.returncode} (log: {log_path})\n{tail}"
        )


def run_strategy(name: str, args: Args) -> dict:
    """Train with recipes/llama.py, then measure model states, under accelerate_configs/{name}.yaml."""
    out = Path(args.output_dir) / name
    out.mkdir(parents=True, exist_ok=True)
    shape = [
        "--model_config",
        args.model_config,
        "--per_device_train_batch_size",
        args.per_device_train_batch_size,
        "--block_size",
        args.block_size,
    ]
    print(f"[{name}] training {args.steps} steps ...", flush=True)
    accelerate_launch(
        name,
        "recipes/llama.py",
        [
            "--output_dir",
            out / "train",
            "--overwrite_output_dir",  # this benchmark's own folder
            "--max_steps",
            args.steps,
            "--logging_steps",
            1,
            "--eval_steps",
            args.steps,
            "--max_eval_samples",
            16,
            "--report_to",
            "none",
            *shape,
        ],
        args,
        out / "train.log",
    )
    print(f"[{name}] measuring model states ...", flush=True)
    accelerate_launch(
        name,
        "benchmarks/measure_model_states.py",
        ["--output_file", out / "states.json", *shape],
        args,
        out / "states.log",
    )

    info = json.loads((out / "train" / "run_info.json").read_text())
    lines = [json.loads(line) for line in open(out / "train" / "metrics.jsonl")]
    steps = [r for r in lines if not r.get("summary")]
    states = json.loads((out / "states.json").read_text())
    if states["n_params"] != info["n_params"]:  # the companion must measure the recipe's model
        sys.exit(
            f"error: measure_model_states.py built {states['n_params']} parameters, "
            f"recipes/llama.py {info['n_params']}: they no longer build the same model"
        )
    tokens_per_step = (
        args.per_device_train_batch_size
        * info["args"]["gradient_accumulation_steps"]
        * args.block_size
    )
    step_s = median_step_seconds(steps, tokens_per_step)
    rank_max = {c: max(states[f"{c}_bytes"]) for c in STATE_CATEGORIES}  # the fullest rank
    return {
        "strategy": name,
        "distributed_type": info["distributed_type"],
        "world_size": info["world_size"],
        "mixed_precision": info["mixed_precision"],
        "n_params": info["n_params"],
        "step_seconds": step_s,
        "tokens_per_second": info["world_size"] * tokens_per_step / step_s,
        "final_loss": steps[-1]["loss"],
        "eval_loss": steps[-1].get("eval_loss"),
        "local_param_elements": info["local_param_elements"],
        "optimizer": states["optimizer"],
        **{f"{c}_bytes": rank_max[c] for c in STATE_CATEGORIES},
        "optimizer_state_bytes": rank_max["fp32_master"] + rank_max["adam_moments"],
        "optimizer_state_device": ",".join(
            states["devices"].get("adam_moments", [])
        ),  # e.g. cpu when offloaded
        "model_state_bytes": sum(rank_max.values()),
        "comm_kind": states["comm_kind"],
        "comm_pattern": comm_pattern(
            states["comm_kind"], states["grad_comm_bytes"], states["param_comm_bytes"]
        ),
        "comm_bytes_paper": predicted_comm_bytes(
            states["comm_kind"],
            info["n_params"],
            states["grad_comm_bytes"],
            states["param_comm_bytes"],
        ),
        "comm_bytes_ring": predicted_comm_bytes(
            states["comm_kind"],
            info["n_params"],
            states["grad_comm_bytes"],
            states["param_comm_bytes"],
            info["world_size"],
        ),
    }


def markdown_table(rows: list[dict]) -> str:
    """The results as a markdown table; ratios are against the first row."""
    base = rows[0]
    mb = 1e6
    lines = [
        f"| strategy | step time (ms) | tokens/s (all ranks) | tokens/s vs {base['strategy']} "
        "| params MB/rank | grads MB/rank | optimizer state MB/rank (on) | total MB/rank "
        "| predicted comm/step/rank | paper MB | ring MB | loss at last step |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['strategy']} | {r['step_seconds'] * 1e3:.0f} | {r['tokens_per_second']:,.0f} "
            f"| {r['tokens_per_second'] / base['tokens_per_second']:.2f}x | {r['params_bytes'] / mb:.1f} "
            f"| {r['grads_bytes'] / mb:.1f} | {r['optimizer_state_bytes'] / mb:.1f} ({r['optimizer_state_device']}) "
            f"| {r['model_state_bytes'] / mb:.1f} "
            f"| {r['comm_pattern']} | {r['comm_bytes_paper'] / mb:.1f} | {r['comm_bytes_ring'] / mb:.1f} "
            f"| {r['final_loss']:.3f} |"
        )
    lines += [
        "",
        "Measured: step time (median), tokens/s, and bytes per rank of the live tensors (the fullest "
        "rank; optimizer state = fp32 master copy + Adam moments, excluding communication buckets). "
        "Predicted, not measured: communication per step and rank, ZeRO paper (arXiv 1910.02054 §7); "
        "RS reduce-scatter, AG all-gather, AR all-reduce, each in the dtype the run sends; "
        "'ring' keeps the (N-1)/N share that the paper rounds to 1.",
    ]
    return "\n".join(lines)


def save_chart(rows: list[dict], path: Path, title: str) -> None:
    """Three panels: tokens/s, stacked model-state bytes per rank, predicted comm bytes per step."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    names = [r["strategy"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    axes[0].bar(names, [r["tokens_per_second"] for r in rows], color="tab:blue")
    axes[0].set_title("throughput (tokens/s, all ranks)")
    bottom = [0.0] * len(rows)
    for key, label in [
        ("params_bytes", "params"),
        ("grads_bytes", "grads"),
        ("fp32_master_bytes", "fp32 master"),
        ("adam_moments_bytes", "Adam moments"),
    ]:
        values = [r[key] / 1e6 for r in rows]
        axes[1].bar(names, values, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, values)]
    axes[1].set_title("model states per rank (MB, measured)")
    axes[1].legend(fontsize=8)
    axes[2].bar(
        names,
        [r["comm_bytes_paper"] / 1e6 for r in rows],
        color="tab:gray",
        label="paper (2Ψ / 3Ψ)",
    )
    axes[2].bar(
        names,
        [r["comm_bytes_ring"] / 1e6 for r in rows],
        color="tab:orange",
        width=0.4,
        label="ring, x(N-1)/N",
    )
    axes[2].set_title("predicted communication per step per rank (MB)")
    axes[2].legend(fontsize=8)
    for ax in axes:
        ax.tick_params(axis="x", labelrotation=20, labelsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main():
    args = parse_flags((Args,), description=__doc__)[0][0]
    names = [s.strip() for s in args.strategies.split(",") if s.strip()]
    missing = [s for s in names if not (REPO / "accelerate_configs" / f"{s}.yaml").is_file()]
    if not names or missing:
        known = sorted(p.stem for p in (REPO / "accelerate_configs").glob("*.yaml"))
        sys.exit(
            f"error: --strategies {args.strategies!r}: no config for {missing or 'any'}; known: {known}"
        )
    if args.steps <= WARMUP_STEPS:
        sys.exit(
            f"error: --steps {args.steps} leaves no step after the {WARMUP_STEPS} warm-up steps"
        )
    if args.num_processes < 1:
        sys.exit(f"error: --num_processes must be >= 1, got {args.num_processes}")
    if args.mixed_precision not in ("auto", "no", "bf16", "fp16"):
        sys.exit(
            f"error: --mixed_precision {args.mixed_precision!r}: choose auto, no, bf16 or fp16"
        )
    os.makedirs(args.output_dir, exist_ok=True)

    rows = [run_strategy(name, args) for name in names]
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    machine = describe_machine()
    header = (
        f"{args.model_config} Llama ({rows[0]['n_params']:,} parameters = Ψ), {args.num_processes} ranks, "
        f"{rows[0]['mixed_precision']}, micro batch {args.per_device_train_batch_size} x {args.block_size} "
        "tokens, "
        f"{args.steps} steps (median step time after {WARMUP_STEPS}); {when}; {machine}"
    )
    table = markdown_table(rows)
    print(f"\n{header}\n\n{table}\n")
    out = Path(args.output_dir)
    (out / "compare_strategies.md").write_text(f"{header}\n\n{table}\n")
    (out / "compare_strategies.json").write_text(
        json.dumps({"header": header, "rows": rows}, indent=1)
    )
    save_chart(rows, out / "compare_strategies.png", header)
    print(f"wrote {out / 'compare_strategies.md'}, .json and .png")


if __name__ == "__main__":
    errors.run(main)  # a bad flag: one error line
