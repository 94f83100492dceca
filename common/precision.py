"""Which mixed precision for which hardware, and fp16 with loss scaling on CPU ranks.

| hardware                          | bf16 | fp16                         | `auto` picks |
|-----------------------------------|------|------------------------------|--------------|
| CUDA compute capability >= 8.0    | yes  | yes                          | bf16         |
|   (Ampere A100/RTX 30xx, Ada, Hopper H100/H200, Blackwell)                |              |
| CUDA 7.x (Volta V100, Turing T4)  | no   | yes (fp16 tensor cores)      | fp16         |
| CUDA < 7.0 (Pascal and older)     | no   | storage only, no tensor cores| no (fp32)    |
| CPU                               | yes  | yes, slow without AVX512-FP16| bf16         |

bf16 has fp32's exponent range, so gradients neither underflow nor overflow and no loss
scaling is needed; fp16 has 5 exponent bits (max 65504, smallest normal 6.1e-5), so small
gradients underflow unless the loss is scaled up first (dynamic loss scaling, Micikevicius et
al. 2018, "Mixed Precision Training"). Choosing fp16 where bf16 exists buys that fragility for
nothing, which is why it is flagged for large models.

fp16 on CPU: Accelerate 1.15 builds its GradScaler and fp16 autocast only for non-CPU devices
(`Accelerator.__init__`: `mixed_precision == "fp16" and self.device.type != "cpu"`); on a CPU
rank `mixed_precision="fp16"` silently trains in plain fp32. torch 2.13 does support both
pieces on CPU (`torch.autocast("cpu", dtype=torch.float16)`, `torch.amp.GradScaler("cpu")`), so
`common.launch.install_cpu_grad_scaler` hands Accelerate the CPU scaler it did not build; from then on
backward scaling, unscale-before-clip, step skipping and checkpointing are Accelerate's own code.
"""

from __future__ import annotations

import os
import warnings

import torch

LARGE_MODEL_PARAMS = 1_000_000_000  # above this, fp16 on bf16-capable hardware draws a warning
MODES = ("auto", "no", "bf16", "fp16")


def detect_device() -> tuple[str, tuple[int, int] | None]:
    """The device this rank will train on and, for CUDA, its compute capability.

    Returns:
        ("cuda", (major, minor)) for the GPU of this rank (`LOCAL_RANK`), else ("cpu", None).
    """
    if torch.cuda.is_available():
        return "cuda", torch.cuda.get_device_capability(int(os.environ.get("LOCAL_RANK", 0)))
    return "cpu", None


def choose_precision(requested: str, device_type: str, capability: tuple[int, int] | None,
                     n_params: int) -> tuple[str, str]:
    """Pick the mixed precision for the hardware (a pure function: the device is an input).

    Args:
        requested: `--precision`, one of "auto", "no", "bf16", "fp16".
        device_type: "cuda" or "cpu" (anything else is trusted for explicit requests; "auto"
            then falls back to fp32).
        capability: CUDA compute capability (major, minor); ignored off CUDA.
        n_params: parameter count of the model (for the large-model fp16 warning).

    Returns:
        (mode, reason): mode is "no", "bf16" or "fp16" (Accelerate's names), reason one line
        for the log.

    Raises:
        ValueError: unknown `requested`, or bf16 requested on a CUDA GPU below compute
            capability 8.0 (no bf16 arithmetic there).

    Warns:
        UserWarning: fp16 requested on bf16-capable hardware for a model of at least
            `LARGE_MODEL_PARAMS` parameters.
    """
    if requested not in MODES:
        raise ValueError(f"--precision {requested!r}: choose one of {', '.join(MODES)}")
    cc = f"compute capability {capability[0]}.{capability[1]}" if device_type == "cuda" and capability else device_type
    bf16_ok = device_type == "cpu" or (device_type == "cuda" and capability is not None and capability >= (8, 0))
    fp16_tensor_cores = device_type == "cuda" and capability is not None and capability >= (7, 0)

    if requested == "bf16" and device_type == "cuda" and not bf16_ok:
        raise ValueError(f"--precision bf16: this GPU ({cc}) has no bf16 support, which needs compute capability "
                         "8.0+ (Ampere or newer); use --precision fp16 (loss-scaled) or --precision auto")
    if requested == "fp16" and bf16_ok and n_params >= LARGE_MODEL_PARAMS:
        warnings.warn(f"--precision fp16 on bf16-capable hardware ({cc}) for a {n_params / 1e9:.1f}B-parameter "
                      "model: fp16's narrow range needs loss scaling and can still overflow in large models; "
                      "bf16 needs neither and is at least as fast there. Use --precision bf16 unless you must match "
                      "an fp16 reference.", UserWarning, stacklevel=2)
    if requested != "auto":
        return requested, f"--precision {requested} as requested ({cc})"
    if bf16_ok:
        why = "bf16 autocast is supported on CPU" if device_type == "cpu" else "Ampere or newer has bf16 tensor cores"
        return "bf16", f"auto: {cc}: {why}; bf16 keeps fp32's range, so no loss scaling"
    if fp16_tensor_cores:
        return "fp16", f"auto: {cc} (Volta/Turing) has fp16 tensor cores but no bf16; fp16 with dynamic loss scaling"
    if device_type == "cuda":
        return "no", f"auto: {cc}: no bf16 and no fp16 tensor cores, so fp32"
    return "no", f"auto: no rule for device type {device_type!r}, so fp32; pass --precision bf16 or fp16 explicitly"


