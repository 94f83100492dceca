"""Start-up checks of a launch (accelerate config, DeepSpeed JSON, flags, model, data, hardware): one line per problem.

One function, `config_problems`, used by every recipe and by the planner (`tools/plan.py`). Its
inputs are plain values: the accelerate config as a dict in the YAML's keys (the planner reads the
YAML; a recipe rebuilds it from what `accelerate launch` put in its environment,
`launch_config_from_env`), the DeepSpeed JSON as a dict, the flags as a dict, and the hardware
facts. Each check runs when its inputs are given, so a recipe calls it as soon as the launch is
known (before the Accelerator) and again once the data and the model config exist: `Startup`,
one call per stage, prints each warning once and stops with every error line.

| check                                                  | severity | why                                     |
|--------------------------------------------------------|----------|-----------------------------------------|
| DeepSpeed JSON batch keys vs the batch flags           | error    | Accelerate adopts the JSON's: other     |
|                                                        |          | steps and schedule than the flags say   |
| `accelerate launch` DeepSpeed flags (--zero_stage,     | error    | a JSON's own value wins silently; one   |
|   --offload_*, --gradient_accumulation_steps, ...) vs  |          |   that reaches DeepSpeed must match the |
|   the JSON, the recipe's flags, a non-DeepSpeed launch |          |   recipe's; elsewhere Accelerate drops it|
| `gradient_clipping` vs `--max_grad_norm`               | error    | the engine clips with the JSON's        |
| the JSON's explicit `bf16`/`fp16` block vs the launch's| error    | the JSON's wins (or Accelerate raises)  |
| bf16 on a GPU below compute capability 8.0             | error    | emulated, several times slower          |
| fp16 on a GPU with bf16                                | warning  | loss scaling and overflow for nothing   |
| FSDP1 with `fsdp_use_orig_params: false`               | error    | the optimizer steps unused tensors      |
| `fsdp_offload_params: true` on a CPU-only host         | error    | pinning host memory needs a GPU         |
| `fsdp_transformer_layer_cls_to_wrap` not in the model  | error    | Accelerate fails deep in `prepare`      |
| more processes per machine than visible GPUs           | error    | a rank without a device                 |
| fewer processes per machine than visible GPUs          | warning  | the other GPUs stay idle (multi-process |
|                                                        |          |   launches: every YAML pins 2)          |
| a global batch larger than the training set            | error    | not one optimizer step                  |
| warmup not shorter than the run                        | warning  | the LR never reaches its peak           |
| global batch far above `--reference_global_batch`      | warning  | slower or unstable training             |
|   without `--scale_lr` or warmup                       |          |                                         |
| ZeRO-3 where the plan fits ZeRO-2 or FSDP without      | warning  | 1.5x the communication for no memory    |
|   resharding, with less communication                  |          |   that the run needs                    |
| a dynamo backend (torch.compile) under DeepSpeed that  | error    | the ranks train uncompiled: accelerate  |
|   is not in the ranks' environment                     |          |   launch drops it for DeepSpeed (1.15)  |
| regional compilation under FSDP1                       | error    | Accelerate's compile_regions fails in   |
|                                                        |          |   prepare on FSDP1's wrapped blocks     |
| `parallelism_config` sizes whose product is not the    | error    | Accelerate raises in its constructor    |
|   ranks, or dp_shard_size 1                            |          |   (a traceback)                         |
| `parallelism_config_cp_size` or `_sp_size` above 1     | error    | no sequence split of the batch          |
| `parallelism_config_tp_size` above 1 outside llama.py, | error    | the model is built whole, or Accelerate |
|   off FSDP2, or with `fsdp_cpu_ram_efficient_loading` |          |   would broadcast rank 0's TP slices    |
| HSDP shard groups that span machines                   | warning  | all-gathers cross the network           |
"""

from __future__ import annotations

import json
import math
import os
from typing import NamedTuple

from common import launch, models, precision, run_dir
from common.errors import Stop

# DeepSpeed settings that `accelerate launch` takes as flags (or an accelerate config's deepspeed_config
# keys, which Accelerate refuses next to a JSON), the JSON key each one fills, and DeepSpeed's value
# when the JSON lacks it. Accelerate 1.15 (DeepSpeedPlugin.__post_init__) copies a flag into the
# JSON only where the key says "auto"; elsewhere the JSON wins, silently.
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


class Problem(NamedTuple):
    """One problem: `severity` "error" (the run stops) or "warning" (printed once); `text` one line."""

    severity: str
    text: str

    def __str__(self) -> str:
        return f"{self.severity}: {self.text}"


def _true(value) -> bool:
    return str(value).strip().lower() in ("1", "true", "yes", "on")


MESH_DIMS = ("dp_replicate", "dp_shard", "tp", "cp", "sp")  # ParallelismConfig's, in its mesh order


