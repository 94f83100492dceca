"""common/checks.py: every start-up check gets one bad input (a YAML, JSON or flag written to tmp_path) and
the exact line; every recipe and the planner really call it. In-process, no launches."""

import json
from types import SimpleNamespace
import sys

import pytest
import torch
import yaml

from conftest import REPO, run_in_process

sys.path.insert(0, str(REPO))
from common import checks, models  # noqa: E402
from tools import planner  # noqa: E402
from tools import plan as plan_cli  # noqa: E402
from common.errors import Stop  # noqa: E402

CPU = {"device_type": "cpu", "capability": None, "gpus": 0}
FLAGS = {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 1, "max_grad_norm": 1.0}


def yaml_config(tmp_path, name, edit=None, **keys):
    """accelerate_configs/NAME.yaml, with `edit` (old, new) applied to its text and `keys` set, written to tmp_path
    and read back as the planner reads it."""
    text = (REPO / "accelerate_configs" / f"{name}.yaml").read_text()
    if edit:
        assert edit[0] in text
        text = text.replace(*edit)
    path = tmp_path / f"{name}.yaml"
    path.write_text(text)
    return {**yaml.safe_load(path.read_text()), **keys}


def ds_json(tmp_path, source="zero2", **keys):
    """ds_configs/SOURCE.json with `keys` set, written to tmp_path; returns (config dict for a DeepSpeed YAML
    pointing to it, the JSON dict, where)."""
    path = tmp_path / f"{source}.json"
    path.write_text(
        json.dumps({**json.loads((REPO / "ds_configs" / f"{source}.json").read_text()), **keys})
    )
    config = {
        "distributed_type": "DEEPSPEED",
        "mixed_precision": "bf16",
        "num_processes": 2,
        "deepspeed_config": {"deepspeed_config_file": str(path)},
    }
    ds, where = checks.deepspeed_settings(config)
    return config, ds, where


def lines(problems):
    return [str(p) for p in problems]


def test_deepspeed_batch_keys_against_the_flags(tmp_path):
    config, ds, where = ds_json(
        tmp_path,
        train_batch_size=16,
        train_micro_batch_size_per_gpu=2,
        gradient_accumulation_steps=4,
    )
    assert where == f"the DeepSpeed JSON {tmp_path / 'zero2.json'}"
    assert lines(checks.config_problems(config, ds=ds, ds_where=where, flags=FLAGS)) == [
        f"error: {where} sets train_micro_batch_size_per_gpu: 2, but --per_device_train_batch_size is 4; set the key "
        'to "auto" (it then follows the flags) or make them equal',
        f"error: {where} sets gradient_accumulation_steps: 4, but --gradient_accumulation_steps is 1; set the key "
        'to "auto" (it then follows the flags) or make them equal',
        f"error: {where} sets train_batch_size: 16, but the global batch (4 per device x 1 accumulation x 2 ranks) "
        'is 8; set the key to "auto" (it then follows the flags) or make them equal',
    ]
    # our JSONs: "auto" everywhere, and the same clipping as the flag's default
    config, ds, where = ds_json(tmp_path)
    assert checks.config_problems(config, ds=ds, ds_where=where, flags=FLAGS, hardware=CPU) == []


def test_gradient_clipping_against_max_grad_norm(tmp_path):
    config, ds, where = ds_json(tmp_path, gradient_clipping=0.5)
    assert lines(checks.config_problems(config, ds=ds, ds_where=where, flags=FLAGS)) == [
        f"error: --max_grad_norm 1.0 differs from the DeepSpeed JSON's gradient_clipping 0.5 ({where}); DeepSpeed "
        "does the clipping, so make them equal"
    ]


@pytest.mark.parametrize(
    "block, launch, verb",
    [("bf16", "no", "enables"), ("fp16", "bf16", "enables"), ("bf16", "bf16", "disables")],
)
def test_deepspeed_precision_block_against_the_launch(block, launch, verb, tmp_path):
    config, ds, where = ds_json(tmp_path, **{block: {"enabled": verb == "enables"}})
    config["mixed_precision"] = launch
    assert lines(checks.config_problems(config, ds=ds, ds_where=where, flags=FLAGS)) == [
        f"error: the launch asks for mixed precision {launch}, but {where} {verb} {block} ({block}.enabled: "
        f'{str(verb == "enables").lower()}): its bf16/fp16 "enabled" keys win; set them to "auto" so the '
        "config's mixed_precision (or --mixed_precision) decides"
    ]


