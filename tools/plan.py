"""Will it fit? The planner's command line: bytes per rank for each strategy, before you launch.

    python tools/plan.py --all --model_config llama-3-8b --block_size 2048 \
        --per_device_train_batch_size 1 --num_processes 8 --device_memory 80GB

Prints, per rank and for each accelerate config: model states, activations, logits and loss
buffers, communication buffers, the total against the device memory, the communication per
optimizer step, a recommendation, and the problems the recipes' start-up checks would report
(`common/checks.py`). `--format json` gives the same numbers in bytes. The memory model, its
formulas and sources: `common/plan.py`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from common import checks, models  # noqa: E402
from common.plan import (detect_memory, load_model_config, model_shape, parse_memory,  # noqa: E402
                         plan_strategy, read_strategy)


def format_table(plans: dict, header: str, device_memory: int, problems: list[str]) -> str:
    """A markdown table (GB = 1e9 bytes, or MB below 1 GB) per rank, strategies as columns, then the
    recommendation and the problems (one line each)."""
    names = list(plans)
    unit, scale = ("GB", 1e9) if max(plans[s]["total"] for s in names) >= 1e9 else ("MB", 1e6)
    gb = lambda b: f"{b / scale:,.2f}"  # noqa: E731
    rows = [("params", "params"), ("grads", "grads"), ("fp32 master", "fp32_master"), ("Adam moments", "adam_moments"),
            ("comm buffers / gathered units", "comm_buffers"), ("activations (saved + recompute)", "activations"),
            ("logits + loss (peak)", "logits_loss"), ("**total**", "total"), ("offloaded to host", "host")]
    lines = [header, "", f"| {unit} per rank | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    for label, key in rows:
        lines.append(f"| {label} | " + " | ".join(gb(plans[s][key]) for s in names) + " |")
    lines.append(f"| headroom vs {gb(device_memory)} {unit} | "
                 + " | ".join(gb(device_memory - plans[s]["total"]) for s in names) + " |")
    fits = ("yes" if plans[s]["total"] <= device_memory else "**no**" for s in names)
    lines.append("| fits | " + " | ".join(fits) + " |")
    lines.append(f"| comm per step and rank ({unit}) | "
                 + " | ".join(gb(plans[s]["comm_per_step"]) for s in names) + " |")
    lines.append("| collectives per step | " + " | ".join(plans[s]["comm_pattern"] for s in names) + " |")
    lines += ["", recommend(plans, device_memory)]
    lines += ["", "Problems:" if problems else "Problems: none found"] + [f"- {p}" for p in problems]
    return "\n".join(lines)


def recommend(plans: dict, device_memory: int) -> str:
    """One line: the fitting strategy with the least communication per step (ties: no host offload,
    which costs time, then the least sharding: single, ddp, zero2, fsdp, zero3)."""
    fitting = [s for s in plans if plans[s]["total"] <= device_memory]
    if len(plans) > 1 and any(plans[s]["ranks"] > 1 for s in plans):  # a single process is no answer for N ranks
        fitting = [s for s in fitting if plans[s]["ranks"] > 1]
    if not fitting:
        return ("Recommendation: nothing fits; try --gradient_checkpointing, a smaller micro batch, more ranks, "
                "or an offload config (deepspeed_zero3_offload)")
    order = ("single", "ddp", "zero2", "fsdp", "fsdp1", "zero3")
    best = min(fitting, key=lambda s: (plans[s]["comm_per_step"], plans[s]["host"] > 0, order.index(plans[s]["kind"])))
    sent = plans[best]["comm_per_step"]
    sent = f"{sent / 1e9:.2f} GB" if sent >= 1e9 else f"{sent / 1e6:.2f} MB"
    return (f"Recommendation: {best} (fits, {sent} sent per rank and step, the "
            "least among those that fit). Confirm with benchmarks/compare_strategies.py before a long run.")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", action="append", help="accelerate YAML path or name in accelerate_configs/ (repeatable)")
    p.add_argument("--all", action="store_true", help="every accelerate_configs/*.yaml")
    p.add_argument("--model_config", default="debug",
                   help=f"preset ({', '.join(models.PRESETS)}) or local HF config dir")
    p.add_argument("--vocab_size", type=int, default=None)
    p.add_argument("--per_device_train_batch_size", type=int, default=8)
    p.add_argument("--gradient_accumulation_steps", type=int, default=1)
    p.add_argument("--block_size", type=int, default=256)
    p.add_argument("--gradient_checkpointing", action="store_true")
    p.add_argument("--mixed_precision", choices=["no", "bf16", "fp16"], default=None, help="default: the YAML's")
    p.add_argument("--num_processes", type=int, default=None,
                   help="all processes, on all machines (as accelerate launch); default: the YAML's")
    p.add_argument("--num_machines", type=int, default=None)
    p.add_argument("--device_memory", default=None, help="e.g. 80GB; default: detected GPU, else host RAM / ranks")
    p.add_argument("--format", choices=["table", "json"], default="table")
    args = p.parse_args(argv)
    import yaml

    try:
        for name in ("per_device_train_batch_size", "gradient_accumulation_steps", "block_size", "vocab_size",
                     "num_processes", "num_machines"):
            if getattr(args, name) is not None and getattr(args, name) < 1:
                raise ValueError(f"--{name} {getattr(args, name)}: must be >= 1")
        paths = sorted((REPO / "accelerate_configs").glob("*.yaml")) if args.all else []
        for c in args.config or ([] if args.all else ["ddp"]):
            path = Path(c) if c.endswith((".yaml", ".yml")) else REPO / "accelerate_configs" / f"{c}.yaml"
            if not path.is_file():
                raise ValueError(f"--config {c!r}: no such file {path}")
            paths.append(path)
        strategies = [read_strategy(path) for path in paths]
        config = load_model_config(args.model_config, args.vocab_size)
        shape = model_shape(config)
        problems: list[str] = []
        with torch.device("meta"):
            model_classes = {type(m).__name__ for m in models.causal_lm_class(config)(config).modules()}
        if config.model_type != "llama":
            problems.append(f"warning: --model_config {args.model_config}: activations use the Llama block formula "
                            f"({config.model_type} may differ)")
        plans, memory, source = {}, None, None
        for s, path in zip(strategies, paths):
            machines = args.num_machines or s["num_machines"]
            ranks = args.num_processes or (1 if s["kind"] == "single" else s["num_processes"])  # on all machines
            if ranks % machines:
                raise ValueError(f"--num_processes {ranks} is not a multiple of --num_machines {machines}")
            per_machine = ranks // machines
            if memory is None:
                memory, source = ((parse_memory(args.device_memory), "--device_memory") if args.device_memory
                                  else detect_memory(per_machine))
            precision = args.mixed_precision or s["mixed_precision"]
            plans[s["name"]] = plan_strategy(s, shape, 1 if s["kind"] == "single" else ranks,
                                             args.per_device_train_batch_size, args.block_size,
                                             args.gradient_accumulation_steps, args.gradient_checkpointing, precision)
            plans[s["name"]].update(ranks=1 if s["kind"] == "single" else ranks, mixed_precision=precision,
                                    kind=s["kind"])
            if source.startswith("no GPU"):  # the "device" is host RAM: what is offloaded to the host counts too
                plans[s["name"]]["total"] += plans[s["name"]]["host"]
            # the recipes' start-up checks, on what the planner knows (no training set, no schedule flags);
            # the hardware ones only for this machine (not with --device_memory, a plan for another one)
            yaml_config = {**yaml.safe_load(path.read_text()), "num_processes": ranks, "mixed_precision": precision,
                           "num_machines": machines}
            ds, ds_where = checks.deepspeed_settings(yaml_config, root=str(REPO))
            flags = {"per_device_train_batch_size": args.per_device_train_batch_size, "block_size": args.block_size,
                     "gradient_accumulation_steps": args.gradient_accumulation_steps,
                     "gradient_checkpointing": args.gradient_checkpointing}
            where = str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)
            problems += [str(p) for p in checks.config_problems(
                yaml_config, where=where, ds=ds, ds_where=ds_where, flags=flags, model_classes=model_classes,
                hardware=None if args.device_memory else checks.detect_hardware(), shape=shape, device_memory=memory,
                compiles=True)]  # (plans recipes/llama.py, which compiles)
    except ValueError as err:
        sys.exit(f"error: {err}")
    if args.format == "json":
        print(json.dumps({"model": args.model_config, "n_params": shape["n_params"], "device_memory": memory,
                          "device_memory_source": source, "plans": plans, "problems": problems,
                          "recommendation": recommend(plans, memory)}, indent=1))
        if any(p.startswith("error:") for p in problems):
            sys.exit(1)
        return
    first = next(iter(plans.values()))
    header = (f"{args.model_config}: {shape['n_params']:,} parameters (Ψ), vocabulary {shape['vocab']:,}; "
              f"{first['ranks']} ranks, {first['mixed_precision']}, micro batch {args.per_device_train_batch_size} x "
              f"{args.block_size} tokens, accumulation {args.gradient_accumulation_steps}, checkpointing "
              f"{'on' if args.gradient_checkpointing else 'off'}; device memory {memory / 1e9:.1f} GB per rank "
              f"({source})")
    print(format_table(plans, header, memory, problems))
    if any(p.startswith("error:") for p in problems):
        sys.exit(1)


if __name__ == "__main__":
    main()
