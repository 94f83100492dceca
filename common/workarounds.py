"""Every patch of a library's state or behaviour, one function each.

Each function's docstring gives the library and version it was found on, the symptom without
it, and its canary: a test in tests/test_workarounds.py that asserts the upstream behaviour is
still there, and fails once upstream changes it. Then review the function; delete it if the
library no longer needs it. Versions: accelerate 1.15, torch 2.13, deepspeed 0.19.8.

Each returns the names of what it applied, `["its_name"]` or `[]`, so a recipe adds them up
and llama.py writes them to run_info.json (`"workarounds"`). Two run at export, after
run_info.json is written: `fsdp1_cpu_state_dict` returns the state dict instead, and
`safetensors_mode_from_umask` (also run on each checkpoint) is not recorded.

| workaround                 | library          | symptom without it           | canary: upstream      |
|----------------------------|------------------|------------------------------|-----------------------|
| die_with_launcher          | torchrun 2.13,   | a SIGKILLed launcher leaves  | spawns ranks without  |
|                            | Linux (glibc)    | its ranks running            | a parent-death signal |
| allow_mixed_precision_     | Accelerate 1.15  | ZeRO trains in fp32: no YAML | refuses the YAML's    |
|   with_deepspeed_json      |                  | mixed_precision with a JSON  | mixed_precision       |
| ddp_ranks_on_cpu           | Accelerate 1.15  | CPU-only DDP: independent    | a CPU rank is NO      |
|                            |                  | runs, not one distributed    | unless told cpu       |
| fsdp_ranks_on_cpu          | Accelerate 1.15  | CPU-only FSDP: unsharded     | FSDP only from a      |
|                            |                  | runs                         | multi-device type     |
| skip_deepspeed_shm_build   | DeepSpeed 0.19.8 | ~40 s of gcc per launch      | offers the CPU op     |
| cache_deepspeed_cpu_       | DeepSpeed 0.19.8 | ZeRO-3: torch's deprecation  | runs numactl at each  |
|   device_count             |                  | warning at every collective  | device_count()        |
| install_cpu_grad_scaler    | Accelerate 1.15  | fp16 on CPU trains in fp32   | no CPU GradScaler     |
| keep_fp32_reduction        | Accelerate 1.15  | FSDP reduces gradients and   | reduces in the        |
|                            |                  | the loss in bf16; FSDP1:     | compute dtype         |
|                            |                  | bf16 rotary inv_freq         |                       |
| drop_fp32_output_copy      | Accelerate 1.15  | an unread fp32 logits copy   | fp32 outputs          |
| eager_state_dict_keys      | torch 2.13       | compiled export reloads      | `_orig_mod.` keys     |
|                            |                  | untrained (`_orig_mod.`)     |                       |
| fill_fsdp1_optimizer_state | Accelerate 1.15  | FSDP1 resume: Adam moments   | loads in place        |
|                            |                  | stay zero                    |                       |
| micro_steps_from_          | Accelerate 1.15  | another batch split closes   | restores              |
|   optimizer_steps          |                  | windows early on resume      | accelerator.step      |
| relink_offload_lr_         | Accelerate 1.15, | ZeRO-Offload resume: CPU Adam| load_state_dict makes |
|   scheduler                | torch 2.13       | keeps the checkpoint's LR    | new group dicts       |
| fsdp1_cpu_state_dict       | torch 2.13       | FSDP1 export on CPU: SIGSEGV | torch 2.13; offloads  |
| trim_malloc_heap           | glibc            | RSS counts freed heap pages  | glibc, malloc_trim    |
| replicate_parallel_for_    | Accelerate 1.15, | tensor parallel: `prepare`   | Accelerate imports it |
|   accelerate               | transformers 5.24| fails (ImportError)          | transformers lacks it |
| gather_metrics_once_per_   | Accelerate 1.15  | tensor parallel: eval loss   | gathers every tp rank |
|   tp_group                 |                  | off by 1e-3 (last batch)     |                       |
| no_deepspeed_import_on_   | Accelerate 1.15  | ~1 s of CPU per rank at each | imports deepspeed to  |
|   unwrap                   |                  | non-DeepSpeed export         | unwrap any module     |
| safetensors_mode_from_     | safetensors 0.8  | exports unreadable by the    | writes files with     |
|   umask                    |                  | group (0600)                 | mode 0600             |
| fsdp_trainable_state_only  | Accelerate 1.15, | LoRA checkpoints hold the    | saves the whole model;|
|                            | torch 2.13 FSDP1 | frozen base; FSDP1's         | adapter_only loads    |
|                            |                  | adapter_only loads nothing   | FSDP1 by wrapped names|

The canary of each is `test_<workaround>` in tests/test_workarounds.py; the last column says
what it checks upstream still does.
"""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