def launch_config_from_env(env=os.environ) -> dict:
    """The accelerate config this rank was launched with, in the YAML's keys, from `accelerate launch`'s variables.

    Returns:
        {"distributed_type": "NO" | "MULTI_GPU" | "FSDP" | "DEEPSPEED", "mixed_precision",
        "mixed_precision_forced" (True when the precision was given on the launch line, not the YAML),
        "num_processes" (all ranks, Accelerate's meaning), "num_machines", "fsdp_config" (fsdp_version,
        fsdp_use_orig_params, fsdp_offload_params, fsdp_transformer_layer_cls_to_wrap,
        fsdp_reshard_after_forward, fsdp_cpu_ram_efficient_loading), "deepspeed_config" (deepspeed_config_file,
        or the YAML's own gradient_accumulation_steps / gradient_clipping / zero_stage), "dynamo_config"
        ({"dynamo_backend": "INDUCTOR"} when torch.compile was asked for; under DeepSpeed from
        `launcher_dynamo_backend`),
        "parallelism_config" ({"parallelism_config_dp_shard_size": 2, ...}: the mesh of HSDP, tensor
        parallel), "dropped_launch_flags" ({"--zero_stage": "3", ...}: DeepSpeed flags of the `accelerate launch` line
        of a launch that is not DeepSpeed, which Accelerate drops)}; absent values are left out.
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
            # set only when given (the launch line, or the YAML without a JSON): "none" is a value here
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
            "fsdp_use_orig_params": _true(
                env.get("FSDP_USE_ORIG_PARAMS", "false")
            ),  # Accelerate's default
            "fsdp_offload_params": _true(env.get("FSDP_OFFLOAD_PARAMS", "false")),
            "fsdp_reshard_after_forward": env.get("FSDP_RESHARD_AFTER_FORWARD", "true"),
            "fsdp_cpu_ram_efficient_loading": _true(
                env.get("FSDP_CPU_RAM_EFFICIENT_LOADING", "false")
            ),
            **(
                {"fsdp_transformer_layer_cls_to_wrap": env["FSDP_TRANSFORMER_CLS_TO_WRAP"]}
                if env.get("FSDP_TRANSFORMER_CLS_TO_WRAP")
                else {}
            ),
        }
    else:
        config["distributed_type"] = "MULTI_GPU" if world > 1 else "NO"
    if _true(
        env.get("ACCELERATE_USE_PARALLELISM_CONFIG")
    ):  # the YAML's parallelism_config (or its launch flags)
        config["parallelism_config"] = {
            f"parallelism_config_{dim}_size": int(
                env.get(f"PARALLELISM_CONFIG_{dim.upper()}_SIZE", 1)
            )
            for dim in MESH_DIMS
        }
    if (
        config["distributed_type"] != "DEEPSPEED"
    ):  # accelerate launch drops its DeepSpeed flags here
        names = {f"--{key}" for key in (*LAUNCH_DS_KEYS, "zero3_init_flag")}
        if dropped := {k: v for k, v in (launcher or {}).items() if k in names}:
            config["dropped_launch_flags"] = dropped
    # torch.compile: accelerate launch passes its dynamo settings in ACCELERATE_DYNAMO_*, except to
    # DeepSpeed ranks; there we read what the launcher was asked for (config_problems refuses it).
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
    """The flags of the `accelerate launch` process that started this one, up to the training script.

    Reads the parent's command line (Linux /proc; `pid` overrides the parent). A rank learns from it
    what `accelerate launch` does not pass on, or passes on mixed with the config file's values.

    Returns:
        {"--flag": value} for each `--flag value` / `--flag=value` (a bare switch maps to ""), or
        None when the parent is not `accelerate launch` or cannot be read.
    """
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
    """The dynamo backend that the `accelerate launch` process which started this one was asked for, or None.

    `--dynamo_backend X` on its command line, else the `dynamo_config: {dynamo_backend: X}` of its
    `--config_file`. Accelerate 1.15 sets `ACCELERATE_DYNAMO_BACKEND` for every launcher but
    DeepSpeed's, so a DeepSpeed rank cannot learn it otherwise. None when unreadable, not asked for, or "no".
    """
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
    """The DeepSpeed settings of an accelerate config: its JSON (relative paths from `root`), else the YAML's keys.

    Returns:
        (the JSON as a dict, or the YAML's `deepspeed_config` keys in DeepSpeed's names; None off
        DeepSpeed, where): `where` names the source for messages ("the DeepSpeed JSON PATH").

    Raises:
        ValueError: the JSON is missing or not JSON (one line, naming it).
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
    """This rank's hardware: {"device_type": "cuda" | "cpu", "capability": (major, minor) or None, "gpus": int}.

    `gpus` counts the GPUs torch sees (0 without CUDA); a rank whose `LOCAL_RANK` has no GPU reads
    device 0's capability, so that the process-count check can name the problem.
    """
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


def clipping_problem(ds_clip, max_grad_norm: float | None, where: str | None = None) -> str | None:
    """A line if DeepSpeed's `gradient_clipping` differs from `--max_grad_norm` (the engine clips with its own).

    `"auto"`/None agree (Accelerate fills the flag in); 0 and None both mean no clipping.
    """
    if ds_clip in (None, "auto") or float(ds_clip) == float(max_grad_norm or 0):
        return None
    return (
        f"--max_grad_norm {max_grad_norm} differs from the DeepSpeed JSON's gradient_clipping {ds_clip}"
        f"{f' ({where})' if where else ''}; DeepSpeed does the clipping, so make them equal"
    )


def _deepspeed_problems(
    ds: dict, where: str, flags: dict, ranks: int, mixed_precision: str
) -> list[Problem]:
    out = []
    if all(flag in flags for flag in BATCH_KEYS.values()):
        micro, accumulation = (
            flags["per_device_train_batch_size"],
            flags["gradient_accumulation_steps"],
        )
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
                out.append(
                    Problem(
                        "error",
                        f"{where} sets {key}: {explicit}, but {flag} is {value}; set the key to "
                        '"auto" (it then follows the flags) or make them equal',
                    )
                )
    if "max_grad_norm" in flags and (
        line := clipping_problem(ds.get("gradient_clipping"), flags["max_grad_norm"], where)
    ):
        out.append(Problem("error", line))
    for dtype in ("bf16", "fp16"):
        enabled = str((ds.get(dtype) or {}).get("enabled", "auto")).lower()
        if enabled in ("true", "false") and (enabled == "true") != (mixed_precision == dtype):
            state = "enables" if enabled == "true" else "disables"
            out.append(
                Problem(
                    "error",
                    f"the launch asks for mixed precision {mixed_precision}, but {where} {state} "
                    f'{dtype} ({dtype}.enabled: {enabled}): its bf16/fp16 "enabled" keys win; '
                    'set them to "auto" so the config\'s mixed_precision (or --mixed_precision) '
                    "decides",
                )
            )
    return out


def _json_value(ds: dict, dotted: str):
    """The value at a dotted key path of a DeepSpeed JSON ("zero_optimization.stage"), None where absent."""
    for key in dotted.split("."):
        ds = ds.get(key) if isinstance(ds, dict) else None
    return ds


