"""Which mixed precision for which hardware (docs/configs.md#precision), and each step's health.

bf16 where computed natively (CUDA 8.0+, AVX512-BF16 or AMX, Arm BF16), fp16 on CUDA 7.x, else
fp32: a config's bf16 on a CPU that emulates it (~14x slower) only if the launch line forces it."""

from __future__ import annotations

import os
import platform

import torch

from common import errors
from common.errors import Stop

LARGE_MODEL_PARAMS = 1_000_000_000  # above this, fp16 on bf16-capable hardware draws a warning
MODES = ("auto", "no", "bf16", "fp16")
MIN_LOSS_SCALE = 1.0  # DeepSpeed's default `min_loss_scale`; torch's GradScaler has no floor
SKIPS_IN_A_ROW_WARNING = 10


def detect_device() -> tuple[str, tuple[int, int] | None]:
    """("cuda", compute capability) for this rank's GPU (`LOCAL_RANK`), else ("cpu", None)."""
    if torch.cuda.is_available():
        return "cuda", torch.cuda.get_device_capability(int(os.environ.get("LOCAL_RANK", 0)))
    return "cpu", None


def onednn_cap() -> str | None:
    """`ONEDNN_MAX_CPU_ISA` when it keeps oneDNN below bf16 instructions, else None."""
    isa = os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper()
    below = ("SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX512_CORE", "AVX512_CORE_VNNI")
    return isa if isa in below else None


def _cpu_native_dtypes() -> set[str]:
    """The low precisions this CPU computes natively: its hardware's, none under `onednn_cap`."""
    return set() if onednn_cap() else cpu_hardware_dtypes()


def cpu_hardware_dtypes() -> set[str]:
    """The low precisions this CPU has instructions for (oneDNN's x86 check says yes on AVX-512)."""
    if platform.machine().lower() in ("arm64", "aarch64"):
        return {"bf16"} if torch.ops.mkldnn._is_mkldnn_bf16_supported() else set()
    bf16 = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    fp16 = torch.ops.mkldnn._is_mkldnn_fp16_supported()  # AVX512-FP16 or AMX-FP16
    return {name for name, has in (("bf16", bf16), ("fp16", fp16)) if has}


def device_name(device_type: str, capability: tuple[int, int] | None) -> str:
    """The device in a log line: "compute capability 8.0", or "this CPU (AVX512, AVX512-BF16, AMX)"."""
    if device_type == "cuda" and capability:
        return f"compute capability {capability[0]}.{capability[1]}"
    if device_type != "cpu":
        return device_type
    isa = [torch.backends.cpu.get_cpu_capability()]
    isa += ["AVX512-BF16"] if torch.cpu._is_avx512_bf16_supported() else []
    isa += ["AMX"] if torch.cpu._is_amx_tile_supported() else []
    isa += [f"ONEDNN_MAX_CPU_ISA={onednn_cap()}"] if onednn_cap() else []
    return f"this CPU ({', '.join(isa)})"