import torch
from accelerate import PartialState
from accelerate.utils import DistributedType

from common.errors import Stop


def die_with_launcher() -> list[str]:
    """End this worker when its launcher dies, even by SIGKILL: no orphaned ranks.

    torch 2.13's torchrun (which `accelerate launch` runs) stops its workers when it exits
    normally or on a signal it can catch; SIGKILLed (the OOM killer, `kill -9`, a node agent),
    it cannot, and the workers ran on (reported: 22 minutes, until killed by hand). Linux's
    parent-death signal (glibc `prctl(PR_SET_PDEATHSIG, SIGKILL)`) has the kernel kill this
    process when its parent, the launcher, goes. SIGKILL rather than SIGTERM: nobody would be
    left to restart the job, and a relaunch resumes from the last complete checkpoint anyway.
    Only under torchrun (`TORCHELASTIC_RUN_ID` set), so `nohup python recipe.py` keeps running
    after its shell closes. Linux only. Canary: torchrun still spawns workers without a
    parent-death signal.
    """
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return []
    import ctypes
    import signal

    PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() == 1:  # the launcher died before the call: the signal will never come
        os._exit(1)
    return ["die_with_launcher"]


def allow_mixed_precision_with_deepspeed_json() -> list[str]:
    """Let a DeepSpeed YAML carry `mixed_precision`, like every other accelerate config.

    `accelerate launch` passes the YAML's `mixed_precision` on, but Accelerate 1.15 then refuses
    to start when the YAML points to a DeepSpeed JSON (`_deepspeed_config_checks`: the JSON's
    own `bf16`/`fp16` blocks would win). Without the key the launch defaults to fp32, so the
    ZeRO configs trained in fp32 where every other config trained in bf16. Our JSONs set those
    blocks to `"auto"`, which follows the requested precision; a JSON whose explicit blocks
    disagree is refused at start-up (`checks.config_problems`). Drops `mixed_precision` from
    the YAML fields that Accelerate refuses (`ACCELERATE_CONFIG_DS_FIELDS`). Call before
    building the `Accelerator`; `--mixed_precision` on the launch line still wins over the YAML.
    Canary: Accelerate still refuses `mixed_precision` among those fields.
    """
    fields = os.environ.get("ACCELERATE_CONFIG_DS_FIELDS")
    if not fields:
        return []
    os.environ["ACCELERATE_CONFIG_DS_FIELDS"] = ",".join(
        f for f in fields.split(",") if f != "mixed_precision"
    )
    return (
        ["allow_mixed_precision_with_deepspeed_json"]
        if "mixed_precision" in fields.split(",")
        else []
    )


def ddp_ranks_on_cpu() -> list[str]:
    """DDP on a CPU-only host: Accelerate's own MULTI_CPU path over gloo.

    `accelerate launch --num_processes 2` starts 2 processes through torchrun, but inside them
    Accelerate 1.15 finds no device and builds a single, non-distributed state per process
    (`PartialState._prepare_backend` takes MULTI_CPU only when told `cpu`): two independent
    runs that only look distributed. Sets `ACCELERATE_USE_CPU=true`. Call before building the
    `Accelerator`, on a torchrun launch without an accelerator. Canary: a CPU torchrun rank
    without the flag is still given a non-distributed state.
    """
    os.environ["ACCELERATE_USE_CPU"] = "true"
    return ["ddp_ranks_on_cpu"]