def _same(a, b) -> bool:
    """Setting values equal as DeepSpeed reads them: "3" == 3, "0.5" == 0.5, "true" == True, "CPU" == "cpu"."""

    def norm(v):
        text = str(v).strip().lower()
        try:
            return float(text)
        except ValueError:
            return {"true": 1.0, "false": 0.0}.get(text, text)

    return norm(a) == norm(b)


def launch_flag_problems(launch_ds: dict, ds: dict, ds_where: str, flags: dict) -> list[Problem]:
    """The DeepSpeed settings of the launch line (`launch_ds`: the accelerate config's deepspeed_config,
    as `launch_config_from_env` reads it) that a DeepSpeed JSON (`ds`) would ignore, or that change
    what the recipe's flags say, each one line.

    Accelerate 1.15 copies `accelerate launch --zero_stage 3`, `--offload_optimizer_device cpu`,
    `--gradient_accumulation_steps 4`, ... into the JSON only where its key is "auto"; where the
    JSON has a value, or lacks the key, the flag is dropped without a word (measured: --zero_stage 3
    ran ZeRO-2, --offload_optimizer_device cpu ran without offload). Where a flag does reach
    DeepSpeed, accumulation and clipping must still be the recipe's own (--gradient_accumulation_steps,
    --max_grad_norm), or DeepSpeed steps on another schedule than the one the recipe counts and reports.
    """
    out = []
    for key, (json_key, default) in LAUNCH_DS_KEYS.items():
        if key not in launch_ds:
            continue
        value, in_json = launch_ds[key], _json_value(ds, json_key)
        flag = f"accelerate launch --{key} {value}"
        if in_json != "auto":
            used = default if in_json is None else in_json
            if not _same(value, used):
                how = (
                    f"sets {json_key}: {json.dumps(in_json)}"
                    if in_json is not None
                    else f"has no {json_key} (DeepSpeed's default: {json.dumps(used)})"
                )
                out.append(
                    Problem(
                        "error",
                        f"{flag} conflicts with {ds_where}, which {how} and wins (Accelerate "
                        "ignores the flag next to a JSON); drop the flag, or launch with a JSON "
                        "that says what you want",
                    )
                )
            continue
        recipe = {
            "gradient_accumulation_steps": "gradient_accumulation_steps",
            "gradient_clipping": "max_grad_norm",
        }.get(key)
        if recipe in flags and not _same(value, flags[recipe] or 0):
            out.append(
                Problem(
                    "error",
                    f"{flag} differs from the recipe's --{recipe} {flags[recipe]}: DeepSpeed "
                    f'would follow the launch flag ({ds_where} says "auto") while the recipe '
                    "counts and reports its own; give the value to the recipe (after the script "
                    "name) and drop the launch flag",
                )
            )
    return out


def _precision_problems(mixed_precision: str, hardware: dict) -> list[Problem]:
    capability = hardware.get("capability")
    if hardware.get("device_type") != "cuda" or capability is None:
        return []
    cc = f"compute capability {capability[0]}.{capability[1]}"
    if mixed_precision == "bf16" and tuple(capability) < (8, 0):
        return [
            Problem(
                "error",
                f"mixed_precision bf16 (accelerate config or --mixed_precision): this GPU ({cc}) has "
                "no bf16 arithmetic, which needs 8.0+ (Ampere or newer); Accelerate would emulate "
                "it, several times slower. Launch with --mixed_precision fp16 (loss-scaled) or "
                "--mixed_precision no (recipes/mixed_precision.py: --precision fp16 or no)",
            )
        ]
    if mixed_precision == "fp16" and tuple(capability) >= (8, 0):
        return [
            Problem(
                "warning",
                f"mixed_precision fp16 on a GPU with bf16 ({cc}): fp16 needs loss scaling and can "
                "still overflow; bf16 keeps fp32's range at the same speed. Use bf16 unless you "
                "must match an fp16 reference (--mixed_precision bf16 on the launch line; "
                "recipes/mixed_precision.py: --precision bf16)",
            )
        ]
    return []


def _fsdp_problems(
    fsdp: dict, where: str, hardware: dict | None, model_classes: set | None
) -> list[Problem]:
    out = []
    if int(fsdp.get("fsdp_version", 1)) == 1 and not _true(fsdp.get("fsdp_use_orig_params", True)):
        out.append(
            Problem(
                "error",
                f"fsdp_use_orig_params: false in {where}: these recipes build the optimizer "
                "before accelerator.prepare, which FSDP1 supports only with "
                "fsdp_use_orig_params: true",
            )
        )
    if (
        hardware is not None
        and _true(fsdp.get("fsdp_offload_params", False))
        and hardware["device_type"] == "cpu"
    ):
        out.append(
            Problem(
                "error",
                f"fsdp_offload_params: true in {where} needs a GPU (it pins host memory); on a "
                "CPU-only host the parameters are in CPU memory already: set it to false",
            )
        )
    wrap = fsdp.get("fsdp_transformer_layer_cls_to_wrap")
    if model_classes is not None and wrap:
        names = [wrap] if isinstance(wrap, str) else list(wrap)
        names = [n.strip() for name in names for n in name.split(",") if n.strip()]
        if missing := [n for n in names if n not in model_classes]:
            blocks = sorted(n for n in model_classes if n.endswith(("Layer", "Block")))
            out.append(
                Problem(
                    "error",
                    f"fsdp_transformer_layer_cls_to_wrap: {', '.join(missing)} in {where}, but the "
                    f"model has no such module (its blocks: {', '.join(blocks) or 'none'}); name "
                    "one of them, or delete the key to wrap the model's _no_split_modules",
                )
            )
    return out


