"""Canaries for common/workarounds.py: each `test_<workaround>` asserts that the upstream behaviour
the workaround exists for is still there. One failing means upstream changed: review the
workaround, and delete it if the library no longer needs it. In-process and fast: no launches."""

import ast
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from accelerate import Accelerator, PartialState
from accelerate.state import AcceleratorState, GradientState
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin, TorchDynamoPlugin

from common import launch, workarounds

REPO = Path(__file__).resolve().parent.parent
STAGES = {"patch_accelerator", "patch_model"}  # one call per point where workarounds apply


def upstream(name: str) -> str:
    return f"upstream changed: review/delete {name if '.' in name else 'workarounds.' + name}"


@pytest.fixture
def fresh_state():
    """Accelerate's shared state, empty before and after the test."""
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def test_die_with_launcher():
    """torchrun still starts its workers without a parent-death signal: SIGKILLed, it leaves them."""
    from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler

    source = inspect.getsource(subprocess_handler)
    assert "PDEATHSIG" not in source and "prctl" not in source, upstream("die_with_launcher")


def test_allow_mixed_precision_with_deepspeed_json(monkeypatch):
    """Accelerate still refuses a YAML's mixed_precision next to a DeepSpeed JSON; without it, not."""
    from accelerate.utils import DeepSpeedPlugin

    monkeypatch.setenv("ACCELERATE_CONFIG_DS_FIELDS", "deepspeed_config_file,mixed_precision")
    with pytest.raises(ValueError, match="will be ignored"):
        DeepSpeedPlugin._deepspeed_config_checks(None)
    assert workarounds.allow_mixed_precision_with_deepspeed_json() == [
        "allow_mixed_precision_with_deepspeed_json"
    ]
    assert os.environ["ACCELERATE_CONFIG_DS_FIELDS"] == "deepspeed_config_file"
    DeepSpeedPlugin._deepspeed_config_checks(None)  # nothing refused now
    monkeypatch.setenv("ACCELERATE_CONFIG_DS_FIELDS", "deepspeed_config_file")
    assert workarounds.allow_mixed_precision_with_deepspeed_json() == []


def test_ddp_ranks_on_cpu(monkeypatch):
    """A torchrun rank with no device is still given a non-distributed state unless told `cpu`,
    which ACCELERATE_USE_CPU still sets."""
    if torch.cuda.is_available():
        pytest.skip("a GPU host: Accelerate finds the device")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert PartialState._prepare_backend(None, cpu=False) == (None, DistributedType.NO), upstream(
        "ddp_ranks_on_cpu"
    )
    assert PartialState._prepare_backend(None, cpu=True) == ("gloo", DistributedType.MULTI_CPU)
    assert "ACCELERATE_USE_CPU" in inspect.getsource(AcceleratorState.__init__), upstream(
        "ddp_ranks_on_cpu"
    )


def test_fsdp_ranks_on_cpu(monkeypatch, fresh_state):
    """AcceleratorState still picks FSDP from a multi-device state only: a CPU one stays unsharded."""
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")

    def state():
        return AcceleratorState(cpu=True, _from_accelerator=True, dynamo_plugin=TorchDynamoPlugin())

    assert state().distributed_type == DistributedType.NO, upstream("fsdp_ranks_on_cpu")
    AcceleratorState._reset_state(reset_partial_state=True)
    relabelled = PartialState(cpu=True)  # what the workaround does, without a process group
    relabelled.distributed_type, relabelled.device = DistributedType.MULTI_GPU, torch.device("cpu")
    assert state().distributed_type == DistributedType.FSDP


def test_skip_deepspeed_shm_build():
    """DeepSpeed's CPU accelerator still offers the shared-memory all-reduce op, so its process-group
    setup would compile it; marked incompatible, it builds nothing."""
    from deepspeed.accelerator import get_accelerator
    from deepspeed.comm.torch import build_shm_op

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    assert builder is not None and builder.is_compatible(), upstream("skip_deepspeed_shm_build")
    assert workarounds.skip_deepspeed_shm_build() == ["skip_deepspeed_shm_build"]
    assert build_shm_op() is None