def test_deepspeed_json_that_cannot_be_read(tmp_path):
    config = {
        "distributed_type": "DEEPSPEED",
        "deepspeed_config": {"deepspeed_config_file": "nope/zero9.json"},
    }
    with pytest.raises(
        ValueError,
        match=r"DeepSpeed config nope/zero9.json \(deepspeed_config_file in the "
        r"accelerate config\) cannot be read from .*No such file",
    ):
        checks.deepspeed_settings(config)


def test_precision_against_the_hardware(tmp_path):
    config = yaml_config(tmp_path, "ddp")
    assert config["mixed_precision"] == "bf16"
    v100 = {"device_type": "cuda", "capability": (7, 0), "gpus": 2}
    assert lines(checks.config_problems(config, hardware=v100)) == [
        "error: mixed_precision bf16 (accelerate config or --mixed_precision): this GPU (compute capability 7.0) has "
        "no bf16 arithmetic, which needs 8.0+ (Ampere or newer); Accelerate would emulate it, several times slower. "
        "Launch with --mixed_precision fp16 (loss-scaled) or --mixed_precision no (recipes/mixed_precision.py: "
        "--precision fp16 or no)"
    ]
    h100 = {"device_type": "cuda", "capability": (9, 0), "gpus": 2}
    assert checks.config_problems(config, hardware=h100) == []
    assert lines(
        checks.config_problems(config, hardware=h100, flags={"mixed_precision": "fp16"})
    ) == [
        "warning: mixed_precision fp16 on a GPU with bf16 (compute capability 9.0): fp16 needs loss scaling and can "
        "still overflow; bf16 keeps fp32's range at the same speed. Use bf16 unless you must match an fp16 "
        "reference (--mixed_precision bf16 on the launch line; recipes/mixed_precision.py: --precision bf16)"
    ]
    assert (
        checks.config_problems(
            config, hardware={**v100, "capability": (7, 5)}, flags={"mixed_precision": "fp16"}
        )
        == []
    )
    assert checks.config_problems(config, hardware=CPU) == []


def test_wrap_class_that_the_model_does_not_have(tmp_path):
    config = yaml_config(
        tmp_path,
        "fsdp",
        (
            "fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP",
            "fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP\n"
            "  fsdp_transformer_layer_cls_to_wrap: GPT2Block",
        ),
    )
    debug = models.llama_config("debug", 4096)
    classes = checks.model_class_names(models.causal_lm_class(debug), debug)
    assert "LlamaDecoderLayer" in classes
    where = "accelerate_configs/fsdp.yaml"
    assert lines(checks.config_problems(config, where=where, model_classes=classes)) == [
        f"error: fsdp_transformer_layer_cls_to_wrap: GPT2Block in {where}, but the model has no such module (its "
        "blocks: LlamaDecoderLayer); name one of them, or delete the key to wrap the model's _no_split_modules"
    ]
    config["fsdp_config"]["fsdp_transformer_layer_cls_to_wrap"] = "LlamaDecoderLayer"
    assert checks.config_problems(config, where=where, model_classes=classes) == []


def test_fsdp1_settings_the_recipes_cannot_use(tmp_path):
    config = yaml_config(
        tmp_path, "fsdp1", ("fsdp_use_orig_params: true", "fsdp_use_orig_params: false")
    )
    assert lines(checks.config_problems(config)) == [
        "error: fsdp_use_orig_params: false in the accelerate config: these recipes build the optimizer before "
        "accelerator.prepare, which FSDP1 supports only with fsdp_use_orig_params: true"
    ]
    config = yaml_config(
        tmp_path, "fsdp1", ("fsdp_offload_params: false", "fsdp_offload_params: true")
    )
    assert lines(checks.config_problems(config, where="fsdp1.yaml", hardware=CPU)) == [
        "error: fsdp_offload_params: true in fsdp1.yaml needs a GPU (it pins host memory); on a CPU-only host the "
        "parameters are in CPU memory already: set it to false"
    ]
    assert (
        checks.config_problems(
            config, hardware={"device_type": "cuda", "capability": (9, 0), "gpus": 2}
        )
        == []
    )