def _mesh_problems(
    mesh: dict, where: str, ranks: int, per_machine: int, config: dict, tensor_parallel: bool
) -> list[Problem]:
    """A `parallelism_config` (HSDP: dp_replicate x dp_shard; tensor parallel: dp_shard x tp) that Accelerate
    would refuse with a traceback, that the recipe cannot train, or whose shard groups span machines."""
    sizes = {dim: int(mesh.get(f"parallelism_config_{dim}_size") or 1) for dim in MESH_DIMS}
    shown = " x ".join(
        f"parallelism_config_{dim}_size {n}"
        for dim, n in sizes.items()
        if n > 1 or dim.startswith("dp")
    )
    fsdp = config.get("fsdp_config") or {}
    fsdp2 = config.get("distributed_type") == "FSDP" and int(fsdp.get("fsdp_version") or 1) == 2
    tp = f"parallelism_config_tp_size {sizes['tp']} in {where}"
    out = []
    if other := [
        f"parallelism_config_{dim}_size {n}" for dim in ("cp", "sp") if (n := sizes[dim]) > 1
    ]:
        out.append(
            Problem(
                "error",
                f"{', '.join(other)} in {where}: the recipes shard the data-parallel dimensions "
                "(HSDP) and, in recipes/llama.py, tensor parallel; context and sequence parallel "
                "need the batch split along the sequence, which they do not do (docs/configs.md)",
            )
        )
    elif sizes["tp"] > 1 and not tensor_parallel:
        out.append(
            Problem(
                "error",
                f"{tp}: this recipe builds its model whole; recipes/llama.py is the one that "
                "shards it for tensor parallel (docs/configs.md#tensor-parallel)",
            )
        )
    elif sizes["tp"] > 1 and not fsdp2:
        out.append(
            Problem(
                "error",
                f"{tp} with distributed_type {config.get('distributed_type')}: tensor parallel "
                "runs under FSDP2 (fsdp_version: 2) only, as in accelerate_configs/tp.yaml",
            )
        )
    elif sizes["tp"] > 1 and _true(fsdp.get("fsdp_cpu_ram_efficient_loading")):
        out.append(
            Problem(
                "error",
                f"{tp} with fsdp_cpu_ram_efficient_loading: true: Accelerate would broadcast "
                "rank 0's tensor-parallel slices to every rank; set it to false (tp.yaml)",
            )
        )
    elif math.prod(sizes.values()) != ranks:
        out.append(
            Problem(
                "error",
                f"{shown} in {where} = {math.prod(sizes.values())} ranks, but the launch has "
                f"num_processes {ranks}: make the product the number of processes",
            )
        )
    elif sizes["dp_shard"] == 1:
        alone = (
            "; for tensor parallel, leave FSDP dp_shard ranks (tp.yaml: dp_shard 2 x tp 2)"
            if sizes["tp"] > 1
            else "; for replicas alone use accelerate_configs/ddp.yaml"
        )
        out.append(
            Problem(
                "error",
                f"parallelism_config_dp_shard_size 1 in {where}: FSDP has nothing to shard "
                f"across{alone}",
            )
        )
    elif per_machine % sizes["dp_shard"] and sizes["dp_replicate"] > 1:
        out.append(
            Problem(
                "warning",
                f"parallelism_config_dp_shard_size {sizes['dp_shard']} in {where} with "
                f"{per_machine} processes per machine: shard groups span machines, so every "
                "step's all-gathers cross the network, which HSDP is meant to avoid; make "
                "dp_shard_size the processes per machine (or a divisor of it)",
            )
        )
    return out


def _dynamo_problem(config: dict, where: str, compiles: bool) -> Problem | None:
    """torch.compile that fails (regional compilation under FSDP1: a traceback in prepare) or that would not
    happen under DeepSpeed: accelerate launch (1.15) passes its dynamo settings
    (`--dynamo_backend`, `dynamo_config`) to every launcher's processes but DeepSpeed's, whose ranks then train
    uncompiled and say nothing. Set in the launch's environment, ACCELERATE_DYNAMO_BACKEND does reach them, and
    DeepSpeed compiles its module in place (measured: ZeRO-2 and ZeRO-3 within 1.4e-7 of eager in fp32)."""
    dynamo = config.get("dynamo_config") or {}
    backend = str(dynamo.get("dynamo_backend") or "NO").upper()
    if backend == "NO":
        return None
    if (
        not compiles
    ):  # the compile wrapper renames every state-dict key ("_orig_mod."): exports reload untrained
        return Problem(
            "error",
            f"dynamo backend {backend.lower()} (--dynamo_backend or dynamo_config in {where}): "
            "this recipe does not support torch.compile (its checkpoints and export would carry "
            "the compile wrapper's '_orig_mod.' key names); recipes/llama.py does, "
            "or drop the setting",
        )
    fsdp_version = int((config.get("fsdp_config") or {}).get("fsdp_version", 1))
    if (
        config.get("distributed_type") == "FSDP"
        and fsdp_version == 1
        and _true(dynamo.get("dynamo_use_regional_compilation", False))
    ):
        return Problem(
            "error",
            f"regional compilation (--dynamo_use_regional_compilation or dynamo_config in {where}) "
            "under FSDP1: Accelerate 1.15's compile_regions fails in prepare on FSDP1's wrapped "
            "blocks (AttributeError: no attribute '_fsdp_wrapped_module'); compile the whole model "
            "(drop the flag) or use FSDP2 (accelerate_configs/fsdp.yaml)",
        )
    if config.get("distributed_type") != "DEEPSPEED":
        return None
    if os.environ.get("ACCELERATE_DYNAMO_BACKEND", "NO").upper() == backend:
        return None  # reaches the ranks
    return Problem(
        "error",
        f"dynamo backend {backend.lower()} (--dynamo_backend or dynamo_config in {where}) under "
        "DeepSpeed: accelerate launch does not pass it to DeepSpeed's processes, which would train "
        f"uncompiled; run `ACCELERATE_DYNAMO_BACKEND={backend} accelerate launch ...` instead (the "
        "environment reaches them), or drop the setting",
    )


def _size(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.2f} MB"