def test_cache_deepspeed_cpu_device_count(monkeypatch):
    """DeepSpeed's CPU accelerator still runs numactl at every device_count() (ZeRO-3 calls it at
    every reduce-scatter); cached, it runs it once."""
    import deepspeed.utils.numa
    from deepspeed.accelerator import get_accelerator

    calls = []

    def check_output(cmd, *args, **kwargs):
        calls.append(cmd)
        raise FileNotFoundError(cmd[0])  # as on a host without numactl

    monkeypatch.delenv("LOCAL_SIZE", raising=False)
    monkeypatch.setattr(deepspeed.utils.numa.subprocess, "check_output", check_output)
    accelerator = get_accelerator()
    assert accelerator.device_name() == "cpu"
    # the class's method, uncached; put back after the test
    monkeypatch.setattr(
        accelerator, "device_count", type(accelerator).device_count.__get__(accelerator)
    )
    assert accelerator.device_count() == accelerator.device_count() == 1
    assert calls == [["numactl", "--hardware"]] * 2, upstream("cache_deepspeed_cpu_device_count")
    assert workarounds.cache_deepspeed_cpu_device_count() == ["cache_deepspeed_cpu_device_count"]
    assert [accelerator.device_count() for _ in range(3)] == [1, 1, 1] and len(calls) == 3


def test_install_cpu_grad_scaler(fresh_state):
    """Accelerate still builds no GradScaler and no fp16 autocast for fp16 on a CPU device."""
    accelerator = Accelerator(mixed_precision="fp16", cpu=True)
    assert accelerator.scaler is None and not accelerator.native_amp, upstream(
        "install_cpu_grad_scaler"
    )
    assert workarounds.install_cpu_grad_scaler(accelerator) == ["install_cpu_grad_scaler"]
    assert isinstance(accelerator.scaler, torch.amp.GradScaler) and accelerator.native_amp


@pytest.mark.parametrize("version", [1, 2])
def test_keep_fp32_reduction(version):
    """Accelerate's FSDP bf16 policy still reduces gradients in bf16, and casts FSDP2's outputs
    (FSDP1: keeps buffers) in bf16 too."""
    plugin = FullyShardedDataParallelPlugin(fsdp_version=version)
    plugin.set_mixed_precision("bf16")
    policy = plugin.mixed_precision_policy
    other = policy.output_dtype if version == 2 else policy.buffer_dtype
    assert policy.reduce_dtype == other == torch.bfloat16, upstream("keep_fp32_reduction")


def test_drop_fp32_output_copy(fresh_state):
    """`prepare` under bf16 still wraps the forward to return fp32 copies of its outputs."""
    accelerator = Accelerator(mixed_precision="bf16", cpu=True)
    model = accelerator.prepare(torch.nn.Linear(4, 4))
    assert model(torch.randn(2, 4)).dtype == torch.float32, upstream("drop_fp32_output_copy")
    assert "_original_forward" in model.__dict__, upstream("drop_fp32_output_copy")
    assert workarounds.drop_fp32_output_copy(accelerator, model) == ["drop_fp32_output_copy"]
    assert model(torch.randn(2, 4)).dtype == torch.bfloat16


def test_eager_state_dict_keys(fresh_state):
    """A compiled module's state-dict keys still carry `_orig_mod.`; with the hooks, eager keys."""
    compiled = torch.compile(torch.nn.Linear(2, 2))
    assert list(compiled.state_dict()) == ["_orig_mod.weight", "_orig_mod.bias"], upstream(
        "eager_state_dict_keys"
    )
    assert workarounds.eager_state_dict_keys(Accelerator(cpu=True), compiled) == [
        "eager_state_dict_keys"
    ]
    assert list(compiled.state_dict()) == ["weight", "bias"]


def test_fill_fsdp1_optimizer_state():
    """Accelerate still loads FSDP1's sharded optimizer state into the optimizer's existing state,
    which a fresh torch optimizer does not have yet."""
    from accelerate.utils.fsdp_utils import load_fsdp_optimizer

    source = inspect.getsource(load_fsdp_optimizer)
    assert "FSDP.optim_state_dict(model, optimizer)" in source and "dist_cp.load(" in source, (
        upstream("fill_fsdp1_optimizer_state")
    )
    fresh = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))])
    assert fresh.state_dict()["state"] == {}, upstream("fill_fsdp1_optimizer_state")


