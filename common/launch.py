"""The launch: process-group settings, real ranks on CPU-only hosts, and an orderly end."""

from __future__ import annotations

import atexit
import gc
import os
import shutil
import subprocess
from contextlib import contextmanager
from datetime import timedelta

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, InitProcessGroupKwargs

from common import workarounds
from common.errors import Stop


def _has_accelerator() -> bool:
    return torch.cuda.is_available() or (hasattr(torch, "xpu") and torch.xpu.is_available())


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _host_nvidia_gpus(
    proc_dir: str = "/proc/driver/nvidia/gpus", timeout_s: float = 10.0
) -> tuple[int, str]:
    """(NVIDIA GPUs on this host, seen by torch or not; where seen), or (0, "")."""
    try:
        if n := len(os.listdir(proc_dir)):
            return n, proc_dir
    except OSError:
        pass
    if (smi := shutil.which("nvidia-smi")) is None:
        return 0, ""
    try:
        run = subprocess.run(
            [smi, "-L"], capture_output=True, text=True, timeout=timeout_s, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return 0, ""
    n = sum(line.startswith("GPU ") for line in run.stdout.splitlines())
    return (n, "nvidia-smi") if n else (0, "")


def process_group(timeout_s: float) -> tuple[InitProcessGroupKwargs, list[str]]:
    """(process-group kwargs, gloo on CPU ranks; the workarounds applied), after checks."""
    if timeout_s <= 0:
        raise Stop(f"--ddp_timeout must be a positive number of seconds, got {timeout_s}")
    # Read the opt-in before ddp_ranks_on_cpu sets ACCELERATE_USE_CPU.
    opted_in = _env_true("ACCELERATE_RECIPES_ALLOW_CPU") or _env_true("ACCELERATE_USE_CPU")
    if not _has_accelerator() and not opted_in and (found := _host_nvidia_gpus())[0]:
        n_gpus, seen_by = found
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        hiding = "" if visible is None else f", CUDA_VISIBLE_DEVICES={visible!r}"
        why = (
            f"likely causes: a driver too old for CUDA {torch.version.cuda}, a container started "
            f"without --gpus{hiding}"
            if torch.version.cuda
            else "it is a CPU-only build: install a CUDA one"
        )
        raise Stop(
            f"this host has {n_gpus} NVIDIA GPU{'s' * (n_gpus > 1)} ({seen_by}) but torch "
            f"{torch.__version__} sees none; {why}. Fix that, or set ACCELERATE_RECIPES_ALLOW_CPU=1 "
            "to train on CPU ranks anyway (`accelerate launch --cpu` would run one process, not "
            "the config's ranks)"
        )
    applied = workarounds.allow_mixed_precision_with_deepspeed_json()
    # (relative to where you launch; Accelerate would fail with a JSONDecodeError)
    ds_json = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE", "none")
    if ds_json != "none" and not os.path.isfile(ds_json):
        raise Stop(
            f"DeepSpeed config {ds_json} (deepspeed_config_file in the accelerate config) not found "
            f"from {os.getcwd()}: launch from the project root, and copy ds_configs/ with the recipe"
        )
    # restarted ranks sharing the dead attempt's rendezvous store hang (pytorch/pytorch#135712)
    if (
        int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0
        and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    ):
        raise Stop(
            "--max_restarts with torchrun's shared rendezvous store: a restarted job would "
            "reconnect to the dead attempt's addresses and hang (pytorch/pytorch#135712). Launch "
            "with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in the environment and "
            "`accelerate launch --rdzv_backend c10d --max_restarts N ...`"
        )
    applied += workarounds.inductor_cache_per_cpu_capability()
    timeout = timedelta(seconds=timeout_s)
    if _has_accelerator() or "LOCAL_RANK" not in os.environ:
        return InitProcessGroupKwargs(timeout=timeout), applied
    if _env_true("ACCELERATE_USE_FSDP"):
        applied += workarounds.fsdp_ranks_on_cpu(timeout)
    elif _env_true("ACCELERATE_USE_DEEPSPEED"):
        if _env_true("ACCELERATE_USE_CPU"):  # Accelerate would quietly build plain CPU ranks
            raise Stop(
                "ACCELERATE_USE_CPU is set (`accelerate launch --cpu`, or the environment), which "
                "keeps Accelerate off DeepSpeed: unset it; DeepSpeed configs run on CPU-only hosts "
                "without it"
            )
        applied += workarounds.skip_deepspeed_shm_build()
        applied += workarounds.cache_deepspeed_cpu_device_count()
    else:
        applied += workarounds.ddp_ranks_on_cpu()
    return InitProcessGroupKwargs(backend="gloo", timeout=timeout), applied


def imports_done() -> None:
    """After a recipe's imports (under its `gc.disable()`): freeze their objects, which no collection
    then scans (1.5 s of a 1-step launch), and turn collection back on."""
    gc.freeze()
    gc.enable()


def _end_process() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    gc.freeze()  # everything is written: no final collection over torch's objects (~2 s at exit)


@contextmanager
def node_first(accelerator: Accelerator):
    """Run the block on each node's first rank, then on the others (which read its caches); an
    `OSError` or `ValueError` becomes a `Stop` once the others are released."""
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
    """End a run in order after `prepare` (a collective); `del model, optimizer` first (freed after
    the process group, DDP's reducer can hang in gloo's destructor)."""
    accelerator.wait_for_everyone()
    accelerator.free_memory()
    accelerator.end_training()


def check_distributed(accelerator: Accelerator) -> None:
    """Refuse independent processes posing as a distributed run; end the process group at exit."""
    atexit.register(_end_process)  # first: a refused start ends the process group cleanly too
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    mismatch = "common/launch.py no longer matches this Accelerate version"
    if accelerator.num_processes != world_size:
        raise Stop(
            f"launched with WORLD_SIZE={world_size} but Accelerate built a state with "
            f"{accelerator.num_processes} process(es) ({accelerator.distributed_type.value}); "
            + mismatch
        )
    asked = {"FSDP": DistributedType.FSDP, "DEEPSPEED": DistributedType.DEEPSPEED}
    wanted = next((t for k, t in asked.items() if _env_true(f"ACCELERATE_USE_{k}")), None)
    if wanted is not None and accelerator.distributed_type != wanted:
        raise Stop(
            f"the accelerate config asks for {wanted.value} but Accelerate chose "
            f"{accelerator.distributed_type.value}; " + mismatch
        )


def mesh_layout(accelerator: Accelerator) -> dict | None:
    """A 2-D (or more) mesh, e.g. {"dp_replicate": 2, "dp_shard": 2}; None for a 1-D run."""
    config = getattr(accelerator, "parallelism_config", None)
    if config is None:
        return None
    dims = {name: config._sizes[name] for name in config.active_mesh_dims}
    return None if len(dims) < 2 and set(dims) <= {"dp_shard", "dp_replicate"} else dims


def data_parallel_size(accelerator: Accelerator) -> int:
    """The ranks that train on batches of their own (a tensor-parallel group shares one)."""
    config = getattr(accelerator, "parallelism_config", None)
    return accelerator.num_processes // (config.non_data_parallel_size if config else 1)


def data_parallel_sum(accelerator: Accelerator, tensor: torch.Tensor) -> torch.Tensor:
    """A new tensor: `tensor` summed over the ranks, each batch once (a tp group holds one batch)."""
    config = getattr(accelerator, "parallelism_config", None)
    if config is None or config.non_data_parallel_size == 1:
        return accelerator.reduce(tensor.clone(), reduction="sum")
    out = tensor.clone()
    if config.dp_dim_names:  # (tp alone: one batch, nothing to add)
        torch.distributed.all_reduce(out, group=accelerator.torch_device_mesh["dp"].get_group())
    return out