def zero3_problem(
    ds: dict,
    where: str,
    shape: dict,
    flags: dict,
    ranks: int,
    mixed_precision: str,
    device_memory: int,
) -> Problem | None:
    """A warning if `common/plan.py` says ZeRO-2, or FSDP2 without resharding, fits in `device_memory` with less
    communication than this ZeRO-3 config (`ds`, stage 3), else None.

    Args:
        ds: the DeepSpeed JSON (a dict); where: its name, for the message.
        shape: `plan.model_shape(model_config)`.
        flags: needs per_device_train_batch_size and block_size; gradient_accumulation_steps,
            gradient_checkpointing and packing default to 1, False and "stream".
        ranks: all processes; mixed_precision: "no", "bf16" or "fp16"; device_memory: bytes per rank.
    """
    from common import plan

    zero = ds.get("zero_optimization") or {}
    if int(zero.get("stage", 0)) != 3 or ranks < 2:
        return None
    base = {
        "offload_optimizer": False,
        "offload_param": False,
        "reshard": True,
        "ds": zero,
        "grad_accum_bytes": DTYPE_BYTES.get(
            str((ds.get("data_types") or {}).get("grad_accum_dtype"))
        ),
        "comm_bytes": DTYPE_BYTES.get(str(ds.get("communication_data_type"))),
    }
    offload = {
        "offload_optimizer": (zero.get("offload_optimizer") or {}).get("device", "none") != "none",
        "offload_param": (zero.get("offload_param") or {}).get("device", "none") != "none",
    }
    strategies = {
        "ZeRO-3": {**base, **offload, "kind": "zero3"},
        "ZeRO-2": {**base, "kind": "zero2"},
        "FSDP2 with fsdp_reshard_after_forward: false": {**base, "kind": "fsdp", "reshard": False},
    }
    plans = {
        name: plan.plan_strategy(
            s,
            shape,
            ranks,
            flags["per_device_train_batch_size"],
            flags["block_size"],
            flags.get("gradient_accumulation_steps", 1),
            bool(flags.get("gradient_checkpointing")),
            mixed_precision,
            packing=flags.get("packing", "stream"),
        )
        for name, s in strategies.items()
    }
    this = plans.pop("ZeRO-3")
    device = plan.device_spec(plan.detect_device())  # tools/plan.py's time model, uncalibrated

    def tokens_per_s(name):
        return plan.time_strategy(
            strategies[name],
            shape,
            device,
            ranks,
            flags["per_device_train_batch_size"],
            flags["block_size"],
            flags.get("gradient_accumulation_steps", 1),
            plan.checkpoint_mode(bool(flags.get("gradient_checkpointing"))),
            mixed_precision=mixed_precision,
        )["tokens_per_s"]

    better = [
        f"{name} fits ({_size(p['total'])} of {_size(device_memory)} per rank) sending "
        f"{_size(p['comm_per_step'])}, predicted at {tokens_per_s(name) / tokens_per_s('ZeRO-3'):.2f}x "
        f"ZeRO-3's tokens/s on {device.name}"
        for name, p in plans.items()
        if p["total"] <= device_memory and p["comm_per_step"] < this["comm_per_step"]
    ]
    if not better:
        return None
    return Problem(
        "warning",
        f"ZeRO-3 (zero_optimization.stage: 3 in {where}) sends {_size(this['comm_per_step'])} "
        f"per rank and step ({_size(this['total'])} per rank), but the plan says "
        f"{'; '.join(better)}; prefer that unless you measured otherwise "
        "(python tools/plan.py, benchmarks/compare_strategies.py)",
    )


