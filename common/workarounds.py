"""Every patch of a library's state or behaviour, one function each (docs/workarounds.md).

Each docstring names the library, the symptom without the patch, and its canary: `test_<name>` in
tests/test_workarounds.py fails once upstream changes; then review the patch. Each returns
`["its_name"]` or `[]`, for run_info.json. Those beside the code they serve:
- common/checkpoint.py, `zero_universal`: DeepSpeed's `engine._config.load_universal_checkpoint`.
- common/causal_lm.py, `tensor_parallel`: transformers' `model._tp_size`.
- common/causal_lm.py, `replicate_parallel_for_accelerate`: transformers' tensor-parallel styles.
- common/causal_lm.py, `gather_metrics_once_per_tp_group`: `accelerator.gather_for_metrics`.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from contextlib import contextmanager
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from types import MethodType

import torch
from accelerate import PartialState
from accelerate.utils import DistributedType, get_mixed_precision_context_manager, other

from common.errors import Stop


def _fsdp1(accelerator) -> bool:
    return accelerator.distributed_type == DistributedType.FSDP and not accelerator.is_fsdp2


def die_with_launcher() -> list[str]:
    """The kernel kills this rank when its torchrun launcher dies (Linux): torch 2.13's torchrun
    leaves its workers running when SIGKILLed. Canary: no parent-death signal yet."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return []
    PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() == 1:  # the launcher died before the call: the signal will never come
        os._exit(1)
    return ["die_with_launcher"]


def allow_mixed_precision_with_deepspeed_json() -> list[str]:
    """Let a DeepSpeed YAML carry `mixed_precision`: Accelerate 1.15 refuses it beside a JSON, so
    ZeRO trained in fp32. Before the `Accelerator`. Canary: still refused."""
    fields = os.environ.get("ACCELERATE_CONFIG_DS_FIELDS", "").split(",")
    if "mixed_precision" not in fields:
        return []
    os.environ["ACCELERATE_CONFIG_DS_FIELDS"] = ",".join(
        f for f in fields if f != "mixed_precision"
    )
    return ["allow_mixed_precision_with_deepspeed_json"]


def ddp_ranks_on_cpu() -> list[str]:
    """DDP on CPU ranks: Accelerate 1.15 makes them independent runs. Canary: still so."""
    os.environ["ACCELERATE_USE_CPU"] = "true"
    return ["ddp_ranks_on_cpu"]


def fsdp_ranks_on_cpu(timeout: timedelta) -> list[str]:
    """FSDP on CPU torchrun ranks: Accelerate 1.15 picks FSDP from a multi-device type only (CPU
    FSDP ran unsharded); "cpu", not "cpu:0" (FSDP1). Canary: still picked from MULTI_GPU only."""
    state = PartialState(cpu=True, backend="gloo", timeout=timeout)
    state.distributed_type = DistributedType.MULTI_GPU
    state.device = torch.device("cpu")
    return ["fsdp_ranks_on_cpu"]


