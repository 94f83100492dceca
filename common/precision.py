"""Which mixed precision for which hardware, and fp16 with loss scaling on CPU ranks.

One rule for every device: bf16 where the device computes it natively; fp16 only where it has
fast fp16 and no bf16 (Volta/Turing GPUs); otherwise fp32.

| hardware                          | bf16      | fp16                          | `auto` picks |
|-----------------------------------|-----------|-------------------------------|--------------|
| CUDA compute capability >= 8.0    | yes       | yes                           | bf16         |
|   (Ampere A100/RTX 30xx, Ada, Hopper H100/H200, Blackwell)                    |              |
| CUDA 7.x (Volta V100, Turing T4)  | no        | yes (fp16 tensor cores)       | fp16         |
| CUDA < 7.0 (Pascal and older)     | no        | storage only, no tensor cores | no (fp32)    |
| CPU with AVX512-BF16 or AMX       | yes       | emulated unless AVX512-FP16   | bf16         |
|   (Intel Cooper Lake, Sapphire Rapids and later; AMD Zen 4 and later; Arm with BF16)     |
| CPU without (AVX2, plain AVX-512) | emulated  | emulated                      | no (fp32)    |

"Emulated" on a CPU: torch computes it in software, one element at a time. Measured on a 2-core
AMD EPYC (Zen 3, AVX2): a bf16 or fp16 matmul about 50x, and a recipes/llama.py step about 14x,
slower than fp32. So an accelerate config's `mixed_precision: bf16` (every YAML's) means "bf16
where the hardware has it": on such a CPU the run trains in fp32 and says so in one line and in
run_info.json. `accelerate launch --mixed_precision bf16` (on the launch line, not in the YAML)
forces the emulated mode, to test bf16 numerics; the run says it is emulated.

Native CPU bf16 is read from the instruction set that torch reports (`torch.cpu.
_is_avx512_bf16_supported`, `_is_amx_tile_supported`; on Arm, oneDNN's bf16 support, which there
means the BF16 extension), not measured: a measurement could come out differently on two ranks.
`ONEDNN_MAX_CPU_ISA` set below bf16 (e.g. AVX2) counts as no bf16: oneDNN then emulates it.
oneDNN's own x86 bf16 check (`torch.ops.mkldnn._is_mkldnn_bf16_supported`) is not used: it also
says yes on AVX-512 CPUs without bf16 instructions (Skylake, Cascade Lake), which convert in software.

bf16 has fp32's exponent range, so gradients neither underflow nor overflow and no loss
scaling is needed; fp16 has 5 exponent bits (max 65504, smallest normal 6.1e-5), so small
gradients underflow unless the loss is scaled up first (dynamic loss scaling, Micikevicius et
al. 2018, "Mixed Precision Training"). Choosing fp16 where bf16 exists buys that fragility for
nothing, which is why it is flagged for large models.

fp16 on CPU: Accelerate 1.15 builds its GradScaler and fp16 autocast only for non-CPU devices
(`Accelerator.__init__`: `mixed_precision == "fp16" and self.device.type != "cpu"`); on a CPU
rank `mixed_precision="fp16"` silently trains in plain fp32. torch 2.13 does support both
pieces on CPU (`torch.autocast("cpu", dtype=torch.float16)`, `torch.amp.GradScaler("cpu")`), so
`common.workarounds.install_cpu_grad_scaler` hands Accelerate the CPU scaler it did not build; from
then on backward scaling, unscale-before-clip, step skipping and checkpointing are Accelerate's own
code. FSDP's fp32 gradient reduction and the dropped fp32 copy of the outputs are workarounds too
(`keep_fp32_reduction`, `drop_fp32_output_copy`).
"""

from __future__ import annotations

import os
import warnings

import torch

from common.errors import Stop

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


def onednn_cap() -> str | None:
    """`ONEDNN_MAX_CPU_ISA` when it keeps oneDNN below bf16 instructions (then its bf16 and fp16
    matmuls are emulated on any x86 CPU: how the suite reproduces an AVX2 host on a newer one), else None."""
    isa = os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper()
    return (
        isa
        if isa in ("SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX512_CORE", "AVX512_CORE_VNNI")
        else None
    )


def cpu_native_dtypes() -> set[str]:
    """The low precisions this CPU computes natively: its hardware's, none under `onednn_cap`."""
    return set() if onednn_cap() else cpu_hardware_dtypes()