def keep_fp32_reduction(accelerator) -> None:
    """FSDP with bf16/fp16: compute in low precision, but reduce gradients (and return outputs) in
    fp32, and keep buffers (rotary `inv_freq`) in fp32.

    Accelerate's FSDP mixed-precision policy reduces gradients in the compute dtype, where most
    of the precision of a sum over ranks is lost, and (FSDP2) casts every wrapped module's output
    to it, which rounds the fp32 loss the model computes to bf16 (steps of 0.03 at a loss of 8);
    under fp16 the backward then starts by casting the loss scale itself (by default 65536, above
    fp16's max 65504) to fp16, so the first step overflows and is skipped (measured: it was).
    FSDP1's policy also has `buffer_dtype` = the compute dtype: its first forward rounds the rotary
    frequencies to bf16 (a phase error growing with position: 0.45 rad at 1023 for head dim 64),
    where DDP, FSDP2, DeepSpeed (0.19 casts parameters only) and the export keep them fp32.
    Call after building the Accelerator and before `prepare`; a no-op for other strategies.
    """
    from dataclasses import replace

    from accelerate.utils import DistributedType

    if accelerator.distributed_type != DistributedType.FSDP or accelerator.mixed_precision == "no":
        return
    plugin = accelerator.state.fsdp_plugin
    plugin.mixed_precision_policy = replace(plugin.mixed_precision_policy, reduce_dtype=torch.float32,
                                            **({"output_dtype": None} if accelerator.is_fsdp2 else
                                               {"buffer_dtype": torch.float32}))


def drop_fp32_output_copy(accelerator, model) -> bool:
    """Keep `prepare`'s autocast around the forward, but not its fp32 copy of every output.

    Under bf16/fp16 autocast (single process, DDP, FSDP), `accelerator.prepare` wraps the model's
    forward in autocast and then in `convert_outputs_to_fp32`, which returns an fp32 copy of every
    low-precision output: for a causal LM the whole B x T x V logits (4·B·T·V bytes: 8.4 GB at
    8 x 2048 tokens and a 128k vocabulary), which nothing reads, since the model's loss upcasts the
    logits itself (huggingface/accelerate#3477). Measured with benchmarks/overhead.py on the debug
    model: 4% of a step; losses, gradient norms and eval losses bitwise equal without it. Outputs
    stay in the compute dtype: cast what you read (`metrics.token_nll` does, in slices).
    Call right after `prepare`, before the first forward (a compiled model traces it then).

    Returns:
        True if a copy was dropped; False when there was none (fp32, DeepSpeed: its engine casts).
    """
    from types import MethodType

    from accelerate.utils import get_mixed_precision_context_manager

    if not accelerator.native_amp:
        return False
    autocast = get_mixed_precision_context_manager(accelerator.native_amp, accelerator.autocast_handler)
    # The module whose forward prepare wrapped, and any copy of it that runs instead: regional
    # compilation (--dynamo_use_regional_compilation) builds a new top module whose __dict__ holds
    # the wrapped forward rebound to it; DDP / FSDP1 (.module) and whole-model compile (._orig_mod)
    # hold it inside.
    candidates = [model, getattr(model, "module", None), getattr(model, "_orig_mod", None)]
    candidates += [getattr(c, "module", None) for c in candidates[1:] if c is not None]
    candidates.append(accelerator.unwrap_model(model, keep_torch_compile=False))
    dropped = False
    for module in {id(c): c for c in candidates if isinstance(c, torch.nn.Module)}.values():
        original = module.__dict__.get("_original_forward")  # set by prepare when it wrapped the forward
        if original is None:
            continue
        if hasattr(original, "__func__"):
            module.forward = MethodType(autocast(original.__func__), module)
        else:
            module.forward = autocast(original)
        dropped = True
    return dropped


MIN_LOSS_SCALE = 1.0  # DeepSpeed's default `min_loss_scale`; torch's GradScaler has no floor of its own
SKIPS_IN_A_ROW_WARNING = 10