def test_hsdp_mesh_that_the_launch_cannot_run(tmp_path):
    """accelerate_configs/hsdp.yaml as shipped passes; a mesh whose product is not the ranks, one with nothing
    to shard, context parallel, and shard groups across machines are named, from the YAML or the ranks' env."""
    config = yaml_config(tmp_path, "hsdp")
    assert checks.config_problems(config, where="hsdp.yaml", hardware=CPU) == []

    def mesh(replicate, shard, cp=1, ranks=4, machines=1):
        sizes = {"dp_replicate": replicate, "dp_shard": shard, "cp": cp}
        return lines(
            checks.config_problems(
                {
                    **config,
                    "num_processes": ranks,
                    "num_machines": machines,
                    "parallelism_config": {
                        f"parallelism_config_{k}_size": v for k, v in sizes.items()
                    },
                },
                where="hsdp.yaml",
            )
        )

    assert mesh(2, 2, ranks=8) == [
        "error: parallelism_config_dp_replicate_size 2 x parallelism_config_dp_shard_size 2 in hsdp.yaml = 4 ranks, "
        "but the launch has num_processes 8: make the product the number of processes"
    ]
    assert mesh(4, 1) == [
        "error: parallelism_config_dp_shard_size 1 in hsdp.yaml: FSDP has nothing to shard across; "
        "for replicas alone use accelerate_configs/ddp.yaml"
    ]
    for cp_mesh in (
        mesh(1, 2, cp=2),
        mesh(1, 1, cp=2, ranks=2),
    ):  # with dp_shard 2, and alone: one line
        assert len(cp_mesh) == 1 and cp_mesh[0].startswith(
            "error: parallelism_config_cp_size 2 in hsdp.yaml: "
            "the recipes shard the data-parallel dimensions"
        )
    assert mesh(2, 4, ranks=8, machines=4)[
        0
    ].startswith(  # 2 per machine: a shard group spans 2 machines
        "warning: parallelism_config_dp_shard_size 4 in hsdp.yaml with 2 processes per machine: shard groups span"
    )
    assert (
        mesh(2, 2, ranks=4, machines=2) == mesh(4, 2, ranks=8, machines=2) == []
    )  # within a machine
    env = {
        "WORLD_SIZE": "4",
        "ACCELERATE_USE_FSDP": "true",
        "FSDP_VERSION": "2",
        "ACCELERATE_USE_PARALLELISM_CONFIG": "true",
        "PARALLELISM_CONFIG_DP_REPLICATE_SIZE": "2",
        "PARALLELISM_CONFIG_DP_SHARD_SIZE": "2",
        "PARALLELISM_CONFIG_TP_SIZE": "1",
    }
    assert checks._launch_config_from_env(env)["parallelism_config"] == {
        "parallelism_config_dp_replicate_size": 2,
        "parallelism_config_dp_shard_size": 2,
        "parallelism_config_tp_size": 1,
        "parallelism_config_cp_size": 1,
        "parallelism_config_sp_size": 1,
    }