def cpu_hardware_dtypes() -> set[str]:
    """The low precisions this CPU has instructions for: a subset of {"bf16", "fp16"} (see the module docstring)."""
    import platform

    if platform.machine().lower() in ("arm64", "aarch64"):
        return {"bf16"} if torch.ops.mkldnn._is_mkldnn_bf16_supported() else set()
    native = set()
    if torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported():
        native.add("bf16")
    if torch.ops.mkldnn._is_mkldnn_fp16_supported():  # AVX512-FP16 or AMX-FP16
        native.add("fp16")
    return native


def native_dtypes(device_type: str, capability: tuple[int, int] | None) -> set[str]:
    """The low precisions `device_type` computes natively: bf16 from CUDA 8.0 on, fp16 from 7.0; CPUs by their ISA."""
    if device_type == "cuda":
        return {
            d
            for d, cc in (("bf16", (8, 0)), ("fp16", (7, 0)))
            if capability is not None and capability >= cc
        }
    return cpu_native_dtypes() if device_type == "cpu" else set()


def device_name(device_type: str, capability: tuple[int, int] | None) -> str:
    """The device in a log line: "compute capability 8.0", or "this CPU (AVX2)": torch's CPU capability,
    then its bf16 extensions ("this CPU (AVX512, AVX512-BF16, AMX)") and an `ONEDNN_MAX_CPU_ISA` cap."""
    if device_type == "cuda" and capability:
        return f"compute capability {capability[0]}.{capability[1]}"
    if device_type == "cpu":
        isa = [torch.backends.cpu.get_cpu_capability()]
        isa += [
            name
            for name, has in (
                ("AVX512-BF16", torch.cpu._is_avx512_bf16_supported),
                ("AMX", torch.cpu._is_amx_tile_supported),
            )
            if has()
        ]
        isa += [f"ONEDNN_MAX_CPU_ISA={onednn_cap()}"] if onednn_cap() else []
        return f"this CPU ({', '.join(isa)})"
    return device_type


def _lacks(cc: str, dtype: str) -> str:
    """Why a CPU emulates `dtype`: "this CPU (AVX2) has no bf16 instructions", or the oneDNN cap's doing."""
    if onednn_cap() and dtype in cpu_hardware_dtypes():
        return f"{cc}: the cap keeps oneDNN from {dtype} instructions"
    return f"{cc} has no {dtype} instructions"