def skip_deepspeed_shm_build() -> list[str]:
    """Keep DeepSpeed 0.19.8 from compiling its CPU shared-memory all-reduce at process-group
    set-up (~40 s of gcc), which only tensor-parallel inference uses. Canary: it still offers the op."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    return ["skip_deepspeed_shm_build"]


def cache_deepspeed_cpu_device_count() -> list[str]:
    """DeepSpeed's CPU `device_count()` asked once: deepspeed 0.19.8 runs numactl at each ZeRO-3
    reduce-scatter, which resets the warning registries. Canary: numactl at every call."""
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    count = accelerator.device_count()
    accelerator.device_count = lambda: count
    return ["cache_deepspeed_cpu_device_count"]


def install_cpu_grad_scaler(accelerator) -> list[str]:
    """fp16 on CPU ranks with loss scaling: Accelerate 1.15 builds its GradScaler and autocast for
    other devices only (fp16 trained in fp32). Before `prepare`; Stop for DeepSpeed fp16 on a CPU
    without fp16 kernels. Canary: still no scaler for fp16 on CPU."""
    fp16 = accelerator.mixed_precision == "fp16" and accelerator.scaler is None
    if not fp16 or accelerator.device.type != "cpu":
        return []
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        from deepspeed.accelerator import get_accelerator

        if not get_accelerator().is_fp16_supported():
            raise Stop(
                "fp16 under DeepSpeed on this CPU: DeepSpeed's CPU accelerator reports no fp16 "
                "support (no oneDNN fp16 kernels); use bf16, or a DDP/FSDP config (CPU GradScaler)"
            )
        return []  # the DeepSpeed engine scales the loss itself
    handler = accelerator.scaler_handler
    kwargs = handler.to_kwargs() if handler is not None else {}
    if _fsdp1(accelerator):
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        accelerator.scaler = ShardedGradScaler("cpu", **kwargs)  # agrees on overflow across shards
    else:  # (FSDP2's DTensor gradients reduce their overflow check themselves)
        accelerator.scaler = torch.amp.GradScaler("cpu", **kwargs)
    accelerator.native_amp = True
    return ["install_cpu_grad_scaler"]


def keep_fp32_reduction(accelerator) -> list[str]:
    """FSDP with bf16/fp16: reduce and return outputs in fp32 (FSDP1: fp32 buffers). Accelerate
    1.15's policy reduces in the compute dtype, FSDP2 rounds the loss (fp16: overflows), FSDP1 the
    rotary `inv_freq`. Before `prepare`. Canary: the policy still reduces in the compute dtype."""
    if accelerator.distributed_type != DistributedType.FSDP or accelerator.mixed_precision == "no":
        return []
    plugin = accelerator.state.fsdp_plugin
    plugin.mixed_precision_policy = replace(
        plugin.mixed_precision_policy,
        reduce_dtype=torch.float32,
        **({"output_dtype": None} if accelerator.is_fsdp2 else {"buffer_dtype": torch.float32}),
    )
    return ["keep_fp32_reduction"]


def drop_fp32_output_copy(accelerator, model) -> list[str]:
    """Keep `prepare`'s autocast, without Accelerate 1.15's unread fp32 copy of every output (8.4 GB
    of logits at 8 x 2048 tokens, 128k vocabulary). After `prepare`. Canary: still fp32 outputs."""
    if not accelerator.native_amp:
        return []
    autocast = get_mixed_precision_context_manager(True, accelerator.autocast_handler)
    # what may hold the wrapped forward: the model, `.module`, `._orig_mod`, a regional top module
    candidates = [model, getattr(model, "module", None), getattr(model, "_orig_mod", None)]
    candidates += [getattr(c, "module", None) for c in candidates[1:] if c is not None]
    candidates.append(accelerator.unwrap_model(model, keep_torch_compile=False))
    dropped = False
    for module in {id(c): c for c in candidates if isinstance(c, torch.nn.Module)}.values():
        original = module.__dict__.get("_original_forward")  # set by prepare
        if original is not None:
            func = autocast(getattr(original, "__func__", original))
            module.forward = MethodType(func, module) if hasattr(original, "__func__") else func
            dropped = True
    return ["drop_fp32_output_copy"] if dropped else []


def eager_state_dict_keys(accelerator, model) -> list[str]:
    """`torch.compile` wrappers save and load eager key names (FSDP2 strips them itself): torch 2.13
    prefixes `_orig_mod.` (the export reloaded untrained). Canary: keys still carry the prefix."""
    if accelerator.is_fsdp2:
        return []

    def strip(module, state_dict, prefix, local_metadata):
        inner = prefix + "_orig_mod."
        renamed = [
            (prefix + k.removeprefix(inner) if k.startswith(inner) else k, v)
            for k, v in state_dict.items()
        ]
        state_dict.clear()
        state_dict.update(renamed)  # keeps the order

    def restore(module, state_dict, prefix, *_):
        inner = prefix + "_orig_mod."
        for k in [k for k in state_dict if k.startswith(prefix) and not k.startswith(inner)]:
            state_dict[inner + k[len(prefix) :]] = state_dict.pop(k)

    OptimizedModule = torch._dynamo.eval_frame.OptimizedModule
    wrappers = [m for m in model.modules() if isinstance(m, OptimizedModule)]
    for m in wrappers:
        m.register_state_dict_post_hook(strip)
        m.register_load_state_dict_pre_hook(restore)
    return ["eager_state_dict_keys"] if wrappers else []


def fill_fsdp1_optimizer_state(accelerator, model, optimizer) -> list[str]:
    """FSDP1: the optimizer's empty states before `load_state`, which Accelerate 1.15 loads into (a
    fresh Adam has none: zeroed moments). Canary: it still loads into the existing state."""
    if not _fsdp1(accelerator):
        return []
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    get_optimizer_state_dict(model, optimizer.optimizer)  # initialises the states
    return ["fill_fsdp1_optimizer_state"]


def micro_steps_from_optimizer_steps(accelerator, optimizer_steps: int) -> list[str]:
    """After `load_state`: `accelerator.step` = optimizer steps x this run's accumulation; Accelerate
    1.15 restores the saved count, which closes windows early under another split (9 % 2 = 1).
    Canary: `load_state` still restores it."""
    accelerator.step = optimizer_steps * accelerator.gradient_accumulation_steps
    return ["micro_steps_from_optimizer_steps"]


def relink_offload_lr_scheduler(accelerator) -> list[str]:
    """After `load_state` under ZeRO-Offload: the LR scheduler drives the CPU Adam again (torch's
    `load_state_dict` replaced the group dicts: it kept the checkpoint's LR). Canary: still so."""
    if accelerator.distributed_type != DistributedType.DEEPSPEED:
        return []
    applied = []
    for scheduler in accelerator._schedulers:
        held = getattr(getattr(scheduler, "scheduler", scheduler), "optimizer", None)
        for wrapped in accelerator._optimizers:  # wrapper -> ZeRO -> base optimizer
            base = getattr(getattr(wrapped, "optimizer", None), "optimizer", None)
            if held is not None and base is not None and held.param_groups is not base.param_groups:
                held.param_groups = base.param_groups
                applied = ["relink_offload_lr_scheduler"]
    return applied


@contextmanager
def fsdp_trainable_state_only(accelerator):
    """FSDP: inside the block `save_state` / `load_state` keep the trainable parameters only
    (Accelerate 1.15 saves a LoRA model's frozen base; its `adapter_only` load under FSDP1 loaded
    nothing). Yields the names applied. Canary: still called without `adapter_only`."""
    if accelerator.distributed_type != DistributedType.FSDP:
        yield []
        return
    import accelerate.accelerator as module
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import state_dict as sd

    trainable = sd.StateDictOptions(ignore_frozen_params=True)
    folder = lambda out, i: os.path.join(out, f"pytorch_model_fsdp_{i}")  # noqa: E731

    def save(fsdp_plugin, accelerator, model, output_dir, model_index=0, **_):
        dcp.save(
            {"model": sd.get_model_state_dict(model, options=trainable)},
            checkpoint_id=folder(output_dir, model_index),
        )

    def load(fsdp_plugin, accelerator, model, input_dir, model_index=0, **_):
        state_dict = sd.get_model_state_dict(model, options=trainable)
        dcp.load({"model": state_dict}, checkpoint_id=folder(input_dir, model_index))
        options = sd.StateDictOptions(ignore_frozen_params=True, strict=False)
        sd.set_model_state_dict(model, state_dict, options=options)

    saved = module.save_fsdp_model, module.load_fsdp_model
    module.save_fsdp_model, module.load_fsdp_model = save, load
    try:
        yield ["fsdp_trainable_state_only"]
    finally:
        module.save_fsdp_model, module.load_fsdp_model = saved


def fsdp1_cpu_state_dict(accelerator, model: torch.nn.Module) -> dict | None:
    """FSDP1 on CPU: the full state dict (rank 0; {} elsewhere) without Accelerate 1.15's offloading
    gather (SIGSEGV on torch 2.13). A collective; None elsewhere. Canary: pinned to torch 2.13."""
    if not _fsdp1(accelerator) or accelerator.device.type != "cpu":
        return None
    from torch.distributed.fsdp import FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    config = FullStateDictConfig(offload_to_cpu=False, rank0_only=True)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, config):
        return model.state_dict()


