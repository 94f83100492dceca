"""Real multi-process training on a machine with no accelerator: the one place that handles it.

`accelerate launch --num_processes 2` on a CPU-only host starts 2 processes through torchrun,
but inside them Accelerate 1.x finds no device and quietly builds a *single*, non-distributed
state per process: two independent runs that only look distributed. `process_group` switches
each strategy back to its real code path over gloo (the workarounds are common/workarounds.py's),
and `check_distributed` refuses to train if that did not work, so an Accelerate upgrade that
changes the internals fails loudly.

What each strategy needs (checked with accelerate 1.15, deepspeed 0.19.8, torch 2.13 CPU):

| strategy (set by `accelerate launch`)  | what we do on CPU                                          |
|----------------------------------------|------------------------------------------------------------|
| DDP / MULTI_CPU                        | `workarounds.ddp_ranks_on_cpu`: Accelerate's MULTI_CPU path |
| DeepSpeed (`ACCELERATE_USE_DEEPSPEED`)  | process-group backend `gloo` instead of `nccl`;            |
|                                        | `workarounds.skip_deepspeed_shm_build` and                 |
|                                        | `workarounds.cache_deepspeed_cpu_device_count`             |
| FSDP1 / FSDP2 (`ACCELERATE_USE_FSDP`)   | `workarounds.fsdp_ranks_on_cpu`: a gloo process group, and |
|                                        | a state that `AcceleratorState` picks FSDP from            |

On a host with CUDA (or any device Accelerate knows) nothing here changes anything: the only
effect is the collective timeout, which every run gets.

A host that *has* NVIDIA GPUs but whose torch sees none (a CPU-only wheel, a driver too old for
the wheel's CUDA, a container started without `--gpus`) would otherwise land on the CPU path
above and train there, slowly and silently. `process_group` refuses that (see
`host_nvidia_gpus`) unless the user opts in with `ACCELERATE_RECIPES_ALLOW_CPU=1`. Accelerate's
own CPU switches cannot be that opt-in: `accelerate launch --cpu` starts one plain process, not
the config's ranks, and drops FSDP/DeepSpeed; `use_cpu: true` in the YAML never reaches the
ranks of a multi-GPU, FSDP or DeepSpeed launch (both checked with accelerate 1.15). An
`ACCELERATE_USE_CPU=true` already in the environment (`--cpu`'s one process) is accepted too.
"""

from __future__ import annotations

import atexit
import gc
import os
import shutil
import subprocess
import sys
from contextlib import contextmanager
from datetime import timedelta

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, InitProcessGroupKwargs

if __name__ == "__main__":  # python common/launch.py CONFIG RECIPE: the shorthand at the end
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import workarounds  # noqa: E402
from common.errors import Stop  # noqa: E402


def _has_accelerator() -> bool:
    return torch.cuda.is_available() or (hasattr(torch, "xpu") and torch.xpu.is_available())


