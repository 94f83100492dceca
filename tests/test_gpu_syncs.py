"""On a GPU host: no synchronizing CUDA operation from project code in an ordinary training step.

The CPU tests (test_llama.py, test_mixed_precision.py, ...) count the project's reads of tensor
values per step; this one checks the real thing where there is a GPU, with
`torch.cuda.set_sync_debug_mode("warn")` switched on from the first step
(tests/device_guard/host_reads.py, HOST_READS_CUDA_SYNCS=1): every sync, whatever the op, is
logged and attributed to the frame that ran it. "error" would stop at the first library sync:
transformers checks every forward's position ids for packed sequences with one (`.all()`),
GradScaler checks for inf, DeepSpeed for overflow. Those are listed, not failed.

Skipped on hosts without an NVIDIA GPU (every CI run here). On a GPU host: python -m pytest -q tests/test_gpu_syncs.py
"""

import pytest

from common.launch import _host_nvidia_gpus
from conftest import FAST, HOST_CUDA_VISIBLE_DEVICES, host_reads, launch, ordinary_step_reads

pytestmark = pytest.mark.skipif(_host_nvidia_gpus()[0] == 0, reason="needs an NVIDIA GPU")


@pytest.mark.parametrize("config", ["single", "fsdp"])
def test_no_cuda_sync_from_project_code_in_ordinary_steps(config, tmp_path, cache_dir, monkeypatch):
    reads_dir = tmp_path / "reads"
    reads_dir.mkdir()
    if (
        HOST_CUDA_VISIBLE_DEVICES is None
    ):  # conftest hid the GPUs for the CPU tests: show them again
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", HOST_CUDA_VISIBLE_DEVICES)
    monkeypatch.delenv("ACCELERATE_RECIPES_ALLOW_CPU")
    monkeypatch.setenv("HOST_READS_DIR", str(reads_dir))
    monkeypatch.setenv("HOST_READS_CUDA_SYNCS", "1")
    launch(
        config,
        "recipes/llama.py",
        "--output_dir",
        tmp_path / "run",
        "--max_steps",
        8,
        "--logging_steps",
        4,
        "--eval_steps",
        8,
        *FAST,
        cache_dir=cache_dir,
        num_processes=1,
    )
    reads = host_reads(reads_dir)
    assert reads, "no log: the recipe did not run under the logger"
    for rank, log in reads.items():
        assert any(r[1] == "cuda_sync" for r in log), (
            "sync debug mode logged nothing (not on a GPU?)"
        )
        ordinary = ordinary_step_reads(log, logging_steps=4, max_steps=8)
        project = [r for r in ordinary if r[0] == "project"]
        assert not project, (
            f"rank {rank}: host reads/syncs from project code in ordinary steps: {project[:4]}"
        )
        print(
            f"{config} rank {rank}: library syncs in ordinary steps: {sorted({(r[1], r[2]) for r in ordinary})}"
        )