def test_tensor_parallel_only_where_it_runs(tmp_path):
    """accelerate_configs/tp.yaml passes for recipes/llama.py, whose global batch counts the 2 data-parallel
    ranks of its 4; tp_size elsewhere (another recipe, off FSDP2, FSDP1, rank 0 loading for all, tp without
    dp_shard) is one error line naming the flag and the config."""
    config = yaml_config(tmp_path, "tp")
    assert checks.config_problems(config, where="tp.yaml", hardware=CPU, tensor_parallel=True) == []
    flags = {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 1}

    def one(config, **facts):
        out = lines(
            checks.config_problems(config, where="tp.yaml", **{"tensor_parallel": True, **facts})
        )
        assert len(out) == 1, out
        return out[0]

    assert one(config, flags=flags, train_size=3) == (  # 4 = 2 x 1 x 2 data-parallel ranks, not 8
        "error: the training split has 3 samples, fewer than one global batch of 4 (= 2 per device x 1 "
        "accumulation x 2 data-parallel ranks of 4)"
    )
    assert checks.config_problems(config, flags=flags, train_size=4, tensor_parallel=True) == []
    tp = "error: parallelism_config_tp_size 2 in tp.yaml"
    assert (
        one(config, tensor_parallel=False)
        == f"{tp}: this recipe builds its model whole; recipes/llama.py is "
        "the one that shards it for tensor parallel (docs/configs.md#tensor-parallel)"
    )
    for kind in ("MULTI_GPU", "DEEPSPEED"):
        assert (
            one({**config, "distributed_type": kind})
            == f"{tp} with distributed_type {kind}: tensor parallel "
            "runs under FSDP2 (fsdp_version: 2) only, as in accelerate_configs/tp.yaml"
        )
    assert one({**config, "fsdp_config": {**config["fsdp_config"], "fsdp_version": 1}}).startswith(
        f"{tp} with distributed_type FSDP: tensor parallel runs under FSDP2"
    )
    assert (
        one(
            {
                **config,
                "fsdp_config": {**config["fsdp_config"], "fsdp_cpu_ram_efficient_loading": True},
            }
        )
        == f"{tp} with fsdp_cpu_ram_efficient_loading: true: Accelerate would broadcast rank 0's tensor-parallel "
        "slices to every rank; set it to false (tp.yaml)"
    )
    alone = {
        **config,
        "parallelism_config": {
            "parallelism_config_dp_shard_size": 1,
            "parallelism_config_tp_size": 4,
        },
    }
    assert (
        one(alone)
        == "error: parallelism_config_dp_shard_size 1 in tp.yaml: FSDP has nothing to shard across; "
        "for tensor parallel, leave FSDP dp_shard ranks (tp.yaml: dp_shard 2 x tp 2)"
    )
    env = {
        "WORLD_SIZE": "4",
        "ACCELERATE_USE_FSDP": "true",
        "FSDP_VERSION": "2",
        "FSDP_CPU_RAM_EFFICIENT_LOADING": "false",
        "ACCELERATE_USE_PARALLELISM_CONFIG": "true",
        "PARALLELISM_CONFIG_DP_SHARD_SIZE": "2",
        "PARALLELISM_CONFIG_TP_SIZE": "2",
    }
    assert checks.config_problems(checks._launch_config_from_env(env), tensor_parallel=True) == []
    assert one(
        checks._launch_config_from_env({**env, "FSDP_CPU_RAM_EFFICIENT_LOADING": "true"})
    ).startswith(f"{tp} with fsdp_cpu_ram_efficient_loading: true")