def _idle_gpus_problem(
    config: dict, where: str, hardware: dict, ranks: int, per_machine: int
) -> Problem | None:
    """A warning when a multi-process launch starts fewer processes on this machine than it has GPUs.

    Every YAML pins `num_processes: 2`, and Accelerate gives local rank i the GPU cuda:i: on an
    8-GPU host the others sit idle, silently. The idle ones are named as torch numbers them, and
    by their `CUDA_VISIBLE_DEVICES` entry where that is set. A one-process launch
    (`distributed_type: NO`, single.yaml) asks for one device and gets no warning.
    """
    gpus = int(hardware.get("gpus") or 0)
    if (
        hardware.get("device_type") != "cuda"
        or per_machine >= gpus
        or config.get("distributed_type") == "NO"
    ):
        return None
    visible = [
        v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()
    ]
    idle = [
        f"cuda:{i}" + (f" (device {visible[i]})" if len(visible) == gpus else "")
        for i in range(per_machine, gpus)
    ]
    machines = max(1, int(config.get("num_machines", 1)))
    return Problem(
        "warning",
        f"num_processes {ranks} in {where} (or --num_processes) starts {per_machine} "
        f"processes on this machine, which has {gpus} GPUs: {len(idle)} stay idle: "
        f"{', '.join(idle)}; "
        f"launch with --num_processes {gpus * machines} to use them all (or set "
        "CUDA_VISIBLE_DEVICES to the GPUs this job should have)",
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
    shape: dict | None = None,
    device_memory: int | None = None,
    compiles: bool = False,
    tensor_parallel: bool = False,
) -> list[Problem]:
    """Every problem of a launch that its inputs let us see; each check runs when its inputs are given.

    Args:
        config: the accelerate config, YAML keys (`yaml.safe_load` of the file, or
            `launch_config_from_env()`); `num_processes` counts all ranks, as in Accelerate.
        where: the config's name in messages (its path, or "the accelerate config").
        ds, ds_where: the DeepSpeed settings and their name (`deepspeed_settings`); None off DeepSpeed.
        flags: recipe flags by name without dashes, those the recipe has: per_device_train_batch_size,
            gradient_accumulation_steps, max_grad_norm, warmup_steps, reference_global_batch, scale_lr,
            block_size, gradient_checkpointing; `mixed_precision` overrides the config's (e.g.
            mixed_precision.py's --precision).
        hardware: `detect_hardware()` (device_type, capability, gpus); None skips the hardware checks.
        model_classes: class names of the model's modules (for fsdp_transformer_layer_cls_to_wrap).
        train_size, train_unit: samples in the training set, and what one is (for the message).
        steps: optimizer steps the run will take (for the warmup check).
        shape, device_memory: `plan.model_shape(model_config)` and bytes per rank (for the ZeRO-3 check).
        compiles: the recipe supports torch.compile (a dynamo backend): keeps eager state-dict keys in its
            checkpoints and export (recipes/llama.py, and the planner, which plans it). Else a backend is an error.
        tensor_parallel: the recipe shards its model on the mesh's tp dimension (recipes/llama.py,
            `causal_lm.tensor_parallel`). Else a `parallelism_config_tp_size` above 1 is an error.

    Returns:
        The problems, errors first, each a `Problem` whose text is one line naming the file or flag,
        the key and both values. Empty when nothing is wrong.
    """
    flags = flags or {}
    ranks = int(config.get("num_processes", 1))
    mixed_precision = str(flags.get("mixed_precision") or config.get("mixed_precision") or "no")
    out: list[Problem] = []
    if hardware is not None:
        out += _precision_problems(mixed_precision, hardware)
        per_machine = ranks // max(1, int(config.get("num_machines", 1)))
        if hardware.get("gpus") and per_machine > hardware["gpus"]:
            out.append(
                Problem(
                    "error",
                    f"num_processes {ranks} in {where} (or --num_processes) starts {per_machine} "
                    f"processes on this machine, but torch sees {hardware['gpus']} GPU(s) "
                    f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); "
                    "launch at most one process per GPU",
                )
            )
        if problem := _idle_gpus_problem(config, where, hardware, ranks, per_machine):
            out.append(problem)
    for name, value in (config.get("dropped_launch_flags") or {}).items():
        if name == "--gradient_accumulation_steps" and _same(
            value, flags.get("gradient_accumulation_steps")
        ):
            continue  # the recipe accumulates as many anyway
        instead = (
            f"give {name} {value} to the recipe (after the script name)"
            if name == "--gradient_accumulation_steps"
            else "drop it, or launch a DeepSpeed config"
        )
        out.append(
            Problem(
                "error",
                f"accelerate launch {name} {value}: Accelerate passes it to DeepSpeed only, and "
                f"this launch is not DeepSpeed ({config.get('distributed_type')}), so it would "
                f"be ignored; {instead}",
            )
        )
    if ds is not None:
        out += _deepspeed_problems(ds, ds_where, flags, ranks, mixed_precision)
        if (launch_ds := config.get("deepspeed_config") or {}).get("deepspeed_config_file"):
            out += launch_flag_problems(launch_ds, ds, ds_where, flags)
    if (problem := _dynamo_problem(config, where, compiles)) is not None:
        out.append(problem)
    if config.get("distributed_type") == "FSDP":
        out += _fsdp_problems(config.get("fsdp_config") or {}, where, hardware, model_classes)
    if config.get("parallelism_config"):
        out += _mesh_problems(
            config["parallelism_config"],
            where,
            ranks,
            ranks // max(1, int(config.get("num_machines", 1))),
            config,
            tensor_parallel,
        )
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
            out.append(
                Problem(
                    "error",
                    f"the training split has {train_size} {train_unit}, fewer than one global "
                    f"batch of {global_batch} {split}",
                )
            )
        reference = flags.get("reference_global_batch")
        warmup = flags.get("warmup_steps")
        if reference and global_batch > reference and (not flags.get("scale_lr") or not warmup):
            missing = "--scale_lr" if not flags.get("scale_lr") else "--warmup_steps"
            out.append(
                Problem(
                    "warning",
                    f"global batch {global_batch} > {reference} without {missing}: "
                    f"--reference_global_batch {reference} is the batch --learning_rate was "
                    f"tuned at, and this run's is {global_batch} {split}; expect slower or "
                    "unstable training",
                )
            )
    if steps and flags.get("warmup_steps") is not None and flags["warmup_steps"] >= steps:
        out.append(
            Problem(
                "warning",
                f"--warmup_steps {flags['warmup_steps']} >= the run's {steps} steps: the LR "
                "never reaches its peak (--learning_rate)",
            )
        )
    if shape is not None and device_memory and ds is not None and "block_size" in flags:
        if problem := zero3_problem(
            ds, ds_where, shape, flags, ranks, mixed_precision, device_memory
        ):
            out.append(problem)
    return sorted(out, key=lambda p: p.severity != "error")