def fsdp_ranks_on_cpu(timeout: timedelta) -> list[str]:
    """FSDP1 / FSDP2 on a CPU-only host: a gloo process group, and a state FSDP is chosen from.

    Accelerate 1.15's `AcceleratorState` picks FSDP only from a multi-device distributed type
    (MULTI_GPU, MULTI_XPU, ...), never from MULTI_CPU or NO, so a CPU launch of an FSDP config
    ran unsharded. Builds the shared `PartialState` (a singleton: the `Accelerator` built next
    reuses it) with a gloo process group, then relabels it MULTI_GPU; the device stays CPU,
    as `torch.device("cpu")`: torch 2.13's FSDP1 rejects an indexed CPU `device_id` ("cpu:0").
    Call before building the `Accelerator`, on a torchrun launch without an accelerator.
    Canary: `AcceleratorState` still picks FSDP from MULTI_GPU only.
    """
    state = PartialState(cpu=True, backend="gloo", timeout=timeout)
    state.distributed_type = DistributedType.MULTI_GPU
    state.device = torch.device("cpu")  # not "cpu:0": FSDP1 rejects an indexed CPU device_id
    return ["fsdp_ranks_on_cpu"]


def skip_deepspeed_shm_build() -> list[str]:
    """Keep DeepSpeed from compiling its CPU shared-memory all-reduce, which training never calls.

    deepspeed 0.19.8's CPU accelerator builds the `deepspeed_shm_comm` op when it sets up its
    process group (`TorchBackend.__init__`): ~40 s of gcc on 2 cores in a fresh environment,
    and a load of the cached build on every later launch. Only `inference_all_reduce`
    (tensor-parallel inference) uses it; ZeRO's collectives go through torch.distributed.
    Marking the op incompatible makes `build_shm_op` return None. Canary: DeepSpeed's CPU
    accelerator still offers the op.
    """
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    return ["skip_deepspeed_shm_build"]


def cache_deepspeed_cpu_device_count() -> list[str]:
    """Ask DeepSpeed's CPU accelerator for its device count once, not at every gradient bucket.

    deepspeed 0.19.8's CPU `device_count()` runs `numactl --hardware` at each call (it counts
    NUMA nodes; 1 where numactl is missing), and ZeRO-3 calls it at every reduce-scatter. Each
    call starts a subprocess, and `subprocess` resets Python's warning registries, so torch's
    FutureWarning about the deprecated collectives ZeRO calls printed at every call: 386 times
    in a 4-step 2-rank ZeRO-3 run, 4 with this (once per message and rank). The answer cannot
    change during a run. Canary: the CPU accelerator still runs numactl at every call.
    """
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    count = accelerator.device_count()
    accelerator.device_count = lambda: count
    return ["cache_deepspeed_cpu_device_count"]


def install_cpu_grad_scaler(accelerator) -> list[str]:
    """Make `mixed_precision="fp16"` real on CPU ranks. Call before `prepare`.

    Accelerate 1.15 builds its GradScaler and fp16 autocast only for non-CPU devices
    (`Accelerator.__init__`), so on a CPU rank fp16 silently trained in fp32; torch 2.13
    supports both on CPU. Gives Accelerate a `torch.amp.GradScaler("cpu")` (FSDP1:
    `ShardedGradScaler("cpu")`, which agrees on overflow across shards) built from the
    Accelerator's `GradScalerKwargs`, and turns on its native-AMP path, so that `prepare` wraps
    the forward in fp16 autocast and the optimizer steps through the scaler. Does nothing on
    GPUs, under DeepSpeed (its engine scales the loss itself) and for other precisions.
    Canary: Accelerate still builds no scaler for fp16 on CPU.

    Raises:
        Stop: fp16 under DeepSpeed on a CPU without fp16 kernels: DeepSpeed 0.19.8 refuses
            it at `prepare` ("Type fp16 is not supported on your device", from its CPU
            accelerator's `is_fp16_supported`, which asks oneDNN).
    """
    if (
        accelerator.mixed_precision != "fp16"
        or accelerator.device.type != "cpu"
        or accelerator.scaler is not None
    ):
        return []  # (under DeepSpeed, `mixed_precision` reads the JSON's fp16/bf16 blocks)
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        from deepspeed.accelerator import get_accelerator

        if not get_accelerator().is_fp16_supported():
            raise Stop(
                "fp16 under DeepSpeed on this CPU: DeepSpeed's CPU accelerator reports no fp16 support "
                "(oneDNN has no fp16 kernels here), so its engine would refuse it; use bf16, or a "
                "DDP/FSDP accelerate config, where fp16 runs with a CPU GradScaler"
            )
        return []  # the DeepSpeed engine scales the loss itself
    kwargs = (
        accelerator.scaler_handler.to_kwargs() if accelerator.scaler_handler is not None else {}
    )
    if accelerator.distributed_type == DistributedType.FSDP and not accelerator.is_fsdp2:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        accelerator.scaler = ShardedGradScaler("cpu", **kwargs)
    else:  # FSDP2 gradients are DTensors, whose overflow check is already reduced across ranks
        accelerator.scaler = torch.amp.GradScaler("cpu", **kwargs)
    accelerator.native_amp = True
    return ["install_cpu_grad_scaler"]