def test_fsdp_trainable_state_only():
    """`save_state` and `load_state` still call the `save_fsdp_model` / `load_fsdp_model` names that
    accelerate.accelerator imported, without `adapter_only`: a LoRA checkpoint would hold the frozen base.
    The workaround rebinds them for its block only."""
    import accelerate.accelerator as accelerator_module
    from accelerate.utils import fsdp_utils

    saves, loads = (
        inspect.getsource(Accelerator.save_state),
        inspect.getsource(Accelerator.load_state),
    )
    assert (
        "save_fsdp_model(self.state.fsdp_plugin, self, model, output_dir, i)" in saves
        and "load_fsdp_model(self.state.fsdp_plugin, self, model, input_dir, i)" in loads
        and accelerator_module.save_fsdp_model is fsdp_utils.save_fsdp_model
    ), upstream("fsdp_trainable_state_only")
    fsdp = SimpleNamespace(distributed_type=DistributedType.FSDP)
    with workarounds.fsdp_trainable_state_only(fsdp) as applied:
        assert applied == ["fsdp_trainable_state_only"]
        assert accelerator_module.save_fsdp_model is not fsdp_utils.save_fsdp_model
        assert accelerator_module.load_fsdp_model is not fsdp_utils.load_fsdp_model
    assert accelerator_module.save_fsdp_model is fsdp_utils.save_fsdp_model
    assert accelerator_module.load_fsdp_model is fsdp_utils.load_fsdp_model
    with workarounds.fsdp_trainable_state_only(
        SimpleNamespace(distributed_type=DistributedType.MULTI_CPU)
    ) as applied:
        assert applied == [] and accelerator_module.save_fsdp_model is fsdp_utils.save_fsdp_model


def test_micro_steps_from_optimizer_steps(fresh_state, tmp_path):
    """`load_state` still restores the saved count of micro batches (`accelerator.step`)."""
    accelerator = Accelerator(cpu=True)
    accelerator.step = 9
    accelerator.save_state(str(tmp_path))
    accelerator.step = 0
    accelerator.load_state(str(tmp_path))
    assert accelerator.step == 9, upstream("micro_steps_from_optimizer_steps")
    accelerator.gradient_accumulation_steps = 2
    assert workarounds.micro_steps_from_optimizer_steps(accelerator, 9) == [
        "micro_steps_from_optimizer_steps"
    ]
    assert accelerator.step == 18


def test_fsdp1_cpu_state_dict():
    """The crash was measured on torch 2.13 (a SIGSEGV cannot be probed in-process): re-measure the
    FSDP1 export on CPU (tests/test_llama.py, fsdp1) on another torch. Accelerate still gathers
    FSDP1's full state dict with `offload_to_cpu=True`."""
    assert torch.__version__.startswith("2.13."), upstream("fsdp1_cpu_state_dict")
    plugin = FullyShardedDataParallelPlugin(fsdp_version=1, state_dict_type="FULL_STATE_DICT")
    assert plugin.state_dict_config.offload_to_cpu, upstream("fsdp1_cpu_state_dict")


def test_trim_malloc_heap():
    """The C library is still glibc, whose malloc keeps freed heap pages, and it has malloc_trim."""
    import ctypes
    import platform

    if not os.uname().sysname == "Linux":
        pytest.skip("Linux only")
    assert platform.libc_ver()[0] == "glibc", upstream("trim_malloc_heap")
    assert hasattr(ctypes.CDLL(None), "malloc_trim"), upstream("trim_malloc_heap")
    assert workarounds.trim_malloc_heap() == ["trim_malloc_heap"]


def test_safetensors_mode_from_umask(tmp_path):
    """safetensors still writes its files with mode 0600 whatever the umask; the workaround gives 0666 less it."""
    from safetensors.torch import save_file

    umask = os.umask(0o022)
    try:
        save_file({"w": torch.zeros(2)}, tmp_path / "model.safetensors")
        assert (tmp_path / "model.safetensors").stat().st_mode & 0o777 == 0o600, upstream(
            "safetensors_mode_from_umask"
        )
        assert workarounds.safetensors_mode_from_umask(tmp_path) == ["safetensors_mode_from_umask"]
        assert (tmp_path / "model.safetensors").stat().st_mode & 0o777 == 0o644
        os.umask(0o027)
        assert workarounds.safetensors_mode_from_umask(tmp_path) == ["safetensors_mode_from_umask"]
        assert (tmp_path / "model.safetensors").stat().st_mode & 0o777 == 0o640
        os.umask(0o077)
        alone = tmp_path / "model.safetensors"  # a file, not a folder
        assert workarounds.safetensors_mode_from_umask(alone) == ["safetensors_mode_from_umask"]
        assert alone.stat().st_mode & 0o777 == 0o600
    finally:
        os.umask(umask)
    assert workarounds.safetensors_mode_from_umask(tmp_path / "none") == []


def _functions() -> dict:
    return {
        name: f
        for name, f in inspect.getmembers(workarounds, inspect.isfunction)
        if f.__module__ == workarounds.__name__ and not name.startswith("_")
    }