class Startup:
    """The start-up checks of one run, one call per stage: errors raise `Stop` (every error line at
    once), warnings print once, on rank 0. Each stage adds what it learnt to the facts and runs
    `config_problems` again: a check runs as soon as its inputs exist, and a warning already printed
    is not repeated.

        guard = checks.Startup(args)       # launch: the config, DeepSpeed JSON and flags vs the hardware
        accelerator = Accelerator(mixed_precision=guard.precision["used"], kwargs_handlers=guard.handlers, ...)
        guard.accelerator_built(accelerator, args)  # distributed for real; this job's output directory
        guard.data_ready(train_size=..., steps=..., model_cls=..., model_config=...)

    Args:
        args: the parsed flags; those of `FLAGS` the recipe has are checked.
        precision_used: the precision the recipe chose itself (mixed_precision.py's --precision),
            instead of the launch config's, kept where the hardware computes it (`precision.for_launch`).
        compiles: the recipe supports torch.compile (eager key names in checkpoints and the export).
        tensor_parallel: the recipe shards its model for tensor parallel (`causal_lm.tensor_parallel`).
        steps, model_cls, model_config: known before the data (for the warmup, FSDP-wrap and ZeRO-3 checks).
        handlers: the recipe's own kwargs_handlers for the Accelerator (e.g. GradScalerKwargs).

    Attributes:
        precision: {"requested", "used", "reason"}; "used" goes to the `Accelerator`.
        handlers: the Accelerator's kwargs_handlers: the collective timeout, and on a CPU-only host
            real gloo ranks (`launch.process_group`), then the recipe's `handlers`.
        workarounds: the names of the library workarounds `launch.process_group` applied
            (common/workarounds.py): a recipe adds its own and records them in run_info.json.
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

    def __init__(
        self,
        args,
        *,
        precision_used: str | None = None,
        compiles: bool = False,
        steps: int | None = None,
        model_cls=None,
        model_config=None,
        handlers: tuple = (),
        tensor_parallel: bool = False,
    ):
        self.config = launch_config_from_env()
        hardware = detect_hardware()
        if precision_used is None:
            self.precision = precision.for_launch(self.config, hardware)
        else:
            self.precision = {
                "requested": precision_used,
                "used": precision_used,
                "reason": "--precision",
            }
        flags = {k: getattr(args, k) for k in self.FLAGS if hasattr(args, k)}
        flags["mixed_precision"] = self.precision["used"]
        self.ds, ds_where = deepspeed_settings(self.config)
        self.facts = dict(
            ds=self.ds,
            ds_where=ds_where,
            flags=flags,
            hardware=hardware,
            compiles=compiles,
            steps=steps,
            tensor_parallel=tensor_parallel,
        )
        self._printed: set[str] = set()
        self.check(model_cls=model_cls, model_config=model_config)
        group, self.workarounds = launch.process_group(args.ddp_timeout)
        self.handlers = [group, *handlers]

    def check(self, *, model_cls=None, model_config=None, **facts) -> None:
        """Add `facts` (config_problems' keywords), then stop on any error; print each new warning."""
        self.facts.update({k: v for k, v in facts.items() if v is not None})
        if model_cls is not None:
            self.facts.update(model_facts(self.config, self.ds, model_cls, model_config))
        problems = config_problems(self.config, **self.facts)
        for p in problems:
            if p.severity == "warning" and str(p) not in self._printed:
                self._printed.add(str(p))
                if int(os.environ.get("RANK", 0)) == 0:
                    print(p, flush=True)
        if errors := [str(p) for p in problems if p.severity == "error"]:
            raise Stop("\n".join(errors).removeprefix("error: "))

    def accelerator_built(self, accelerator, args) -> None:
        """Refuse independent processes posing as a distributed run (`launch.check_distributed`), then
        claim `args.output_dir` for this job (`run_dir.claim`: locked, emptied by --overwrite_output_dir,
        one folder shared by every node)."""
        launch.check_distributed(accelerator)
        run_dir.claim(accelerator, args)

    def data_ready(
        self,
        *,
        train_size: int,
        train_unit: str,
        steps: int | None = None,
        model_cls=None,
        model_config=None,
    ) -> None:
        """The training set against one global batch, warmup against the run's length, and the model
        (its FSDP wrap class, the ZeRO-3 plan, --packing documents) once its config exists."""
        if self.facts["flags"].get("packing") == "documents" and (
            problem := documents_problem(model_cls)
        ):
            raise Stop(problem)
        self.check(
            train_size=train_size,
            train_unit=train_unit,
            steps=steps,
            model_cls=model_cls,
            model_config=model_config,
        )

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
        if (
            ds_used and ds_used["train_batch_size"] != global_batch
        ):  # (config_problems refuses the causes)
            raise Stop(
                f"DeepSpeed runs a batch of {ds_used['train_batch_size']} samples per step, the recipe "
                f"counts {global_batch}: {ds_used}"
            )
        return {"fsdp_units": units, "deepspeed": ds_used}


def documents_problem(model_cls) -> str | None:
    """Why `model_cls` cannot train on --packing documents, or None. The documents of a block are kept
    apart by the position ids alone (transformers' mask builder reads where they restart): a model
    whose forward takes none, such as Bloom (ALiBi), would attend across documents, silently."""
    import inspect

    if model_cls is None or "position_ids" in inspect.signature(model_cls.forward).parameters:
        return None
    return (
        f"--packing documents keeps documents apart through position_ids, which {model_cls.__name__}'s "
        "forward does not take: its tokens would attend across documents. Use --packing none (a padded row "
        "each) or stream"
    )


def model_class_names(model_cls, config) -> set[str]:
    """Class names of every module of `model_cls(config)`, built on the meta device (no memory, no init)."""
    import torch

    with torch.device("meta"):
        return {type(m).__name__ for m in model_cls(config).modules()}


def model_facts(config: dict, ds: dict | None, model_cls, model_config) -> dict:
    """The model-dependent inputs of `config_problems`, computed only where a check needs them (all on the meta
    device, no memory): `model_classes` when the config names fsdp_transformer_layer_cls_to_wrap, `shape` and
    `device_memory` (`plan.detect_memory`: the GPU's, else host RAM / ranks) under a ZeRO-3 DeepSpeed config."""
    facts = {}
    if (config.get("fsdp_config") or {}).get("fsdp_transformer_layer_cls_to_wrap"):
        facts["model_classes"] = model_class_names(model_cls, model_config)
    if ds is not None and int((ds.get("zero_optimization") or {}).get("stage", 0)) == 3:
        from common import plan

        per_machine = int(config.get("num_processes", 1)) // max(
            1, int(config.get("num_machines", 1))
        )
        facts.update(
            shape=plan.model_shape(model_config), device_memory=plan.detect_memory(per_machine)[0]
        )
    return facts


def rank_mismatch(accelerator, what: str, value: str) -> str | None:
    """A message if `value` is not the same on every rank, else None. A collective: call on every rank.

    For what each node reads from its own disk (the training data, a tokenizer): a node-local
    copy that differs from rank 0's would train on other samples, silently (measured on two
    loopback "machines" with another text of the same block count: 1.0% off in loss after 4 steps).

    Args:
        what: what `value` identifies, for the message (e.g. "training data").
        value: a short fingerprint (a digest) of it on this rank.
    """
    from accelerate.utils import gather_object

    values = gather_object([value])
    if len(set(values)) == 1:
        return None
    differ = [r for r, v in enumerate(values) if v != values[0]]
    return (
        f"the {what} differs between ranks: rank(s) {', '.join(map(str, differ))} read another one than rank 0 "
        f"({values[differ[0]]} vs {values[0]}); every node must see the same files (a shared or identical path)"
    )