def choose_precision(requested, device_type, capability, n_params, forced=True) -> tuple[str, str]:
    """(Accelerate's mode "no"/"bf16"/"fp16" for the hardware, one log line). `requested`: one of
    `MODES`; `forced`: a CPU that only emulates it keeps it rather than falling back to fp32."""
    if requested not in MODES:
        raise Stop(f"--precision {requested!r}: choose one of {', '.join(MODES)}")
    cc = device_name(device_type, capability)
    if device_type == "cuda":
        native = {d for d, v in (("bf16", (8, 0)), ("fp16", (7, 0))) if (capability or ()) >= v}
    else:
        native = _cpu_native_dtypes() if device_type == "cpu" else set()
    if requested == "bf16" and device_type == "cuda" and "bf16" not in native:
        raise Stop(
            f"--precision bf16: this GPU ({cc}) has no bf16 support, which needs compute "
            "capability 8.0+ (Ampere or newer); use --precision fp16 (loss-scaled) or --precision auto"
        )
    if requested == "fp16" and "bf16" in native and n_params >= LARGE_MODEL_PARAMS:
        errors.warn(
            f"--precision fp16 on bf16-capable hardware ({cc}) for a {n_params / 1e9:.1f}B-parameter "
            "model: fp16's narrow range needs loss scaling and can still overflow in large models; "
            "bf16 needs neither and is at least as fast there. Use --precision bf16 unless you must "
            "match an fp16 reference."
        )
    if requested in ("bf16", "fp16") and device_type == "cpu" and requested not in native:
        if onednn_cap() and requested in cpu_hardware_dtypes():
            lacks = f"{cc}: the cap keeps oneDNN from {requested} instructions"
        else:
            lacks = f"{cc} has no {requested} instructions"
        if forced:
            return requested, (
                f"{requested} as requested, emulated: {lacks}, so each step is several times "
                "slower than fp32 (about 14x for llama.py on AVX2)"
            )
        return "no", (
            f"fp32, not the config's {requested}: {lacks}, and emulating it is several times "
            f"slower; force it with `accelerate launch --mixed_precision {requested}`"
        )
    if requested != "auto":
        return requested, f"{requested} as requested ({cc})"
    if "bf16" in native:
        why = "bf16 instructions" if device_type == "cpu" else "Ampere or newer: bf16 tensor cores"
        return "bf16", f"auto: {cc}: {why}; bf16 keeps fp32's range, so no loss scaling"
    if "fp16" in native and device_type == "cuda":
        return "fp16", f"auto: {cc} (Volta/Turing): fp16 tensor cores, no bf16; loss-scaled fp16"
    return "no", f"auto: {cc}: no bf16 and no fast fp16, so fp32"


def for_launch(launch_config: dict, hardware: dict) -> dict:
    """{"requested", "used", "reason"}: the config's mixed_precision if the hardware computes it."""
    requested = launch_config.get("mixed_precision") or "no"
    if hardware["device_type"] != "cpu":
        return {"requested": requested, "used": requested, "reason": f"{requested} as requested"}
    forced = launch_config.get("mixed_precision_forced", True)
    used, reason = choose_precision(requested, "cpu", None, 0, forced)  # 0: no model yet
    if (used != requested or "emulated" in reason) and int(os.environ.get("RANK", 0)) == 0:
        print(f"precision: {reason}", flush=True)
    return {"requested": requested, "used": used, "reason": reason}


def loss_scale(accelerator, model=None) -> float | None:
    """The fp16 loss scale (DeepSpeed's: pass its engine as `model`), or None."""
    if accelerator.scaler is not None:
        return float(accelerator.scaler.get_scale())
    optimizer = getattr(model, "optimizer", None)  # DeepSpeed engine
    if accelerator.mixed_precision == "fp16" and hasattr(optimizer, "cur_scale"):
        return float(optimizer.cur_scale)
    return None


def _loss_scale_verdict(
    scale: float | None, skipped_in_a_row: int, step: int, min_scale: float = MIN_LOSS_SCALE
) -> str | None:
    """After step `step` (every rank): why the run must stop (the scale below `min_scale`: it
    overflows at any scale), or None; `SKIPS_IN_A_ROW_WARNING` skips in a row warn."""
    if scale is None:
        return None
    if scale < min_scale:
        return (
            f"the fp16 loss scale fell to {scale:g}, below its minimum {min_scale:g}, after "
            f"{skipped_in_a_row} skipped steps in a row: the gradients overflow at any scale. "
            "Lower --learning_rate, lengthen --warmup_steps, or train in bf16"
        )
    if skipped_in_a_row == SKIPS_IN_A_ROW_WARNING:
        errors.warn(
            f"step {step}: {skipped_in_a_row} fp16 steps in a row skipped for inf/NaN gradients "
            f"(loss scale now {scale:g}); the run stops if the scale falls below {min_scale:g}"
        )
    return None


def precision_name(mixed_precision: str) -> str:
    """Accelerate's mixed-precision name as a user reads it: "no" is "fp32"."""
    return "fp32" if mixed_precision == "no" else mixed_precision