def trim_malloc_heap() -> list[str]:
    """Hand glibc's freed pages back to the OS (RSS then counts live memory). Canary: glibc."""
    if sys.platform != "linux":
        return []
    ctypes.CDLL(None).malloc_trim(0)
    return ["trim_malloc_heap"]


def safetensors_mode_from_umask(path: str) -> list[str]:
    """Files under `path`: 0666 less the umask (safetensors 0.8: 0600). Canary: 0600."""
    umask = os.umask(0o077)  # (reading it means setting it, for that moment)
    os.umask(umask)
    path = Path(path)
    files = [path] if path.is_file() else list(path.rglob("*.safetensors"))
    for f in files:
        f.chmod(0o666 & ~umask)
    return ["safetensors_mode_from_umask"] if files else []


def no_deepspeed_import_on_unwrap(accelerator) -> list[str]:
    """Off DeepSpeed, `unwrap_model` imports no deepspeed (Accelerate 1.15 did: ~1 s per rank at
    each export). Canary: unwrapping a plain module still imports it."""
    patched = getattr(other.is_deepspeed_available, "__name__", "") == "deepspeed_imported"
    if patched or accelerator.distributed_type == DistributedType.DEEPSPEED:
        return []

    def deepspeed_imported() -> bool:
        return "deepspeed" in sys.modules

    other.is_deepspeed_available = deepspeed_imported
    return ["no_deepspeed_import_on_unwrap"]


def inductor_cache_per_cpu_capability() -> list[str]:
    """Inductor's cache per `ATEN_CPU_CAPABILITY` (torch 2.13 ignores it). Canary: so."""
    capability = os.environ.get("ATEN_CPU_CAPABILITY")
    if not capability:
        return []
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    default = default_cache_dir()
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR", default) != default:
        return []  # a folder the user chose
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = f"{default}_{capability.lower()}"
    return ["inductor_cache_per_cpu_capability"]


def patch_accelerator(accelerator) -> list[str]:
    """Right after `Accelerator(...)`: `install_cpu_grad_scaler`, `keep_fp32_reduction`,
    `no_deepspeed_import_on_unwrap`."""
    return (
        install_cpu_grad_scaler(accelerator)
        + keep_fp32_reduction(accelerator)
        + no_deepspeed_import_on_unwrap(accelerator)
    )


def patch_model(accelerator, model) -> list[str]:
    """Right after `prepare`: `drop_fp32_output_copy`, then `eager_state_dict_keys`."""
    return drop_fp32_output_copy(accelerator, model) + eager_state_dict_keys(accelerator, model)