def keep_fp32_reduction(accelerator) -> list[str]:
    """FSDP with bf16/fp16: compute in low precision, but reduce gradients (and return outputs)
    in fp32, and keep buffers (rotary `inv_freq`) in fp32.

    Accelerate 1.15's FSDP mixed-precision policy reduces gradients in the compute dtype, where
    most of the precision of a sum over ranks is lost, and (FSDP2) casts every wrapped module's
    output to it, which rounds the fp32 loss the model computes to bf16 (steps of 0.03 at a
    loss of 8); under fp16 the backward then starts by casting the loss scale itself (65536,
    above fp16's max 65504) to fp16, so the first step overflows and is skipped. FSDP1's
    policy also has `buffer_dtype` = the compute dtype: its first forward rounds the rotary
    frequencies to bf16 (a phase error growing with position: 0.45 rad at 1023 for head dim
    64), where DDP, FSDP2, DeepSpeed and the export keep them fp32. Replaces the plugin's
    policy. Call after building the Accelerator and before `prepare`; other strategies: no-op.
    Canary: Accelerate's policy still reduces (and FSDP2 outputs) in the compute dtype.
    """
    from dataclasses import replace

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
    """Keep `prepare`'s autocast around the forward, but not its fp32 copy of every output.

    Under bf16/fp16 autocast (single process, DDP, FSDP), Accelerate 1.15's `prepare` wraps the
    model's forward in autocast and then in `convert_outputs_to_fp32`, which returns an fp32
    copy of every low-precision output: for a causal LM the whole B x T x V logits (4·B·T·V
    bytes: 8.4 GB at 8 x 2048 tokens and a 128k vocabulary), which nothing reads, since the
    model's loss upcasts the logits itself. Measured with benchmarks/overhead.py on the debug
    model: 4% of a step; losses, gradient norms and eval losses bitwise equal without it.
    Outputs stay in the compute dtype: cast what you read (`metrics.token_nll` does, in slices).
    Call right after `prepare`, before the first forward (a compiled model traces it then).
    Nothing to drop in fp32, or under DeepSpeed (its engine casts). Canary: `prepare` under
    bf16 still returns fp32 outputs.
    """
    from types import MethodType

    from accelerate.utils import get_mixed_precision_context_manager

    if not accelerator.native_amp:
        return []
    autocast = get_mixed_precision_context_manager(
        accelerator.native_amp, accelerator.autocast_handler
    )
    # The module whose forward prepare wrapped, and any copy of it that runs instead: regional
    # compilation (--dynamo_use_regional_compilation) builds a new top module whose __dict__ holds
    # the wrapped forward rebound to it; DDP / FSDP1 (.module) and whole-model compile (._orig_mod)
    # hold it inside.
    candidates = [model, getattr(model, "module", None), getattr(model, "_orig_mod", None)]
    candidates += [getattr(c, "module", None) for c in candidates[1:] if c is not None]
    candidates.append(accelerator.unwrap_model(model, keep_torch_compile=False))
    dropped = False
    for module in {id(c): c for c in candidates if isinstance(c, torch.nn.Module)}.values():
        original = module.__dict__.get(
            "_original_forward"
        )  # set by prepare when it wrapped the forward
        if original is None:
            continue
        if hasattr(original, "__func__"):
            module.forward = MethodType(autocast(original.__func__), module)
        else:
            module.forward = autocast(original)
        dropped = True
    return ["drop_fp32_output_copy"] if dropped else []


