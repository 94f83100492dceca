"""Fast checks of benchmarks/compare_strategies.py's arithmetic (no launches, no timings)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from compare_strategies import comm_pattern, median_step_seconds, predicted_comm_bytes  # noqa: E402

PSI = 4_212_992  # the debug Llama's parameter count with the 4,096-token BPE


def test_paper_volumes_for_a_known_psi():
    # ZeRO paper, section 7: DDP 2Ψ, ZeRO-1/2 2Ψ, ZeRO-3 3Ψ elements, here all in one dtype
    assert predicted_comm_bytes("ddp", PSI, grad_bytes=4) == 33_703_936  # 2 x 4,212,992 x 4 B
    assert predicted_comm_bytes("zero2", PSI, grad_bytes=2, param_bytes=2) == 16_851_968  # 2Ψ x 2 B
    assert predicted_comm_bytes("zero3", PSI, grad_bytes=2, param_bytes=2) == 25_277_952  # 3Ψ x 2 B
    # ZeRO-3 is 1.5x ZeRO-2 for the same dtypes
    assert (
        predicted_comm_bytes("zero3", PSI, 2, 2) / predicted_comm_bytes("zero2", PSI, 2, 2) == 1.5
    )


def test_mixed_dtypes_price_each_collective_separately():
    # FSDP with bf16 parameters and fp32 gradient reduction: RS Ψ x 4 B + 2 AG Ψ x 2 B = 8Ψ bytes
    assert predicted_comm_bytes("zero3", 1000, grad_bytes=4, param_bytes=2) == 8000
    # ZeRO-2 with fp32 reduction, bf16 parameter all-gather: 4Ψ + 2Ψ
    assert predicted_comm_bytes("zero2", 1000, grad_bytes=4, param_bytes=2) == 6000
    assert comm_pattern("zero3", 4, 2) == "RS Ψ×4B + 2×AG Ψ×2B"
    assert comm_pattern("zero2", 2, 2) == "RS Ψ×2B + AG Ψ×2B"
    assert comm_pattern("ddp", 4) == "AR 2Ψ×4B"
    # DeepSpeed's ZeRO-2 all-reduces its gradients by default (use_multi_rank_bucket_allreduce)
    assert predicted_comm_bytes("zero2_allreduce", 1000, grad_bytes=4, param_bytes=2) == 10000
    assert comm_pattern("zero2_allreduce", 4, 2) == "AR 2Ψ×4B + AG Ψ×2B"


def test_ring_factor():
    # a ring collective sends (N-1)/N of the buffer per rank: half with 2 ranks, 7/8 with 8, none alone
    assert predicted_comm_bytes("ddp", 1000, 4, world_size=2) == 4000
    assert predicted_comm_bytes("zero3", 1000, 2, 2, world_size=8) == 6000 * 7 / 8
    assert predicted_comm_bytes("zero2", 1000, 2, 2, world_size=1) == 0


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(ValueError, match="unknown communication kind 'zero4'"):
        predicted_comm_bytes("zero4", 10, 2, 2)
    with pytest.raises(ValueError, match="param_bytes"):
        predicted_comm_bytes("zero3", 10, 2)
    with pytest.raises(ValueError, match="n_params"):
        predicted_comm_bytes("ddp", -1, 4)
    with pytest.raises(ValueError, match="world_size"):
        predicted_comm_bytes("ddp", 10, 4, world_size=0)


def test_median_step_time_skips_warmup():
    tokens = 2048
    records = [
        {"step": 1, "tokens_per_second": 100.0},  # slow first steps are left out
        {"step": 2, "tokens_per_second": 200.0},
        {"step": 3, "tokens_per_second": 2048.0},  # 1.0 s
        {"step": 4, "tokens_per_second": 1024.0},  # 2.0 s
        {"step": 5, "tokens_per_second": 4096.0},
    ]  # 0.5 s
    assert median_step_seconds(records, tokens, skip=2) == 1.0
    with pytest.raises(ValueError, match="warm-up"):
        median_step_seconds(records[:2], tokens, skip=2)
