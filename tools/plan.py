r"""Will it fit, and how fast? The planner's command line: bytes per rank and tokens/s for each strategy.

    python tools/plan.py --all --model_config llama-3-8b --block_size 2048 \
        --per_device_train_batch_size 1 --num_processes 8 --gpu h100

Plans the hardware named: `--gpu`'s memory per rank and datasheet figures (`--device_memory` with a
unit overrides the size), else this host's GPU, else CPU ranks in host RAM (its first line says so).
Prints, per rank and for each accelerate config: model states, activations, logits and loss
buffers, communication buffers, the total against the device memory in its unit (fits: yes, tight
when only the allocated bytes fit, no), the communication per optimizer step, the step time
(compute, exposed communication, optimizer) and tokens/s per rank, uncalibrated or calibrated on a
figure of the same GPU (`--calibrate`), the recommendation (`recommend`: its rule), and the problems
the recipes' start-up checks would report (`common/checks.py`), their ZeRO-3 warning on the table's
numbers. `--format json` gives the same numbers in bytes and seconds. The models, their formulas
and sources: `tools/planner.py`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from common import checks, models  # noqa: E402
from common.checks import detect_memory  # noqa: E402
from tools.planner import (  # noqa: E402
    DEFAULT_EFFICIENCY,
    GPUS,
    RESERVED_SLACK,
    calibrate,
    checkpoint_mode,
    detect_gpu,
    device_spec,
    load_model_config,
    logits_factor,
    model_names,
    model_shape,
    parse_figure,
    parse_memory,
    plan_strategy,
    read_measurement,
    read_strategy,
    time_strategy,
)


def format_table(
    plans: dict, header: str, memory: dict, problems: list[str], time_source: str
) -> str:
    """A markdown table per rank in the device memory's unit (GB = 1e9 bytes or GiB = 2^30, MB or MiB
    below 1 GB), strategies as columns, the step time split and tokens/s per rank, where the time
    model's figures come from, then the recommendation and the problems (one line each)."""
    names = list(plans)
    unit, scale = memory["unit"], 2**30 if memory["unit"] == "GiB" else 1e9
    if max(plans[s]["total"] for s in names) < scale:
        unit, scale = unit.replace("G", "M"), scale / (1024 if unit == "GiB" else 1000)
    gb = lambda b: f"{b / scale:,.2f}"  # noqa: E731
    rows = [
        ("params", "params"),
        ("grads", "grads"),
        ("fp32 master", "fp32_master"),
        ("Adam moments", "adam_moments"),
        ("comm buffers / gathered units", "comm_buffers"),
        ("activations (saved + recompute)", "activations"),
        ("logits + loss (peak)", "logits_loss"),
        ("**total**", "total"),
        (f"reserved (total + {RESERVED_SLACK:.0%}, estimate)", "reserved"),
        ("offloaded to host", "host"),
    ]
    lines = [
        header,
        "",
        f"| {unit} per rank | " + " | ".join(names) + " |",
        "|---|" + "---:|" * len(names),
    ]
    for label, key in rows:
        lines.append(f"| {label} | " + " | ".join(gb(plans[s][key]) for s in names) + " |")
    size = memory["bytes"]
    lines.append(
        f"| headroom vs {gb(size)} {unit} | "
        + " | ".join(gb(size - plans[s]["total"]) for s in names)
        + " |"
    )
    lines.append("| fits | " + " | ".join(verdict(plans[s], size) for s in names) + " |")
    lines.append(
        f"| comm per step and rank ({unit}) | "
        + " | ".join(gb(plans[s]["comm_per_step"]) for s in names)
        + " |"
    )
    lines.append(
        f"| - of it across machines ({unit}) | "
        + " | ".join(gb(plans[s]["comm_inter_node"]) for s in names)
        + " |"
    )
    lines.append(
        "| collectives per step | " + " | ".join(plans[s]["comm_pattern"] for s in names) + " |"
    )
    for label, key in (
        ("step time (ms)", "step"),
        ("- compute", "compute"),
        ("- exposed communication", "exposed_comm"),
        ("- optimizer", "optimizer"),
        ("communication, hidden or not", "comm"),
    ):
        lines.append(
            f"| {label} | "
            + " | ".join(f"{plans[s]['time'][key] * 1e3:,.1f}" for s in names)
            + " |"
        )
    lines.append(
        "| **tokens/s per rank** | "
        + " | ".join(f"{plans[s]['time']['tokens_per_s']:,.0f}" for s in names)
        + " |"
    )
    lines += ["", f"Time: {time_source}", "", memory["recommendation"]]
    lines += ["", "Problems:" if problems else "Problems: none found"] + [
        f"- {p}" for p in problems
    ]
    return "\n".join(lines)


