"""A GPU host whose torch sees no GPU refuses to train on CPU unless told to (common/launch.py), and
the suite hides GPUs on purpose (tests/conftest.py). A fake `nvidia-smi` on PATH plays the GPUs."""

import functools
import os
import stat
from pathlib import Path

import pytest
import torch

from common import launch as launch_mod
from conftest import FAST, launch, read_metrics, run_in_process

SMI_LINE = "GPU {i}: NVIDIA H100 80GB HBM3 (UUID: GPU-00000000-0000-0000-0000-00000000000{i})"
PROC = Path("/proc/driver/nvidia/gpus")  # the driver's own list, on a real GPU host


def fake_smi(tmp_path, monkeypatch, body):
    """Put an executable `nvidia-smi` running the shell `body` first on PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    smi = bin_dir / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\n{body}\n")
    smi.chmod(smi.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")


def eight_gpus(tmp_path, monkeypatch):
    lines = "\n".join(SMI_LINE.format(i=i) for i in range(8))
    fake_smi(
        tmp_path, monkeypatch, f"cat <<'EOF'\n{lines}\n  MIG 1g.10gb Device 0: (UUID: MIG-0)\nEOF"
    )


def test_the_suite_hides_gpus_and_opts_in_to_cpu():
    assert os.environ["CUDA_VISIBLE_DEVICES"] == ""
    assert os.environ["ACCELERATE_RECIPES_ALLOW_CPU"] == "1"
    assert not torch.cuda.is_available()


def test_nvidia_smi_gpus_are_counted(tmp_path, monkeypatch):
    eight_gpus(tmp_path, monkeypatch)
    assert launch_mod._host_nvidia_gpus(proc_dir=str(tmp_path / "absent")) == (
        8,
        "nvidia-smi",
    )  # not the MIG line


def test_driver_proc_entries_are_counted_first(tmp_path, monkeypatch):
    fake_smi(tmp_path, monkeypatch, "exit 1")
    for bus in ("0000:17:00.0", "0000:2a:00.0"):
        (tmp_path / "gpus" / bus).mkdir(parents=True)
    assert launch_mod._host_nvidia_gpus(proc_dir=str(tmp_path / "gpus")) == (
        2,
        str(tmp_path / "gpus"),
    )


@pytest.mark.parametrize(
    "body",
    [
        None,  # no nvidia-smi on PATH
        'echo "NVIDIA-SMI has failed because it couldn\'t communicate with the NVIDIA driver."; exit 9',
        "exec sleep 30",  # a hung driver
        "echo 'No devices were found'",
    ],
)
def test_no_gpu_when_nvidia_smi_is_absent_fails_or_hangs(body, tmp_path, monkeypatch):
    if body is None:
        (tmp_path / "empty").mkdir()
        monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    else:
        fake_smi(tmp_path, monkeypatch, body)
    assert launch_mod._host_nvidia_gpus(proc_dir=str(tmp_path / "absent"), timeout_s=0.5) == (0, "")


@pytest.fixture
def gpu_host(tmp_path, monkeypatch):
    """8 fake GPUs that torch cannot see, no opt-in, no launcher: `process_group` runs in-process."""
    eight_gpus(tmp_path, monkeypatch)
    monkeypatch.setattr(
        launch_mod,
        "_host_nvidia_gpus",
        functools.partial(launch_mod._host_nvidia_gpus, proc_dir=str(tmp_path / "absent")),
    )
    for name in ("ACCELERATE_RECIPES_ALLOW_CPU", "ACCELERATE_USE_CPU", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)


def refusal(found="8 NVIDIA GPUs (nvidia-smi)", cuda=None):
    """The message, for a CPU-only torch wheel (cuda=None) or one built for CUDA `cuda`."""
    why = (
        "it is a CPU-only build: install a CUDA one"
        if cuda is None
        else f"likely causes: a driver too old for CUDA {cuda}, a container started without --gpus, "
        "CUDA_VISIBLE_DEVICES=''"
    )
    return (
        f"this host has {found} but torch {torch.__version__} sees none; {why}. Fix that, or set "
        "ACCELERATE_RECIPES_ALLOW_CPU=1 to train on CPU ranks anyway (`accelerate launch --cpu` would run one "
        "process, not the config's ranks)"
    )


@pytest.mark.parametrize("cuda", [None, "12.8"])
def test_gpu_host_without_visible_gpus_refuses(cuda, gpu_host, monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", cuda)
    with pytest.raises(ValueError) as exc:
        launch_mod.process_group(60)[0]
    assert str(exc.value) == refusal(cuda=cuda)
    monkeypatch.setenv("ACCELERATE_RECIPES_ALLOW_CPU", "0")  # not an opt-in
    with pytest.raises(ValueError):
        launch_mod.process_group(60)[0]


@pytest.mark.parametrize(
    "name, value", [("ACCELERATE_RECIPES_ALLOW_CPU", "1"), ("ACCELERATE_USE_CPU", "True")]
)
def test_opt_in_to_cpu(name, value, gpu_host, monkeypatch):
    monkeypatch.setenv(name, value)
    assert launch_mod.process_group(60)[0].timeout.total_seconds() == 60


def test_gpus_that_torch_sees_are_fine(gpu_host, monkeypatch):
    monkeypatch.setattr(launch_mod, "_has_accelerator", lambda: True)
    assert launch_mod.process_group(60)[0].backend == "nccl"  # the default: nothing CPU-specific


def test_plain_python_refuses_too(gpu_host, monkeypatch, tmp_path):
    # No launcher (run_in_process unsets LOCAL_RANK): the check does not depend on it.
    monkeypatch.setattr(torch.version, "cuda", None)
    assert (
        run_in_process(monkeypatch, "recipes/llama.py", "--output_dir", tmp_path / "out")
        == f"error: {refusal()}"
    )


def test_launched_ranks_refuse_without_the_suites_opt_in_and_train_with_it(
    tmp_path, monkeypatch, cache_dir
):
    eight_gpus(tmp_path, monkeypatch)
    args = ["recipes/llama.py", *FAST, "--max_steps", 2, "--eval_steps", 2, "--warmup_steps", 0]
    with (
        monkeypatch.context() as m
    ):  # what every launched test would hit on a GPU host without conftest's opt-in
        m.delenv("ACCELERATE_RECIPES_ALLOW_CPU")
        proc = launch(
            "ddp", *args, "--output_dir", tmp_path / "refused", cache_dir=cache_dir, check=False
        )
    assert proc.returncode != 0
    n = (
        len(os.listdir(PROC)) if PROC.exists() else 0
    )  # on a real GPU host the driver's entries win over the fake
    found = f"{n} NVIDIA GPU{'s' * (n > 1)} ({PROC})" if n else "8 NVIDIA GPUs (nvidia-smi)"
    assert {line for line in proc.stderr.splitlines() if line.startswith("error:")} == {
        f"error: {refusal(found, torch.version.cuda)}"
    }
    assert not (tmp_path / "refused" / "metrics.jsonl").exists()

    proc = launch("ddp", *args, "--output_dir", tmp_path / "cpu", cache_dir=cache_dir)
    assert "MULTI_CPU x2" in proc.stdout
    steps, (summary,) = read_metrics(tmp_path / "cpu")
    assert (
        steps[-1]["step"] == 2 and summary["input_tokens"] == 2 * 2 * 4 * 128
    )  # steps x ranks x batch x block


def test_deepspeed_with_use_cpu_is_refused(monkeypatch):
    """`accelerate launch --cpu` with a DeepSpeed config: Accelerate would build plain CPU ranks instead."""
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_USE_CPU", "True")
    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)
    with pytest.raises(launch_mod.Stop, match="ACCELERATE_USE_CPU is set"):
        launch_mod.process_group(60)
