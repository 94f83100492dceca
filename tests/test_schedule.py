"""The LR: --scale_lr applies the linear scaling rule with warmup, and says so; the schedule flags
mean what they mean in transformers.TrainingArguments; the launch line's flags are refused."""

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from transformers import TrainingArguments, get_scheduler

from common import checkpoint
from common.args import LAUNCH_FLAGS, TrainingFlags, _FlagParser, parse_args
from common.causal_lm import scaled_learning_rate
from common.errors import Stop
from common.schedule import SCHEDULES, lr_decays_after, lr_scheduler, warmup_count
from conftest import FAST, REPO, launch, read_metrics

# FAST's batch (the global batch the messages name), with small blocks, a small eval and no sample.
SMALL = [*FAST, "--block_size", 64, "--max_eval_samples", 8, "--sample_tokens", 0]


def test_linear_scaling_arithmetic():
    assert scaled_learning_rate(3e-4, 256, 32) == pytest.approx(2.4e-3)  # 8x the batch, 8x the LR
    assert scaled_learning_rate(1e-3, 8, 16) == pytest.approx(5e-4)
    assert scaled_learning_rate(1e-3, 16, 16) == 1e-3
    with pytest.raises(ValueError, match="--learning_rate must be positive"):
        scaled_learning_rate(0.0, 8, 16)
    with pytest.raises(ValueError, match="--reference_global_batch 0"):
        scaled_learning_rate(1e-3, 8, 0)


def test_scale_lr_in_the_recipe(tmp_path, cache_dir):
    out = tmp_path / "run"
    proc = launch(
        "ddp",
        "recipes/llama.py",
        "--output_dir",
        out,
        *SMALL,
        "--scale_lr",
        "--reference_global_batch",
        2,
        "--learning_rate",
        1e-3,
        "--warmup_steps",
        2,
        "--max_steps",
        4,
        "--logging_steps",
        1,
        "--eval_steps",
        4,
        cache_dir=cache_dir,
    )
    # global batch 8 = 4 per device x 2 ranks: 4x the reference batch, so 4x the LR, after warmup
    assert (
        "LR: base 0.001 (tuned at global batch 2), effective 0.004 at global batch 8, 2 warmup steps"
        in proc.stdout
    )
    lrs = [r["lr"] for r in read_metrics(out)[0]]
    assert lrs[:3] == pytest.approx([0.0, 0.002, 0.004])
    # (without --scale_lr the same batch is a warning: tests/test_bad_input.py's epoch run)


# The schedule flags as transformers.TrainingArguments has them (common/schedule.py builds them).
KWARGS = {  # the keywords a schedule needs (transformers raises without them)
    "cosine_with_min_lr": '{"min_lr_rate": 0.1}',
    "cosine_warmup_with_min_lr": '{"min_lr_rate": 0.1}',
    "warmup_stable_decay": '{"num_decay_steps": 5}',
}
# (--warmup_steps, --warmup_ratio, the warmup of a 20-step run)
WARMUPS = [(0, 0.0, 0), (3, 0.0, 3), (0.25, 0.0, 5), (0, 0.3, 6), (2, 0.5, 2)]


def own_flags(tmp_path, *argv, **defaults):
    @dataclass
    class Own:
        pass

    return parse_args(Own, ["--output_dir", str(tmp_path / "out"), *map(str, argv)], **defaults)


def lrs(scheduler, steps):
    out = []
    for _ in range(steps):
        out.append(scheduler.get_last_lr()[0])
        scheduler.optimizer.step()
        scheduler.step()
    return out


