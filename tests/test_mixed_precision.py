"""recipes/mixed_precision.py and common/precision.py: the precision choice per device, fp16 loss
scaling with a real Accelerator and GradScaler, and real 2-rank launches under ddp and fsdp."""

import copy
import json
import math
import os
import re
import subprocess
import sys

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState

from conftest import (
    REPO,
    host_reads,
    launch,
    ordinary_step_reads,
    preempt,
    run_in_process,
    strict_json,
    strict_lines,
)

sys.path.insert(0, str(REPO))
from common import precision  # noqa: E402
from common.grad_norm import clip_grad_norm_  # noqa: E402
from common.workarounds import drop_fp32_output_copy, install_cpu_grad_scaler  # noqa: E402

RECIPE = "recipes/mixed_precision.py"
SMALL, LARGE = 4_212_992, 1_235_814_400  # the debug preset; Llama-3.2-1B
# fp32 and bf16 train the same model on the same batches: |fp32 - bf16| of the summary losses after
# 4 steps of 1 x 64 tokens per rank, nats/token, measured on a 2-core AVX-512 CPU with native bf16
# and again with its AVX2 kernels (ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2: bf16 emulated,
# an AVX2 host's figures): DDP train 5.6e-5 / 2.4e-6, eval 2.3e-5 / 2.3e-4; FSDP2 train 4.6e-4 /
# 6.6e-5, eval 3.5e-4 / 2.5e-4. About 10x the worse of the two, per strategy and key: far below
# the ~0.5 nats/token learned.
LOSS_TOLERANCE = {
    "ddp": {"train_loss": 6e-4, "eval_loss": 2.5e-3},
    "fsdp": {"train_loss": 5e-3, "eval_loss": 3.5e-3},
}
# FSDP2's bf16 run against DDP's, same measurements: per logged step, relative, loss 6.5e-5 / 9.2e-6
# and grad norm 1.6e-3 / 2.7e-3; the summary eval loss 3.3e-4 / 2.3e-5 nats/token. About 10x.
BF16_FSDP_VS_DDP = {"loss": 7e-4, "grad_norm": 3e-2, "eval_loss": 3.5e-3}
# The debug preset's AdamW groups: 29 matrices (embedding, tied to the LM head, + 7 per layer) decay,
# the 9 RMSNorm gains (2 per layer + the final one, 256 each) do not.
ADAMW_GROUPS = (
    "AdamW weight decay: 0.1 on 29 tensors (4,210,688 elements), 0 on 9 tensors (2,304 elements)"
)


# --- the precision choice, with the device capability mocked (the function takes it as input) ----


@pytest.fixture
def cpu_isa(monkeypatch):
    """Set what this CPU computes natively: cpu_isa({"bf16"}) for AVX512-BF16/AMX, cpu_isa(set()) for AVX2.
    Without ONEDNN_MAX_CPU_ISA (the suite run as on an AVX2 host, tests/docs): the CPU alone decides."""
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)

    def fake(native):
        monkeypatch.setattr(precision, "_cpu_native_dtypes", lambda: set(native))
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: "bf16" in native)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)

    return fake


@pytest.mark.parametrize(
    "device_type, capability, cpu_native, expected",
    [
        ("cuda", (7, 0), set(), "fp16"),  # V100
        ("cuda", (7, 5), set(), "fp16"),  # T4
        ("cuda", (8, 0), set(), "bf16"),  # A100
        ("cuda", (9, 0), set(), "bf16"),  # H100/H200
        ("cpu", None, {"bf16"}, "bf16"),  # AVX512-BF16 or AMX (Sapphire Rapids, Zen 4)
        ("cpu", None, {"bf16", "fp16"}, "bf16"),
        ("cpu", None, set(), "no"),  # AVX2 (Zen 3, most client CPUs): bf16 would be emulated
        ("cuda", (6, 1), set(), "no"),  # Pascal: neither bf16 nor fp16 tensor cores
    ],
)
def test_auto_picks_precision_for_the_hardware(
    device_type, capability, cpu_native, expected, cpu_isa
):
    cpu_isa(cpu_native)
    mode, reason = precision.choose_precision("auto", device_type, capability, SMALL)
    assert mode == expected
    assert reason.startswith("auto:") and "\n" not in reason  # one log line that says why