def eager_state_dict_keys(accelerator, model) -> list[str]:
    """Make every `torch.compile` wrapper inside `model` save and load its eager module's keys.

    `accelerator.prepare` under a dynamo backend (`accelerate launch --dynamo_backend inductor`)
    returns `torch.compile(model)`: an `OptimizedModule` that holds the model as `_orig_mod`,
    so every state-dict key gains `_orig_mod.` (regional compilation: one per block). Measured,
    torch 2.13: the final/ export then held only `_orig_mod.model...` keys, and transformers'
    `from_pretrained` reloaded it as a freshly initialised model, with a warning, exit 0.
    Checkpoints written by a compiled run would not load into an eager one, and back.

    State-dict post-hooks drop `_orig_mod.` from what each wrapper writes; load pre-hooks put it
    back in front of eager names (keys that already carry it load as they are). Parameters and
    optimizer state are untouched. Not under FSDP2, whose `get_model_state_dict` strips the
    prefix itself. Call after `prepare`; nothing compiled: no-op. Canary: a compiled module's
    state-dict keys still start with `_orig_mod.`.
    """
    if accelerator.is_fsdp2:
        return []

    def strip(module, state_dict, prefix, local_metadata):
        inner = prefix + "_orig_mod."
        renamed = [
            (prefix + k[len(inner) :] if k.startswith(inner) else k, v)
            for k, v in state_dict.items()
        ]
        state_dict.clear()
        state_dict.update(renamed)  # keeps the order

    def restore(
        module,
        state_dict,
        prefix,
        local_metadata,
        strict,
        missing_keys,
        unexpected_keys,
        error_msgs,
    ):
        inner = prefix + "_orig_mod."
        for k in [k for k in state_dict if k.startswith(prefix) and not k.startswith(inner)]:
            state_dict[inner + k[len(prefix) :]] = state_dict.pop(k)

    wrappers = [
        m for m in model.modules() if isinstance(m, torch._dynamo.eval_frame.OptimizedModule)
    ]
    for m in wrappers:
        m.register_state_dict_post_hook(strip)
        m.register_load_state_dict_pre_hook(restore)
    return ["eager_state_dict_keys"] if wrappers else []


def fill_fsdp1_optimizer_state(accelerator, model, optimizer) -> list[str]:
    """FSDP1 resume: give the optimizer its (empty) states, so that `load_state` fills them.

    Accelerate 1.15 loads FSDP1's SHARDED_STATE_DICT optimizer state with
    torch.distributed.checkpoint, which fills the *existing* state dict in place. In a fresh
    process Adam has no state yet (torch 2.13), so nothing was loaded, silently: the run
    resumed with zeroed moments (found by tests/test_checkpoint.py). `get_optimizer_state_dict`
    initialises the states first (torch's `_init_optim_state`). Call before `load_state`;
    other strategies: no-op. Canary: Accelerate still loads into the optimizer's existing state.
    """
    if accelerator.distributed_type != DistributedType.FSDP or accelerator.is_fsdp2:
        return []
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    get_optimizer_state_dict(model, optimizer.optimizer)
    return ["fill_fsdp1_optimizer_state"]


def micro_steps_from_optimizer_steps(accelerator, optimizer_steps: int) -> list[str]:
    """After `load_state`: count micro batches from the optimizer steps, for this run's split.

    Accelerate 1.15's `load_state` restores its count of micro batches (`accelerator.step`),
    whose remainder modulo `gradient_accumulation_steps` decides which micro batch ends an
    accumulation window. A run resumed with another split of the same global batch (batch 2 x 1
    saved at step 9, resumed as batch 1 x accumulation 2: 9 % 2 = 1) would close every window
    one micro batch early, silently. Sets it to `optimizer_steps x gradient_accumulation_steps`.
    Canary: `load_state` still restores `accelerator.step` as saved.
    """
    accelerator.step = optimizer_steps * accelerator.gradient_accumulation_steps
    return ["micro_steps_from_optimizer_steps"]