def verdict(plan: dict, size: int) -> str:
    """yes: the reserved estimate fits; tight: the allocated total fits, the estimate of what the allocator
    reserves (total + RESERVED_SLACK) does not, so fragmentation can run it out of memory; no."""
    return "yes" if plan["reserved"] <= size else "tight" if plan["total"] <= size else "**no**"


TIE = (
    0.05  # predictions closer than this are a tie (about the time model's error on published runs)
)
# Strategies whose predicted tokens/s this collection has checked against measurements, by device:
# GPUs, FSDP2 against torchtitan's published runs (tests/test_plan_time.py); CPU ranks, every strategy
# against benchmarks/results/compare_strategies_cpu2.md.
VERIFIED = {"gpu": ("fsdp",), "cpu": ("single", "ddp", "fsdp", "fsdp1", "zero2", "zero3")}
SIMPLEST = ("single", "ddp", "zero2", "fsdp", "fsdp1", "zero3")


def recommend(plans: dict, size: int, device: str) -> str:
    """The strategies that fit, fastest first by predicted tokens/s per rank, and the recommendation.
    The rule: among the fitting plans within TIE of the fastest (a tie: the model cannot tell them
    apart), the one whose prediction this collection has verified on `device` ("cpu" or a GPU), then
    no host offload, then the least sharding (SIMPLEST); every tied plan is named."""
    fitting = [s for s in plans if plans[s]["total"] <= size]
    if len(plans) > 1 and any(plans[s]["ranks"] > 1 for s in plans):
        fitting = [s for s in fitting if plans[s]["ranks"] > 1]  # one process is no answer for N
    if not fitting:
        return ""
    verified = VERIFIED["cpu" if device == "cpu" else "gpu"]
    rate = lambda s: plans[s]["time"]["tokens_per_s"]  # noqa: E731
    ranked = sorted(fitting, key=lambda s: -round(rate(s), 6))
    key = lambda s: (  # noqa: E731
        plans[s]["kind"] not in verified,
        plans[s]["host"] > 0,
        SIMPLEST.index(plans[s]["kind"]),
    )
    tied = sorted((s for s in ranked if rate(s) >= (1 - TIE) * rate(ranked[0])), key=key)
    best = tied[0]
    t = plans[best]["time"]
    text = (
        f"Recommendation: {best} ({rate(best):,.0f} tokens/s per rank predicted on {device}, "
        f"{t['exposed_comm'] / t['step']:.0%} of the step in exposed communication"
    )
    if len(tied) > 1:
        others = ", ".join(f"{s} {rate(s) / rate(best) - 1:+.0%}" for s in tied[1:])
        checked = [s for s in tied if plans[s]["kind"] in verified]
        text += f"; a tie, within the model's {TIE:.0%}: {others}; {best} preferred: " + (
            f"this collection checked its prediction on {'CPU ranks' if device == 'cpu' else 'GPUs'}"
            + (", not theirs" if len(checked) == 1 else "")
            if plans[best]["kind"] in verified
            else "none of them is checked on this device; the simpler one"
        )
    elif len(ranked) > 1:
        o = plans[ranked[1]]["time"]
        text += (
            f"; {ranked[1]} {rate(ranked[1]) / rate(best) - 1:+.0%}, "
            f"{o['exposed_comm'] / o['step']:.0%} exposed communication, "
            f"{o['optimizer'] / o['step']:.0%} optimizer"
        )
    lines = [
        text + "). Confirm with benchmarks/compare_strategies.py before a long run.",
        "Ranked by predicted tokens/s per rank (fitting): "
        + ", ".join(f"{s} {rate(s):,.0f}" for s in ranked),
    ]
    if tight := [s for s in fitting if plans[s]["reserved"] > size]:
        lines.append(
            f"Tight: {', '.join(tight)} fit(s) allocated but not with the allocator's "
            f"{RESERVED_SLACK:.0%} slack; PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True reduces it"
        )
    if not_fitting := [s for s in plans if plans[s]["total"] > size]:
        lines[1] += "; does not fit: " + ", ".join(not_fitting)
    return "\n".join(lines)