@pytest.mark.parametrize("name", SCHEDULES)
def test_every_schedule_is_trainers(name, tmp_path):
    """Per step, the LR the recipes' builder gives equals transformers.get_scheduler's with the
    warmup TrainingArguments resolves (an integer, or a share of the run below 1); --warmup_ratio
    is transformers 4's share, which a --warmup_steps above 0 overrides."""
    steps = 20
    for warmup_steps, warmup_ratio, expected in WARMUPS:
        argv = ["--lr_scheduler_type", name, "--warmup_steps", warmup_steps]
        argv += ["--warmup_ratio", warmup_ratio] + (
            ["--lr_scheduler_kwargs", KWARGS[name]] if name in KWARGS else []
        )
        args = own_flags(tmp_path, *argv)
        trainer = TrainingArguments(
            str(tmp_path),
            lr_scheduler_type=name,
            warmup_steps=warmup_steps or warmup_ratio,
            lr_scheduler_kwargs=KWARGS.get(name),
        )
        warmup = trainer.get_warmup_steps(steps)
        assert warmup == expected
        optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.ones(2))], lr=0.01)
        got = lrs(lr_scheduler(optimizer, args, steps), steps)
        optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.ones(2))], lr=0.01)
        want = lrs(
            get_scheduler(name, optimizer, warmup, steps, trainer.lr_scheduler_kwargs), steps
        )
        assert got == want, (warmup_steps, warmup_ratio)
        assert warmup_count(args.warmup_steps, args.warmup_ratio, steps) == warmup
    assert {"linear", "cosine", "cosine_with_min_lr", "constant_with_warmup"} <= set(SCHEDULES)
    assert "warmup_stable_decay" in SCHEDULES and "reduce_lr_on_plateau" not in SCHEDULES


def test_a_warmup_that_constant_ignores_is_said(tmp_path, capsys):
    own_flags(tmp_path, "--lr_scheduler_type", "constant", warmup_steps=15)
    assert capsys.readouterr().err.startswith("warning: --lr_scheduler_type constant has no warmup")
    own_flags(tmp_path, "--lr_scheduler_type", "constant_with_warmup", warmup_steps=15)
    assert capsys.readouterr().err == ""


def test_a_ratio_replaces_the_recipes_warmup_steps(tmp_path, capsys):
    args = own_flags(tmp_path, "--warmup_ratio", 0.1, warmup_steps=15)  # llama.py's default
    assert (args.warmup_steps, warmup_count(args.warmup_steps, args.warmup_ratio, 150)) == (0, 15)
    args = own_flags(tmp_path, "--warmup_ratio", 0.1, "--warmup_steps", 4, warmup_steps=15)
    assert warmup_count(args.warmup_steps, args.warmup_ratio, 150) == 4  # the steps win
    assert capsys.readouterr().err.strip() == (
        "warning: --warmup_steps 4 and --warmup_ratio 0.1 both given: --warmup_steps wins (as in "
        "transformers 4's TrainingArguments)"
    )


@pytest.mark.parametrize(
    "argv, error",
    [
        (
            ["--lr_scheduler_type", "cosine_with_min_lr"],
            "One of min_lr or min_lr_rate should be set",
        ),
        (["--lr_scheduler_type", "warmup_stable_decay"], "num_decay_steps"),
        (
            ["--lr_scheduler_kwargs", '{"min_lr_rate": 0.1}'],
            "unexpected keyword argument 'min_lr_rate'",
        ),
        (["--lr_scheduler_kwargs", "min_lr_rate=0.1"], "Expecting value"),
        (["--lr_scheduler_type", "reduce_lr_on_plateau"], "invalid choice: 'reduce_lr_on_plateau'"),
    ],
)
def test_a_schedule_that_cannot_be_built_stops_at_parse_time(argv, error, tmp_path):
    with pytest.raises(Stop) as stop:
        own_flags(tmp_path, *argv)
    assert error in str(stop.value) and "\n" not in str(stop.value), stop.value