def relink_offload_lr_scheduler(accelerator) -> list[str]:
    """After `load_state` under ZeRO-Offload: the LR scheduler drives DeepSpeed's CPU Adam again.

    With offload_optimizer, Accelerate 1.15 swaps the recipe's AdamW for a DeepSpeedCPUAdam built
    from the same param-group dicts (`map_pytorch_optim_to_deepspeed`), while the LR scheduler
    keeps the AdamW: it sets the LR only because the two share those dicts. The checkpoint load
    (`Optimizer.load_state_dict` of the CPU Adam) replaces its groups with new dicts, so the
    scheduler then writes the dead AdamW's: the CPU Adam keeps the checkpoint's LR forever (the
    first resumed step right, later ones wrong; the logged LR, the scheduler's, looks right).
    Points the scheduler's optimizer back at the CPU Adam's groups. Canary: `load_state` still
    leaves the scheduler's optimizer and DeepSpeed's base optimizer with different group dicts.
    """
    if accelerator.distributed_type != DistributedType.DEEPSPEED:
        return []
    applied = []
    for scheduler in accelerator._schedulers:
        torch_scheduler = getattr(scheduler, "scheduler", scheduler)
        held = getattr(torch_scheduler, "optimizer", None)
        for wrapped in accelerator._optimizers:
            base = getattr(
                getattr(wrapped, "optimizer", None), "optimizer", None
            )  # wrapper -> ZeRO -> base
            if (
                held is None
                or base is None
                or held is base
                or held.param_groups is base.param_groups
            ):
                continue
            held.param_groups = base.param_groups
            applied = ["relink_offload_lr_scheduler"]
    return applied


@contextmanager
def fsdp_trainable_state_only(accelerator):
    """FSDP1 / FSDP2: inside the block, `save_state` and `load_state` write and read the model's
    trainable parameters only (a LoRA model's adapters, not its frozen base).

    Accelerate 1.15's `save_state` and `load_state` call `save_fsdp_model` / `load_fsdp_model`
    without `adapter_only`, so a LoRA checkpoint held the whole base; and its `adapter_only` load
    under FSDP1 (torch 2.13) matched peft's key names against FSDP1's wrapped ones and loaded
    nothing, silently: the resume restarted from the initial adapters. For the block, the names
    `accelerate.accelerator` imported are rebound to functions that save and load through torch's
    `get_model_state_dict` / `set_model_state_dict` with `ignore_frozen_params` (DCP, in the same
    `pytorch_model_fsdp_{i}` folder), then restored. The optimizer's state is Accelerate's own
    (it holds the trainable parameters only). Other strategies: nothing. Canary: `save_state` and
    `load_state` still call those names without `adapter_only`.

    Yields:
        ["fsdp_trainable_state_only"], or [] where this is not FSDP.
    """
    if accelerator.distributed_type != DistributedType.FSDP:
        yield []
        return
    import accelerate.accelerator as accelerator_module
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )

    trainable = StateDictOptions(ignore_frozen_params=True)

    def save_trainable(fsdp_plugin, accelerator, model, output_dir, model_index=0, **_):
        dcp.save(
            {"model": get_model_state_dict(model, options=trainable)},
            checkpoint_id=os.path.join(output_dir, f"pytorch_model_fsdp_{model_index}"),
        )

    def load_trainable(fsdp_plugin, accelerator, model, input_dir, model_index=0, **_):
        state_dict = get_model_state_dict(model, options=trainable)
        dcp.load(
            {"model": state_dict},
            checkpoint_id=os.path.join(input_dir, f"pytorch_model_fsdp_{model_index}"),
        )
        set_model_state_dict(
            model, state_dict, options=StateDictOptions(ignore_frozen_params=True, strict=False)
        )

    saved = accelerator_module.save_fsdp_model, accelerator_module.load_fsdp_model
    accelerator_module.save_fsdp_model, accelerator_module.load_fsdp_model = (
        save_trainable,
        load_trainable,
    )
    try:
        yield ["fsdp_trainable_state_only"]
    finally:
        accelerator_module.save_fsdp_model, accelerator_module.load_fsdp_model = saved


