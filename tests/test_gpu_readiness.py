"""What would break on a first GPU run, simulated on CPU: the GPU is mocked, or a
device without host storage (`meta`) stands in for CUDA, and a byte meter stands in for the
CUDA allocator's statistics."""

import math
import sys
import types

import pytest
import torch
import torch.nn.functional as F
from accelerate.utils import DistributedType

from conftest import REPO, run_in_process

sys.path.insert(0, str(REPO))
from common import checks, grad_norm, metrics, precision  # noqa: E402
from common.memory import PeakTensorBytes  # noqa: E402

RECIPES = [
    "llama",
    "ddp_classifier",
    "sharded_data",
    "gradient_checkpointing",
]  # precision from the launch config


# --- bf16 on a GPU without it: every recipe refuses at start-up ---------------------------------


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_refuses_bf16_on_a_gpu_without_it(recipe, tmp_path, monkeypatch):
    """A V100/T4 (compute capability 7.x) with the YAMLs' bf16: Accelerate would emulate it,
    slowly and silently. The recipe must stop before building anything."""
    monkeypatch.setattr(precision, "detect_device", lambda: ("cuda", (7, 0)))
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    data = (
        ("--data_dir", tmp_path / "shards") if recipe == "sharded_data" else ()
    )  # a full command line
    message = run_in_process(
        monkeypatch,
        f"recipes/{recipe}.py",
        "--output_dir",
        tmp_path / "out",
        "--max_steps",
        3,
        *data,
    )
    assert (
        message.startswith("error: mixed_precision bf16") and "compute capability 7.0" in message
    ), message
    assert "--mixed_precision fp16" in message


def test_launch_precision_check_by_hardware(monkeypatch):
    def problems(requested):
        return [
            str(p)
            for p in checks.config_problems(
                {"mixed_precision": requested}, hardware=checks.detect_hardware()
            )
        ]

    for device, requested in [
        (("cuda", (8, 0)), "bf16"),
        (("cuda", (7, 5)), "fp16"),
        (("cpu", None), "bf16"),
        (("cuda", (7, 0)), "no"),
    ]:
        monkeypatch.setattr(precision, "detect_device", lambda d=device: d)
        assert problems(requested) == [], (device, requested)
    monkeypatch.setattr(precision, "detect_device", lambda: ("cuda", (9, 0)))
    assert problems("fp16")[0].startswith("warning: mixed_precision fp16 on a GPU with bf16")
    monkeypatch.setattr(precision, "detect_device", lambda: ("cuda", (7, 5)))
    [line] = problems("bf16")
    assert line.startswith("error: mixed_precision bf16") and "compute capability 7.5" in line


# --- the gradient norm: on the device, no fp64 copy of a whole gradient ---------------------------


def _accelerator(device):
    """What clip_grad_norm_ uses of an Accelerator, on any device (meta stands in for CUDA)."""
    return types.SimpleNamespace(
        distributed_type=DistributedType.NO,
        device=torch.device(device),
        num_processes=1,
        unscale_gradients=lambda: None,
    )


def test_grad_norm_stays_on_the_device():
    """On meta there is no value to copy to the host: a `.item()` or a CPU norm would fail here,
    as they cost a sync (and the clip's slow path) on CUDA."""
    model = torch.nn.Linear(64, 32, device="meta")
    for p in model.parameters():
        p.grad = torch.empty_like(p)
    norm = grad_norm.clip_grad_norm_(_accelerator("meta"), model, max_norm=1.0)
    assert (
        isinstance(norm, torch.Tensor)
        and norm.device.type == "meta"
        and norm.dtype == torch.float64
    )


def test_grad_norm_fp64_temporaries_are_bounded(monkeypatch):
    """The fp64 sums run over slices: the fp64 bytes alive at once stay within two slices, and the
    norm is still the exact fp64 norm."""
    monkeypatch.setattr(grad_norm, "FP64_CHUNK_ELEMENTS", 1 << 14)
    model = torch.nn.Embedding(4096, 256)
    model.weight.grad = torch.randn(4096, 256, generator=torch.Generator().manual_seed(0))
    exact = model.weight.grad.double().pow(2).sum().sqrt().item()
    with PeakTensorBytes() as meter:
        norm = grad_norm.clip_grad_norm_(_accelerator("cpu"), model, max_norm=0)
    assert float(norm) == pytest.approx(exact, rel=1e-12)
    whole_fp64 = model.weight.numel() * 8  # 8 MB: what a whole-tensor fp64 cast allocates
    assert meter.peak <= 2 * (1 << 14) * 8 < whole_fp64 / 10, meter.peak


# --- evaluation: no fp32 copies of the whole logits -----------------------------------------------


def _old_eval_loss(logits, labels):
    """What llama.py's evaluate did before: fp32 copy, sliced logits, per-token loss."""
    logits = logits.float()
    targets = labels[:, 1:]
    per_token = F.cross_entropy(
        logits[:, :-1].flatten(0, 1), targets.flatten(), reduction="none", ignore_index=-100
    )
    return per_token.view(targets.shape).sum(1), (targets != -100).sum(1)