def time_setup(args, gpu: str, gpus_per_node: int | None) -> tuple:
    """(device, efficiency, source line) for the time model from the flags: `gpu`'s datasheet figures
    with the bandwidth flags over them, and the efficiency given, fitted on --calibrate, or the default.

    Raises:
        ValueError: a bad --gpu, --calibrate file, figure or device, or --calibrate_strategy (one line).
    """
    giga = lambda v: None if v is None else v * 1e9  # noqa: E731
    device = device_spec(
        gpu,
        peak_flops=None if args.peak_tflops is None else args.peak_tflops * 1e12,
        memory_bandwidth=giga(args.memory_bandwidth),
        intra_node=giga(args.intra_node_bandwidth),
        network=giga(args.network_bandwidth),
        gpus_per_node=args.gpus_per_node or gpus_per_node,
    )
    if args.efficiency is not None:
        if not 0 < args.efficiency <= 1:
            raise ValueError(f"--efficiency {args.efficiency}: expected a share in (0, 1]")
        return (
            device,
            args.efficiency,
            f"{device.source}; efficiency {args.efficiency:g} (--efficiency)",
        )
    if not args.calibrate:
        return (
            device,
            DEFAULT_EFFICIENCY,
            f"{device.source}; efficiency {DEFAULT_EFFICIENCY} assumed, not calibrated: "
            + (
                "torchtitan's H100 runs measured 26-31% below such a prediction, its A100 runs "
                "1% below to 16% above; --calibrate on a measured or published figure fits it"
                if gpu != "cpu"
                else "--calibrate a compare_strategies result or a llama.py run fits it"
            ),
        )
    rows = (
        [parse_figure(args.calibrate)]
        if "=" in args.calibrate
        else read_measurement(args.calibrate)
    )
    names = [r["strategy"] for r in rows]
    if args.calibrate_strategy and args.calibrate_strategy not in names:
        raise ValueError(
            f"--calibrate_strategy {args.calibrate_strategy!r}: {args.calibrate} has {', '.join(names)}"
        )
    m = rows[names.index(args.calibrate_strategy)] if args.calibrate_strategy else rows[0]
    if m["gpu"] is None:
        raise ValueError(
            f"--calibrate {args.calibrate}: it does not say which device it ran on; give the figure on "
            "the command line instead (--calibrate tokens_per_s=...,gpu=...: docs/planning.md)"
        )
    if m["gpu"] != device.name:
        raise ValueError(
            f"--calibrate {args.calibrate}: measured on {m['gpu']}, the plan is for {device.name}, and "
            f"an efficiency does not carry across devices: calibrate on a {device.name} figure, or "
            f"plan --gpu {m['gpu']}"
        )
    yaml_path = REPO / "accelerate_configs" / f"{m['strategy']}.yaml"
    strategy = (
        read_strategy(yaml_path)
        if yaml_path.is_file()
        else {
            "kind": m["kind"],
            "reshard": True,
            "ds": {},
            "offload_optimizer": False,
            "offload_param": False,
            "comm_bytes": None,
        }
    )
    shape = model_shape(
        load_model_config(
            m["model_config"], args.vocab_size if m["model_config"] == args.model_config else None
        )
    )
    efficiency = calibrate(
        m["tokens_per_s"],
        strategy,
        shape,
        device,
        m["ranks"],
        m["batch"],
        m["seq"],
        accumulation=m["accumulation"],
        checkpointing=m["checkpointing"],
        compiled=m["compiled"],
        mixed_precision=m["mixed_precision"],
    )
    return (
        device,
        efficiency,
        f"{device.source}; efficiency {efficiency:.3f} calibrated on {m['source']}: "
        f"{m['tokens_per_s']:,.0f} tokens/s per rank, {m['strategy']}, {m['ranks']} ranks, "
        f"{m['model_config']}, {m['batch']} x {m['seq']} tokens, checkpointing {m['checkpointing']}"
        f"{', compiled' if m['compiled'] else ''}",
    )