def fsdp1_cpu_state_dict(accelerator, model: torch.nn.Module) -> dict | None:
    """FSDP1 on a CPU-only host: the full state dict gathered without offloading; else None.

    `accelerator.get_state_dict`'s FULL_STATE_DICT gather with `offload_to_cpu=True` (Accelerate
    1.15's default) crashed with SIGSEGV under FSDP1 on CPU (torch 2.13), and offloading to the
    CPU means nothing when the tensors live there already. A collective: call on every rank.
    Canary: pinned to torch 2.13, and Accelerate's FSDP1 full state dict still offloads.

    Returns:
        name -> full-size tensor on rank 0 (the other ranks' dicts are empty); None when this
        is not FSDP1 on CPU (use `accelerator.get_state_dict`).
    """
    if (
        accelerator.distributed_type != DistributedType.FSDP
        or accelerator.is_fsdp2
        or accelerator.device.type != "cpu"
    ):
        return None
    from torch.distributed.fsdp import FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    with FSDP.state_dict_type(
        model,
        StateDictType.FULL_STATE_DICT,
        FullStateDictConfig(offload_to_cpu=False, rank0_only=True),
    ):
        return model.state_dict()


def trim_malloc_heap() -> list[str]:
    """Hand the heap pages glibc keeps after `free` back to the OS, before reading memory figures.

    glibc's malloc keeps freed heap pages mapped, so a process's resident set (RSS) counts
    memory that nothing holds any more, by the luck of where its last allocations fell.
    `malloc_trim(0)` returns them; RSS then counts what is live. Linux only.
    Canary: the C library is still glibc, with `malloc_trim`.
    """
    if sys.platform != "linux":
        return []
    import ctypes

    ctypes.CDLL(None).malloc_trim(0)
    return ["trim_malloc_heap"]


def safetensors_mode_from_umask(path: str) -> list[str]:
    """Give a `.safetensors` file, or those under a folder, the mode the umask allows (0644 under 022).

    safetensors 0.8 writes its files with mode 0600 (safetensors/safetensors#782), where
    `torch.save` and `open` give 0666 less the umask: an export or checkpoint that the team's
    group, or a serving job under another user, cannot read, beside a config.json that it can.
    Call on the rank that wrote them. Canary: safetensors still writes 0600 under umask 022.
    """
    umask = os.umask(0o077)  # (reading it means setting it: to a strict one for that moment)
    os.umask(umask)
    path = Path(path)
    files = [path] if path.is_file() else list(path.rglob("*.safetensors"))
    for f in files:
        f.chmod(0o666 & ~umask)
    return ["safetensors_mode_from_umask"] if files else []


def replicate_parallel_for_accelerate(accelerator) -> list[str]:
    """Tensor parallel: the `ReplicateParallel` style that Accelerate's `prepare` imports from transformers.

    Accelerate 1.15's `_prepare_tp` (FSDP2 path) turns each parameter that the tensor-parallel plan left
    whole (the RMSNorm weights) into a `Replicate` DTensor on the tp mesh and hooks its module with
    `transformers.integrations.tensor_parallel.ReplicateParallel().prepare_module_tp(module, tp_mesh)`;
    transformers 5.24 no longer has that class, so `prepare` fails with an ImportError. This defines it
    there as transformers 5.24's `local_params` style: the module runs its forward on the local copies of
    its (replicated) parameters, as the sliced projections hand it plain tensors. Their gradients are
    whole on every tp rank (the projections all-reduce the input gradient), so `Replicate` is exact.
    Call after building the Accelerator; without a tp dimension: no-op.
    Canary: Accelerate's `_prepare_tp` still imports the class, and transformers still lacks it.
    """
    import transformers.integrations.tensor_parallel as hf_tp

    config = getattr(accelerator, "parallelism_config", None)
    if config is None or not config.tp_enabled or hasattr(hf_tp, "ReplicateParallel"):
        return []
    from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES

    class ReplicateParallel:
        def prepare_module_tp(self, module, mesh):
            if not getattr(
                module, "_replicated_params_local", False
            ):  # once per module, not per parameter
                ALL_PARALLEL_STYLES["local_params"].install_forward(module, mesh)
                module._replicated_params_local = True

    hf_tp.ReplicateParallel = ReplicateParallel
    return ["replicate_parallel_for_accelerate"]