def host_nvidia_gpus(
    proc_dir: str = "/proc/driver/nvidia/gpus", timeout_s: float = 10.0
) -> tuple[int, str]:
    """How many NVIDIA GPUs this host has, whatever torch makes of them.

    Reads the driver's `/proc/driver/nvidia/gpus` (one entry per GPU), else runs `nvidia-smi -L`
    if it is on PATH and counts its `GPU ...` lines. Neither needs CUDA to work, so this sees the
    GPUs that a CPU-only torch wheel, a driver/CUDA mismatch or `CUDA_VISIBLE_DEVICES=""` hide.

    Args:
        proc_dir: the driver's per-GPU folder (a parameter for tests).
        timeout_s: seconds to wait for `nvidia-smi`; a hung driver can block it indefinitely.

    Returns:
        (number of GPUs, where they were seen: `proc_dir` or "nvidia-smi"); (0, "") when neither
        shows one. An `nvidia-smi` that fails, hangs past `timeout_s` or cannot run counts as none.
    """
    try:
        if n := len(os.listdir(proc_dir)):
            return n, proc_dir
    except OSError:
        pass
    if (smi := shutil.which("nvidia-smi")) is None:
        return 0, ""
    try:
        out = subprocess.run(
            [smi, "-L"], capture_output=True, text=True, timeout=timeout_s, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return 0, ""
    n = sum(line.startswith("GPU ") for line in out.splitlines())
    return (n, "nvidia-smi") if n else (0, "")


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def process_group(timeout_s: float) -> tuple[InitProcessGroupKwargs, list[str]]:
    """Process-group settings for `Accelerator(kwargs_handlers=[...])`, after the launch's checks.

    Call it before building the `Accelerator`. It lets a DeepSpeed YAML set `mixed_precision`
    (`workarounds.allow_mixed_precision_with_deepspeed_json`). With no accelerator and a
    torchrun launch (`LOCAL_RANK` set), it makes the strategy chosen by the accelerate config
    run for real over gloo (see the module docstring). Elsewhere it only sets the timeout.

    Args:
        timeout_s: collective timeout in seconds (`--ddp_timeout`, as in `TrainingArguments`). A
            rank stuck in a collective longer than this raises, so one dead rank ends the job.

    Returns:
        (`InitProcessGroupKwargs` with `timeout` set, and `backend="gloo"` on CPU-only launches;
        the names of the workarounds applied, common/workarounds.py).

    Raises:
        ValueError: if `timeout_s` is not positive, the accelerate config's DeepSpeed JSON is missing,
            torchrun restarts (`--max_restarts`) would reuse the rendezvous store of the dead attempt,
            or the host has NVIDIA GPUs that torch cannot see and the user did not opt in to CPU
            (`ACCELERATE_RECIPES_ALLOW_CPU=1`, or `ACCELERATE_USE_CPU=true`): with or without a launcher.
    """
    if timeout_s <= 0:
        raise Stop(f"--ddp_timeout must be a positive number of seconds, got {timeout_s}")
    # Read the opt-in before anything below sets ACCELERATE_USE_CPU for DDP.
    if not _has_accelerator() and not (
        _env_true("ACCELERATE_RECIPES_ALLOW_CPU") or _env_true("ACCELERATE_USE_CPU")
    ):
        n_gpus, seen_by = host_nvidia_gpus()
        if n_gpus:
            if torch.version.cuda is None:
                why = "it is a CPU-only build: install a CUDA one"
            else:
                visible = os.environ.get("CUDA_VISIBLE_DEVICES")
                hiding = "" if visible is None else f", CUDA_VISIBLE_DEVICES={visible!r}"
                why = (
                    f"likely causes: a driver too old for CUDA {torch.version.cuda}, "
                    f"a container started without --gpus{hiding}"
                )
            raise Stop(
                f"this host has {n_gpus} NVIDIA GPU{'s' * (n_gpus > 1)} ({seen_by}) but torch {torch.__version__} sees "
                f"none; {why}. Fix that, or set ACCELERATE_RECIPES_ALLOW_CPU=1 to train on CPU ranks anyway "
                "(`accelerate launch --cpu` would run one process, not the config's ranks)"
            )
    applied = workarounds.allow_mixed_precision_with_deepspeed_json()
    # A DeepSpeed YAML names its JSON relative to where you launch; missing, Accelerate would fail
    # with a JSONDecodeError, then a UnicodeDecodeError, before saying what was wrong.
    if (
        ds_json := os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE", "none")
    ) != "none" and not os.path.isfile(ds_json):
        raise Stop(
            f"DeepSpeed config {ds_json} (deepspeed_config_file in the accelerate config) not found from "
            f"{os.getcwd()}: launch from the project root, and copy ds_configs/ with the recipe"
        )
    # torchrun's --max_restarts with the rendezvous store shared between attempts (the default): the
    # restarted ranks read the dead attempt's gloo/NCCL addresses from it and hang or fail to connect
    # (pytorch/pytorch#135712; measured: 7 restarts in 8 failed). The static rendezvous of the accelerate
    # configs always shares it; the c10d one with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 gives every
    # attempt a fresh store (6 in 6 worked).
    if (
        int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0
        and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    ):
        raise Stop(
            "--max_restarts with torchrun's shared rendezvous store: a restarted job would reconnect to "
            "the dead attempt's addresses and hang (pytorch/pytorch#135712). Launch with "
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in the environment and "
            "`accelerate launch --rdzv_backend c10d --max_restarts N ...`"
        )
    inductor_cache_per_cpu_capability()
    timeout = timedelta(seconds=timeout_s)
    if _has_accelerator() or "LOCAL_RANK" not in os.environ:
        return InitProcessGroupKwargs(timeout=timeout), applied
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
        applied += workarounds.fsdp_ranks_on_cpu(timeout)
    elif os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
        if _env_true(
            "ACCELERATE_USE_CPU"
        ):  # Accelerate would quietly build plain CPU ranks instead
            raise Stop(
                "ACCELERATE_USE_CPU is set (`accelerate launch --cpu`, or the environment), which keeps "
                "Accelerate off DeepSpeed: unset it; DeepSpeed configs run on CPU-only hosts without it"
            )
        applied += (
            workarounds.skip_deepspeed_shm_build() + workarounds.cache_deepspeed_cpu_device_count()
        )
    else:
        applied += workarounds.ddp_ranks_on_cpu()
    return InitProcessGroupKwargs(backend="gloo", timeout=timeout), applied


def inductor_cache_per_cpu_capability() -> None:
    """Under `ATEN_CPU_CAPABILITY`, torch.compile's kernel cache is a directory of its own:
    `TORCHINDUCTOR_CACHE_DIR`, if unset or torch's default `<tmp>/torchinductor_<user>` (which torch
    writes into the environment when a module that loads inductor is imported, as transformers'
    LlamaForCausalLM is), becomes `<tmp>/torchinductor_<user>_<capability>`.

    torch 2.13's inductor reads kernels cached under another CPU capability. Measured on a
    2-core AMX host: a compiled DDP run under `ATEN_CPU_CAPABILITY=avx2`, reading the cache a
    native run had written, failed a compiled kernel's index check (`0 <= tmp10 < 4096`) at
    its first step; with a fresh cache, or one written under avx2, it matched eager. A kernel
    without such a check could compute wrong values silently.
    """
    capability = os.environ.get("ATEN_CPU_CAPABILITY")
    if not capability:
        return
    from torch._inductor.runtime.cache_dir_utils import (
        default_cache_dir,
    )  # torch's rule (a user without a name too)

    default = default_cache_dir()
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR", default) == default:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = f"{default}_{capability.lower()}"


def imports_done() -> None:
    """Turn garbage collection back on after a recipe's imports, which run without it (the
    recipe's `gc.disable()` above them), and freeze what they made (`gc.freeze`).

    torch, transformers, Accelerate and datasets make some millions of objects at import, all
    alive until the process ends; collecting while they load only scans them again and again,
    and once frozen no later collection scans them either. No collection here: one would scan
    them all (0.4-0.6 s of CPU per process on a 2-core Zen 4). The recipe collects above its
    `gc.disable()` instead, where that takes milliseconds in a fresh process, so that a notebook
    or test that runs a recipe in its own process does not freeze its own earlier garbage; the
    imports' few cycles (about 10,000 objects) are frozen and kept. Measured on a 2-core Zen 4,
    a 1-step 2-rank `recipes/llama.py` launch, 6 interleaved rounds: 13.3 -> 11.0 s of CPU
    (launcher and ranks), 8.9 -> 7.4 s wall (a collection here instead: 12.2 s and 8.2 s).
    """
    gc.freeze()
    gc.enable()


def cpu_process_group_kwargs(timeout_s: float) -> InitProcessGroupKwargs:
    """`process_group`'s settings alone, for scripts that build an `Accelerator` by hand."""
    return process_group(timeout_s)[0]


def _end_process() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    # Everything is written by now: leave torch's objects to the OS. The interpreter's last
    # garbage collection over them takes ~2 s per process at exit (2-core CPU).
    gc.freeze()


@contextmanager
def node_first(accelerator: Accelerator):
    """Run the block on each node's first rank, then on the others (which then read its caches).

    A file or format error in the block (a missing file, a config or tokenizer that does not load:
    `OSError`, `ValueError`) becomes a `Stop` with its message, raised only after the first rank
    has released the others, which meet the same error themselves: one `error:` line per rank and
    no rank left waiting. (`accelerator.local_main_process_first` skips its release on an error.)
    """
    if not accelerator.is_local_main_process:
        accelerator.wait_for_everyone()
    try:
        yield
    except (ValueError, OSError) as err:
        raise Stop(str(err) or type(err).__name__) from None
    finally:
        if accelerator.is_local_main_process:
            accelerator.wait_for_everyone()


def teardown(accelerator: Accelerator) -> None:
    """End a run in order, on every way out after `prepare` (the end, preemption, a stop).

    No rank destroys the process group while a peer still uses it, and the prepared model (DDP's
    reducer holds the group) is freed before the group: freed after it, as the interpreter exits,
    it hung or aborted now and then in gloo's destructor (torch 2.13, CPU). Drop the recipe's own
    references first (`del model, optimizer`); `free_memory` drops Accelerate's. A collective:
    call on every rank at the same point.
    """
    accelerator.wait_for_everyone()
    accelerator.free_memory()
    accelerator.end_training()


def check_distributed(accelerator: Accelerator) -> None:
    """Refuse to train if Accelerate silently fell back to independent single processes; and end the
    process group on every exit. (The FSDP settings the recipes cannot use are refused earlier, by
    `checks.config_problems`.)

    Compares Accelerate's view with what the launcher set (`WORLD_SIZE`, and the strategy chosen
    by `ACCELERATE_USE_FSDP` / `ACCELERATE_USE_DEEPSPEED`). Registers an `atexit` hook that
    destroys the process group if it is still up, so that a rank leaving through `sys.exit`
    (a refused flag, say) ends cleanly instead of aborting in gloo's teardown, and then skips the
    interpreter's final garbage collection (`gc.freeze`).

    Raises:
        ValueError: if `accelerator.num_processes` differs from `WORLD_SIZE`, or the
            distributed type is not the one the accelerate config asked for (the recipes print
            it as their one `error:` line).
    """
    atexit.register(_end_process)  # first: a refused start ends the process group cleanly too
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if accelerator.num_processes != world_size:
        raise Stop(
            f"launched with WORLD_SIZE={world_size} but Accelerate built a state with "
            f"{accelerator.num_processes} process(es) ({accelerator.distributed_type.value}); "
            "common/launch.py no longer matches this Accelerate version"
        )
    wanted = None
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
        wanted = DistributedType.FSDP
    elif os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
        wanted = DistributedType.DEEPSPEED
    if wanted is not None and accelerator.distributed_type != wanted:
        raise Stop(
            f"the accelerate config asks for {wanted.value} but Accelerate chose "
            f"{accelerator.distributed_type.value}; common/launch.py no longer matches this Accelerate version"
        )


def mesh_layout(accelerator: Accelerator) -> dict | None:
    """The device mesh of a 2-D (or more) layout, from the accelerate config's `parallelism_config`:
    {"dp_replicate": 2, "dp_shard": 2} for HSDP (accelerate_configs/hsdp.yaml), with "tp" for tensor
    parallel. None for a 1-D run (DDP, FSDP over all ranks, DeepSpeed), as if it had no mesh."""
    config = getattr(accelerator, "parallelism_config", None)
    if config is None:
        return None
    dims = {name: config._sizes[name] for name in config.active_mesh_dims}
    return None if len(dims) < 2 and set(dims) <= {"dp_shard", "dp_replicate"} else dims


def data_parallel_size(accelerator: Accelerator) -> int:
    """The ranks that train on batches of their own: all of them, except under tensor parallel, where
    the ranks of one tp group share a batch (Accelerate's data loader hands them the same one). Global
    batch = per device x accumulation x this; tp.yaml's dp_shard 2 x tp 2 gives 2 of 4 ranks."""
    config = getattr(accelerator, "parallelism_config", None)
    return accelerator.num_processes // (config.non_data_parallel_size if config else 1)


def data_parallel_sum(accelerator: Accelerator, tensor: torch.Tensor) -> torch.Tensor:
    """`accelerator.reduce(tensor, "sum")` counting each batch once: under tensor parallel the sum runs
    over the data-parallel ranks only (Accelerate's flattened "dp" mesh dimension), since the ranks of
    a tp group hold the same batch, hence the same token counts and losses. A new tensor."""
    config = getattr(accelerator, "parallelism_config", None)
    if config is None or config.non_data_parallel_size == 1:
        return accelerator.reduce(tensor.clone(), reduction="sum")
    out = tensor.clone()
    if config.dp_dim_names:  # (tp alone: one batch, nothing to add)
        torch.distributed.all_reduce(out, group=accelerator.torch_device_mesh["dp"].get_group())
    return out


def deepspeed_in_use(accelerator: Accelerator) -> dict | None:
    """What DeepSpeed really runs with, read from its config after `prepare` (where Accelerate has filled
    the "auto" keys and any launch-line flags): for run_info.json and the start line. None off DeepSpeed.

    Returns:
        {"zero_stage", "offload_optimizer_device", "offload_param_device", "gradient_accumulation_steps",
        "train_batch_size" (samples per optimizer step, all ranks), "gradient_clipping"}.
    """
    if accelerator.distributed_type != DistributedType.DEEPSPEED:
        return None
    ds = accelerator.state.deepspeed_plugin.deepspeed_config
    zero = ds.get("zero_optimization") or {}
    return {
        "zero_stage": zero.get("stage", 0),
        "offload_optimizer_device": (zero.get("offload_optimizer") or {}).get("device", "none"),
        "offload_param_device": (zero.get("offload_param") or {}).get("device", "none"),
        **{
            key: ds.get(key)
            for key in ("gradient_accumulation_steps", "train_batch_size", "gradient_clipping")
        },
    }


if __name__ == "__main__":
    # Shorthand that checks the config name first: python common/launch.py fsdp recipes/llama.py [ARGS]
    # runs `accelerate launch --config_file accelerate_configs/fsdp.yaml recipes/llama.py [ARGS]`.
    from pathlib import Path

    configs = Path(__file__).resolve().parent.parent / "accelerate_configs"
    usage = "usage: python common/launch.py CONFIG RECIPE [ARGS...]"
    if sys.argv[1:2] in (["-h"], ["--help"]):
        print(
            f"{usage}\n\nRuns `accelerate launch --config_file accelerate_configs/CONFIG.yaml RECIPE [ARGS...]` "
            "once the config exists. CONFIG: a .yaml path or one of "
            f"{', '.join(sorted(p.stem for p in configs.glob('*.yaml')))}. The recipe's own flags: RECIPE --help."
        )
        sys.exit(0)
    if len(sys.argv) < 3:
        sys.exit(usage)
    name = sys.argv[1]
    path = Path(name) if name.endswith(".yaml") else configs / f"{name}.yaml"
    if not path.is_file():
        sys.exit(
            f"error: accelerate config {path} not found; available: "
            f"{', '.join(sorted(p.stem for p in configs.glob('*.yaml')))}"
        )
    os.execvp(
        sys.executable,
        [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--config_file",
            str(path),
            *sys.argv[2:],
        ],
    )