class NonFiniteGuard:
    """Stops a run whose loss or grad norm went inf/NaN (fp16's skipped steps aside) before a save:
    `record` keeps the first bad step on the device, `problem` reads it with the recipe's values."""

    def __init__(self, accelerator, model=None):
        self.accelerator = accelerator
        self.precision = precision_name(accelerator.mixed_precision)
        self.on = loss_scale(accelerator, model) is None
        # [first bad step (0: none yet), its loss, its gradient norm], float64 on the device
        self.first = torch.zeros(3, dtype=torch.float64, device=accelerator.device)

    def record(self, step: int, loss, norm) -> None:
        """Step `step`'s loss on this rank and global gradient norm (0-dim tensors or floats)."""
        if not self.on:
            return
        loss, norm = (
            v.detach().to(torch.float64)
            if isinstance(v, torch.Tensor)
            else torch.full((), v, dtype=torch.float64, device=self.first.device)
            for v in (loss, norm)
        )
        new = (self.first[0] == 0) & ~(torch.isfinite(loss) & torch.isfinite(norm))
        self.first = torch.where(
            new, torch.stack([torch.full_like(loss, step), loss, norm.to(loss.device)]), self.first
        )

    def problem(self) -> str | None:
        """The first bad step on any rank, as one line, or None. A collective and a host read."""
        if not self.on:
            return None
        rows = self.accelerator.gather(self.first[None]).tolist()  # [ranks, 3]
        bad = [r for r in rows if r[0] > 0]
        if not bad:
            return None
        step, loss, norm = min(bad)
        return (
            f"step {step:.0f}: the training loss is {loss:g} and the gradient norm {norm:g} in "
            f"{self.precision}; stopped before saving any weights (only fp16 loss scaling skips "
            "such a step and goes on). Lower --learning_rate, lengthen --warmup_steps, keep "
            "--max_grad_norm clipping on, or check the data"
        )


class StepHealth:
    """Each optimizer step judged: fp16 skips, windows without a target token, inf/NaN. The counts
    go into each checkpoint (`state`) and come back on a resume (`saved`)."""

    def __init__(self, accelerator, model, saved: dict, min_scale: float = MIN_LOSS_SCALE):
        self.accelerator, self.model, self.min_scale = accelerator, model, min_scale
        self.nonfinite = NonFiniteGuard(accelerator, model)
        self.skipped_steps = saved.get("skipped_steps", 0)
        self.empty_windows = saved.get("empty_windows", 0)
        self.skipped_in_a_row, self.scale_error = saved.get("skipped_in_a_row", 0), None

    def after_step(self, step: int, has_targets: bool, loss, norm) -> None:
        """Judge step `step`: an empty window (the first warns), an fp16 skip, `loss` and `norm`."""
        self.scale_error = None
        if not has_targets:
            self.empty_windows += 1
            if self.empty_windows == 1:
                errors.warn(
                    f"step {step}: no target tokens in the whole window; skipped (no optimizer, "
                    "scheduler or weight-decay update)"
                )
            return
        skipped = self.accelerator.optimizer_step_was_skipped
        self.skipped_steps += skipped
        self.skipped_in_a_row = self.skipped_in_a_row + 1 if skipped else 0
        scale = loss_scale(self.accelerator, self.model)
        error = _loss_scale_verdict(scale, self.skipped_in_a_row, step, self.min_scale)
        self.scale_error = f"step {step}: {error}" if error else None
        self.nonfinite.record(step, loss, norm)

    def problem(self, read: bool) -> str | None:
        """Why the run must stop, or None; `read` (a collective and a host read) checks inf/NaN."""
        return self.scale_error or (self.nonfinite.problem() if read else None)

    def scale_fields(self) -> dict:
        """{"loss_scale", "skipped_steps"} for a step line under fp16 loss scaling, else {}."""
        scale = loss_scale(self.accelerator, self.model)
        return {} if scale is None else {"loss_scale": scale, "skipped_steps": self.skipped_steps}

    def state(self) -> dict:
        """The counts a checkpoint keeps."""
        return {
            "skipped_steps": self.skipped_steps,
            "skipped_in_a_row": self.skipped_in_a_row,
            "empty_windows": self.empty_windows,
        }

    def end_of_run(self, steps: int) -> dict:
        """Warn once for each kind of skipped step; returns the summary's counts."""
        if self.empty_windows:
            errors.warn(
                f"{self.empty_windows} of {steps} windows had no target tokens and were skipped"
            )
        if self.skipped_steps:
            errors.warn(
                f"{self.skipped_steps} of {steps} {precision_name(self.accelerator.mixed_precision)} "
                "steps were skipped for inf/NaN gradients"
            )
        fp16 = {"skipped_steps": self.skipped_steps} if self.scale_fields() else {}
        return {"empty_windows": self.empty_windows, **fp16}