def llama_flags(args, from_scratch: bool) -> None:
    """recipes/llama.py's flag combinations that cannot mean what they say (before any work)."""
    if from_scratch and args.config_name is None and args.model_config not in models.PRESETS:
        raise Stop(
            f"unknown --model_config {args.model_config!r}; choose one of {sorted(models.PRESETS)}"
        )
    if args.config_overrides and not from_scratch:
        raise Stop(
            "--config_overrides changes a model trained from scratch (--config_name or the preset); "
            "pretrained weights (--model_name_or_path) keep their shapes"
        )
    if args.allow_new_weights and from_scratch:
        raise Stop(
            "--allow_new_weights concerns the weights loaded by --model_name_or_path, and there is none"
        )


def sft_flags(args) -> None:
    """recipes/sft.py's flag combinations that cannot mean what they say (before any work)."""
    if not args.model_name_or_path:
        raise Stop(
            "sft.py fine-tunes a pretrained model: pass --model_name_or_path (e.g. runs/llama/final, "
            "the export of recipes/llama.py)"
        )
    if not args.use_peft and (lora := sorted(f for f in args.given if f.startswith("lora_"))):
        raise Stop(f"--{lora[0]} sets LoRA, which is off: add --use_peft, or drop the LoRA flags")


def lora_targets_found(model, targets: str) -> None:
    """Stop unless each name of --lora_target_modules (a comma list, or all-linear) adapted some
    module of `model`, a peft model: peft stops only when no name matches, so a misspelt one would
    leave its modules untrained, silently."""
    adapted = model.targeted_module_names
    names = [] if targets == "all-linear" else targets.split(",")
    if missing := [t for t in names if not any(n == t or n.endswith(f".{t}") for n in adapted)]:
        raise Stop(
            f"--lora_target_modules {targets}: no module named {', '.join(missing)} in the model "
            f"(adapted: {', '.join(sorted({n.rsplit('.', 1)[-1] for n in adapted}))})"
        )


def tokenizer_fits(tokenizer, source: str | None, raw, config, block_size: int) -> None:
    """The tokenizer and the block size against the model config, before packing.

    A tokenizer that loads but cannot encode (a model directory without tokenizer files) would
    train on nothing but end-of-text tokens, and look like fast learning; token ids past the
    embedding fail with an IndexError at the first forward; blocks longer than the model's
    positions fail deep in its attention.
    """
    from common import data

    if source and (
        problem := data.tokenizer_error(tokenizer, source, data.sample_text(raw["train"]))
    ):
        raise Stop(problem)
    if len(tokenizer) > config.vocab_size:
        raise Stop(
            f"the tokenizer has {len(tokenizer)} entries but the model's vocab_size is "
            f"{config.vocab_size}: pass a matching --tokenizer_name_or_path, or raise vocab_size "
            "(--config_overrides vocab_size=N, from scratch) or lower --vocab_size (trained BPE)"
        )
    model_max = models.max_positions(config)
    if model_max is not None and block_size > model_max:
        raise Stop(
            f"--block_size {block_size} exceeds the model's max_position_embeddings {model_max}"
        )


def same_on_every_rank(accelerator, what: str, value: str) -> None:
    """`rank_mismatch` as a stop: every rank raises the same line. A collective."""
    if mismatch := rank_mismatch(accelerator, what, value):
        raise Stop(mismatch)


def model_runs(model, overrides: str) -> None:
    """Stop if the model built with `--config_overrides` fails one forward (`models.forward_error`)."""
    if error := models.forward_error(model):
        raise Stop(f"the model built with --config_overrides {overrides!r} does not run: {error}")


def mixed_precision_flags(args) -> None:
    """recipes/mixed_precision.py's flags that cannot mean what they say (before any work); with
    --compare, what the driver needs: plain `python`, an existing config, a resume by name."""
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
    """recipes/ddp_classifier.py's model flags that BERT would refuse later (before any work)."""
    if args.hidden_size % args.num_attention_heads:
        raise Stop(
            f"--hidden_size {args.hidden_size} is not a multiple of --num_attention_heads "
            f"{args.num_attention_heads}"
        )


def same_data(
    accelerator, raw, tokenizer, block_size: int, packing: str, rows_key: str | None = None
) -> str:
    """Stop unless every rank packed the same data: train and validation rows, tokenizer, block
    size, packing mode and a recipe's own `rows_key` (`data.packing_digest`). A collective. Each node
    reads --train_file from its own path, and another copy there would train on other samples.
    Returns the digest, for the checkpoints (a resume on other data is refused)."""
    from common import data

    digest = data.packing_digest(raw, tokenizer, block_size, packing, rows_key)
    same_on_every_rank(
        accelerator, "data (train and validation text, tokenizer, block size, packing)", digest
    )
    return digest


def sharded_data_flags(args) -> None:
    """recipes/sharded_data.py's refusals of core flags (before any work): it counts steps only."""
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
    """`check(*args, **kwargs)`'s result on every rank, or a `Stop` on every rank if it raised
    FileNotFoundError or ValueError on any: the first such rank's line, `rank R: ...`. A collective.

    For what each rank checks on its own (its own data files): one rank's bad file stops every
    rank alike, instead of one rank leaving and the others waiting for it in a collective.
    """
    from accelerate.utils import gather_object

    result, error = None, None
    try:
        result = check(*args, **kwargs)
    except (FileNotFoundError, ValueError) as err:  # (a library's as well as our own)
        error = f"rank {accelerator.process_index}: {err}"
    if error := next(filter(None, gather_object([error])), None):
        raise Stop(error)
    return result