def test_a_config_default_follows_the_cpu_and_the_launch_line_forces_it(
    cpu_isa, capsys, monkeypatch
):
    """The YAML's bf16 on a CPU without bf16 instructions trains in fp32 and says so; `accelerate
    launch --mixed_precision bf16` keeps bf16 and calls it emulated; a native CPU keeps bf16 silently."""
    monkeypatch.setenv("RANK", "0")
    isa = torch.backends.cpu.get_cpu_capability()
    cpu_isa(set())
    for requested in ("bf16", "fp16"):
        mode, reason = precision.choose_precision(requested, "cpu", None, SMALL, forced=False)
        assert mode == "no" and f"this CPU ({isa}) has no {requested} instructions" in reason
        assert f"force it with `accelerate launch --mixed_precision {requested}`" in reason
        mode, reason = precision.choose_precision(requested, "cpu", None, SMALL, forced=True)
        assert mode == requested and "emulated" in reason
    got = precision.for_launch(
        {"mixed_precision": "bf16", "mixed_precision_forced": False},
        {"device_type": "cpu", "capability": None},
    )
    assert got == {"requested": "bf16", "used": "no", "reason": got["reason"]}
    assert capsys.readouterr().out == f"precision: {got['reason']}\n"  # one line, rank 0
    cpu_isa({"bf16"})
    for forced in (False, True):
        got = precision.for_launch(
            {"mixed_precision": "bf16", "mixed_precision_forced": forced},
            {"device_type": "cpu", "capability": None},
        )
        assert (
            got["used"] == "bf16"
            and "emulated" not in got["reason"]
            and f"({isa}, AVX512-BF16)" in got["reason"]
        )
    assert capsys.readouterr().out == ""  # nothing to say where the config is followed
    # a config's fp16 on a bf16 CPU without fp16 instructions: fp32; a GPU keeps what it is given
    assert precision.choose_precision("fp16", "cpu", None, SMALL, forced=False)[0] == "no"
    assert precision.choose_precision("fp16", "cuda", (7, 5), SMALL, forced=False)[0] == "fp16"
    assert precision.choose_precision("no", "cpu", None, SMALL, forced=False)[0] == "no"


def test_native_bf16_is_read_from_the_instruction_set():
    """Against /proc/cpuinfo, which torch does not read: bf16 is native with avx512_bf16 or amx_bf16."""
    if not os.path.exists("/proc/cpuinfo") or os.uname().machine != "x86_64":
        pytest.skip("x86 Linux only")
    flags = set(next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split())
    capped = (
        os.environ.get("ONEDNN_MAX_CPU_ISA") == "AVX2"
    )  # the suite run as on an AVX2 host: no bf16
    assert ("bf16" in precision._cpu_native_dtypes()) == (
        bool(flags & {"avx512_bf16", "amx_bf16"}) and not capped
    )
    assert ("fp16" in precision._cpu_native_dtypes()) <= bool(flags & {"avx512_fp16", "amx_fp16"})


def test_onednn_capped_below_bf16_counts_as_no_bf16(monkeypatch):
    """ONEDNN_MAX_CPU_ISA=AVX2 makes oneDNN emulate bf16 even on a CPU that has it: the rule says fp32,
    and the reason names the cap there (the CPU on one without); a cap that keeps bf16 changes nothing."""
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    for has_bf16, why in [
        (False, "ONEDNN_MAX_CPU_ISA=AVX2) has no bf16 instructions"),
        (True, "ONEDNN_MAX_CPU_ISA=AVX2): the cap keeps oneDNN from bf16 instructions"),
    ]:
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda has=has_bf16: has)
        assert precision._cpu_native_dtypes() == set()
        reason = precision.choose_precision("bf16", "cpu", None, SMALL, forced=False)[1]
        assert why in reason, reason
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_AMX")
    assert "bf16" in precision._cpu_native_dtypes() and "ONEDNN" not in precision.device_name(
        "cpu", None
    )