def plan_all(args, strategies, mode, batch, ranks_flag, device, efficiency, host_ram) -> dict:
    """{config name: plan with its "time"} for each strategy at these flags (what `main` prints)."""
    compiled = str(args.dynamo_backend).lower() not in ("no", "none")
    plans = {}
    for s in map(dict, strategies):
        machines = args.num_machines or s["num_machines"]
        ranks = 1 if s["kind"] == "single" else ranks_flag or s["num_processes"]  # all machines
        if ranks % machines and s["kind"] != "single":
            raise ValueError(
                f"--num_processes {ranks} is not a multiple of --num_machines {machines}"
            )
        if s["replicas"] > 1 and (ranks_flag or args.num_machines):  # HSDP: shard within a machine
            s["replicas"] = machines if machines > 1 else s["replicas"]
        precision = args.mixed_precision or s["mixed_precision"]
        plan = plan_strategy(
            s,
            args.shape,
            ranks,
            batch,
            args.block_size,
            args.gradient_accumulation_steps,
            mode,
            precision,
            logits_factor(compiled_loss=compiled),
            not args.grads_set_to_none,
            machines,
            packing=args.packing,
        )
        plan.update(ranks=ranks, machines=machines, mixed_precision=precision, kind=s["kind"])
        plan["replicas"] = s["replicas"]
        plan["time"] = time_strategy(
            s,
            args.shape,
            device,
            ranks,
            batch,
            args.block_size,
            args.gradient_accumulation_steps,
            mode,
            compiled,
            efficiency,
            precision,
        )
        if host_ram:  # the "device" is host RAM: what is offloaded to the host counts too
            plan["total"] += plan["host"]
            plan["reserved"] = int(plan["total"] * (1 + RESERVED_SLACK))
        plans[s["name"]] = plan
    return plans