def _elsewhere() -> list[tuple[str, str]]:
    """(file, function) of each patch the module docstring lists as living elsewhere."""
    return re.findall(r"^- (common/\w+\.py), `(\w+)`", workarounds.__doc__, flags=re.M)


def test_replicate_parallel_for_accelerate():
    """Accelerate's tensor-parallel prepare (FSDP2) still imports `ReplicateParallel` from transformers,
    which transformers still lacks."""
    import transformers.integrations.tensor_parallel as hf_tp

    source = inspect.getsource(Accelerator._prepare_tp)
    assert (
        "from transformers.integrations.tensor_parallel import ReplicateParallel" in source
        and not hasattr(hf_tp, "ReplicateParallel")
    ), upstream("causal_lm.replicate_parallel_for_accelerate")


def test_gather_metrics_once_per_tp_group():
    """`gather_for_metrics` still gathers every rank's rows through `self.gather`, then cuts the last batch
    to the remainder counted over data-parallel ranks (tests/test_tp.py measures what that costs)."""
    source = inspect.getsource(Accelerator.gather_for_metrics)
    assert (
        "data = self.gather(input_data)" in source
        and "tensor[: self.gradient_state.remainder]" in source
    ), upstream("causal_lm.gather_metrics_once_per_tp_group")


def test_no_deepspeed_import_on_unwrap():
    """Unwrapping a plain module still imports deepspeed (a fresh process: this one may have it)."""
    code = (
        "import sys, torch; from accelerate.utils.other import extract_model_from_parallel as unwrap; "
        "unwrap(torch.nn.Linear(1, 1)); print('deepspeed' in sys.modules)"
    )
    assert (
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True
        ).stdout.split()[-1]
        == "True"
    ), upstream("no_deepspeed_import_on_unwrap")
    code = (
        "import sys, torch; from common import workarounds; "
        "workarounds.no_deepspeed_import_on_unwrap(workarounds.PartialState()); "
        "from accelerate.utils.other import extract_model_from_parallel as unwrap; "
        "unwrap(torch.nn.Linear(1, 1)); print('deepspeed' in sys.modules)"
    )
    assert (
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO
        ).stdout.split()[-1]
        == "False"
    )


def test_every_workaround_has_its_canary():
    functions = _functions()
    workarounds_ = set(functions) - STAGES
    here = inspect.getsource(inspect.getmodule(test_every_workaround_has_its_canary))
    for name in sorted(workarounds_):
        assert f"def test_{name}(" in here, f"no canary test_{name}"
        doc = functions[name].__doc__
        libraries = r"\b(accelerate|torch|deepspeed|glibc|torchrun|safetensors)\b"
        assert "Canary:" in doc and re.search(libraries, doc, re.I), name
    elsewhere = _elsewhere()
    assert len(elsewhere) >= 2
    for path, name in elsewhere:
        assert f"def {name}(" in (REPO / path).read_text(), (path, name)
        assert f"def test_{name}(" in here and name not in functions, f"no canary test_{name}"
    for name in STAGES:  # a stage names the workarounds it calls, and calls them
        named = set(re.findall(r"`(\w+)`", functions[name].__doc__)) & set(functions)
        called = {
            n.func.id
            for n in ast.walk(ast.parse(inspect.getsource(functions[name])))
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
        }
        assert named == called and named <= workarounds_, (name, named, called)


def test_each_workaround_returns_its_own_name():
    """What run_info.json lists is the function's own name: `return ["name"]` or `[]`."""
    for name, f in _functions().items():
        returns = [
            n for n in ast.walk(ast.parse(inspect.getsource(f))) if isinstance(n, ast.Return)
        ]
        names = {
            c.value
            for r in returns
            for n in ast.walk(r)
            if isinstance(n, ast.List)
            for c in n.elts
            if isinstance(c, ast.Constant)
        }
        assert names <= {name}, (name, names)


def test_the_stages_return_what_applied(fresh_state, monkeypatch):
    """fp16 on CPU: the scaler goes in, and unwrapping stops importing deepspeed; then `prepare` wraps the
    forward, whose fp32 copy goes."""
    from accelerate.utils import imports, other

    monkeypatch.setattr(
        other, "is_deepspeed_available", imports.is_deepspeed_available
    )  # unpatched, restored
    accelerator = Accelerator(mixed_precision="fp16", cpu=True)
    assert workarounds.patch_accelerator(accelerator) == [
        "install_cpu_grad_scaler",
        "no_deepspeed_import_on_unwrap",
    ]
    model = accelerator.prepare(torch.nn.Linear(2, 2))
    assert workarounds.patch_model(accelerator, model) == ["drop_fp32_output_copy"]
    AcceleratorState._reset_state(reset_partial_state=True)
    assert (
        workarounds.patch_accelerator(Accelerator(cpu=True)) == []
    )  # fp32, unwrap patched already: nothing