def test_bf16_requested_without_bf16_hardware_is_an_error():
    with pytest.raises(
        ValueError,
        match=r"--precision bf16: this GPU \(compute capability 7\.0\) has no bf16 support",
    ):
        precision.choose_precision("bf16", "cuda", (7, 0), SMALL)
    assert precision.choose_precision("bf16", "cuda", (8, 0), SMALL)[0] == "bf16"


@pytest.mark.parametrize("device_type, capability", [("cuda", (8, 0)), ("cpu", None)])
def test_fp16_on_bf16_hardware_warns_for_a_large_model_only(
    device_type, capability, cpu_isa, capsys, monkeypatch
):
    cpu_isa({"bf16"})
    monkeypatch.delenv("RANK", raising=False)  # errors.warn: rank 0 (or no launcher) prints
    assert precision.choose_precision("fp16", device_type, capability, LARGE)[0] == "fp16"
    assert re.match(
        r"warning: --precision fp16 on bf16-capable hardware .* 1.2B-parameter",
        capsys.readouterr().err,
    )
    # a small model, or hardware without bf16: no warning
    assert precision.choose_precision("fp16", device_type, capability, SMALL)[0] == "fp16"
    assert precision.choose_precision("fp16", "cuda", (7, 0), LARGE)[0] == "fp16"
    assert capsys.readouterr().err == ""


def test_unknown_precision_is_an_error():
    with pytest.raises(ValueError, match="--precision 'fp8'"):
        precision.choose_precision("fp8", "cpu", None, SMALL)


# --- the flags: common/args.py's core TrainingArguments flags, checked before any launch work -----


def test_a_non_empty_output_dir_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    for argv in ([], ["--compare"]):  # the --compare driver checks its own folder the same way
        message = run_in_process(monkeypatch, RECIPE, "--output_dir", out, "--max_steps", 3, *argv)
        assert message.startswith(
            f"error: --output_dir {out} already holds files (metrics.jsonl)"
        ), message
        assert "\n" not in message and [p.name for p in out.iterdir()] == ["metrics.jsonl"]
        assert (out / "metrics.jsonl").read_text() == '{"step": 1}\n'  # untouched


# --- fp16 loss scaling with the real Accelerator and GradScaler, in this process -----------------


@pytest.fixture
def fresh_accelerate_state():
    """Accelerate's state is a per-process singleton: start and leave this process without one."""
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def test_prepared_forward_keeps_autocast_without_the_fp32_logits_copy(fresh_accelerate_state):
    """`prepare` under bf16 returned an fp32 copy of the B x T x V logits that nothing read (4% of a
    step, benchmarks/overhead.py); `drop_fp32_output_copy` keeps autocast and drops the copy."""
    from common import memory, models
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(models.llama_config("debug", vocab_size=4096))
    accelerator = Accelerator(mixed_precision="bf16", cpu=True)
    model = accelerator.prepare(model)
    ids = torch.randint(0, 4096, (2, 64))

    def forward():
        with memory.PeakTensorBytes() as meter:
            out = model(input_ids=ids, labels=ids)
        return out, meter.net  # bytes still held after the forward: activations and the outputs

    (with_copy, held_with), elements = forward(), ids.numel() * 4096
    assert with_copy.logits.dtype == torch.float32  # Accelerate's convert_outputs_to_fp32
    assert drop_fp32_output_copy(accelerator, model)
    without, held_without = forward()
    assert without.logits.dtype == torch.bfloat16  # autocast still on: bf16 matmuls
    assert torch.equal(without.loss, with_copy.loss) and without.loss.dtype == torch.float32
    assert torch.equal(without.logits.float(), with_copy.logits)
    # until backward, the output holds 2-byte logits instead of 4-byte ones (the bf16 ones were freed)
    assert held_with - held_without == 2 * elements, (held_with, held_without, elements)
    assert not drop_fp32_output_copy(
        Accelerator(cpu=True), torch.nn.Linear(2, 2)
    )  # fp32: nothing to drop