@pytest.mark.parametrize(
    "argv, says",
    [
        (
            ["--bf16", "true"],
            "--bf16: precision is set on the launch line: accelerate launch "
            "--mixed_precision bf16 ... (or mixed_precision: bf16 in the config)",
        ),
        (
            ["--fp16"],
            "--fp16: precision is set on the launch line: accelerate launch --mixed_precision fp16",
        ),
        (["--half_precision_backend", "auto"], "--mixed_precision fp16"),
        (["--tf32=true"], "--tf32: TF32 is PyTorch's"),
        (
            ["--deepspeed", "ds.json"],
            "--deepspeed: DeepSpeed is set on the launch line: accelerate launch --config_file "
            "accelerate_configs/deepspeed_zero2.yaml (zero3, zero3_offload), or accelerate "
            "launch --use_deepspeed --deepspeed_config_file FILE",
        ),
        (
            ["--fsdp", "full_shard"],
            "--fsdp: FSDP is set on the launch line: accelerate launch --config_file "
            "accelerate_configs/fsdp.yaml",
        ),
        (["--fsdp-config", "f.json"], "accelerate_configs/fsdp.yaml"),  # (either spelling)
    ],
)
def test_a_launch_line_flag_stops_naming_where_it_goes(argv, says, tmp_path):
    with pytest.raises(Stop) as stop:
        own_flags(tmp_path, "--max_steps", 3, *argv)
    text = str(stop.value)
    name = "--" + argv[0][2:].split("=")[0].replace("-", "_")
    assert text.startswith(name + ": ") and says in text, text
    assert "\n" not in text


def test_help_shows_the_schedule_flags_not_the_launch_lines():
    @dataclass
    class Own:
        pass

    parser = _FlagParser((TrainingFlags, Own), defaults={"lr_scheduler_type": "cosine"})
    text = " ".join(parser.format_help().split())
    assert (
        "--lr_scheduler_type" in text
        and "--warmup_ratio" in text
        and "TrainingArguments: linear" in text
    )
    assert "(default: cosine; TrainingArguments: linear)" in text
    assert not [f for f in LAUNCH_FLAGS if f"--{f} " in text or f"--{f}=" in text]


def test_a_changed_schedule_is_refused_on_resume():
    """The schedule and its warmup in steps are in the run state a checkpoint records: another one
    stops at start-up in one line; past the warmup of an LR that decays over --max_steps, another
    --max_steps too."""
    from types import SimpleNamespace

    from accelerate.utils import DistributedType
    from transformers import LlamaConfig

    accelerator = SimpleNamespace(
        mixed_precision="no", distributed_type=DistributedType.NO, num_processes=1
    )
    model = torch.nn.Linear(2, 2)
    model.config = LlamaConfig()

    def state(*argv, max_steps=20):
        args = own_flags(Path("/nonexistent"), *argv)
        args.adam_beta1, args.adam_beta2, args.adam_epsilon = 0.9, 0.95, 1e-8  # a recipe's flags
        return checkpoint.run_state(accelerator, args, model, 0.01, max_steps, seed=42)

    saved, _ = state("--lr_scheduler_type", "cosine", "--warmup_ratio", 0.1)
    saved["step"] = 10

    def refusal(*argv, max_steps=20):
        now, must_match = state(*argv, max_steps=max_steps)
        with pytest.raises(Stop) as stop:
            checkpoint.check_resume(Path("ckpt"), saved, now, must_match, lr_decays_after(now))
        return str(stop.value)

    assert saved["warmup_steps"] == 2 and lr_decays_after(saved) == 2
    assert refusal("--lr_scheduler_type", "linear", "--warmup_ratio", 0.1).startswith(
        "cannot resume from ckpt: lr_scheduler_type cosine -> linear. Resume with the saved"
    )
    assert refusal(
        "--lr_scheduler_type",
        "cosine_with_min_lr",
        "--lr_scheduler_kwargs",
        '{"min_lr_rate": 0.2}',
        "--warmup_steps",
        2,
    ).startswith(
        "cannot resume from ckpt: lr_scheduler_type cosine -> cosine_with_min_lr; "
        "lr_scheduler_kwargs.min_lr_rate None -> 0.2. Resume"
    )
    # a share of a longer run is a longer warmup
    assert refusal("--lr_scheduler_type", "cosine", "--warmup_ratio", 0.1, max_steps=40).startswith(
        "cannot resume from ckpt: warmup_steps 2 -> 4 (--warmup_steps, or --warmup_ratio x "
        "--max_steps); max_steps 20 -> 40 (the LR decays over "
        "--max_steps after 4 warmup steps"
    )
    now, must_match = state("--lr_scheduler_type", "cosine", "--warmup_steps", 2)
    checkpoint.check_resume(Path("ckpt"), saved, now, must_match, lr_decays_after(now))  # the same
    assert lr_decays_after({**now, "lr_scheduler_type": "constant_with_warmup"}) is None


