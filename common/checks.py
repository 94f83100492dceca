"""Start-up checks: the accelerate config, DeepSpeed JSON, flags, model, data and hardware against
each other, one line per problem (docs/startup_checks.md). `config_problems` takes plain dicts; the
recipes call it through `Startup`, `tools/plan.py` on the YAMLs it plans."""

from __future__ import annotations

import json
import math
import os
from typing import NamedTuple

from common import errors, models, precision, schedule
from common.errors import Stop

# `accelerate launch`'s DeepSpeed flags: the JSON key each fills, DeepSpeed's default. Accelerate
# 1.15 copies a flag into the JSON only where the key says "auto"; elsewhere the JSON wins, silently.
LAUNCH_DS_KEYS = {
    "gradient_accumulation_steps": ("gradient_accumulation_steps", 1),
    "gradient_clipping": ("gradient_clipping", 0.0),
    "zero_stage": ("zero_optimization.stage", 0),
    "offload_optimizer_device": ("zero_optimization.offload_optimizer.device", "none"),
    "offload_param_device": ("zero_optimization.offload_param.device", "none"),
    "offload_optimizer_nvme_path": ("zero_optimization.offload_optimizer.nvme_path", "none"),
    "offload_param_nvme_path": ("zero_optimization.offload_param.nvme_path", "none"),
    "zero3_save_16bit_model": (
        "zero_optimization.stage3_gather_16bit_weights_on_model_save",
        False,
    ),
}
# DeepSpeed batch keys and the flag each must equal (train_batch_size is the product).
BATCH_KEYS = {
    "train_micro_batch_size_per_gpu": "per_device_train_batch_size",
    "gradient_accumulation_steps": "gradient_accumulation_steps",
}
DTYPE_BYTES = {"fp32": 4, "float32": 4, "fp16": 2, "bf16": 2, "bfloat16": 2, "float16": 2}
MESH_DIMS = ("dp_replicate", "dp_shard", "tp", "cp", "sp")  # ParallelismConfig's, in mesh order


class Problem(NamedTuple):
    """One problem: `severity` "error" (the run stops) or "warning"; `text` one line."""

    severity: str
    text: str

    def __str__(self) -> str:
        return f"{self.severity}: {self.text}"


def _true(value) -> bool:
    return str(value).strip().lower() in ("1", "true", "yes", "on")