def test_the_fp32_logits_copy_goes_under_regional_compilation_too(fresh_accelerate_state):
    """Regional compilation runs a new top module holding prepare's wrapped forward: drop it there."""
    from accelerate.utils import TorchDynamoPlugin
    from common import models
    from transformers import LlamaForCausalLM

    plugin = TorchDynamoPlugin(
        backend="eager", use_regional_compilation=True
    )  # eager: no C++ build
    accelerator = Accelerator(mixed_precision="bf16", dynamo_plugin=plugin, cpu=True)
    model = accelerator.prepare(LlamaForCausalLM(models.llama_config("debug", vocab_size=512)))
    ids = torch.randint(0, 512, (1, 16))
    assert model(input_ids=ids).logits.dtype == torch.float32
    assert drop_fp32_output_copy(accelerator, model)
    assert model(input_ids=ids).logits.dtype == torch.bfloat16


def test_injected_inf_gradient_skips_the_step_and_halves_the_scale(
    fresh_accelerate_state, tmp_path
):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 1))
    reference = copy.deepcopy(model)  # fp32, for the true gradient norm
    accelerator = Accelerator(mixed_precision="fp16", cpu=True)
    assert (
        accelerator.scaler is None
    )  # what Accelerate 1.15 does on CPU: fp16 would silently be fp32
    assert install_cpu_grad_scaler(accelerator)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    x, y = torch.randn(16, 32), torch.randn(16, 1)

    # A clean step: the loss is computed in fp16, scaled for backward, unscaled before clipping.
    dtypes = []
    model[0].register_forward_hook(lambda mod, inp, out: dtypes.append(out.dtype))
    loss = torch.nn.functional.mse_loss(model(x), y)
    assert dtypes == [torch.float16]  # autocast really is on
    accelerator.backward(loss)
    assert (
        max(p.grad.abs().max() for p in model.parameters()) > 100
    )  # the gradients hold loss x 65536
    norm = clip_grad_norm_(accelerator, model, 1e9)  # what the recipes call
    torch.nn.functional.mse_loss(reference(x), y).backward()
    true_norm = torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()])
    # unscaled before the clip: a norm still scaled would be 65536x; 1e-2 covers the fp16 model's
    # rounding against the fp32 reference (a reason, not a measured figure)
    assert float(norm) == pytest.approx(true_norm.item(), rel=1e-2)
    optimizer.step()
    optimizer.zero_grad()
    assert not accelerator.optimizer_step_was_skipped
    assert accelerator.scaler.get_scale() == 65536.0

    # The drill: an inf in one gradient. The step must not touch the weights or Adam's state.
    before = [p.detach().clone() for p in model.parameters()]
    adam_steps = [optimizer.state[p]["step"].item() for p in model.parameters()]
    accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
    with torch.no_grad():
        model[2].weight.grad[0, 0] = float("inf")
    assert math.isinf(clip_grad_norm_(accelerator, model, 1.0))
    optimizer.step()
    optimizer.zero_grad()
    assert accelerator.optimizer_step_was_skipped
    assert accelerator.scaler.get_scale() == 32768.0  # halved (backoff_factor 0.5)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert [optimizer.state[p]["step"].item() for p in model.parameters()] == adam_steps

    # The scale is part of the checkpoint, and comes back with it.
    accelerator.save_state(str(tmp_path / "ckpt"))
    assert (tmp_path / "ckpt" / "scaler.pt").is_file()
    accelerator.scaler.update(new_scale=1024.0)
    accelerator.load_state(str(tmp_path / "ckpt"))
    assert accelerator.scaler.get_scale() == 32768.0


# --- the recipe, launched for real: 2 gloo ranks under DDP and FSDP2 ------------------------------

# bf16 and fp16 are emulated on AVX2 CPUs (~14x slower than fp32): short runs of small blocks. Every
# launch that is compared with another trains with these flags: 4 steps of 1 x 64 tokens per rank.
STEPS = 4
RUN = [
    "--max_steps",
    STEPS,
    "--logging_steps",
    2,
    "--warmup_steps",
    1,
    "--per_device_train_batch_size",
    1,
    "--block_size",
    64,
    "--max_eval_samples",
    8,
    "--ddp_timeout",
    120,
]


