"""Full training against LoRA: model-state bytes per rank, measured and planned, on the same model.

    python benchmarks/lora_states.py --output_file benchmarks/results/lora_states_cpu2.md

Launches `benchmarks/measure_model_states.py` once per accelerate config (ddp, fsdp, deepspeed_zero2,
deepspeed_zero3 by default), each measuring the debug preset twice in one launch: fully trained, then
with LoRA adapters of rank `--lora_r` on every Linear but the head (recipes/sft.py's `--use_peft`
default all-linear). Each rank's parameters, gradients, fp32 master and Adam moments are counted from
the live tensors after one optimizer step (measure_model_states.py says how), and set beside
`tools/planner.py`'s prediction for the same settings (`model_shape(config, lora)`, `plan_strategy`).
The table gives the fullest rank's bytes; "gap" is (planned - measured) / measured.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from common import models  # noqa: E402
from tools import planner  # noqa: E402

STATES = ("params", "grads", "fp32_master", "adam_moments")


def measure(config: str, lora_r: int, mixed_precision: str, workdir: Path) -> list[dict]:
    """measure_model_states.py under accelerate_configs/{config}.yaml: [full, LoRA] result dicts."""
    out = workdir / f"{config}.json"
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(REPO / "accelerate_configs" / f"{config}.yaml"),
        "--mixed_precision",
        mixed_precision,
        str(REPO / "benchmarks" / "measure_model_states.py"),
        "--output_file",
        str(out),
        "--config_overrides",
        f";lora_r={lora_r}",
        "--per_device_train_batch_size",
        "1",
        "--block_size",
        "32",
    ]
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": "1",
    }
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        sys.exit(
            f"error: measure_model_states.py under {config} exited {proc.returncode}\n{proc.stderr[-3000:]}"
        )
    return json.loads(out.read_text())


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--output_file", required=True, help="markdown table")
    p.add_argument("--configs", default="ddp,fsdp,deepspeed_zero2,deepspeed_zero3")
    p.add_argument("--lora_r", type=int, default=8)
    p.add_argument("--mixed_precision", default="no", choices=["no", "bf16"])
    args = p.parse_args()
    config = models.llama_config("debug", 4096)
    shapes = {
        None: planner.model_shape(config),
        args.lora_r: planner.model_shape(config, {"r": args.lora_r}),
    }
    lines = []
    worst = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.configs.split(","):
            spec = planner.read_strategy(REPO / "accelerate_configs" / f"{name}.yaml")
            for m in measure(name, args.lora_r, args.mixed_precision, Path(tmp)):
                shape = shapes[m["lora_r"]]
                assert (
                    shape["n_params"] == m["n_params"] and shape["trainable"] == m["n_trainable"]
                ), m
                planned = planner.plan_strategy(
                    spec,
                    shape,
                    ranks=m["world_size"],
                    batch=1,
                    seq=32,
                    accumulation=1,
                    checkpointing=False,
                    mixed_precision=m["mixed_precision"],
                )
                got = {c: max(m[f"{c}_bytes"]) for c in STATES}  # the fullest rank
                got["total"], planned["total"] = sum(got.values()), sum(planned[c] for c in STATES)
                for c in (*STATES, "total"):
                    gap = (planned[c] - got[c]) / got[c] if got[c] else float(planned[c] != 0)
                    worst = max(worst, abs(gap))
                    lines.append(
                        f"| {name} | {'LoRA r ' + str(m['lora_r']) if m['lora_r'] else 'full'} | {c} | "
                        f"{got[c]:,} | {planned[c]:,} | {gap:+.1e} |"
                    )
    full, lora = shapes[None], shapes[args.lora_r]
    text = [
        f"# Model states per rank, full training against LoRA (debug preset, 2 ranks, "
        f"{'fp32' if args.mixed_precision == 'no' else args.mixed_precision})",
        "",
        f"`python benchmarks/lora_states.py --output_file {args.output_file} --lora_r {args.lora_r} "
        f"--mixed_precision {args.mixed_precision}`: CPU only, {os.cpu_count()} cores, "
        f"gloo; torch {torch.__version__}. Full: {full['n_params']:,} parameters, all trained. LoRA r "
        f"{args.lora_r} on all-linear: {lora['n_params']:,} parameters, {lora['trainable']:,} of them (the "
        "adapters) trained. Bytes of the fullest rank, measured from the live tensors after one step "
        "(benchmarks/measure_model_states.py) and planned (tools/planner.py); gap = (planned - measured) / "
        f"measured; largest |gap| {worst:.1e}.",
        "",
        "| config | training | state | measured bytes | planned bytes | gap |",
        "|---|---|---|---:|---:|---:|",
        *lines,
    ]
    Path(args.output_file).write_text("\n".join(text) + "\n")
    print("\n".join(text))


if __name__ == "__main__":
    main()