def loss_scale(accelerator, model=None) -> float | None:
    """The current fp16 loss scale, or None when the run has no loss scaling (fp32, bf16).

    Reads Accelerate's `GradScaler`, or under DeepSpeed fp16 the engine's optimizer
    (`cur_scale`); pass the prepared `model` (the engine) for the latter.
    """
    if accelerator.scaler is not None:
        return float(accelerator.scaler.get_scale())
    optimizer = getattr(model, "optimizer", None)  # DeepSpeed engine
    if accelerator.mixed_precision == "fp16" and hasattr(optimizer, "cur_scale"):
        return float(optimizer.cur_scale)
    return None


def skipped_step_warning(scale: float | None, skipped_in_a_row: int, min_scale: float = MIN_LOSS_SCALE) -> str | None:
    """Judge the fp16 loss scale after an optimizer step; call on every rank after each step.

    A step whose gradients overflowed is skipped and the scale halved; a few skips early in a
    run are normal (the scale searches downwards from 65536). Ten in a row means the gradients
    are not finite at any scale: the weights or the LR have gone bad, and the run only burns
    time while the scale decays towards 0.

    Args:
        scale: `loss_scale(...)` after the step (None: no loss scaling, nothing to judge).
        skipped_in_a_row: consecutive skipped steps up to and including this one.
        min_scale: the floor; a scale below it stops the run.

    Returns:
        A warning line when exactly `SKIPS_IN_A_ROW_WARNING` steps in a row were skipped, else None.

    Raises:
        ValueError: the scale fell below `min_scale` (the run must stop; the message says why).
    """
    if scale is None:
        return None
    if scale < min_scale:
        raise ValueError(f"the fp16 loss scale fell to {scale:g}, below its minimum {min_scale:g}, after "
                         f"{skipped_in_a_row} skipped steps in a row: the gradients overflow at any scale. Lower "
                         "--learning_rate, lengthen --warmup_steps, or train in bf16")
    if skipped_in_a_row == SKIPS_IN_A_ROW_WARNING:
        return (f"warning: {skipped_in_a_row} fp16 steps in a row skipped for inf/NaN gradients (loss scale now "
                f"{scale:g}); the run stops if the scale falls below {min_scale:g}")
    return None


def precision_name(mixed_precision: str) -> str:
    """Accelerate's mixed-precision name as a user reads it: "no" is "fp32"."""
    return "fp32" if mixed_precision == "no" else mixed_precision


class NonFiniteGuard:
    """Stops a run whose training loss or gradient norm went inf/NaN, without a host read per step.

    Outside fp16 loss scaling nothing stops such a step: DDP and FSDP let AdamW apply NaN gradients
    (every weight turns NaN and the export holds nothing else), DeepSpeed skips every step from
    then on (the export holds the last good weights, and the run still reports each step). fp16
    has its own rule (a skipped step, then `skipped_step_warning`), so the guard is off there.

    `record` folds each step's verdict into a device tensor (no sync: on a GPU the host never
    waits for it); `problem` reads it, a collective, where the recipe reads values anyway: at
    logging steps, and before every checkpoint and export, so no non-finite weights are saved.

    Args:
        accelerator: the run's `Accelerator`; model: the prepared model (DeepSpeed: its engine),
            to tell fp16 loss scaling (`loss_scale`) apart.
    """

    def __init__(self, accelerator, model=None):
        self.accelerator = accelerator
        self.precision = precision_name(accelerator.mixed_precision)
        self.on = loss_scale(accelerator, model) is None
        # [first bad step (0: none yet), its loss, its gradient norm], float64 on the device
        self.first = torch.zeros(3, dtype=torch.float64, device=accelerator.device)

    def record(self, step: int, loss, norm) -> None:
        """Note optimizer step `step` (1-based): `loss` this rank's loss of the step, `norm` the global
        gradient norm (0-dim tensors on the run's device, or floats). No host read, no host-to-device copy."""
        if not self.on:
            return
        loss, norm = (v.detach().to(torch.float64) if isinstance(v, torch.Tensor) else
                      torch.full((), v, dtype=torch.float64, device=self.first.device) for v in (loss, norm))
        new = (self.first[0] == 0) & ~(torch.isfinite(loss) & torch.isfinite(norm))
        self.first = torch.where(new, torch.stack([torch.full_like(loss, step), loss, norm.to(loss.device)]), self.first)

    def problem(self) -> str | None:
        """One line naming the first step whose loss or gradient norm was not finite on any rank, or None.
        A collective (call it on every rank at the same step) and a host read."""
        if not self.on:
            return None
        rows = self.accelerator.gather(self.first[None]).tolist()  # [ranks, 3]
        bad = [r for r in rows if r[0] > 0]
        if not bad:
            return None
        step, loss, norm = min(bad)
        return (f"step {step:.0f}: the training loss is {loss:g} and the gradient norm {norm:g} in {self.precision}; "
                "stopped before saving any weights (only fp16 loss scaling skips such a step and goes on). Lower "
                "--learning_rate, lengthen --warmup_steps, keep --max_grad_norm clipping on, or check the data")
