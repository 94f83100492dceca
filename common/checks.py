"""Start-up checks of a launch: the accelerate config, DeepSpeed JSON, flags, model, data and
hardware, against each other. One line per problem; docs/startup_checks.md lists them and why.

`config_problems` takes plain values (the accelerate config as a dict in the YAML's keys, the
DeepSpeed JSON as a dict, the flags as a dict, the hardware facts) and runs each check whose
inputs are given. The recipes call it through `Startup`, once per stage; `tools/plan.py` calls it
on the YAMLs it plans.
"""

from __future__ import annotations

import json
import math
import os
from typing import NamedTuple

from common import errors, launch, models, precision
from common.errors import Stop

# DeepSpeed settings that `accelerate launch` takes as flags (or a YAML's deepspeed_config keys),
# the JSON key each fills, and DeepSpeed's value when the JSON lacks it. Accelerate 1.15 copies a
# flag into the JSON only where the key says "auto"; elsewhere the JSON wins, silently.
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


def launch_config_from_env(env=os.environ) -> dict:
    """The accelerate config this rank was launched with, in the YAML's keys, rebuilt from the
    variables `accelerate launch` sets (the ranks never see the YAML's path).

    Returns:
        {"distributed_type", "mixed_precision", "mixed_precision_forced" (given on the launch line,
        not by the YAML), "num_processes" (all ranks), "num_machines", and where set: "fsdp_config",
        "deepspeed_config", "dynamo_config", "parallelism_config", "dropped_launch_flags" (the
        DeepSpeed flags of a launch line that is not DeepSpeed, which Accelerate drops)}.
    """
    world = int(env.get("WORLD_SIZE", 1))
    config = {
        "mixed_precision": env.get("ACCELERATE_MIXED_PRECISION", "no"),
        "num_processes": world,
        "num_machines": max(1, world // int(env.get("LOCAL_WORLD_SIZE", world))),
    }
    # The launch line's --mixed_precision (or a hand-set variable, without accelerate launch) is a
    # demand; the YAML's is a default that follows the hardware (common/precision.py).
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
    # accelerate launch passes its dynamo settings in ACCELERATE_DYNAMO_*, except to DeepSpeed's
    # ranks: there we read what the launcher was asked for (config_problems refuses it).
    backend = env.get("ACCELERATE_DYNAMO_BACKEND") or (
        launcher_dynamo_backend() if config["distributed_type"] == "DEEPSPEED" else None
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
    """The flags of the `accelerate launch` that started this process (its parent's command line,
    Linux /proc; or `pid`'s), up to the training script: {"--flag": value}, "" for a bare switch;
    None when the parent is not `accelerate launch` or cannot be read."""
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


def launcher_dynamo_backend(pid: int | None = None) -> str | None:
    """The dynamo backend `accelerate launch` was asked for (`--dynamo_backend`, else its
    `--config_file`'s dynamo_config), or None. Accelerate 1.15 sets `ACCELERATE_DYNAMO_BACKEND`
    for every launcher but DeepSpeed's, so a DeepSpeed rank cannot learn it otherwise."""
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
    """(the DeepSpeed JSON of an accelerate config, relative paths from `root`, or its YAML keys in
    DeepSpeed's names; its name for messages). (None, "") off DeepSpeed.

    Raises:
        Stop: the JSON is missing or not JSON.
    """
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
    """This rank's {"device_type": "cuda" | "cpu", "capability": (major, minor) or None, "gpus"}:
    `gpus` counts the GPUs torch sees; a rank whose `LOCAL_RANK` has none reads device 0's
    capability, so that the process-count check can name the problem."""
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
    """The line if DeepSpeed's `gradient_clipping` differs from `--max_grad_norm` (the engine clips
    with its own), else None. "auto"/None agree; 0 and None both mean no clipping."""
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
    # Every YAML pins num_processes: 2: on an 8-GPU host six would sit idle, silently. A one-process
    # launch (distributed_type NO) asks for one device.
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


def launch_flag_problems(launch_ds: dict, ds: dict, ds_where: str, flags: dict):
    """The DeepSpeed flags of the launch line (`launch_ds`, the config's deepspeed_config) that the
    JSON `ds` would ignore, or that differ from the recipe's flags. Accelerate 1.15 copies
    `--zero_stage 3`, `--offload_optimizer_device cpu`, ... into the JSON only where its key is
    "auto", else drops it without a word (measured: --zero_stage 3 ran ZeRO-2); one that reaches
    DeepSpeed must still match the recipe's accumulation and clipping, which it counts and reports.
    """
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
    """A `parallelism_config` (HSDP, tensor parallel) that Accelerate would refuse with a
    traceback, that the recipe cannot train, or whose shard groups span machines."""
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
    """torch.compile that fails (regional compilation under FSDP1: a traceback in prepare) or that
    would not happen: accelerate launch (1.15) passes its dynamo settings to every launcher's
    processes but DeepSpeed's, which then train uncompiled. ACCELERATE_DYNAMO_BACKEND set in the
    launch's environment does reach them (measured: ZeRO-2 and -3 within 1.4e-7 of eager, fp32)."""
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
        warmup = flags.get("warmup_steps")
        if reference and global_batch > reference and (not flags.get("scale_lr") or not warmup):
            missing = "--scale_lr" if not flags.get("scale_lr") else "--warmup_steps"
            yield _warning(
                f"global batch {global_batch} > {reference} without {missing}: "
                f"--reference_global_batch {reference} is the batch --learning_rate was "
                f"tuned at, and this run's is {global_batch} {split}; expect slower or "
                "unstable training"
            )
    if steps and flags.get("warmup_steps") is not None and flags["warmup_steps"] >= steps:
        yield _warning(
            f"--warmup_steps {flags['warmup_steps']} >= the run's {steps} steps: the LR "
            "never reaches its peak (--learning_rate)"
        )


def _size(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.2f} MB"


def _zero3_problems(ds, where, n_params, ranks, mixed_precision, device_memory):
    """ZeRO-3 (`ds`) where a less sharded strategy sends less and its model states take at most
    half of `device_memory` (bytes per rank; the other half for activations, which tools/plan.py
    counts): ZeRO-2, or FSDP2 with fsdp_reshard_after_forward: false, which keeps the gathered
    parameters from forward to backward."""
    zero = ds.get("zero_optimization") or {}
    if int(zero.get("stage", 0)) != 3 or ranks < 2:
        return
    low, n = (4 if mixed_precision == "no" else 2), ranks
    g = DTYPE_BYTES.get(str((ds.get("data_types") or {}).get("grad_accum_dtype"))) or low
    c = DTYPE_BYTES.get(str(ds.get("communication_data_type"))) or low
    ar = 2 if zero.get("use_multi_rank_bucket_allreduce", True) else 1  # ZeRO-2 all-reduces
    # Bytes per parameter: the model states a rank holds (parameters, g-byte gradients, fp32 master
    # and Adam: the ZeRO paper's, in these configs' dtypes), and what it sends per step before a
    # ring's (N-1)/N share: the gradient reduction, then the parameter all-gathers (ZeRO-3: two).
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
    """Every problem of a launch that its inputs let us see, errors first; each check runs when its
    inputs are given.

    Args:
        config: the accelerate config in the YAML's keys (`num_processes`: all ranks).
        where: the config's name in messages (its path, or "the accelerate config").
        ds, ds_where: `deepspeed_settings(config)`; None off DeepSpeed.
        flags: the recipe's flags by name (those of `Startup.FLAGS` it has); `mixed_precision`
            overrides the config's (mixed_precision.py's --precision).
        hardware: `detect_hardware()`; None skips the hardware checks.
        model_classes: class names of the model's modules (fsdp_transformer_layer_cls_to_wrap).
        train_size, train_unit: the training set's size and what one sample is.
        steps: optimizer steps of the run (the warmup check).
        n_params, device_memory: parameters and bytes per rank (the ZeRO-3 check).
        compiles: the recipe supports torch.compile (eager key names in checkpoints and export).
        tensor_parallel: the recipe shards its model on the mesh's tp dimension (llama.py).
    """
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
            out += launch_flag_problems(launch_ds, ds, ds_where, flags)
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
    """A run's start-up checks, one call per stage. They check, and choose the precision; nothing
    else. Errors raise `Stop` with every error line at once; each warning prints once
    (`errors.warn`). Each stage adds what it learnt to the facts and runs `config_problems` again.

        guard = checks.Startup(args)  # the config, DeepSpeed JSON and flags vs the hardware
        accelerator = Accelerator(mixed_precision=guard.precision["used"], ...)
        guard.data_ready(train_size=..., steps=..., model_cls=..., model_config=...)
        guard.prepared(accelerator, model, model_cls, global_batch)

    Args:
        args: the parsed flags; those of `FLAGS` the recipe has are checked.
        precision_used: the precision the recipe chose itself (mixed_precision.py's --precision)
            instead of the launch config's, kept where the hardware computes it.
        facts: `check`'s, known at launch: compiles, tensor_parallel, steps, model_cls and
            model_config.

    Attributes:
        precision: {"requested", "used", "reason"} (`precision.for_launch`); "used" goes to the
            `Accelerator`.
    """

    FLAGS = (
        "per_device_train_batch_size",
        "gradient_accumulation_steps",
        "max_grad_norm",
        "warmup_steps",
        "reference_global_batch",
        "scale_lr",
        "block_size",
        "gradient_checkpointing",
        "packing",
    )

    def __init__(self, args, *, precision_used: str | None = None, **facts):
        self.config = launch_config_from_env()
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
                documents_kept_apart(model_cls)
            self.facts.update(_model_facts(self.config, self.ds, model_cls, model_config))
        problems = config_problems(self.config, **self.facts)
        for p in problems:
            if p.severity == "warning" and p.text not in self._warned:
                self._warned.add(p.text)
                errors.warn(p.text)
        if lines := [p.text for p in problems if p.severity == "error"]:
            raise Stop("\nerror: ".join(lines))

    def data_ready(self, **facts) -> None:
        """`check` once the data exists: the training set (`train_size`, `train_unit`) against one
        global batch, warmup against the run (`steps`), the model once its config exists
        (`model_cls`, `model_config`: its FSDP wrap class, ZeRO-3, --packing documents)."""
        self.check(**facts)

    def prepared(self, accelerator, model, model_cls, global_batch: int) -> dict:
        """After `accelerator.prepare`: every decoder block its own FSDP unit (else each rank gathers
        the whole model at once), and DeepSpeed stepping the recipe's global batch.

        Returns:
            {"fsdp_units": `models.fsdp_block_units` or None, "deepspeed": `launch.deepspeed_in_use`}.
        """
        units = (
            models.fsdp_block_units(model) if accelerator.distributed_type.value == "FSDP" else None
        )
        if units and units["units"] != units["blocks"]:
            raise Stop(
                f"FSDP made {units['units']} of the {units['blocks']} {units['block_class']} blocks their "
                f"own unit (the model's _no_split_modules is {model_cls._no_split_modules}); set "
                f"fsdp_transformer_layer_cls_to_wrap: {units['block_class']} in the accelerate config"
            )
        ds_used = launch.deepspeed_in_use(accelerator)
        if ds_used and ds_used["train_batch_size"] != global_batch:  # (causes refused earlier)
            raise Stop(
                f"DeepSpeed runs a batch of {ds_used['train_batch_size']} samples per step, the recipe "
                f"counts {global_batch}: {ds_used}"
            )
        return {"fsdp_units": units, "deepspeed": ds_used}


def model_class_names(model_cls, config) -> set[str]:
    """Class names of every module of `model_cls(config)`, built on the meta device (no memory)."""
    import torch

    with torch.device("meta"):
        return {type(m).__name__ for m in model_cls(config).modules()}


def _model_facts(config: dict, ds: dict | None, model_cls, model_config) -> dict:
    """The model's inputs of `config_problems`, where a check needs them: `model_classes` when the
    config names fsdp_transformer_layer_cls_to_wrap; under ZeRO-3, `n_params` (counted on the meta
    device) and `device_memory` (`detect_memory`)."""
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


def documents_kept_apart(model_cls) -> None:
    """Stop unless `model_cls` can train on --packing documents: the documents of a block are kept
    apart by the position ids alone (transformers' mask builder reads where they restart), and a
    model whose forward takes none, such as Bloom (ALiBi), would attend across them, silently."""
    import inspect

    if model_cls is None or "position_ids" in inspect.signature(model_cls.forward).parameters:
        return
    raise Stop(
        f"--packing documents keeps documents apart through position_ids, which {model_cls.__name__}'s "
        "forward does not take: its tokens would attend across documents. Use --packing none (a padded row "
        "each) or stream"
    )


def same_on_every_rank(accelerator, what: str, value: str) -> None:
    """Stop on every rank unless `value`, a short fingerprint (a digest) of `what`, is the same on
    every rank. A collective. For what each node reads from its own disk: a copy that differs from
    rank 0's would train on other samples, silently (measured on two loopback "machines": 1.0% off
    in loss after 4 steps)."""
    from accelerate.utils import gather_object

    values = gather_object([value])
    if len(set(values)) == 1:
        return
    differ = [r for r, v in enumerate(values) if v != values[0]]
    raise Stop(
        f"the {what} differs between ranks: rank(s) {', '.join(map(str, differ))} read another one than rank 0 "
        f"({values[differ[0]]} vs {values[0]}); every node must see the same files (a shared or identical path)"
    )


def mixed_precision_flags(args) -> None:
    """recipes/mixed_precision.py's flags that cannot mean what they say; with --compare, what the
    driver needs: plain `python`, an existing config, a resume by name."""
    if args.precision not in precision.MODES:
        raise Stop(f"--precision {args.precision!r}: choose one of {', '.join(precision.MODES)}")
    if args.model_config not in models.PRESETS:
        raise Stop(
            f"unknown --model_config {args.model_config!r}; choose one of {sorted(models.PRESETS)}"
        )
    for name in ("init_scale", "min_loss_scale"):
        if not getattr(args, name) > 0:
            raise Stop(f"--{name} must be positive, got {getattr(args, name)}")
    if args.init_scale < args.min_loss_scale:
        raise Stop(
            f"--init_scale {args.init_scale:g} is below --min_loss_scale {args.min_loss_scale:g}"
        )
    if not args.compare:
        return
    if "LOCAL_RANK" in os.environ:
        raise Stop(
            "run --compare with plain `python`, not `accelerate launch`: it launches each precision itself"
        )
    if not os.path.isfile(args.config_file):
        raise Stop(f"--config_file {args.config_file}: no such file")
    if args.resume_from_checkpoint not in (None, "latest", "auto"):
        raise Stop(
            "--compare resumes each precision from its own folder: pass --resume_from_checkpoint "
            "latest or auto"
        )


def classifier_flags(args) -> None:
    """recipes/ddp_classifier.py's model flags that BERT would refuse later."""
    if args.hidden_size % args.num_attention_heads:
        raise Stop(
            f"--hidden_size {args.hidden_size} is not a multiple of --num_attention_heads "
            f"{args.num_attention_heads}"
        )


def same_data(accelerator, lm_data) -> str:
    """Stop unless every rank has the same train and validation blocks (`data.pack_stats`' digests
    of what `data.pack_dataset` made). A collective. Each node reads --train_file from its own path,
    and another copy there would train on other samples. Returns the digest, for the checkpoints
    (a resume on other data is refused)."""
    from common import data

    digest = "-".join(
        data.pack_stats(lm_data)[split]["digest"] for split in ("train", "validation")
    )
    same_on_every_rank(
        accelerator, "data (train and validation text, tokenizer, block size, packing)", digest
    )
    return digest


def sharded_data_flags(args) -> None:
    """recipes/sharded_data.py's refusals of core flags: it counts steps only."""
    from common.args import unsupported

    unsupported(
        args,
        "sharded_data.py",
        num_train_epochs="each rank streams its own shards, whose "
        "epochs differ in length: give --max_steps",
    )
    if args.max_steps < 1:
        raise Stop(
            "sharded_data.py needs --max_steps: each rank streams its own shards, whose epochs "
            "differ in length, so --num_train_epochs cannot fix one step count for every rank"
        )


def stop_if_any_rank_fails(accelerator, check, *args, **kwargs):
    """`check(*args, **kwargs)`'s result, or a `Stop` on every rank if it raised FileNotFoundError
    or ValueError on any (the first such rank's line, `rank R: ...`). A collective: one rank's bad
    file stops every rank alike, instead of the others waiting for it in a collective."""
    from accelerate.utils import gather_object

    result, error = None, None
    try:
        result = check(*args, **kwargs)
    except (FileNotFoundError, ValueError) as err:  # (a library's as well as our own)
        error = f"rank {accelerator.process_index}: {err}"
    if error := next(filter(None, gather_object([error])), None):
        raise Stop(error)
    return result