@pytest.fixture(scope="module")
def compared(tmp_path_factory, cache_dir):
    """The --compare driver under DDP, once for the module: no, bf16 and fp16 launched one after another
    with RUN, every process under the device guard and logging its reads of tensor values. Into
    folders that already hold files, with --overwrite_output_dir: the driver checks its own folder,
    and passes the flag on to each launch, which checks its own.

    Returns (the driver's folder, its CompletedProcess, {"no": reads, "bf16": reads}) with reads as
    conftest's `host_reads` gives them ({rank: [...]}).
    """
    out, reads_dir = tmp_path_factory.mktemp("compare"), tmp_path_factory.mktemp("compare-reads")
    (out / "notes.txt").write_text("an earlier run\n")
    (out / "no").mkdir()
    (out / "no" / "metrics.jsonl").write_text('{"step": 99, "loss": 1.0}\n')
    args = [
        "--compare",
        "--config_file",
        REPO / "accelerate_configs" / "ddp.yaml",
        "--output_dir",
        out,
        "--overwrite_output_dir",
        *RUN,
    ]
    env = {
        **os.environ,
        "ACCELERATE_RECIPES_CACHE": cache_dir,
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "HOST_READS_DIR": str(reads_dir),  # inherited by each launch
        "PYTHONPATH": os.pathsep.join(
            filter(None, [str(REPO / "tests" / "device_guard"), os.environ.get("PYTHONPATH")])
        ),
    }
    proc = subprocess.run(
        [sys.executable, str(REPO / RECIPE), *map(str, args)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    # A process writes its log at exit: the two ranks of each launch in turn, then the driver.
    logs = sorted(reads_dir.glob("rank*.json"), key=lambda p: p.stat().st_mtime_ns)
    assert len(logs) == 7 and not json.loads(logs[-1].read_text())["reads"], [p.name for p in logs]
    reads = {}
    for mode, pair in (
        ("no", logs[0:2]),
        ("bf16", logs[2:4]),
    ):  # (fp16 reads its loss scale every step)
        reads[mode] = {
            int(p.name[4:].split("-")[0]): json.loads(p.read_text())["reads"] for p in pair
        }
    return out, proc, reads


def step_lines(path):
    """The step records of a metrics.jsonl (standard JSON), without the run's summary line."""
    return [r for r in strict_lines(path) if not r.get("summary")]


def assert_no_reads_in_ordinary_steps(reads, mode):
    """No read of a device value in an ordinary step (a GPU stall each): only logging steps read."""
    assert sorted(reads) == [0, 1] and all(any(r[3] == 2 for r in log) for log in reads.values())
    for rank, log in reads.items():
        project = [r for r in ordinary_step_reads(log, 2, STEPS) if r[0] == "project"]
        assert not project, (
            f"{mode} rank {rank}: reads of tensor values in ordinary steps: {project[:4]}"
        )


@pytest.mark.parametrize("config", ["ddp", "fsdp"])
def test_fp32_and_bf16_losses_agree(config, compared, tmp_path, cache_dir, monkeypatch):
    """DDP: the driver's fp32 and bf16 launches. FSDP: a bf16 launch against the same fp32 run, as fp32
    trains the same under either (losses and activations equal to the last bit, measured): that
    also catches an FSDP that trains differently."""
    out, proc, reads = compared
    fp32 = strict_json((out / "no" / "summary.json").read_text())
    runs = {"no": (proc.stdout, fp32, reads["no"])}
    if config == "ddp":
        runs["bf16"] = (
            proc.stdout,
            strict_json((out / "bf16" / "summary.json").read_text()),
            reads["bf16"],
        )
    else:
        bf16_out, reads_dir = tmp_path / "bf16", tmp_path / "reads"
        reads_dir.mkdir()
        monkeypatch.setenv(
            "HOST_READS_DIR", str(reads_dir)
        )  # log every read of a tensor value (device_guard)
        bf16_proc = launch(
            config,
            RECIPE,
            "--precision",
            "bf16",
            "--output_dir",
            bf16_out,
            *RUN,
            cache_dir=cache_dir,
        )
        runs["bf16"] = (
            bf16_proc.stdout,
            strict_json((bf16_out / "summary.json").read_text()),
            host_reads(reads_dir),
        )
    for mode, (stdout, summary, mode_reads) in runs.items():
        assert f"precision: {mode} ({mode} as requested" in stdout
        assert_no_reads_in_ordinary_steps(mode_reads, mode)
        assert ADAMW_GROUPS in stdout  # no weight decay on the norm gains (centred on 1, not 0)
    bf16 = runs["bf16"][1]
    assert fp32["world_size"] == 2 and fp32["distributed_type"] == "MULTI_CPU"
    assert (
        bf16["world_size"] == 2
        and bf16["distributed_type"] == {"ddp": "MULTI_CPU", "fsdp": "FSDP2"}[config]
    )
    for s in (fp32, bf16):
        assert s["steps"] == STEPS and s["train_loss"] < 7.9  # from ln(4096) = 8.3 nats/token
    for key in ("train_loss", "eval_loss"):
        assert abs(fp32[key] - bf16[key]) < LOSS_TOLERANCE[config][key], (key, fp32, bf16)
    if (
        config == "fsdp"
    ):  # the same answer under both strategies in bf16 too: FSDP2's bf16 run against DDP's,
        # every logged step's loss and grad norm (both runs' metrics.jsonl), and the eval loss
        ddp_steps, fsdp_steps = (
            step_lines(out / "bf16" / "metrics.jsonl"),
            step_lines(bf16_out / "metrics.jsonl"),
        )
        assert [r["step"] for r in ddp_steps] == [r["step"] for r in fsdp_steps] == [2, 4]
        for a, b in zip(ddp_steps, fsdp_steps):
            for key in ("loss", "grad_norm"):
                assert abs(b[key] - a[key]) / abs(a[key]) < BF16_FSDP_VS_DDP[key], (key, a, b)
        ddp_bf16 = strict_json((out / "bf16" / "summary.json").read_text())
        assert abs(ddp_bf16["eval_loss"] - bf16["eval_loss"]) < BF16_FSDP_VS_DDP["eval_loss"], (
            ddp_bf16,
            bf16,
        )
    # fp32 master weights and gradients in both modes (FSDP: half of them on each rank); bf16 only
    # shrinks what is saved for backward
    sharding = {"ddp": 1, "fsdp": 2}[config]
    assert (
        fp32["parameter_bytes"] == fp32["gradient_bytes"] == 4 * fp32["n_params"]
    )  # DDP: all on each rank
    assert (
        bf16["parameter_bytes"] * sharding
        == bf16["gradient_bytes"] * sharding
        == fp32["parameter_bytes"]
    )
    assert (
        bf16["activation_bytes"] < 0.8 * fp32["activation_bytes"]
    )  # measured at 1 x 64: 0.73 (ddp), 0.62 (fsdp)
    assert fp32["weight_copy_bytes"] == 0
    # DDP autocast saves a bf16 copy of every matmul weight (all but the 2L+1 norm vectors; the
    # embedding is the tied LM head). FSDP2 gathers the weights in bf16 and frees them: no copies.
    matmul_params = fp32["n_params"] - 256 * (2 * 4 + 1)
    assert bf16["weight_copy_bytes"] == {"ddp": 2 * matmul_params, "fsdp": 0}[config]


def test_fp16_skips_the_overflowed_step_and_checkpoints_the_scale(tmp_path, cache_dir):
    """The inf drill under FSDP2, 2 ranks: the skip and the halving seen through DTensor gradients, whose
    overflow check and norm are reduced over the shards, then a resume. DDP's plain-tensor path is the
    real Accelerator's in this process (test_injected_inf_gradient_skips_the_step_and_halves_the_scale:
    the same `install_cpu_grad_scaler`, `clip_grad_norm_`, skip, halving and scaler.pt round trip), its
    2-rank fp16 launch the --compare driver's; the logged fields below are the recipe's on any strategy."""
    config, out = "fsdp", tmp_path / "fp16"
    fast = [
        "--precision",
        "fp16",
        "--output_dir",
        out,
        "--logging_steps",
        1,
        "--per_device_train_batch_size",
        1,
        "--block_size",
        64,
        "--max_eval_samples",
        2,
        "--ddp_timeout",
        120,
    ]  # fp16 is slow on this CPU: small batch
    proc = launch(
        config,
        RECIPE,
        *fast,
        "--max_steps",
        3,
        "--inject_inf_grad_at_step",
        2,
        "--save_steps",
        3,
        cache_dir=cache_dir,
    )
    assert "GradScaler('cpu') installed" in proc.stdout
    steps = step_lines(out / "metrics.jsonl")
    assert [r["step"] for r in steps] == [1, 2, 3]
    before, hit = steps[0], steps[1]
    assert before["skipped_steps"] == 0 and hit["skipped_steps"] == 1  # step 2 skipped
    assert hit["loss_scale"] == before["loss_scale"] / 2 == 32768
    assert [r["skipped_steps"] for r in steps] == [0, 1, 1]  # cumulative, on every line
    assert hit["grad_norm"] is None and hit["nonfinite"] == [
        "grad_norm"
    ]  # the inf norm, as standard JSON
    assert (
        steps[2]["lr"] == hit["lr"] != before["lr"]
    )  # the schedule did not advance on the skipped step
    finite = [r["grad_norm"] for r in steps if r["grad_norm"] is not None]
    assert (
        len(finite) == 2 and max(finite) < 100
    )  # unscaled norms (scaled ones would be ~1e4-1e5 times larger)
    marker = json.loads((out / "checkpoint-3" / "COMPLETE.json").read_text())
    assert marker["skipped_steps"] == 1 and marker["skipped_in_a_row"] == 0
    # (the AdamW groups of a checkpoint's optimizer.bin: DDP's, in the SIGTERM test below)

    # Resume: the scale comes back from checkpoint-3/scaler.pt (not --init_scale), the skipped-step
    # count from its COMPLETE.json (not 0). A second overflow at step 5 halves the restored scale to
    # 16384, below --min_loss_scale 32768: the run logs that step and stops with an error.
    proc = launch(
        config,
        RECIPE,
        *fast,
        "--max_steps",
        5,
        "--resume_from_checkpoint",
        "latest",
        "--inject_inf_grad_at_step",
        5,
        "--min_loss_scale",
        32768,
        cache_dir=cache_dir,
        check=False,
    )
    assert f"resumed from {out / 'checkpoint-3'} at step 3" in proc.stdout, proc.stdout[-3000:]
    assert proc.returncode != 0
    errors = {
        line for line in proc.stderr.splitlines() if line.startswith("error:")
    }  # the same on each rank
    assert len(errors) == 1 and next(iter(errors)).startswith(
        "error: step 5: the fp16 loss scale fell to 16384, below its minimum 32768, after 1 skipped steps in a row"
    ), proc.stderr[-3000:]
    steps = step_lines(out / "metrics.jsonl")
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5]
    resumed, hit = steps[3], steps[4]
    assert resumed["loss_scale"] == 32768 and resumed["skipped_steps"] == 1  # step 4 not skipped
    assert hit["loss_scale"] == 16384 and hit["skipped_steps"] == 2  # step 5 skipped


def test_fp32_has_no_safety_net_so_the_run_stops_at_the_bad_step(tmp_path, cache_dir):
    """The same inf gradient without a GradScaler: nothing can skip the step (the weights would turn
    NaN), so the run logs it and stops there with one line, before the checkpoint of step 2. Every
    file stays standard JSON: null + "nonfinite"."""
    out = tmp_path / "fp32"
    proc = launch(
        "ddp",
        RECIPE,
        "--precision",
        "no",
        "--output_dir",
        out,
        "--max_steps",
        3,
        "--logging_steps",
        1,
        "--inject_inf_grad_at_step",
        2,
        "--save_steps",
        2,
        "--per_device_train_batch_size",
        1,
        "--block_size",
        64,
        "--max_eval_samples",
        8,
        "--ddp_timeout",
        120,
        cache_dir=cache_dir,
        check=False,
    )
    assert proc.returncode != 0
    steps = step_lines(out / "metrics.jsonl")
    assert [r["step"] for r in steps] == [1, 2]
    assert steps[1]["grad_norm"] is None and steps[1]["nonfinite"] == ["grad_norm"]
    assert math.isfinite(steps[1]["loss"])  # the inf is in the gradients
    # no loss scaling in fp32: no scale, no skipped steps
    assert all("loss_scale" not in r and "skipped_steps" not in r for r in steps)
    errors = {
        line[line.index("error:") :]
        for line in proc.stderr.splitlines()
        if "error:" in line and "traceback :" not in line
    }  # (torchrun's summary repeats it, cut short)
    assert len(errors) == 1, proc.stderr[-3000:]
    assert re.fullmatch(
        r"error: step 2: the training loss is [0-9.]+ and the gradient norm inf in fp32; stopped "
        r"before saving any weights .*",
        next(iter(errors)),
    ), errors
    assert not list(out.glob("checkpoint-*")) and not (out / "summary.json").exists()


def test_sigterm_saves_exits_143_and_the_resume_is_exact(compared, tmp_path, cache_dir):
    """The driver's fp32 launch (RUN under ddp.yaml, --precision no) again, preempted in step 1 (SIGTERM
    to the launcher: conftest.preempt checks the save, the line and each rank's 143), then resumed with
    --resume_from_checkpoint latest: it ends as the uninterrupted run did. Measured: every logged value
    and the summary's losses equal to the last bit (the bound is the suite's fp32 one, 1e-6 relative).
    RUN's step 1 applies LR 0 (warmup), so checkpoint-1 holds the initial weights but not the initial
    optimizer: Adam's moments and the schedule (a resume that loaded nothing logged LR 0.0 at step 2)."""
    out, flags = tmp_path / "run", ["--precision", "no", *RUN]
    step, _ = preempt("ddp", RECIPE, *flags, out=out, cache_dir=cache_dir)
    assert (
        step == 1
    )  # the signal arrives while step 1 trains (its first micro batch is measured: the slowest)
    assert not (out / "metrics.jsonl").read_text()  # step 1 is not a logging step
    # the optimizer the run trained with: no decay on the 9 norm gains (1-D), 0.1 on the rest (Adam's
    # moments exist from step 1 on, LR 0 or not)
    groups = torch.load(out / "checkpoint-1" / "optimizer.bin", weights_only=True)
    shapes = [
        [groups["state"][i]["exp_avg"].dim() for i in g["params"]] for g in groups["param_groups"]
    ]
    assert [g["weight_decay"] for g in groups["param_groups"]] == [0.1, 0.0]
    assert set(shapes[0]) == {2} and shapes[1] == [1] * 9
    proc = launch(
        "ddp",
        RECIPE,
        *flags,
        "--output_dir",
        out,
        "--resume_from_checkpoint",
        "latest",
        cache_dir=cache_dir,
    )
    assert f"resumed from {out / 'checkpoint-1'} at step 1" in proc.stdout, proc.stdout[-3000:]
    reference = step_lines(compared[0] / "no" / "metrics.jsonl")
    got = step_lines(out / "metrics.jsonl")
    assert [r["step"] for r in got] == [r["step"] for r in reference] == [2, 4]
    for a, b in zip(reference, got):  # the logged loss, norm and LR are the step's own
        for key in [k for k in ("loss", "grad_norm", "lr", "eval_loss") if k in a]:
            assert b[key] == pytest.approx(a[key], rel=1e-6, abs=0), (key, a, b)
    want, summary = (
        strict_json((d / "summary.json").read_text()) for d in (compared[0] / "no", out)
    )
    for key in ("train_loss", "eval_loss"):
        assert summary[key] == pytest.approx(want[key], rel=1e-6, abs=0), (key, want, summary)
    assert summary["steps"] == STEPS


def test_compare_prints_the_table(compared):
    """The --compare driver: three real 2-rank launches, one row each (the runs of the test above)."""
    out, proc, _ = compared
    assert proc.stdout.count("--overwrite_output_dir True") == 3  # on each launch's command line
    table = (out / "comparison.md").read_text().strip()
    assert table in proc.stdout
    assert (
        f"MULTI_CPU x2 on cpu, debug Llama, global batch 2 x 64 tokens, {STEPS} steps."
        in table.splitlines()[0]
    )
    rows = [
        line.split("|")[1].strip() for line in table.splitlines()[4:]
    ]  # title, blank, header, rule
    assert rows == ["no", "bf16", "fp16"]
    assert [r["step"] for r in step_lines(out / "no" / "metrics.jsonl")] == [
        2,
        4,
    ]  # the stale line is gone
    fp16 = strict_json((out / "fp16" / "summary.json").read_text())
    assert (
        fp16["loss_scale"] == 65536.0 and fp16["skipped_steps"] == 0 and fp16["precision"] == "fp16"
    )