def choose_precision(
    requested: str,
    device_type: str,
    capability: tuple[int, int] | None,
    n_params: int,
    forced: bool = True,
) -> tuple[str, str]:
    """Pick the mixed precision for the hardware (the device is an input; a CPU's ISA is `cpu_native_dtypes`).

    Args:
        requested: "auto", "no", "bf16" or "fp16" (`--precision`, or the accelerate config's mixed_precision).
        device_type: "cuda" or "cpu" (anything else is trusted for explicit requests; "auto"
            then falls back to fp32).
        capability: CUDA compute capability (major, minor); ignored off CUDA.
        n_params: parameter count of the model (for the large-model fp16 warning).
        forced: the user asked for `requested` on the command line (`--precision`, or
            `accelerate launch --mixed_precision`): on a CPU that only emulates it, it is kept and
            called emulated. False for a config file's default: such a CPU trains in fp32 instead.

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
        raise Stop(f"--precision {requested!r}: choose one of {', '.join(MODES)}")
    cc = device_name(device_type, capability)
    native = native_dtypes(device_type, capability)
    if requested == "bf16" and device_type == "cuda" and "bf16" not in native:
        raise Stop(
            f"--precision bf16: this GPU ({cc}) has no bf16 support, which needs compute capability "
            "8.0+ (Ampere or newer); use --precision fp16 (loss-scaled) or --precision auto"
        )
    if requested == "fp16" and "bf16" in native and n_params >= LARGE_MODEL_PARAMS:
        warnings.warn(
            f"--precision fp16 on bf16-capable hardware ({cc}) for a {n_params / 1e9:.1f}B-parameter "
            "model: fp16's narrow range needs loss scaling and can still overflow in large models; "
            "bf16 needs neither and is at least as fast there. Use --precision bf16 unless you must match "
            "an fp16 reference.",
            UserWarning,
            stacklevel=2,
        )
    if requested in ("bf16", "fp16") and device_type == "cpu" and requested not in native:
        if forced:
            return requested, (
                f"{requested} as requested, emulated: {_lacks(cc, requested)}, so each "
                f"step is several times slower than fp32 (about 14x for llama.py on AVX2)"
            )
        return "no", (
            f"fp32, not the config's {requested}: {_lacks(cc, requested)}, and emulating it is several "
            f"times slower; force it with `accelerate launch --mixed_precision {requested}`"
        )
    if requested != "auto":
        return requested, f"{requested} as requested ({cc})"
    if "bf16" in native:
        why = (
            "bf16 instructions" if device_type == "cpu" else "Ampere or newer has bf16 tensor cores"
        )
        return "bf16", f"auto: {cc}: {why}; bf16 keeps fp32's range, so no loss scaling"
    if "fp16" in native and device_type == "cuda":
        return (
            "fp16",
            f"auto: {cc} (Volta/Turing) has fp16 tensor cores but no bf16; fp16 with dynamic loss scaling",
        )
    if device_type in ("cuda", "cpu"):
        return "no", f"auto: {cc}: no bf16 and no fast fp16, so fp32"
    return (
        "no",
        f"auto: no rule for device type {device_type!r}, so fp32; pass --precision bf16 or fp16 explicitly",
    )


def for_launch(launch_config: dict, hardware: dict) -> dict:
    """The precision a launch trains in: its mixed_precision, kept where the hardware computes it (`choose_precision`).

    Args:
        launch_config: `checks.launch_config_from_env()`: "mixed_precision" and "mixed_precision_forced".
        hardware: `checks.detect_hardware()`: "device_type", "capability".

    Returns:
        {"requested", "used", "reason"} for run_info.json; pass "used" to `Accelerator(mixed_precision=...)`.
        When the two differ, or the precision is emulated, rank 0 prints the reason as one line.
        A GPU keeps what was asked: `checks.config_problems` refuses bf16 below compute capability 8.0.
    """
    requested = launch_config.get("mixed_precision") or "no"
    if hardware["device_type"] != "cpu":
        return {"requested": requested, "used": requested, "reason": f"{requested} as requested"}
    used, reason = choose_precision(
        requested,
        hardware["device_type"],
        hardware["capability"],
        0,  # before the model: no large-model fp16 warning
        forced=launch_config.get("mixed_precision_forced", True),
    )
    if (used != requested or "emulated" in reason) and int(os.environ.get("RANK", 0)) == 0:
        print(f"precision: {reason}", flush=True)
    return {"requested": requested, "used": used, "reason": reason}


MIN_LOSS_SCALE = (
    1.0  # DeepSpeed's default `min_loss_scale`; torch's GradScaler has no floor of its own
)
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


def loss_scale_verdict(
    scale: float | None, skipped_in_a_row: int, min_scale: float = MIN_LOSS_SCALE
) -> tuple[str | None, str | None]:
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
        (warning, error): a warning line when exactly `SKIPS_IN_A_ROW_WARNING` steps in a row were
        skipped; the reason to stop (one line, without "error:") when the scale fell below `min_scale`.
    """
    if scale is None:
        return None, None
    if scale < min_scale:
        return None, (
            f"the fp16 loss scale fell to {scale:g}, below its minimum {min_scale:g}, after "
            f"{skipped_in_a_row} skipped steps in a row: the gradients overflow at any scale. Lower "
            "--learning_rate, lengthen --warmup_steps, or train in bf16"
        )
    if skipped_in_a_row == SKIPS_IN_A_ROW_WARNING:
        return (
            f"warning: {skipped_in_a_row} fp16 steps in a row skipped for inf/NaN gradients (loss scale now "
            f"{scale:g}); the run stops if the scale falls below {min_scale:g}"
        ), None
    return None, None


def precision_name(mixed_precision: str) -> str:
    """Accelerate's mixed-precision name as a user reads it: "no" is "fp32"."""
    return "fp32" if mixed_precision == "no" else mixed_precision