def nothing_fits(args, strategies, mode, size, unit, *planning) -> str:
    """When no strategy fits: which ones do with full checkpointing, a micro batch of 1, both, or twice
    the ranks, each planned as the table is (one line). `planning`: plan_all's device, efficiency, host_ram."""
    scale = 2**30 if unit == "GiB" else 1e9
    batch, ranks = args.per_device_train_batch_size, args.num_processes
    tries = [("--gradient_checkpointing", "full", batch, ranks)] if mode != "full" else []
    if batch > 1:
        tries.append(("--per_device_train_batch_size 1", mode, 1, ranks))
        if mode != "full":
            tries.append(
                ("--gradient_checkpointing --per_device_train_batch_size 1", "full", 1, ranks)
            )
    if ranks:
        tries.append((f"--num_processes {2 * ranks}", mode, batch, 2 * ranks))
    for flags, m, b, n in tries:
        plans = plan_all(args, strategies, m, b, n, *planning)
        if fit := [s for s in plans if plans[s]["total"] <= size and plans[s]["ranks"] > 1]:
            return (
                f"Recommendation: nothing fits in {size / scale:,.2f} {unit} per rank; with {flags}: "
                + ", ".join(f"{s} ({plans[s]['total'] / scale:,.2f} {unit})" for s in fit)
            )
    return (
        f"Recommendation: nothing fits in {size / scale:,.2f} {unit} per rank, nor with "
        + ", ".join(t[0] for t in tries)
        + ": a GPU with more memory, or more ranks"
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--config",
        "--config_file",
        action="append",
        dest="config",
        help="accelerate YAML path or name in accelerate_configs/ (repeatable; --config_file as in "
        "accelerate launch)",
    )
    p.add_argument(
        "--all",
        action="store_true",
        help="every accelerate_configs/*.yaml but tensor parallel ones",
    )
    p.add_argument(
        "--model_config",
        default="debug",
        help=f"preset or stored public config ({', '.join(model_names())}) or a local HF config dir",
    )
    p.add_argument("--vocab_size", type=int, default=None)
    p.add_argument("--per_device_train_batch_size", type=int, default=8)
    p.add_argument("--gradient_accumulation_steps", type=int, default=1)
    p.add_argument("--block_size", type=int, default=256)
    p.add_argument(
        "--packing",
        choices=["stream", "documents", "none"],
        default="stream",
        help="as recipes/llama.py: documents and none (padded) give attention a mask, counted",
    )
    p.add_argument(
        "--gradient_checkpointing",
        action="store_true",
        help="every block (--activation_checkpointing full)",
    )
    p.add_argument(
        "--activation_checkpointing",
        choices=["none", "full", "selective_layer", "selective_op"],
        default=None,
        help="selective_layer: every second block; selective_op: torchtitan's per-op policy",
    )
    p.add_argument(
        "--grads_set_to_none",
        action="store_true",
        help="gradients freed between steps (torch's zero_grad default): DDP's and FSDP's do not count "
        "at the activation peak",
    )
    p.add_argument(
        "--dynamo_backend",
        default="no",
        help="as accelerate launch: anything but 'no' plans compiled blocks",
    )
    p.add_argument(
        "--mixed_precision",
        choices=["no", "bf16", "fp16"],
        default=None,
        help="default: the YAML's",
    )
    p.add_argument(
        "--num_processes",
        type=int,
        default=None,
        help="all processes, on all machines (as accelerate launch); default: the YAML's",
    )
    p.add_argument("--num_machines", type=int, default=None)
    p.add_argument(
        "--device_memory",
        default=None,
        help="per rank, with a unit: 80GB (10^9 bytes) or 80GiB (2^30); default: --gpu's, else the "
        "detected GPU's, else host RAM / ranks (CPU ranks)",
    )
    p.add_argument(
        "--gpu",
        default=None,
        help="the GPU planned: a100 (80GB), a100-40gb, h100 (SXM 80GB), h100-pcie, h100-nvl (94GB), "
        "h100-96gb, h200 (141GB) or cpu: its memory and the datasheet figures the time model starts "
        "from; default: the detected GPU, else CPU ranks",
    )
    p.add_argument(
        "--peak_tflops",
        type=float,
        default=None,
        help="dense bf16 TFLOP/s per device (overrides --gpu)",
    )
    p.add_argument(
        "--memory_bandwidth", type=float, default=None, help="device memory GB/s (overrides --gpu)"
    )
    p.add_argument(
        "--intra_node_bandwidth",
        type=float,
        default=None,
        help="bus bandwidth inside a node, GB/s (nccl-tests busbw; overrides --gpu)",
    )
    p.add_argument(
        "--network_bandwidth", type=float, default=None, help="GB/s of each GPU's network link"
    )
    p.add_argument("--gpus_per_node", type=int, default=None)
    p.add_argument(
        "--efficiency",
        type=float,
        default=None,
        help=f"share of the peak the matmuls reach; default {DEFAULT_EFFICIENCY}, or fitted by --calibrate",
    )
    p.add_argument(
        "--calibrate",
        default=None,
        help="fit the efficiency on a measurement: a figure, tokens_per_s=N,gpu=G,model=M,ranks=N,"
        "batch=B,seq=S,checkpointing=C,compile=yes|no[,strategy=fsdp], or compare_strategies.md/.json, "
        "or a recipes/llama.py --output_dir (run_info.json, metrics.jsonl); on the plan's --gpu only",
    )
    p.add_argument(
        "--calibrate_strategy", default=None, help="which row of --calibrate (default: the first)"
    )
    p.add_argument(
        "--use_peft",
        action="store_true",
        help="as recipes/sft.py: LoRA adapters train on the frozen model (gradients and optimizer state "
        "for the adapters only)",
    )
    p.add_argument(
        "--lora_r",
        type=int,
        default=None,
        help="LoRA rank (with --use_peft; default 16, as sft.py)",
    )
    p.add_argument(
        "--lora_target_modules",
        default=None,
        help="comma list of module names, or all-linear (with --use_peft; the default, as sft.py)",
    )
    p.add_argument("--format", choices=["table", "json"], default="table")
    args = p.parse_args(argv)
    import yaml

    try:
        for name in (
            "per_device_train_batch_size",
            "gradient_accumulation_steps",
            "block_size",
            "vocab_size",
            "num_processes",
            "num_machines",
            "lora_r",
        ):
            if getattr(args, name) is not None and getattr(args, name) < 1:
                raise ValueError(f"--{name} {getattr(args, name)}: must be >= 1")
        paths = (
            sorted(
                p
                for p in (REPO / "accelerate_configs").glob("*.yaml")  # (tp.yaml: not modelled)
                if "parallelism_config_tp_size" not in p.read_text()
            )
            if args.all
            else []
        )
        for c in args.config or ([] if args.all else ["ddp"]):
            path = (
                Path(c)
                if c.endswith((".yaml", ".yml"))
                else REPO / "accelerate_configs" / f"{c}.yaml"
            )
            if not path.is_file():
                raise ValueError(f"--config {c!r}: no such file {path}")
            paths.append(path)
        strategies = [read_strategy(path) for path in paths]
        for name in ("lora_r", "lora_target_modules"):
            if getattr(args, name) is not None and not args.use_peft:
                raise ValueError(f"--{name} needs --use_peft")
        targets = args.lora_target_modules or "all-linear"
        lora = args.use_peft and {
            "r": args.lora_r or 16,
            "target_modules": targets if targets == "all-linear" else targets.split(","),
        }
        config = load_model_config(args.model_config, args.vocab_size)
        try:
            args.shape = shape = model_shape(config, lora or None)
        except ValueError as err:  # (peft names the target modules the model lacks)
            raise ValueError(
                f"--lora_target_modules {targets}: {' '.join(str(err).split())}"
            ) from None
        problems: list[str] = []
        model_classes = checks.model_class_names(models.causal_lm_class(config), config)
        if config.model_type != "llama":
            problems.append(
                f"warning: --model_config {args.model_config}: activations use the Llama block formula "
                f"({config.model_type} may differ)"
            )
        mode = checkpoint_mode(args.activation_checkpointing or args.gradient_checkpointing)
        # the hardware planned: --gpu, else this host's GPU, else CPU ranks; its memory per rank
        gpu = args.gpu or detect_gpu()
        device_spec(gpu)  # (an unknown --gpu: one line, before anything else)
        gpu = device_spec(gpu).name
        first = strategies[0]
        machines = args.num_machines or first["num_machines"]
        per_machine = (args.num_processes or first["num_processes"]) // machines or 1
        host_ram = False
        if args.device_memory:
            size, unit = parse_memory(args.device_memory)
            source = f"--device_memory {args.device_memory}"
        elif gpu != "cpu" and args.gpu is None:
            size, source = detect_memory(per_machine)
            unit = "GiB"
        elif gpu != "cpu":
            size, unit = GPUS[gpu]["memory"], "GiB"
            source = f"--gpu {args.gpu}: {GPUS[gpu]['label']}, {size // 2**20:,} MiB as " + GPUS[
                gpu
            ].get("memory_from", "nvidia-smi reports it")
        else:
            (size, source), unit, host_ram = detect_memory(per_machine), "GB", True
        if gpu == "cpu":
            cpu_line = (
                "Planning CPU ranks (gloo, host RAM): "
                + ("--gpu cpu" if args.gpu else "no GPU on this host and no --gpu")
                + f"; to plan GPUs give --gpu ({', '.join(GPUS)})"
            )
        device, efficiency, time_source = time_setup(
            args, gpu, per_machine if machines > 1 else None
        )
        planning = (device, efficiency, host_ram)
        plans = plan_all(
            args, strategies, mode, args.per_device_train_batch_size, args.num_processes, *planning
        )
        recommendation = recommend(plans, size, gpu) or nothing_fits(
            args, strategies, mode, size, unit, *planning
        )
        for s, path in zip(strategies, paths):
            plan = plans[s["name"]]
            ranks, machines = plan["ranks"], plan["machines"]
            # the recipes' start-up checks, on what the planner knows (no training set, no schedule flags);
            # the hardware ones only for this machine (not with --device_memory or --gpu: another one)
            yaml_config = {
                **yaml.safe_load(path.read_text()),
                "num_processes": ranks,
                "mixed_precision": plan["mixed_precision"],
                "num_machines": machines,
            }
            if plan["replicas"] > 1:  # HSDP, as planned: replicas x the ranks sharded over
                yaml_config["parallelism_config"] = {
                    **yaml_config["parallelism_config"],
                    "parallelism_config_dp_replicate_size": plan["replicas"],
                    "parallelism_config_dp_shard_size": ranks // plan["replicas"],
                }
            ds, ds_where = checks.deepspeed_settings(yaml_config, root=str(REPO))
            flags = {
                "per_device_train_batch_size": args.per_device_train_batch_size,
                "block_size": args.block_size,
                "gradient_accumulation_steps": args.gradient_accumulation_steps,
                "gradient_checkpointing": mode != "none",
                "packing": args.packing,
            }
            where = str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)
            found = checks.config_problems(
                yaml_config,
                where=where,
                ds=ds,
                ds_where=ds_where,
                flags=flags,
                model_classes=model_classes,
                hardware=None if args.device_memory or args.gpu else checks.detect_hardware(),
                n_params=shape["n_params"],
                device_memory=size,
                compiles=True,
            )  # (plans recipes/llama.py, which compiles)
            for p in map(str, found):
                # the recipe's ZeRO-3 rule of thumb counts bytes sent; here the table's tokens/s speak
                if p.startswith("warning: ZeRO-3 (zero_optimization.stage: 3"):
                    p = zero3_line(s["name"], plans, size, gpu)
                problems += [p] if p else []
    except ValueError as err:
        sys.exit(f"error: {err}")
    if args.format == "json":
        print(
            json.dumps(
                {
                    "model": args.model_config,
                    "n_params": shape["n_params"],
                    "n_trainable": shape["trainable"],
                    "device": gpu,
                    "device_memory": size,
                    "device_memory_unit": unit,
                    "device_memory_source": source,
                    "plans": plans,
                    "problems": problems,
                    "time_model": {
                        "device": device,
                        "efficiency": efficiency,
                        "source": time_source,
                    },
                    "recommendation": recommendation,
                },
                indent=1,
            )
        )
        if any(p.startswith("error:") for p in problems):
            sys.exit(1)
        return
    first = next(iter(plans.values()))
    adapters = (
        f" (LoRA r {shape['lora_r']} on {targets}: {shape['trainable']:,} of them train, Ψt)"
        if shape["lora_r"]
        else ""
    )
    scale = 2**30 if unit == "GiB" else 1e9
    header = (
        f"{args.model_config}: {shape['n_params']:,} parameters (Ψ){adapters}, vocabulary {shape['vocab']:,}; "
        f"{first['ranks']} ranks, {first['mixed_precision']}, micro batch {args.per_device_train_batch_size} x "
        f"{args.block_size} tokens, accumulation {args.gradient_accumulation_steps}, checkpointing "
        f"{mode}{', compiled' if str(args.dynamo_backend).lower() not in ('no', 'none') else ''}; "
        f"device memory {size / scale:,.2f} {unit} per rank ({source})"
    )
    if gpu == "cpu":
        header = f"{cpu_line}\n\n{header}"
    memory = {"bytes": size, "unit": unit, "recommendation": recommendation}
    print(format_table(plans, header, memory, problems, time_source))
    if any(p.startswith("error:") for p in problems):
        sys.exit(1)


def zero3_line(name: str, plans: dict, size: int, gpu: str) -> str | None:
    """The recipes' ZeRO-3 warning on the table's numbers: a fitting plan of another kind predicted
    faster than ZeRO-3 `name` beyond the model's error, on the device planned; else None."""
    rate = lambda s: plans[s]["time"]["tokens_per_s"]  # noqa: E731
    faster = [
        s
        for s in plans
        if plans[s]["kind"] != "zero3"
        and plans[s]["total"] <= size
        and rate(s) > (1 + TIE) * rate(name)
    ]
    if plans[name]["kind"] != "zero3" or not faster:
        return None
    best = max(faster, key=rate)
    return (
        f"warning: {name} is predicted at {rate(name):,.0f} tokens/s per rank on {gpu}, {best} "
        f"(which fits too) at {rate(best):,.0f}, {rate(best) / rate(name) - 1:.0%} faster: prefer it "
        "unless you measured otherwise"
    )


if __name__ == "__main__":
    main()