def _launch_config_from_env(env=os.environ) -> dict:
    """This rank's accelerate config in the YAML's keys, from what `accelerate launch` sets; plus
    "mixed_precision_forced" (the launch line's) and "dropped_launch_flags" (DeepSpeed's, off it)."""
    world = int(env.get("WORLD_SIZE", 1))
    config = {
        "mixed_precision": env.get("ACCELERATE_MIXED_PRECISION", "no"),
        "num_processes": world,
        "num_machines": max(1, world // int(env.get("LOCAL_WORLD_SIZE", world))),
    }
    # the launch line's --mixed_precision is a demand; the YAML's follows the hardware (precision.py)
    launcher = launcher_args()
    config["mixed_precision_forced"] = launcher is None or "--mixed_precision" in launcher
    if _true(env.get("ACCELERATE_USE_DEEPSPEED")):
        config["distributed_type"] = "DEEPSPEED"
        ds = {
            "deepspeed_config_file": env.get("ACCELERATE_DEEPSPEED_CONFIG_FILE"),
            "gradient_accumulation_steps": env.get("ACCELERATE_GRADIENT_ACCUMULATION_STEPS"),
            "gradient_clipping": env.get("ACCELERATE_GRADIENT_CLIPPING"),
            "zero_stage": env.get("ACCELERATE_DEEPSPEED_ZERO_STAGE"),
            # set only when given (the launch line, or the YAML without a JSON): "none" is a value
            **{
                key: env.get(f"ACCELERATE_DEEPSPEED_{key.upper()}")
                for key in LAUNCH_DS_KEYS
                if key.startswith(("offload_", "zero3_save"))
            },
        }
        config["deepspeed_config"] = {
            k: v
            for k, v in ds.items()
            if v is not None and (v != "none" or k.startswith("offload_"))
        }
    elif _true(env.get("ACCELERATE_USE_FSDP")):
        config["distributed_type"] = "FSDP"
        config["fsdp_config"] = {
            "fsdp_version": int(env.get("FSDP_VERSION", 1)),
            "fsdp_use_orig_params": _true(env.get("FSDP_USE_ORIG_PARAMS", "false")),
            "fsdp_offload_params": _true(env.get("FSDP_OFFLOAD_PARAMS", "false")),
            "fsdp_reshard_after_forward": env.get("FSDP_RESHARD_AFTER_FORWARD", "true"),
            "fsdp_cpu_ram_efficient_loading": _true(
                env.get("FSDP_CPU_RAM_EFFICIENT_LOADING", "false")
            ),
        }
        if wrap := env.get("FSDP_TRANSFORMER_CLS_TO_WRAP"):
            config["fsdp_config"]["fsdp_transformer_layer_cls_to_wrap"] = wrap
    else:
        config["distributed_type"] = "MULTI_GPU" if world > 1 else "NO"
    if _true(env.get("ACCELERATE_USE_PARALLELISM_CONFIG")):
        config["parallelism_config"] = {
            f"parallelism_config_{dim}_size": int(
                env.get(f"PARALLELISM_CONFIG_{dim.upper()}_SIZE", 1)
            )
            for dim in MESH_DIMS
        }
    if config["distributed_type"] != "DEEPSPEED":  # accelerate launch drops its DeepSpeed flags
        names = {f"--{key}" for key in (*LAUNCH_DS_KEYS, "zero3_init_flag")}
        if dropped := {k: v for k, v in (launcher or {}).items() if k in names}:
            config["dropped_launch_flags"] = dropped
    # DeepSpeed's ranks get no ACCELERATE_DYNAMO_*: read the launcher's (config_problems refuses it)
    backend = env.get("ACCELERATE_DYNAMO_BACKEND") or (
        _launcher_dynamo_backend() if config["distributed_type"] == "DEEPSPEED" else None
    )
    if backend and backend.upper() != "NO":
        config["dynamo_config"] = {
            "dynamo_backend": backend.upper(),
            "dynamo_use_regional_compilation": _true(
                env.get("ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION", "false")
            ),
        }
    return config


def launcher_args(pid: int | None = None) -> dict[str, str] | None:
    """{"--flag": value ("" for a switch)} of the `accelerate launch` that started this process (or
    `pid`), read from /proc up to the script; None if the parent is not `accelerate launch`."""
    try:
        with open(f"/proc/{pid or os.getppid()}/cmdline", "rb") as f:
            argv = f.read().decode(errors="replace").split("\0")
    except OSError:
        return None
    if not any("accelerate" in a for a in argv[:3]):
        return None
    flags = {}
    for i, arg in enumerate(argv):
        if arg.endswith(".py"):  # the training script: what follows is its own flags
            break
        if arg.startswith("--"):
            name, eq, value = arg.partition("=")
            nxt = argv[i + 1] if i + 1 < len(argv) else ""
            flags[name] = value if eq else ("" if nxt.startswith("--") else nxt)
    return flags


def _launcher_dynamo_backend(pid: int | None = None) -> str | None:
    """The launcher's `--dynamo_backend` (else its `--config_file`'s), or None: Accelerate 1.15 sets
    `ACCELERATE_DYNAMO_BACKEND` for every launcher but DeepSpeed's."""
    flags = launcher_args(pid) or {}
    backend = flags.get("--dynamo_backend")
    if backend is None and flags.get("--config_file"):
        try:
            import yaml

            with open(flags["--config_file"]) as f:
                backend = ((yaml.safe_load(f) or {}).get("dynamo_config") or {}).get(
                    "dynamo_backend"
                )
        except (OSError, ValueError, AttributeError):
            return None
    return None if backend is None or str(backend).upper() == "NO" else str(backend).upper()


def deepspeed_settings(config: dict, root: str = ".") -> tuple[dict | None, str]:
    """(the config's DeepSpeed JSON, read from `root`, or its YAML keys in DeepSpeed's names; its
    name for messages), (None, "") off DeepSpeed; Stop if the JSON cannot be read."""
    if config.get("distributed_type") != "DEEPSPEED":
        return None, ""
    yaml_ds = config.get("deepspeed_config") or {}
    path = yaml_ds.get("deepspeed_config_file")
    if not path:
        offload = {
            part: {"device": yaml_ds[f"{part}_device"]}
            for part in ("offload_optimizer", "offload_param")
            if f"{part}_device" in yaml_ds
        }
        keys = {
            "gradient_accumulation_steps": yaml_ds.get("gradient_accumulation_steps", "auto"),
            "gradient_clipping": yaml_ds.get("gradient_clipping", "auto"),
            "zero_optimization": {"stage": int(yaml_ds.get("zero_stage", 2)), **offload},
        }
        return keys, "the accelerate config's deepspeed_config"
    try:
        with open(os.path.join(root, path)) as f:
            return json.load(f), f"the DeepSpeed JSON {path}"
    except (OSError, ValueError) as err:
        raise Stop(
            f"DeepSpeed config {path} (deepspeed_config_file in the accelerate config) cannot be read "
            f"from {os.path.abspath(root)}: {' '.join(str(err).split())}; launch from the project root, "
            "and copy ds_configs/ with the recipe"
        ) from None


def detect_hardware() -> dict:
    """{"device_type": "cuda" | "cpu", "capability": (major, minor) | None, "gpus": torch's count}; a
    `LOCAL_RANK` past the GPUs reads device 0 (the process-count check names it)."""
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus and int(os.environ.get("LOCAL_RANK", 0)) >= gpus:
        return {
            "device_type": "cuda",
            "capability": torch.cuda.get_device_capability(0),
            "gpus": gpus,
        }
    device_type, capability = precision.detect_device()
    return {"device_type": device_type, "capability": capability, "gpus": gpus}


def detect_memory(ranks_per_machine: int) -> tuple[int, str]:
    """(bytes per rank, where from): the first GPU's memory, else host RAM / its ranks."""
    import torch

    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return props.total_memory, f"detected: {props.name}"
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return (
        ram // ranks_per_machine,
        f"no GPU: host RAM {ram / 1e9:.1f} GB shared by {ranks_per_machine} CPU ranks",
    )


def _error(text: str) -> Problem:
    return Problem("error", text)


def _warning(text: str) -> Problem:
    return Problem("warning", text)


def clipping_problem(ds_clip, max_grad_norm: float | None, where: str | None = None) -> str | None:
    """The line if DeepSpeed's `gradient_clipping` (which the engine uses) differs from
    `--max_grad_norm`, else None; "auto" agrees, 0 and None both mean no clipping."""
    if ds_clip in (None, "auto") or float(ds_clip) == float(max_grad_norm or 0):
        return None
    return (
        f"--max_grad_norm {max_grad_norm} differs from the DeepSpeed JSON's gradient_clipping {ds_clip}"
        f"{f' ({where})' if where else ''}; DeepSpeed does the clipping, so make them equal"
    )


def _hardware_problems(config, where, hardware, ranks, per_machine, mixed_precision):
    capability, gpus = hardware.get("capability"), int(hardware.get("gpus") or 0)
    if hardware.get("device_type") == "cuda" and capability is not None:
        cc = f"compute capability {capability[0]}.{capability[1]}"
        if mixed_precision == "bf16" and tuple(capability) < (8, 0):
            yield _error(
                f"mixed_precision bf16 (accelerate config or --mixed_precision): this GPU ({cc}) has "
                "no bf16 arithmetic, which needs 8.0+ (Ampere or newer); Accelerate would emulate "
                "it, several times slower. Launch with --mixed_precision fp16 (loss-scaled) or "
                "--mixed_precision no (recipes/mixed_precision.py: --precision fp16 or no)"
            )
        elif mixed_precision == "fp16" and tuple(capability) >= (8, 0):
            yield _warning(
                f"mixed_precision fp16 on a GPU with bf16 ({cc}): fp16 needs loss scaling and can "
                "still overflow; bf16 keeps fp32's range at the same speed. Use bf16 unless you "
                "must match an fp16 reference (--mixed_precision bf16 on the launch line; "
                "recipes/mixed_precision.py: --precision bf16)"
            )
    starts = f"num_processes {ranks} in {where} (or --num_processes) starts {per_machine} processes"
    if gpus and per_machine > gpus:
        yield _error(
            f"{starts} on this machine, but torch sees {gpus} GPU(s) "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); "
            "launch at most one process per GPU"
        )
    # the YAMLs pin num_processes: 2 (an 8-GPU host: six idle, silently); NO asks for one device
    multi = config.get("distributed_type") != "NO"
    if hardware.get("device_type") == "cuda" and per_machine < gpus and multi:
        visible = [v for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
        idle = [
            f"cuda:{i}" + (f" (device {visible[i]})" if len(visible) == gpus else "")
            for i in range(per_machine, gpus)
        ]
        machines = max(1, int(config.get("num_machines", 1)))
        yield _warning(
            f"{starts} on this machine, which has {gpus} GPUs: {len(idle)} stay idle: "
            f"{', '.join(idle)}; launch with --num_processes {gpus * machines} to use them all "
            "(or set CUDA_VISIBLE_DEVICES to the GPUs this job should have)"
        )


def _dropped_flag_problems(config: dict, flags: dict):
    for name, value in (config.get("dropped_launch_flags") or {}).items():
        accumulation = name == "--gradient_accumulation_steps"
        if accumulation and _same(value, flags.get("gradient_accumulation_steps")):
            continue  # the recipe accumulates as many anyway
        instead = (
            f"give {name} {value} to the recipe (after the script name)"
            if accumulation
            else "drop it, or launch a DeepSpeed config"
        )
        yield _error(
            f"accelerate launch {name} {value}: Accelerate passes it to DeepSpeed only, and "
            f"this launch is not DeepSpeed ({config.get('distributed_type')}), so it would "
            f"be ignored; {instead}"
        )


def _deepspeed_problems(ds: dict, where: str, flags: dict, ranks: int, mixed_precision: str):
    if all(flag in flags for flag in BATCH_KEYS.values()):
        micro, accumulation = (flags[f] for f in BATCH_KEYS.values())
        wanted = {
            "train_micro_batch_size_per_gpu": (micro, "--per_device_train_batch_size"),
            "gradient_accumulation_steps": (accumulation, "--gradient_accumulation_steps"),
            "train_batch_size": (
                micro * accumulation * ranks,
                f"the global batch ({micro} per device x "
                f"{accumulation} accumulation x {ranks} ranks)",
            ),
        }
        for key, (value, flag) in wanted.items():
            explicit = ds.get(key, "auto")
            if explicit not in ("auto", None) and int(explicit) != value:
                yield _error(
                    f"{where} sets {key}: {explicit}, but {flag} is {value}; set the key to "
                    '"auto" (it then follows the flags) or make them equal'
                )
    if "max_grad_norm" in flags and (
        line := clipping_problem(ds.get("gradient_clipping"), flags["max_grad_norm"], where)
    ):
        yield _error(line)
    for dtype in ("bf16", "fp16"):
        enabled = str((ds.get(dtype) or {}).get("enabled", "auto")).lower()
        if enabled in ("true", "false") and (enabled == "true") != (mixed_precision == dtype):
            state = "enables" if enabled == "true" else "disables"
            yield _error(
                f"the launch asks for mixed precision {mixed_precision}, but {where} {state} "
                f'{dtype} ({dtype}.enabled: {enabled}): its bf16/fp16 "enabled" keys win; '
                'set them to "auto" so the config\'s mixed_precision (or --mixed_precision) '
                "decides"
            )


def _same(a, b) -> bool:
    """Equal as DeepSpeed reads them: "3" == 3, "0.5" == 0.5, "true" == True, "CPU" == "cpu"."""

    def norm(v):
        text = str(v).strip().lower()
        try:
            return float(text)
        except ValueError:
            return {"true": 1.0, "false": 0.0}.get(text, text)

    return norm(a) == norm(b)


def _launch_flag_problems(launch_ds: dict, ds: dict, ds_where: str, flags: dict):
    """The launch line's DeepSpeed flags (`launch_ds`) that the JSON `ds` ignores (Accelerate 1.15
    copies them only into "auto" keys: --zero_stage 3 ran ZeRO-2), or that differ from the
    recipe's accumulation and clipping."""
    recipe_flags = {
        "gradient_accumulation_steps": "gradient_accumulation_steps",
        "gradient_clipping": "max_grad_norm",
    }
    for key, (json_key, default) in LAUNCH_DS_KEYS.items():
        if key not in launch_ds:
            continue
        value, in_json = launch_ds[key], ds
        for part in json_key.split("."):
            in_json = in_json.get(part) if isinstance(in_json, dict) else None
        flag = f"accelerate launch --{key} {value}"
        used = default if in_json is None else in_json
        if in_json != "auto" and not _same(value, used):
            how = (
                f"sets {json_key}: {json.dumps(in_json)}"
                if in_json is not None
                else f"has no {json_key} (DeepSpeed's default: {json.dumps(used)})"
            )
            yield _error(
                f"{flag} conflicts with {ds_where}, which {how} and wins (Accelerate "
                "ignores the flag next to a JSON); drop the flag, or launch with a JSON "
                "that says what you want"
            )
        recipe = recipe_flags.get(key)
        if in_json == "auto" and recipe in flags and not _same(value, flags[recipe] or 0):
            yield _error(
                f"{flag} differs from the recipe's --{recipe} {flags[recipe]}: DeepSpeed "
                f'would follow the launch flag ({ds_where} says "auto") while the recipe '
                "counts and reports its own; give the value to the recipe (after the script "
                "name) and drop the launch flag"
            )


def _fsdp_problems(fsdp: dict, where: str, hardware: dict | None, model_classes: set | None):
    if int(fsdp.get("fsdp_version", 1)) == 1 and not _true(fsdp.get("fsdp_use_orig_params", True)):
        yield _error(
            f"fsdp_use_orig_params: false in {where}: these recipes build the optimizer "
            "before accelerator.prepare, which FSDP1 supports only with "
            "fsdp_use_orig_params: true"
        )
    if hardware and _true(fsdp.get("fsdp_offload_params")) and hardware["device_type"] == "cpu":
        yield _error(
            f"fsdp_offload_params: true in {where} needs a GPU (it pins host memory); on a "
            "CPU-only host the parameters are in CPU memory already: set it to false"
        )
    wrap = fsdp.get("fsdp_transformer_layer_cls_to_wrap")
    if model_classes is not None and wrap:
        names = [wrap] if isinstance(wrap, str) else list(wrap)
        names = [n.strip() for name in names for n in name.split(",") if n.strip()]
        if missing := [n for n in names if n not in model_classes]:
            blocks = sorted(n for n in model_classes if n.endswith(("Layer", "Block")))
            yield _error(
                f"fsdp_transformer_layer_cls_to_wrap: {', '.join(missing)} in {where}, but the "
                f"model has no such module (its blocks: {', '.join(blocks) or 'none'}); name "
                "one of them, or delete the key to wrap the model's _no_split_modules"
            )


def _mesh_problems(config: dict, where: str, ranks: int, per_machine: int, tensor_parallel: bool):
    """A `parallelism_config` Accelerate refuses, the recipe cannot train, or split by machines."""
    mesh = config["parallelism_config"]
    sizes = {dim: int(mesh.get(f"parallelism_config_{dim}_size") or 1) for dim in MESH_DIMS}
    fsdp = config.get("fsdp_config") or {}
    fsdp2 = config.get("distributed_type") == "FSDP" and int(fsdp.get("fsdp_version") or 1) == 2
    tp = f"parallelism_config_tp_size {sizes['tp']} in {where}"
    other = [
        f"parallelism_config_{dim}_size {sizes[dim]}" for dim in ("cp", "sp") if sizes[dim] > 1
    ]
    if other:
        yield _error(
            f"{', '.join(other)} in {where}: the recipes shard the data-parallel dimensions "
            "(HSDP) and, in recipes/llama.py, tensor parallel; context and sequence parallel "
            "need the batch split along the sequence, which they do not do (docs/configs.md)"
        )
    elif sizes["tp"] > 1 and not tensor_parallel:
        yield _error(
            f"{tp}: this recipe builds its model whole; recipes/llama.py is the one that "
            "shards it for tensor parallel (docs/configs.md#tensor-parallel)"
        )
    elif sizes["tp"] > 1 and not fsdp2:
        yield _error(
            f"{tp} with distributed_type {config.get('distributed_type')}: tensor parallel "
            "runs under FSDP2 (fsdp_version: 2) only, as in accelerate_configs/tp.yaml"
        )
    elif sizes["tp"] > 1 and _true(fsdp.get("fsdp_cpu_ram_efficient_loading")):
        yield _error(
            f"{tp} with fsdp_cpu_ram_efficient_loading: true: Accelerate would broadcast "
            "rank 0's tensor-parallel slices to every rank; set it to false (tp.yaml)"
        )
    elif math.prod(sizes.values()) != ranks:
        shown = " x ".join(
            f"parallelism_config_{dim}_size {n}"
            for dim, n in sizes.items()
            if n > 1 or dim.startswith("dp")
        )
        yield _error(
            f"{shown} in {where} = {math.prod(sizes.values())} ranks, but the launch has "
            f"num_processes {ranks}: make the product the number of processes"
        )
    elif sizes["dp_shard"] == 1:
        alone = (
            "; for tensor parallel, leave FSDP dp_shard ranks (tp.yaml: dp_shard 2 x tp 2)"
            if sizes["tp"] > 1
            else "; for replicas alone use accelerate_configs/ddp.yaml"
        )
        yield _error(
            f"parallelism_config_dp_shard_size 1 in {where}: FSDP has nothing to shard "
            f"across{alone}"
        )
    elif per_machine % sizes["dp_shard"] and sizes["dp_replicate"] > 1:
        yield _warning(
            f"parallelism_config_dp_shard_size {sizes['dp_shard']} in {where} with "
            f"{per_machine} processes per machine: shard groups span machines, so every "
            "step's all-gathers cross the network, which HSDP is meant to avoid; make "
            "dp_shard_size the processes per machine (or a divisor of it)"
        )


def _dynamo_problems(config: dict, where: str, compiles: bool):
    """torch.compile that fails (regional under FSDP1) or would not happen (Accelerate 1.15 passes
    DeepSpeed's ranks no dynamo settings; an ACCELERATE_DYNAMO_BACKEND in the environment does)."""
    dynamo = config.get("dynamo_config") or {}
    backend = str(dynamo.get("dynamo_backend") or "NO").upper()
    asked = f"dynamo backend {backend.lower()} (--dynamo_backend or dynamo_config in {where})"
    fsdp1 = int((config.get("fsdp_config") or {}).get("fsdp_version", 1)) == 1
    if backend == "NO":
        return
    if not compiles:  # the compile wrapper renames every state-dict key ("_orig_mod.")
        yield _error(
            f"{asked}: this recipe does not support torch.compile (its checkpoints and export "
            "would carry the compile wrapper's '_orig_mod.' key names); recipes/llama.py does, "
            "or drop the setting"
        )
    elif (
        config.get("distributed_type") == "FSDP"
        and fsdp1
        and _true(dynamo.get("dynamo_use_regional_compilation"))
    ):
        yield _error(
            f"regional compilation (--dynamo_use_regional_compilation or dynamo_config in {where}) "
            "under FSDP1: Accelerate 1.15's compile_regions fails in prepare on FSDP1's wrapped "
            "blocks (AttributeError: no attribute '_fsdp_wrapped_module'); compile the whole model "
            "(drop the flag) or use FSDP2 (accelerate_configs/fsdp.yaml)"
        )
    elif (
        config.get("distributed_type") == "DEEPSPEED"
        and os.environ.get("ACCELERATE_DYNAMO_BACKEND", "NO").upper() != backend
    ):
        yield _error(
            f"{asked} under DeepSpeed: accelerate launch does not pass it to DeepSpeed's "
            "processes, which would train uncompiled; run "
            f"`ACCELERATE_DYNAMO_BACKEND={backend} accelerate launch ...` instead (the "
            "environment reaches them), or drop the setting"
        )


def _batch_problems(config, flags, ranks, train_size, train_unit, steps):
    batch_flags = ("per_device_train_batch_size", "gradient_accumulation_steps")
    if all(f in flags for f in batch_flags):
        micro, accumulation = (flags[f] for f in batch_flags)
        mesh = config.get("parallelism_config") or {}
        shared = math.prod(
            int(mesh.get(f"parallelism_config_{dim}_size") or 1) for dim in ("tp", "cp", "sp")
        )
        data_ranks = max(1, ranks // shared)  # the ranks of a tensor-parallel group share one batch
        global_batch = micro * accumulation * data_ranks
        split = f"(= {micro} per device x {accumulation} accumulation x {data_ranks} " + (
            "ranks)" if shared == 1 else f"data-parallel ranks of {ranks})"
        )
        if train_size is not None and train_size < global_batch:
            yield _error(
                f"the training split has {train_size} {train_unit}, fewer than one global "
                f"batch of {global_batch} {split}"
            )
        reference = flags.get("reference_global_batch")
        warmup = flags.get("warmup_steps") or flags.get("warmup_ratio")
        if reference and global_batch > reference and (not flags.get("scale_lr") or not warmup):
            missing = "--scale_lr" if not flags.get("scale_lr") else "--warmup_steps"
            yield _warning(
                f"global batch {global_batch} > {reference} without {missing}: "
                f"--reference_global_batch {reference} is the batch --learning_rate was "
                f"tuned at, and this run's is {global_batch} {split}; expect slower or "
                "unstable training"
            )
    warmup = steps and schedule.warmup_count(
        flags.get("warmup_steps", 0), flags.get("warmup_ratio", 0), steps
    )  # in steps
    if steps and warmup >= steps:
        yield _warning(
            f"--warmup_steps {warmup} >= the run's {steps} steps: the LR "
            "never reaches its peak (--learning_rate)"
        )


def _size(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.2f} MB"


def _zero3_problems(ds, where, n_params, ranks, mixed_precision, device_memory):
    """ZeRO-3 where ZeRO-2, or FSDP2 without resharding after forward, sends less and its model
    states take at most half of `device_memory` (bytes per rank)."""
    zero = ds.get("zero_optimization") or {}
    if int(zero.get("stage", 0)) != 3 or ranks < 2:
        return
    low, n = (4 if mixed_precision == "no" else 2), ranks
    g = DTYPE_BYTES.get(str((ds.get("data_types") or {}).get("grad_accum_dtype"))) or low
    c = DTYPE_BYTES.get(str(ds.get("communication_data_type"))) or low
    ar = 2 if zero.get("use_multi_rank_bucket_allreduce", True) else 1  # ZeRO-2 all-reduces
    # bytes per parameter: (model states held, as the ZeRO paper counts them; sent per step before
    # a ring's (N-1)/N share: gradient reduction, parameter all-gathers)
    per_param = {
        "ZeRO-2": (low + (g + 12) / n, ar * c + low),
        "FSDP2 with fsdp_reshard_after_forward: false": (16 / n + low * (1 - 1 / n), 4 + low),
    }
    ring = n_params * (n - 1) / n
    sends = ring * (c + 2 * low)  # ZeRO-3's
    better = [
        f"{name} would hold {_size(n_params * s)} of model states and send {_size(ring * b)}"
        for name, (s, b) in per_param.items()
        if n_params * s <= device_memory / 2 and ring * b < sends
    ]
    if better:
        yield _warning(
            f"ZeRO-3 (zero_optimization.stage: 3 in {where}) sends {_size(sends)} per rank and "
            f"step, but {'; '.join(better)} (at most half of {_size(device_memory)} per rank); "
            "prefer that unless you measured otherwise (python tools/plan.py counts activations "
            "and predicts tokens/s; benchmarks/compare_strategies.py measures)"
        )


def config_problems(
    config: dict,
    *,
    where: str = "the accelerate config",
    ds: dict | None = None,
    ds_where: str = "the DeepSpeed JSON",
    flags: dict | None = None,
    hardware: dict | None = None,
    model_classes: set | None = None,
    train_size: int | None = None,
    train_unit: str = "samples",
    steps: int | None = None,
    n_params: int | None = None,
    device_memory: int | None = None,
    compiles: bool = False,
    tensor_parallel: bool = False,
) -> list[Problem]:
    """Every problem its inputs show, errors first; a check runs when its inputs are given.
    `config`: the YAML's keys; `ds, ds_where`: `deepspeed_settings`; `flags`: `Startup.FLAGS`'
    (their `mixed_precision` wins); `n_params`, `device_memory`: bytes per rank."""
    flags = flags or {}
    ranks = int(config.get("num_processes", 1))
    per_machine = ranks // max(1, int(config.get("num_machines", 1)))
    mixed_precision = str(flags.get("mixed_precision") or config.get("mixed_precision") or "no")
    out: list[Problem] = []
    if hardware is not None:
        out += _hardware_problems(config, where, hardware, ranks, per_machine, mixed_precision)
    out += _dropped_flag_problems(config, flags)
    if ds is not None:
        out += _deepspeed_problems(ds, ds_where, flags, ranks, mixed_precision)
        if (launch_ds := config.get("deepspeed_config") or {}).get("deepspeed_config_file"):
            out += _launch_flag_problems(launch_ds, ds, ds_where, flags)
    out += _dynamo_problems(config, where, compiles)
    if config.get("distributed_type") == "FSDP":
        out += _fsdp_problems(config.get("fsdp_config") or {}, where, hardware, model_classes)
    if config.get("parallelism_config"):
        out += _mesh_problems(config, where, ranks, per_machine, tensor_parallel)
    out += _batch_problems(config, flags, ranks, train_size, train_unit, steps)
    if n_params and device_memory and ds is not None:
        out += _zero3_problems(ds, ds_where, n_params, ranks, mixed_precision, device_memory)
    return sorted(out, key=lambda p: p.severity != "error")


class Startup:
    """A run's start-up checks, one call per stage, each adding facts and running `config_problems`
    again: errors raise one `Stop`, each warning prints once. `precision`: `for_launch`'s, or the
    recipe's `precision_used`."""

    FLAGS = (
        "per_device_train_batch_size",
        "gradient_accumulation_steps",
        "max_grad_norm",
        "warmup_steps",
        "warmup_ratio",
        "reference_global_batch",
        "scale_lr",
        "block_size",
        "gradient_checkpointing",
        "packing",
    )

    def __init__(self, args, *, precision_used: str | None = None, **facts):
        self.config = _launch_config_from_env()
        hardware = detect_hardware()
        self.precision = (
            precision.for_launch(self.config, hardware)
            if precision_used is None
            else dict(requested=precision_used, used=precision_used, reason="--precision")
        )
        flags = {k: getattr(args, k) for k in self.FLAGS if hasattr(args, k)}
        flags["mixed_precision"] = self.precision["used"]
        self.ds, ds_where = deepspeed_settings(self.config)
        self.facts = dict(ds=self.ds, ds_where=ds_where, flags=flags, hardware=hardware)
        self._warned: set[str] = set()
        self.check(**facts)

    def check(self, *, model_cls=None, model_config=None, **facts) -> None:
        """Add `facts` (config_problems' keywords), then stop on any error; warn of each new warning."""
        self.facts.update({k: v for k, v in facts.items() if v is not None})
        if model_cls is not None:
            if self.facts["flags"].get("packing") == "documents":
                _documents_kept_apart(model_cls)
            self.facts.update(_model_facts(self.config, self.ds, model_cls, model_config))
        problems = config_problems(self.config, **self.facts)
        for p in problems:
            if p.severity == "warning" and p.text not in self._warned:
                self._warned.add(p.text)
                errors.warn(p.text)
        if lines := [p.text for p in problems if p.severity == "error"]:
            raise Stop("\nerror: ".join(lines))

    def data_ready(self, **facts) -> None:
        """`check` once the data and the model config exist (`train_size`, `steps`, `model_cls`...)."""
        self.check(**facts)

    def prepared(self, accelerator, model, model_cls, global_batch: int) -> dict:
        """After `prepare`: each decoder block its own FSDP unit (else every rank gathers the whole
        model at once), DeepSpeed stepping the recipe's global batch. Returns {"fsdp_units",
        "deepspeed"} for run_info."""
        units = _fsdp_block_units(model) if accelerator.distributed_type.value == "FSDP" else None
        if units and units["units"] != units["blocks"]:
            raise Stop(
                f"FSDP made {units['units']} of the {units['blocks']} {units['block_class']} blocks their "
                f"own unit (the model's _no_split_modules is {model_cls._no_split_modules}); set "
                f"fsdp_transformer_layer_cls_to_wrap: {units['block_class']} in the accelerate config"
            )
        ds_used = _deepspeed_in_use(accelerator)
        if ds_used and ds_used["train_batch_size"] != global_batch:  # (causes refused earlier)
            raise Stop(
                f"DeepSpeed runs a batch of {ds_used['train_batch_size']} samples per step, the recipe "
                f"counts {global_batch}: {ds_used}"
            )
        return {"fsdp_units": units, "deepspeed": ds_used}


def _fsdp_block_units(model) -> dict:
    """{"block_class", "blocks": n, "units": k}: k of n decoder blocks are FSDP units."""
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    blocks = models.decoder_blocks(model)
    if blocks is None:
        return {"block_class": None, "blocks": 0, "units": 0}
    inner = getattr(blocks[0], "_fsdp_wrapped_module", blocks[0])  # FSDP1 wrapper -> the block
    name = type(inner).__name__
    name = name.removeprefix("FSDP") if isinstance(inner, FSDPModule) else name
    units = sum(isinstance(b, (FSDPModule, FullyShardedDataParallel)) for b in blocks)
    return {"block_class": name, "blocks": len(blocks), "units": units}


def _deepspeed_in_use(accelerator) -> dict | None:
    """What DeepSpeed runs with after `prepare` ("auto" keys filled), None off DeepSpeed."""
    if accelerator.distributed_type.value != "DEEPSPEED":
        return None
    ds = accelerator.state.deepspeed_plugin.deepspeed_config
    zero = ds.get("zero_optimization") or {}
    keys = ("gradient_accumulation_steps", "train_batch_size", "gradient_clipping")
    return {
        "zero_stage": zero.get("stage", 0),
        "offload_optimizer_device": (zero.get("offload_optimizer") or {}).get("device", "none"),
        "offload_param_device": (zero.get("offload_param") or {}).get("device", "none"),
        **{key: ds.get(key) for key in keys},
    }


def model_class_names(model_cls, config) -> set[str]:
    """Class names of every module of `model_cls(config)`, built on the meta device (no memory)."""
    import torch

    with torch.device("meta"):
        return {type(m).__name__ for m in model_cls(config).modules()}


def _model_facts(config: dict, ds: dict | None, model_cls, model_config) -> dict:
    """`config_problems`' model inputs: `model_classes`; ZeRO-3: `n_params`, `device_memory`."""
    facts = {}
    if (config.get("fsdp_config") or {}).get("fsdp_transformer_layer_cls_to_wrap"):
        facts["model_classes"] = model_class_names(model_cls, model_config)
    if ds is not None and int((ds.get("zero_optimization") or {}).get("stage", 0)) == 3:
        import torch

        with torch.device("meta"):
            facts["n_params"] = sum(p.numel() for p in model_cls(model_config).parameters())
        per_machine = int(config.get("num_processes", 1)) // max(
            1, int(config.get("num_machines", 1))
        )
        facts["device_memory"] = detect_memory(per_machine)[0]
    return facts


def _documents_kept_apart(model_cls) -> None:
    """Stop unless `model_cls`'s forward takes position_ids, which alone keep --packing documents
    apart: Bloom (ALiBi) would attend across them, silently."""
    import inspect

    if model_cls is None or "position_ids" in inspect.signature(model_cls.forward).parameters:
        return
    raise Stop(
        f"--packing documents keeps documents apart through position_ids, which {model_cls.__name__}'s "
        "forward does not take: its tokens would attend across documents. Use --packing none (a padded row "
        "each) or stream"
    )


def same_on_every_rank(accelerator, what: str, value: str) -> None:
    """Stop on every rank unless `value`, a digest of `what`, is the same on every rank (a
    collective): a node's own copy that differs would train on other samples, silently."""
    from accelerate.utils import gather_object

    values = gather_object([value])
    if len(set(values)) == 1:
        return
    differ = [r for r, v in enumerate(values) if v != values[0]]
    raise Stop(
        f"the {what} differs between ranks: rank(s) {', '.join(map(str, differ))} read another one than rank 0 "
        f"({values[differ[0]]} vs {values[0]}); every node must see the same files (a shared or identical path)"
    )


def sharded_data_flags(args) -> None:
    """recipes/sharded_data.py counts steps only (its `--num_train_epochs` refusal: `parse_args`)."""
    if args.max_steps < 1:
        raise Stop(
            "sharded_data.py needs --max_steps: each rank streams its own shards, whose epochs "
            "differ in length, so --num_train_epochs cannot fix one step count for every rank"
        )


def stop_if_any_rank_fails(accelerator, check, *args, **kwargs):
    """`check(*args, **kwargs)`, or a `Stop` on every rank ("rank R: ...") if it raised
    FileNotFoundError or ValueError on any (a collective): no rank waits for one that left."""
    from accelerate.utils import gather_object

    result, error = None, None
    try:
        result = check(*args, **kwargs)
    except (FileNotFoundError, ValueError) as err:  # (a library's as well as our own)
        error = f"rank {accelerator.process_index}: {err}"
    if error := next(filter(None, gather_object([error])), None):
        raise Stop(error)
    return result
