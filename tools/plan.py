r"""Will it fit, and how fast? The planner's command line: bytes per rank and tokens/s for each strategy.

    python tools/plan.py --all --model_config llama-3-8b --block_size 2048 \
        --per_device_train_batch_size 1 --num_processes 8 --device_memory 80GB --gpu h100

Prints, per rank and for each accelerate config: model states, activations, logits and loss
buffers, communication buffers, the total against the device memory, the communication per
optimizer step, the step time (compute, exposed communication, optimizer) and tokens/s per rank on
`--gpu`'s datasheet figures or calibrated on a measurement (`--calibrate`), a recommendation (the
fastest that fits), and the problems the recipes' start-up checks would report (`common/checks.py`).
`--format json` gives the same numbers in bytes and seconds. The models, their formulas and sources:
`tools/planner.py`.
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
    RESERVED_SLACK,
    calibrate,
    checkpoint_mode,
    detect_gpu,
    device_spec,
    load_model_config,
    logits_factor,
    model_shape,
    parse_memory,
    plan_strategy,
    read_measurement,
    read_strategy,
    time_strategy,
)


def format_table(
    plans: dict, header: str, device_memory: int, problems: list[str], time_source: str
) -> str:
    """A markdown table (GB = 1e9 bytes, or MB below 1 GB) per rank, strategies as columns, the step time
    split and tokens/s per rank, where the time model's figures come from, then the recommendation and
    the problems (one line each)."""
    names = list(plans)
    unit, scale = ("GB", 1e9) if max(plans[s]["total"] for s in names) >= 1e9 else ("MB", 1e6)
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
    lines.append(
        f"| headroom vs {gb(device_memory)} {unit} | "
        + " | ".join(gb(device_memory - plans[s]["total"]) for s in names)
        + " |"
    )
    fits = ("yes" if plans[s]["total"] <= device_memory else "**no**" for s in names)
    lines.append("| fits | " + " | ".join(fits) + " |")
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
    lines += ["", f"Time: {time_source}", "", recommend(plans, device_memory)]
    lines += ["", "Problems:" if problems else "Problems: none found"] + [
        f"- {p}" for p in problems
    ]
    return "\n".join(lines)


TIE = 0.05  # predictions closer than this are a tie


def recommend(plans: dict, device_memory: int) -> str:
    """The strategies that fit, fastest first by predicted tokens/s per rank, the first one with why, in
    two lines. Within TIE of the fastest (about the time model's error against published runs) the
    simplest wins: no host offload, then the least sharding (single, ddp, zero2, fsdp, fsdp1, zero3)."""
    fitting = [s for s in plans if plans[s]["total"] <= device_memory]
    if len(plans) > 1 and any(
        plans[s]["ranks"] > 1 for s in plans
    ):  # a single process is no answer for N ranks
        fitting = [s for s in fitting if plans[s]["ranks"] > 1]
    if not fitting:
        return (
            "Recommendation: nothing fits; try --gradient_checkpointing, a smaller micro batch, more ranks, "
            "or an offload config (deepspeed_zero3_offload)"
        )
    order = ("single", "ddp", "zero2", "fsdp", "fsdp1", "zero3")
    simplest = lambda s: (plans[s]["host"] > 0, order.index(plans[s]["kind"]))  # noqa: E731
    ranked = sorted(
        fitting, key=lambda s: (-round(plans[s]["time"]["tokens_per_s"], 6), *simplest(s))
    )
    top = plans[ranked[0]]["time"]["tokens_per_s"]
    best = min(
        (s for s in ranked if plans[s]["time"]["tokens_per_s"] >= (1 - TIE) * top), key=simplest
    )
    lines = [
        f"Recommendation: {best} ({why(plans[best], plans, [s for s in ranked if s != best])}). "
        "Confirm with benchmarks/compare_strategies.py before a long run.",
        "Ranked by predicted tokens/s per "
        "rank (fitting): "
        + ", ".join(f"{s} {plans[s]['time']['tokens_per_s']:,.0f}" for s in ranked),
    ]
    not_fitting = [s for s in plans if s not in fitting and plans[s]["total"] > device_memory]
    if not_fitting:
        lines[-1] += "; does not fit: " + ", ".join(not_fitting)
    return "\n".join(lines)


def why(best: dict, plans: dict, others: list[str]) -> str:
    """One clause: the best plan's tokens/s and share of exposed communication, against the runner-up
    (and what the runner-up spends its step on)."""
    t = best["time"]
    text = (
        f"fits, {t['tokens_per_s']:,.0f} tokens/s per rank predicted, "
        f"{t['exposed_comm'] / t['step']:.0%} of the step in exposed communication"
    )
    if others:
        o = plans[others[0]]["time"]
        if o["tokens_per_s"] >= t["tokens_per_s"]:
            return text + (
                f"; {others[0]} is predicted {o['tokens_per_s'] / t['tokens_per_s'] - 1:.0%} faster, "
                f"within the model's {TIE:.0%}: the simpler strategy wins the tie"
            )
        text += (
            f"; {others[0]} is {t['tokens_per_s'] / o['tokens_per_s']:.2f}x slower, "
            f"{o['exposed_comm'] / o['step']:.0%} exposed communication, "
            f"{o['optimizer'] / o['step']:.0%} optimizer"
        )
    return text


def time_setup(args, gpus_per_node: int | None) -> tuple:
    """(device, efficiency, source line) for the time model from the flags: the --gpu datasheet figures
    with the bandwidth flags over them, and the efficiency given, fitted on --calibrate, or the default.

    Raises:
        ValueError: a bad --gpu, --calibrate file or --calibrate_strategy (one line).
    """
    giga = lambda v: None if v is None else v * 1e9  # noqa: E731
    device = device_spec(
        args.gpu or detect_gpu(),
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
            (
                f"{device.source}; efficiency {DEFAULT_EFFICIENCY} assumed, not calibrated "
                "(--calibrate a compare_strategies result or a llama.py run fits it)"
            ),
        )
    rows = read_measurement(args.calibrate)
    names = [r["strategy"] for r in rows]
    if args.calibrate_strategy and args.calibrate_strategy not in names:
        raise ValueError(
            f"--calibrate_strategy {args.calibrate_strategy!r}: {args.calibrate} has {', '.join(names)}"
        )
    m = rows[names.index(args.calibrate_strategy)] if args.calibrate_strategy else rows[0]
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
    if (
        efficiency < 0.02
    ):  # (a GPU stack fits 0.45-0.65 on its datasheet peak; CPU ranks about 0.23 on theirs)
        raise ValueError(
            f"--calibrate {args.calibrate}: {m['tokens_per_s']:,.0f} tokens/s per rank is "
            f"{efficiency:.2%} of what {device.name}'s figures allow: measured on another device? "
            "(--gpu names the one it ran on; --gpu cpu for CPU ranks)"
        )
    return (
        device,
        efficiency,
        (
            f"{device.source}; efficiency {efficiency:.3f} calibrated on {m['source']}: "
            f"{m['tokens_per_s']:,.0f} tokens/s per rank measured, {m['ranks']} ranks, "
            f"{m['model_config']}, {m['batch']} x {m['seq']} tokens"
        ),
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
        help=f"preset ({', '.join(models.PRESETS)}) or local HF config dir",
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
        help="e.g. 80GB; default: detected GPU, else host RAM / ranks",
    )
    p.add_argument(
        "--gpu",
        default=None,
        help="a100, h100, h100-nvl, h100-pcie, h200 or cpu: the datasheet figures "
        "the time model starts from; default: the detected GPU, else cpu",
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
        help="fit the efficiency on a measurement: compare_strategies.md/.json "
        "or a recipes/llama.py --output_dir (run_info.json, metrics.jsonl)",
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
            shape = model_shape(config, lora or None)
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
        compiled = str(args.dynamo_backend).lower() not in ("no", "none")
        plans, memory, source, device = {}, None, None, None
        for s, path in zip(strategies, paths):
            machines = args.num_machines or s["num_machines"]
            ranks = args.num_processes or (
                1 if s["kind"] == "single" else s["num_processes"]
            )  # on all machines
            if ranks % machines:
                raise ValueError(
                    f"--num_processes {ranks} is not a multiple of --num_machines {machines}"
                )
            per_machine = ranks // machines
            if s["replicas"] > 1 and (
                args.num_processes or args.num_machines
            ):  # HSDP: shard within a machine
                s["replicas"] = machines if machines > 1 else s["replicas"]
            if memory is None:
                memory, source = (
                    (parse_memory(args.device_memory), "--device_memory")
                    if args.device_memory
                    else detect_memory(per_machine)
                )
                device, efficiency, time_source = time_setup(
                    args, per_machine if machines > 1 else None
                )
            precision = args.mixed_precision or s["mixed_precision"]
            plans[s["name"]] = plan_strategy(
                s,
                shape,
                1 if s["kind"] == "single" else ranks,
                args.per_device_train_batch_size,
                args.block_size,
                args.gradient_accumulation_steps,
                mode,
                precision,
                logits_factor(compiled_loss=compiled),
                not args.grads_set_to_none,
                machines,
                packing=args.packing,
            )
            plans[s["name"]].update(
                ranks=1 if s["kind"] == "single" else ranks,
                mixed_precision=precision,
                kind=s["kind"],
            )
            plans[s["name"]]["time"] = time_strategy(
                s,
                shape,
                device,
                ranks,
                args.per_device_train_batch_size,
                args.block_size,
                args.gradient_accumulation_steps,
                mode,
                compiled,
                efficiency,
                precision,
            )
            if source.startswith(
                "no GPU"
            ):  # the "device" is host RAM: what is offloaded to the host counts too
                plans[s["name"]]["total"] += plans[s["name"]]["host"]
            # the recipes' start-up checks, on what the planner knows (no training set, no schedule flags);
            # the hardware ones only for this machine (not with --device_memory, a plan for another one)
            yaml_config = {
                **yaml.safe_load(path.read_text()),
                "num_processes": ranks,
                "mixed_precision": precision,
                "num_machines": machines,
            }
            if s["replicas"] > 1:  # HSDP, as planned: replicas x the ranks sharded over
                yaml_config["parallelism_config"] = {
                    **yaml_config["parallelism_config"],
                    "parallelism_config_dp_replicate_size": s["replicas"],
                    "parallelism_config_dp_shard_size": ranks // s["replicas"],
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
            problems += [
                str(p)
                for p in checks.config_problems(
                    yaml_config,
                    where=where,
                    ds=ds,
                    ds_where=ds_where,
                    flags=flags,
                    model_classes=model_classes,
                    hardware=None if args.device_memory else checks.detect_hardware(),
                    n_params=shape["n_params"],
                    device_memory=memory,
                    compiles=True,
                )
            ]  # (plans recipes/llama.py, which compiles)
    except ValueError as err:
        sys.exit(f"error: {err}")
    if args.format == "json":
        print(
            json.dumps(
                {
                    "model": args.model_config,
                    "n_params": shape["n_params"],
                    "n_trainable": shape["trainable"],
                    "device_memory": memory,
                    "device_memory_source": source,
                    "plans": plans,
                    "problems": problems,
                    "time_model": {
                        "device": device,
                        "efficiency": efficiency,
                        "source": time_source,
                    },
                    "recommendation": recommend(plans, memory),
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
    header = (
        f"{args.model_config}: {shape['n_params']:,} parameters (Ψ){adapters}, vocabulary {shape['vocab']:,}; "
        f"{first['ranks']} ranks, {first['mixed_precision']}, micro batch {args.per_device_train_batch_size} x "
        f"{args.block_size} tokens, accumulation {args.gradient_accumulation_steps}, checkpointing "
        f"{mode}{', compiled' if compiled else ''}; device memory {memory / 1e9:.1f} GB per rank ({source})"
    )
    print(format_table(plans, header, memory, problems, time_source))
    if any(p.startswith("error:") for p in problems):
        sys.exit(1)


if __name__ == "__main__":
    main()