# The other TrainingArguments habits: --run_name, --logging_dir, --dataloader_num_workers, and
# llama.py's --dataset_text_field (TRL's name).


def test_the_run_name_and_logging_dir_reach_the_trackers(tmp_path):
    from types import SimpleNamespace

    from common import metrics

    started = {}
    accelerator = SimpleNamespace(
        device=torch.device("cpu"),
        project_configuration=SimpleNamespace(logging_dir=str(tmp_path)),
        is_main_process=False,  # (writes nothing)
        num_processes=1,
        trackers=[],
        init_trackers=lambda project, config, init_kwargs: started.update(init_kwargs),
    )
    argv = ["--run_name", "lr-sweep-3", "--logging_dir", tmp_path / "tb", "--report_to", "none"]
    metrics.RunLog(accelerator, own_flags(tmp_path, *argv), "llama")
    assert started["wandb"] == {"name": "lr-sweep-3"} and started["mlflow"] == {
        "run_name": "lr-sweep-3"
    }
    assert started["tensorboard"] == {"purge_step": 0}  # its folder: LOGGING_DIR/llama
    assert accelerator.project_configuration.logging_dir == str(tmp_path / "tb")


@pytest.mark.parametrize("recipe", ["llama.py", "ddp_classifier.py"])
def test_loader_workers_train_the_same_blocks(recipe):
    """The recipes' shared loaders block, run as written with 0 and 2 workers under a one-process
    Accelerator: the same blocks in the same order, epoch after epoch and after a mid-epoch resume
    (the seedable sampler orders them in the rank's process; the workers only fetch)."""
    from types import SimpleNamespace

    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import DataLoaderConfiguration

    from common import checkpoint as common_checkpoint
    from test_skeleton import shared_blocks

    block = shared_blocks((REPO / "recipes" / recipe).read_text(), recipe)["loaders"]
    data = [{"input_ids": torch.tensor([i])} for i in range(40)]

    def order(workers):
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
        accelerator = Accelerator(
            cpu=True,
            dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=42),
        )
        args = SimpleNamespace(
            per_device_train_batch_size=4,
            per_device_eval_batch_size=4,
            dataloader_num_workers=workers,
        )
        scope = dict(torch=torch, accelerator=accelerator, args=args, checkpoint=common_checkpoint)
        exec(block, scope | dict(train_set=data, eval_set=data), scope)  # the loaders into scope
        loader = accelerator.prepare(scope["train_loader"])
        seen = []
        for epoch in (0, 1):
            loader.set_epoch(epoch)
            seen += [b["input_ids"].flatten().tolist() for b in loader]
        loader.set_epoch(1)  # a resume 3 batches into epoch 1
        seen += [
            b["input_ids"].flatten().tolist() for b in accelerator.skip_first_batches(loader, 3)
        ]
        assert scope["train_loader"].num_workers == workers
        return seen

    try:
        inline, workers = order(0), order(2)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
    assert workers == inline and len(inline) == 10 + 10 + 7
    assert inline[:10] != inline[10:20] and inline[13:20] == inline[20:]  # shuffled; resumed


def test_the_text_column_is_the_data_stages(tmp_path):
    from common import data

    rows = tmp_path / "rows.jsonl"
    texts = [f"document {i} " * 5 for i in range(20)]
    rows.write_text("".join(f'{{"content": "{t}", "text": "x"}}\n' for t in texts))
    raw = data.load_text_dataset(train_file=str(rows), text_field="content")
    assert list(raw["validation"]["text"]) + list(raw["train"]["text"]) == texts  # 5% held out
    assert "content" not in raw["train"].column_names
    with pytest.raises(Stop, match=r"train split has no 'body' column \(--dataset_text_field"):
        data.load_text_dataset(train_file=str(rows), text_field="body")
    llama = (REPO / "recipes" / "llama.py").read_text()
    assert "text_field=args.dataset_text_field" in llama and '"text"]' not in llama