class NonFiniteGuard:
    """Stops a run whose training loss or gradient norm went inf/NaN, without a host read per step.

    Outside fp16 loss scaling nothing stops such a step: DDP and FSDP let AdamW apply NaN gradients
    (every weight turns NaN and the export holds nothing else), DeepSpeed skips every step from
    then on (the export holds the last good weights, and the run still reports each step). fp16
    has its own rule (a skipped step, then `loss_scale_verdict`), so the guard is off there.

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
        """One line naming the first step whose loss or gradient norm was not finite on any rank, or None.
        A collective (call it on every rank at the same step) and a host read."""
        if not self.on:
            return None
        rows = self.accelerator.gather(self.first[None]).tolist()  # [ranks, 3]
        bad = [r for r in rows if r[0] > 0]
        if not bad:
            return None
        step, loss, norm = min(bad)
        return (
            f"step {step:.0f}: the training loss is {loss:g} and the gradient norm {norm:g} in {self.precision}; "
            "stopped before saving any weights (only fp16 loss scaling skips such a step and goes on). Lower "
            "--learning_rate, lengthen --warmup_steps, keep --max_grad_norm clipping on, or check the data"
        )


class StepHealth:
    """What each optimizer step changed, judged in one place: fp16 steps skipped for inf/NaN
    gradients (a long run of them stops the run: `loss_scale_verdict`), windows without one
    target token (--packing false and empty rows; the recipe skips them whole), and a non-finite
    loss or gradient norm outside fp16 (`NonFiniteGuard`: read only when `problem` is asked to).

    The skip counts go into each checkpoint (`state`) and come back on a resume (`saved`).

    Args:
        accelerator: the run's `Accelerator`; model: the prepared model (DeepSpeed: its engine).
        saved: the resumed checkpoint's state ({} or without the counts: a fresh run).
        min_scale: the fp16 loss scale below which the run stops (`loss_scale_verdict`).
    """

    def __init__(self, accelerator, model, saved: dict, min_scale: float = MIN_LOSS_SCALE):
        self.accelerator, self.model, self.min_scale = accelerator, model, min_scale
        self.nonfinite = NonFiniteGuard(accelerator, model)
        self.skipped_steps = saved.get("skipped_steps", 0)
        self.empty_windows = saved.get("empty_windows", 0)
        self.skipped_in_a_row, self.scale_error = saved.get("skipped_in_a_row", 0), None

    def after_step(self, step: int, has_targets: bool, loss, norm) -> None:
        """Judge optimizer step `step` (1-based): `has_targets` false for a skipped empty window
        (the first one warns); else count an fp16 skip (a warning for a long run of them) and
        record this rank's `loss` and the global gradient `norm` on the device (no host read)."""
        self.scale_error = None
        if not has_targets:
            self.empty_windows += 1
            if self.empty_windows == 1:
                self.accelerator.print(
                    f"warning: step {step}: no target tokens in the whole "
                    "window; skipped (no optimizer, scheduler or weight-decay "
                    "update)"
                )
            return
        skipped = self.accelerator.optimizer_step_was_skipped
        self.skipped_steps += skipped
        self.skipped_in_a_row = self.skipped_in_a_row + 1 if skipped else 0
        warning, error = loss_scale_verdict(
            loss_scale(self.accelerator, self.model), self.skipped_in_a_row, self.min_scale
        )
        if warning:
            self.accelerator.print(warning)
        self.scale_error = f"step {step}: {error}" if error else None
        self.nonfinite.record(step, loss, norm)

    def problem(self, read: bool) -> str | None:
        """Why the run must stop now, as one line, or None: the fp16 loss scale's collapse at
        the last step, else, if `read` (a collective and a host read: at logging steps and before
        every checkpoint and export), the first step whose loss or norm was not finite."""
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
        """Print a warning for each kind of step skipped in the run's `steps`; returns the
        summary's counts (empty_windows; skipped_steps under fp16 loss scaling)."""
        if self.empty_windows:
            self.accelerator.print(
                f"warning: {self.empty_windows} of {steps} windows had no "
                "target tokens and were skipped"
            )
        if self.skipped_steps:
            self.accelerator.print(
                f"warning: {self.skipped_steps} of {steps} "
                f"{precision_name(self.accelerator.mixed_precision)} steps "
                "were skipped for inf/NaN gradients"
            )
        fp16 = loss_scale(self.accelerator, self.model) is not None
        return {
            "empty_windows": self.empty_windows,
            **({"skipped_steps": self.skipped_steps} if fp16 else {}),
        }