def test_more_processes_than_gpus(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    config = yaml_config(tmp_path, "ddp", num_processes=8, num_machines=2)  # 4 per machine
    gpus = {"device_type": "cuda", "capability": (9, 0), "gpus": 2}
    assert lines(checks.config_problems(config, where="ddp.yaml", hardware=gpus)) == [
        "error: num_processes 8 in ddp.yaml (or --num_processes) starts 4 processes on this machine, but torch sees "
        "2 GPU(s) (CUDA_VISIBLE_DEVICES=0,1); launch at most one process per GPU"
    ]
    assert checks.config_problems(config, hardware={**gpus, "gpus": 4}) == []


def test_gpus_left_idle(tmp_path, monkeypatch):
    # The quick start's 2 processes on an 8-GPU host: 6 GPUs idle, named, and the flag that uses them.
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    eight = {"device_type": "cuda", "capability": (9, 0), "gpus": 8}
    config = yaml_config(tmp_path, "fsdp")
    assert config["num_processes"] == 2
    assert lines(checks.config_problems(config, where="fsdp.yaml", hardware=eight)) == [
        "warning: num_processes 2 in fsdp.yaml (or --num_processes) starts 2 processes on this machine, which has 8 "
        "GPUs: 6 stay idle: cuda:2, cuda:3, cuda:4, cuda:5, cuda:6, cuda:7; launch with --num_processes 8 to use "
        "them all (or set CUDA_VISIBLE_DEVICES to the GPUs this job should have)"
    ]
    # two machines of 4 GPUs, 6 processes: 3 per machine; the idle one by its CUDA_VISIBLE_DEVICES entry too
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    config = yaml_config(tmp_path, "ddp", num_processes=6, num_machines=2)
    assert lines(
        checks.config_problems(config, where="ddp.yaml", hardware={**eight, "gpus": 4})
    ) == [
        "warning: num_processes 6 in ddp.yaml (or --num_processes) starts 3 processes on this machine, which has 4 "
        "GPUs: 1 stay idle: cuda:3 (device 7); launch with --num_processes 8 to use them all (or set "
        "CUDA_VISIBLE_DEVICES to the GPUs this job should have)"
    ]
    # every GPU used, a one-process launch (single.yaml), or a CPU host: nothing to say
    assert (
        checks.config_problems(yaml_config(tmp_path, "ddp", num_processes=8), hardware=eight) == []
    )
    assert checks.config_problems(yaml_config(tmp_path, "single"), hardware=eight) == []
    assert checks.config_problems(yaml_config(tmp_path, "ddp"), hardware=CPU) == []


def test_global_batch_larger_than_the_training_set():
    config = {"num_processes": 2}
    assert lines(
        checks.config_problems(config, flags=FLAGS, train_size=7, train_unit="blocks of 64 tokens")
    ) == [
        "error: the training split has 7 blocks of 64 tokens, fewer than one global batch of 8 (= 4 per device x 1 "
        "accumulation x 2 ranks)"
    ]
    assert checks.config_problems(config, flags=FLAGS, train_size=8) == []


def test_warmup_not_shorter_than_the_run():
    assert lines(checks.config_problems({}, flags={"warmup_steps": 30}, steps=30)) == [
        "warning: --warmup_steps 30 >= the run's 30 steps: the LR never reaches its peak (--learning_rate)"
    ]
    assert checks.config_problems({}, flags={"warmup_steps": 29}, steps=30) == []


def test_global_batch_above_the_reference_without_scale_lr_or_warmup():
    flags = {**FLAGS, "reference_global_batch": 2, "warmup_steps": 0}
    line = (
        "warning: global batch 8 > 2 without {}: --reference_global_batch 2 is the batch --learning_rate was "
        "tuned at, and this run's is 8 (= 4 per device x 1 accumulation x 2 ranks); expect slower or unstable "
        "training"
    )
    assert lines(checks.config_problems({"num_processes": 2}, flags=flags)) == [
        line.format("--scale_lr")
    ]
    assert lines(
        checks.config_problems({"num_processes": 2}, flags={**flags, "scale_lr": True})
    ) == [line.format("--warmup_steps")]
    assert (
        checks.config_problems(
            {"num_processes": 2}, flags={**flags, "scale_lr": True, "warmup_steps": 2}
        )
        == []
    )
    assert (
        checks.config_problems({"num_processes": 1}, flags={**flags, "reference_global_batch": 4})
        == []
    )


def test_zero3_where_a_less_sharded_strategy_fits():
    config = {
        **yaml.safe_load((REPO / "accelerate_configs/deepspeed_zero3.yaml").read_text()),
        "num_processes": 8,
    }
    ds, where = checks.deepspeed_settings(config, root=str(REPO))
    psi = 4_212_992  # the debug preset with the recipe's 4,096-token vocabulary
    with torch.device("meta"):
        model = models.causal_lm_class(debug := models.llama_config("debug", 4096))(debug)
    assert sum(p.numel() for p in model.parameters()) == psi

    def problems(memory, ds=ds):
        return lines(
            checks.config_problems(
                config, ds=ds, ds_where=where, flags=FLAGS, n_params=psi, device_memory=memory
            )
        )

    # Bytes per rank of params, grads (fp32: the JSON's grad_accum_dtype), fp32 master and Adam,
    # in bf16 on 8 ranks: ZeRO-3 2Ψ/8 + 16Ψ/8; ZeRO-2 2Ψ + 16Ψ/8; FSDP2 16Ψ/8 plus the gathered
    # bf16 parameters it keeps from forward to backward, 2 x 7Ψ/8. Sent per step, a ring's 7/8 of:
    # ZeRO-3 Ψ x 4 B reduced + 2 x Ψ x 2 B gathered; DeepSpeed's ZeRO-2 all-reduces (2Ψ x 4 B) and
    # gathers once; FSDP2 without resharding reduce-scatters Ψ x 4 B and gathers once.
    zero3, zero2, fsdp = 18 * psi / 8, 2 * psi + 16 * psi / 8, 16 * psi / 8 + 2 * 7 * psi / 8
    sends = {"zero3": 8 * psi * 7 / 8, "zero2": 10 * psi * 7 / 8, "zero2_rs": 6 * psi * 7 / 8}
    fsdp_sends = 6 * psi * 7 / 8
    assert fsdp < zero2 and sends["zero2"] > sends["zero3"] > sends["zero2_rs"] == fsdp_sends
    # the planner's model states agree (its ZeRO-3 also keeps the small parameters whole)
    strategy = planner.read_strategy(REPO / "accelerate_configs/deepspeed_zero3.yaml")
    shape = planner.model_shape(debug)
    states = ("params", "grads", "fp32_master", "adam_moments")
    for kind, guard in (("zero3", zero3), ("zero2", zero2)):
        planned = planner.plan_strategy(
            {**strategy, "kind": kind}, shape, 8, 1, 128, 1, False, "bf16"
        )
        assert 0 <= sum(planned[k] for k in states) - guard < 0.02 * guard, kind
    mb = lambda b: f"{b / 1e6:.2f} MB"  # noqa: E731
    head = (
        "warning: ZeRO-3 (zero_optimization.stage: 3 in the DeepSpeed JSON ds_configs/zero3.json) "
        f"sends {mb(sends['zero3'])} per rank and step, but "
    )
    tail = (
        " (at most half of {} per rank); prefer that unless you measured otherwise (python "
        "tools/plan.py counts activations and predicts tokens/s; benchmarks/compare_strategies.py "
        "measures)"
    )
    zero2_line = f"ZeRO-2 would hold {mb(zero2)} of model states and send {mb(sends['zero2_rs'])}"
    fsdp_line = (
        f"FSDP2 with fsdp_reshard_after_forward: false would hold {mb(fsdp)} of model states and send "
        f"{mb(fsdp_sends)}"
    )
    assert problems(10**9) == [head + fsdp_line + tail.format("1.00 GB")]
    # FSDP2's model states in more than half the memory: nothing to say (ZeRO-2 sends more)
    assert problems(2 * fsdp - 1) == []
    # with reduce-scatters (use_multi_rank_bucket_allreduce: false) ZeRO-2 sends less than ZeRO-3
    reduce_ops = {**ds["zero_optimization"], "use_multi_rank_bucket_allreduce": False}
    ds_rs = {**ds, "zero_optimization": reduce_ops}
    assert problems(10**9, ds_rs) == [head + zero2_line + "; " + fsdp_line + tail.format("1.00 GB")]
    assert problems(2 * zero2 - 1, ds_rs) == [head + fsdp_line + tail.format(mb(2 * zero2 - 1))]
    # not ZeRO-3: no warning
    assert problems(10**9, {**ds, "zero_optimization": {"stage": 2}}) == []


def test_deepspeed_settings_on_the_launch_line():
    """`accelerate launch --zero_stage 3 ...` next to a JSON: Accelerate copies a flag only where the JSON
    says "auto"; any other flag is dropped silently, and one that reaches DeepSpeed must match the recipe's."""
    env = {
        "WORLD_SIZE": "2",
        "ACCELERATE_USE_DEEPSPEED": "true",
        "ACCELERATE_DEEPSPEED_CONFIG_FILE": "ds_configs/zero2.json",
        "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "4",
        "ACCELERATE_GRADIENT_CLIPPING": "1.0",
        "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3",
        "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "cpu",
    }
    config = checks._launch_config_from_env(env)
    assert config["deepspeed_config"] == {
        "deepspeed_config_file": "ds_configs/zero2.json",
        "zero_stage": "3",
        "gradient_accumulation_steps": "4",
        "gradient_clipping": "1.0",
        "offload_optimizer_device": "cpu",
    }
    ds, where = checks.deepspeed_settings(config, root=str(REPO))
    flags = {
        "per_device_train_batch_size": 2,
        "gradient_accumulation_steps": 1,
        "max_grad_norm": 1.0,
    }
    assert lines(checks.config_problems(config, ds=ds, ds_where=where, flags=flags)) == [
        "error: accelerate launch --gradient_accumulation_steps 4 differs from the recipe's "
        "--gradient_accumulation_steps 1: DeepSpeed would follow the launch flag (the DeepSpeed JSON "
        'ds_configs/zero2.json says "auto") while the '
        "recipe counts and reports its own; give the value to the recipe (after the script name) and drop the launch "
        "flag",
        "error: accelerate launch --zero_stage 3 conflicts with the DeepSpeed JSON ds_configs/zero2.json, which sets "
        "zero_optimization.stage: 2 and wins (Accelerate ignores the flag next to a JSON); drop the flag, or launch "
        "with a JSON that says what you want",
        "error: accelerate launch --offload_optimizer_device cpu conflicts with the DeepSpeed JSON "
        "ds_configs/zero2.json, which has no zero_optimization.offload_optimizer.device (DeepSpeed's default: "
        '"none") and wins (Accelerate ignores the flag next to a JSON); drop the flag, or launch with a JSON that '
        "says what you want",
    ]
    # What DeepSpeed would do anyway, or what the recipe was told too, is no problem (the clipping above is one).
    same = {
        "gradient_accumulation_steps": "1",
        "zero_stage": "2",
        "offload_optimizer_device": "none",
        "gradient_clipping": "1",
        "zero3_save_16bit_model": "false",
    }
    assert list(checks._launch_flag_problems(same, ds, where, flags)) == []
    zero3_offload, where3 = checks.deepspeed_settings(
        {
            "distributed_type": "DEEPSPEED",
            "deepspeed_config": {"deepspeed_config_file": "ds_configs/zero3_offload.json"},
        },
        root=str(REPO),
    )
    assert [
        p.text.split(",")[0]
        for p in checks._launch_flag_problems(
            {"offload_param_device": "none", "zero3_save_16bit_model": "false"},
            zero3_offload,
            where3,
            flags,
        )
    ] == [
        "accelerate launch --offload_param_device none conflicts with the DeepSpeed JSON "
        "ds_configs/zero3_offload.json",
        "accelerate launch --zero3_save_16bit_model false conflicts with the DeepSpeed JSON "
        "ds_configs/zero3_offload.json",
    ]
    # Under another strategy Accelerate drops every DeepSpeed flag of the launch line.
    config = {
        "distributed_type": "MULTI_GPU",
        "dropped_launch_flags": {"--gradient_accumulation_steps": "4"},
    }
    assert lines(checks.config_problems(config)) == [
        "error: accelerate launch --gradient_accumulation_steps 4: Accelerate passes it to DeepSpeed only, and this "
        "launch is not DeepSpeed (MULTI_GPU), so it would be ignored; give --gradient_accumulation_steps 4 to the "
        "recipe (after the script name)"
    ]


def test_launch_config_from_env_and_startup_stops(capsys, monkeypatch, tmp_path):
    env = {
        "WORLD_SIZE": "4",
        "LOCAL_WORLD_SIZE": "2",
        "ACCELERATE_MIXED_PRECISION": "bf16",
        "ACCELERATE_USE_FSDP": "true",
        "FSDP_VERSION": "1",
        "FSDP_USE_ORIG_PARAMS": "false",
        "FSDP_OFFLOAD_PARAMS": "true",
        "FSDP_TRANSFORMER_CLS_TO_WRAP": "GPT2Block",
    }
    assert checks._launch_config_from_env(env) == {
        "mixed_precision": "bf16",
        "mixed_precision_forced": True,  # no accelerate launch above: set by hand
        "num_processes": 4,
        "num_machines": 2,
        "distributed_type": "FSDP",
        "fsdp_config": {
            "fsdp_version": 1,
            "fsdp_use_orig_params": False,
            "fsdp_offload_params": True,
            "fsdp_reshard_after_forward": "true",
            "fsdp_cpu_ram_efficient_loading": False,
            "fsdp_transformer_layer_cls_to_wrap": "GPT2Block",
        },
    }
    env = {
        "ACCELERATE_USE_DEEPSPEED": "true",
        "ACCELERATE_DEEPSPEED_CONFIG_FILE": "ds_configs/zero2.json",
    }
    assert checks._launch_config_from_env(env)["deepspeed_config"] == {
        "deepspeed_config_file": "ds_configs/zero2.json"
    }
    # Startup: a warning prints once however often it comes back (on stderr, rank 0 only); errors
    # stop, all of them
    monkeypatch.chdir(tmp_path)  # no DeepSpeed JSON, an empty launch environment
    for var in ("ACCELERATE_USE_DEEPSPEED", "ACCELERATE_USE_FSDP", "RANK"):
        monkeypatch.delenv(var, raising=False)
    warning = checks.Problem("warning", "w1 (test_checks)")
    answers = [
        [],
        [warning],
        [warning],
        [checks.Problem("error", "e1"), warning, checks.Problem("error", "e2")],
    ]
    monkeypatch.setattr(checks, "config_problems", lambda config, **facts: answers.pop(0))
    guard = checks.Startup(SimpleNamespace(ddp_timeout=60, per_device_train_batch_size=2))
    assert guard.facts["flags"] == {
        "per_device_train_batch_size": 2,
        "mixed_precision": guard.precision["used"],
    }
    guard.check(train_size=10)
    guard.check(train_size=10)
    assert capsys.readouterr().err.count("warning: w1 (test_checks)\n") == 1
    with pytest.raises(Stop) as exc:
        guard.data_ready(train_size=10, train_unit="blocks", steps=3)
    assert f"error: {exc.value}" == "error: e1\nerror: e2"
    assert guard.facts["train_size"] == 10 and guard.facts["steps"] == 3


def test_the_planner_prints_the_problems(tmp_path, capsys):
    yaml_config(
        tmp_path,
        "fsdp",
        (
            "fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP",
            "fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP\n"
            "  fsdp_transformer_layer_cls_to_wrap: GPT2Block",
        ),
    )
    line = (
        f"error: fsdp_transformer_layer_cls_to_wrap: GPT2Block in {tmp_path / 'fsdp.yaml'}, but the model has "
        "no such module"
    )
    for fmt in ("table", "json"):  # an error among the problems: exit status 1, after the table
        with pytest.raises(SystemExit) as exit_:
            plan_cli.main(
                [
                    "--config",
                    str(tmp_path / "fsdp.yaml"),
                    "--device_memory",
                    "80GB",
                    "--format",
                    fmt,
                ]
            )
        assert exit_.value.code == 1
        out = capsys.readouterr().out
        if fmt == "table":
            assert "\nProblems:\n- " + line in out, out[-2000:]
        else:
            assert json.loads(out)["problems"][0].startswith(line)


# --- every recipe calls the shared check, before its Accelerator -----------------------------------

RECIPE_ARGS = {
    "llama": [],
    "ddp_classifier": [],
    "mixed_precision": [],
    "gradient_checkpointing": [],
    "sharded_data": ["--data_dir", "/nonexistent", "--loader", "parquet"],
}


@pytest.mark.parametrize("recipe", sorted(RECIPE_ARGS))
def test_every_recipe_calls_the_shared_check(recipe, tmp_path, monkeypatch):
    """A DeepSpeed launch whose JSON sets another micro batch than the flag: only common/checks.py sees it, and
    the recipe must stop with its line before building the Accelerator (conftest's stub fails the test there)."""
    _, _, where = ds_json(tmp_path, train_micro_batch_size_per_gpu=3)
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", str(tmp_path / "zero2.json"))
    message = run_in_process(
        monkeypatch,
        f"recipes/{recipe}.py",
        "--output_dir",
        tmp_path / "out",
        "--max_steps",
        3,
        "--per_device_train_batch_size",
        2,
        *RECIPE_ARGS[recipe],
    )
    assert message == (
        f"error: {where} sets train_micro_batch_size_per_gpu: 3, but --per_device_train_batch_size "
        'is 2; set the key to "auto" (it then follows the flags) or make them equal'
    ), message