def gather_metrics_once_per_tp_group(accelerator) -> list[str]:
    """Tensor parallel: `accelerator.gather_for_metrics` keeps one copy of each tp group's rows.

    The ranks of a tp group evaluate the same batch. Accelerate 1.15 gathers from every rank, then
    truncates the last batch to the dataset's remainder, which it counts over the data-parallel
    ranks only: the rows kept are then the first data-parallel rank's twice, not each block once
    (measured: eval loss 1.2e-3 off one process on 13 blocks over dp_shard 2 x tp 2). This makes the
    gather inside `gather_for_metrics` keep the rows of tp rank 0 of each group (tp is the mesh's
    innermost dimension: rank = data-parallel rank x tp size + tp rank). Call after building the
    Accelerator; without a tp dimension: no-op.
    Canary: Accelerate's `gather_for_metrics` still returns every rank's rows.
    """
    from accelerate.utils import recursively_apply

    config = getattr(accelerator, "parallelism_config", None)
    if config is None or not config.tp_enabled:
        return []
    tp, plain = config.non_data_parallel_size, accelerator.gather_for_metrics

    def one_copy(tensor: torch.Tensor) -> torch.Tensor:  # [ranks x n, ...] -> [data ranks x n, ...]
        return tensor.reshape(
            -1, tp, tensor.shape[0] // (accelerator.num_processes), *tensor.shape[1:]
        )[:, 0].reshape(-1, *tensor.shape[1:])

    def gather_for_metrics(input_data, use_gather_object=False):
        accelerator.gather = lambda data: recursively_apply(
            one_copy, type(accelerator).gather(accelerator, data)
        )
        try:
            return plain(input_data, use_gather_object=use_gather_object)
        finally:
            del accelerator.gather  # the class's own again

    accelerator.gather_for_metrics = gather_for_metrics
    return ["gather_metrics_once_per_tp_group"]


# Stages: one call in the recipes for each point where workarounds apply.


def no_deepspeed_import_on_unwrap(accelerator) -> list[str]:
    """Keep `accelerator.unwrap_model` from importing DeepSpeed where no DeepSpeed engine can exist.

    Accelerate 1.15's `extract_model_from_parallel` imports deepspeed whenever it is installed,
    only to add `DeepSpeedEngine` to an isinstance test: about 1 s of CPU per rank at every DDP,
    FSDP or single-process export. A model can be a `DeepSpeedEngine` only once deepspeed is
    imported, so its `is_deepspeed_available` there becomes "deepspeed is imported": the same
    answer for every model. Under DeepSpeed: no-op. Canary: unwrapping a plain module still
    imports deepspeed.
    """
    from accelerate.utils import other

    patched = getattr(other.is_deepspeed_available, "__name__", "") == "deepspeed_imported"
    if patched or accelerator.distributed_type == DistributedType.DEEPSPEED:
        return []

    def deepspeed_imported() -> bool:
        return "deepspeed" in sys.modules

    other.is_deepspeed_available = deepspeed_imported
    return ["no_deepspeed_import_on_unwrap"]


def accelerator_built(accelerator) -> list[str]:
    """Right after `Accelerator(...)`: `install_cpu_grad_scaler`, `keep_fp32_reduction`,
    `replicate_parallel_for_accelerate`, `gather_metrics_once_per_tp_group`, `no_deepspeed_import_on_unwrap`."""
    return (
        install_cpu_grad_scaler(accelerator)
        + keep_fp32_reduction(accelerator)
        + replicate_parallel_for_accelerate(accelerator)
        + gather_metrics_once_per_tp_group(accelerator)
        + no_deepspeed_import_on_unwrap(accelerator)
    )


def prepared(accelerator, model) -> list[str]:
    """Right after `prepare`: `drop_fp32_output_copy`, then `eager_state_dict_keys`."""
    return drop_fp32_output_copy(accelerator, model) + eager_state_dict_keys(accelerator, model)