def test_token_nll_equals_the_sliced_loss_in_small_temporaries(monkeypatch):
    batch, seq, vocab = 4, 64, 5000
    logits = torch.randn(batch, seq, vocab, generator=torch.Generator().manual_seed(0)).bfloat16()
    labels = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(1))
    labels[0, 10:20] = -100  # padding
    monkeypatch.setattr(metrics, "LOSS_CHUNK_ELEMENTS", 16 * vocab)  # 16 positions per fp32 slice
    with PeakTensorBytes() as old_meter:
        old = _old_eval_loss(logits, labels)
    with PeakTensorBytes() as meter:
        nats, tokens = metrics.token_nll(logits, labels)
    assert torch.equal(tokens, old[1]) and tokens.tolist() == [53, 63, 63, 63]
    assert torch.allclose(nats, old[0], rtol=1e-6, atol=0)
    fp32_logits = batch * seq * vocab * 4
    assert old_meter.peak >= 2.5 * fp32_logits  # three whole copies were alive at once
    assert meter.peak < 0.25 * fp32_logits, (meter.peak, fp32_logits)
    assert (
        metrics.token_nll(logits.to("meta"), labels.to("meta"))[0].device.type == "meta"
    )  # no host round trip


def test_eval_needs_less_memory_than_a_train_step(monkeypatch):
    """The byte meter on a Llama with Llama-3's 128k vocabulary, where logits dominate: the
    recipe's evaluation (forward + token_nll, same batch) needs the logits plus one fp32 slice,
    less than half of a training step's forward + backward; the old evaluation needed as much as
    training, three whole logits copies (and more in bf16, at its fixed eval batch of 8)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    # 16 of the 256 positions per slice, the proportion of the default at 8 x 2048 tokens
    monkeypatch.setattr(metrics, "LOSS_CHUNK_ELEMENTS", 16 * 128256)

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128256,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=128,
    )
    model = LlamaForCausalLM(config)
    batch = torch.randint(
        0, config.vocab_size, (2, 128), generator=torch.Generator().manual_seed(0)
    )
    with PeakTensorBytes() as train:
        model(input_ids=batch, labels=batch).loss.backward()
    model.zero_grad(set_to_none=True)
    with torch.no_grad():
        with PeakTensorBytes() as new_eval:
            nats, tokens = metrics.token_nll(model(input_ids=batch).logits, batch)
        with PeakTensorBytes() as old_eval:
            old = _old_eval_loss(model(input_ids=batch).logits, batch)
    assert torch.allclose(nats, old[0], rtol=1e-6) and math.isfinite(nats.sum().item())
    logits_bytes = 2 * 128 * config.vocab_size * 4  # 131 MB in fp32
    assert new_eval.peak < 1.25 * logits_bytes and new_eval.peak < train.peak / 2, (
        new_eval.peak,
        train.peak,
    )
    assert old_eval.peak > 2.5 * logits_bytes, old_eval.peak


# --- what a resume must keep, and the eval batch ------------------------------------------------


def test_resume_state_records_the_deepspeed_reduction_dtype():
    """A checkpoint of a ZeRO run that reduced gradients in bf16, resumed under a JSON that reduces
    in fp32 (or the reverse), trained on and exited 0 with other numbers: the dtypes are now part
    of the run state every resume compares."""
    from common import checkpoint

    def deepspeed_run(config):
        plugin = types.SimpleNamespace(deepspeed_config=config)
        return types.SimpleNamespace(
            distributed_type=DistributedType.DEEPSPEED,
            mixed_precision="bf16",
            state=types.SimpleNamespace(deepspeed_plugin=plugin),
        )

    old = checkpoint.precision_state(deepspeed_run({}))
    new = checkpoint.precision_state(
        deepspeed_run(
            {"communication_data_type": "fp32", "data_types": {"grad_accum_dtype": "fp32"}}
        )
    )
    assert checkpoint.changed_settings(old, new) == [
        "deepspeed_communication_data_type default -> fp32",
        "deepspeed_grad_accum_dtype default -> fp32",
    ]
    ddp = types.SimpleNamespace(distributed_type=DistributedType.MULTI_CPU, mixed_precision="bf16")
    assert checkpoint.precision_state(ddp) == {"mixed_precision": "bf16"}


@pytest.mark.parametrize("recipe", ["llama", "mixed_precision"])
def test_eval_batch_of_zero_is_refused(recipe, tmp_path, monkeypatch):
    """The eval batch defaults to the train batch when unset, but an explicit 0 is still an error."""
    message = run_in_process(
        monkeypatch,
        f"recipes/{recipe}.py",
        "--output_dir",
        tmp_path / "out",
        "--per_device_eval_batch_size",
        0,
    )
    assert message == "error: --per_device_eval_batch_size must be at least 1, got 0", message