def test_process_group_returns_what_applied(monkeypatch):
    """A CPU-only torchrun DDP rank: a DeepSpeed YAML's field list is fixed, then real gloo ranks."""
    if torch.cuda.is_available():
        pytest.skip("a GPU host: nothing to switch")
    for name in (
        "ACCELERATE_USE_FSDP",
        "ACCELERATE_USE_DEEPSPEED",
        "ACCELERATE_USE_CPU",
        "ACCELERATE_DEEPSPEED_CONFIG_FILE",
        "TORCHELASTIC_MAX_RESTARTS",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("ACCELERATE_RECIPES_ALLOW_CPU", "1")
    monkeypatch.setenv("ACCELERATE_CONFIG_DS_FIELDS", "mixed_precision")
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert launch.process_group(60)[1] == ["allow_mixed_precision_with_deepspeed_json"]
    monkeypatch.setenv("LOCAL_RANK", "0")
    group, applied = launch.process_group(60)
    assert applied == ["ddp_ranks_on_cpu"] and group.backend == "gloo"
    assert os.environ["ACCELERATE_USE_CPU"] == "true"


def test_relink_offload_lr_scheduler():
    """Accelerate still builds DeepSpeed's CPU Adam on the AdamW's own param-group dicts, and torch's
    `load_state_dict` still gives an optimizer new group dicts: a scheduler holding the AdamW then
    sets the LR of groups nobody steps."""
    from accelerate.utils import deepspeed as accelerate_deepspeed

    source = inspect.getsource(accelerate_deepspeed.map_pytorch_optim_to_deepspeed)
    assert "optimizer_class(optimizer.param_groups" in source, upstream(
        "relink_offload_lr_scheduler"
    )
    weight = torch.nn.Parameter(torch.ones(2))
    adamw = torch.optim.AdamW([weight], lr=1e-3)
    swapped = torch.optim.AdamW(adamw.param_groups)  # built on the same dicts, as the CPU Adam is
    assert swapped.param_groups[0] is adamw.param_groups[0]
    swapped.load_state_dict(swapped.state_dict())
    assert swapped.param_groups[0] is not adamw.param_groups[0], upstream(
        "relink_offload_lr_scheduler"
    )


def test_inductor_cache_per_cpu_capability(monkeypatch):
    """torch's inductor cache folder and its keys still ignore ATEN_CPU_CAPABILITY; the workaround
    gives the override a folder of its own, and leaves a folder the user chose alone."""
    import torch._inductor.codecache as codecache
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    native = default_cache_dir()
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    assert default_cache_dir() == native and "ATEN_CPU_CAPABILITY" not in inspect.getsource(
        codecache
    ), upstream("inductor_cache_per_cpu_capability")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", native)
    assert workarounds.inductor_cache_per_cpu_capability() == ["inductor_cache_per_cpu_capability"]
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == f"{native}_avx2"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "mine")
    assert workarounds.inductor_cache_per_cpu_capability() == []
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == "mine"


def test_zero_universal():
    """common/checkpoint.zero_universal: Accelerate's `load_state` still has no universal-checkpoint
    option, and DeepSpeed's engine still reads it from its private config."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    name = "checkpoint.zero_universal"
    assert "universal" not in inspect.getsource(Accelerator.load_state), upstream(name)
    assert "return self._config.load_universal_checkpoint" in inspect.getsource(
        DeepSpeedEngine.load_universal_checkpoint
    ), upstream(name)


def test_tensor_parallel():
    """common/causal_lm.tensor_parallel: transformers' `apply_tensor_parallelism` still leaves the
    model's `_tp_size` unset (`from_pretrained` sets it), which `tp_size` returns and Accelerate's
    `prepare` reads (`get_model_tp_size`)."""
    from accelerate.utils.other import get_model_tp_size
    from transformers import PreTrainedModel
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism

    name = "causal_lm.tensor_parallel"
    assert "_tp_size" not in inspect.getsource(apply_tensor_parallelism), upstream(name)
    assert "return self._tp_size" in inspect.getsource(PreTrainedModel.tp_size.fget), upstream(name)
    assert 'getattr(model, "tp_size"' in inspect.getsource(get_model_tp_size), upstream(name)
