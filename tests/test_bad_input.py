"""Bad input: one clear line naming the culprit, a non-zero exit, and no hang."""

import ast
import json
import os
import re
import runpy
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from common import checkpoint, data, precision
from common.args import flag, parse_args, parse_flags
from common.errors import Stop
from conftest import FAST, REPO, launch, run_in_process


def fails_with(proc, *fragments):
    assert proc.returncode != 0
    for fragment in fragments:
        assert fragment in proc.stderr, proc.stderr[-3000:]


def test_missing_config_file(tmp_path, cache_dir, monkeypatch):
    # accelerate's own check names the file ...
    proc = launch(
        Path("accelerate_configs/nope.yaml"),
        "recipes/llama.py",
        cache_dir=cache_dir,
        device_guard=False,
        check=False,
        timeout=120,
    )
    fails_with(proc, "accelerate_configs/nope.yaml", "does not exist")
    # ... and our shorthand also lists the configs there are: its exit message (what Python prints, exit status 1),
    # in this process as test_help_of_every_entry_point runs it; it stops before starting the launcher
    monkeypatch.chdir(REPO)
    monkeypatch.setattr(sys, "argv", ["tools/launch.py", "nope", "recipes/llama.py"])
    monkeypatch.setattr(
        os, "execvp", lambda *a: pytest.fail(f"the shorthand started the launcher: {a}")
    )
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(str(REPO / "tools" / "launch.py"), run_name="__main__")
    message = exit_info.value.code
    assert isinstance(message, str), message
    for fragment in (
        "nope.yaml not found",
        "available: ddp, deepspeed_zero2, deepspeed_zero3",
        "fsdp, fsdp1",
        "single",
    ):
        assert fragment in message, message


def test_unknown_model_config(tmp_path, monkeypatch):
    # refused before the Accelerator is built: in this process (no launch)
    message = run_in_process(
        monkeypatch, "recipes/llama.py", "--model_config", "llama-9000", "--output_dir", tmp_path
    )
    for fragment in ("error: unknown --model_config 'llama-9000'", "'debug'", "'llama-3-8b'"):
        assert fragment in message, message


def test_missing_data_file(tmp_path):
    # in this process: how a data error ends both ranks, with its line last, is the empty-file test's launch
    (tmp_path / "train.txt").write_text("some text\n")
    for files in (
        {"train_file": tmp_path / "absent.txt"},
        {"train_file": tmp_path / "train.txt", "validation_file": tmp_path / "absent.txt"},
    ):
        with pytest.raises(
            Stop, match=re.escape(f"data file not found: {tmp_path / 'absent.txt'}")
        ):
            data.load_text_dataset(**{k: str(v) for k, v in files.items()})


def test_corpus_smaller_than_one_global_batch(tmp_path, cache_dir, small_corpus):
    train, valid, tok = small_corpus
    (tmp_path / "tiny.txt").write_text(train.read_text()[:2000])  # about 9 blocks of 64 tokens
    proc = launch(
        "single",
        "recipes/llama.py",
        "--train_file",
        tmp_path / "tiny.txt",
        "--validation_file",
        valid,
        "--tokenizer_name_or_path",
        tok,
        "--block_size",
        64,
        "--per_device_train_batch_size",
        16,
        "--output_dir",
        tmp_path / "out",
        "--report_to",
        "none",
        cache_dir=cache_dir,
        check=False,
        timeout=300,
    )
    fails_with(
        proc,
        "blocks of 64 tokens, fewer than one global batch of 16 "
        "(= 16 per device x 1 accumulation x 1 ranks)",
    )


def test_block_size_above_max_positions(tmp_path, cache_dir):
    proc = launch(
        "single",
        "recipes/llama.py",
        "--block_size",
        2048,
        "--output_dir",
        tmp_path,
        "--report_to",
        "none",
        cache_dir=cache_dir,
        check=False,
        timeout=300,
    )
    fails_with(proc, "--block_size 2048 exceeds the model's max_position_embeddings 1024")


@pytest.mark.parametrize(
    "flag,value,message",
    [
        ("--ddp_timeout", 0, "--ddp_timeout must be at least 1, got 0"),
        ("--logging_steps", 0, "--logging_steps must be at least 1, got 0"),
        (
            "--max_stepz",
            5,
            "Some specified arguments are not used by the HfArgumentParser: ['--max_stepz', '5']",
        ),
    ],
)
def test_bad_flags(flag, value, message, tmp_path, monkeypatch):
    # the parser's refusals, before the Accelerator: in this process
    # (test_unknown_flag_is_one_error_line_in_every_recipe runs the script for real)
    message_got = run_in_process(
        monkeypatch, "recipes/llama.py", flag, value, "--output_dir", tmp_path, *FAST[:-2]
    )
    assert message_got.startswith(f"error: {message}"), message_got


def test_config_overrides_only_change_a_model_trained_from_scratch(tmp_path, monkeypatch):
    # pretrained weights fix the shapes: refused before anything is loaded
    message = run_in_process(
        monkeypatch,
        "recipes/llama.py",
        "--model_name_or_path",
        tmp_path / "model",
        "--config_overrides",
        "num_hidden_layers=2",
        "--output_dir",
        tmp_path / "out",
    )
    assert message == (
        "error: --config_overrides changes a model trained from scratch (--config_name or the preset); "
        "pretrained weights (--model_name_or_path) keep their shapes"
    )


def test_resume_from_a_checkpoint_that_is_not_there(tmp_path, cache_dir):
    # the recipe's resume refusal, for real (it comes after the model is built: a launch) ...
    proc = launch(
        "single",
        "recipes/llama.py",
        "--resume_from_checkpoint",
        "latest",
        "--output_dir",
        tmp_path,
        *FAST[:-2],
        cache_dir=cache_dir,
        check=False,
        timeout=300,
    )
    fails_with(
        proc, "error: cannot resume: --resume_from_checkpoint latest: no complete checkpoint in"
    )
    # ... and the same function's refusal of a path that does not exist (the recipe's call, without the launch)
    with pytest.raises(Stop, match="--resume_from_checkpoint /nonexistent/ckpt: no such directory"):
        checkpoint._resolve_checkpoint(tmp_path, "/nonexistent/ckpt", None)


# What the ranks of a deepspeed_zero2.yaml launch read (common/checks.py _launch_config_from_env), on 2 CPU ranks.
DEEPSPEED_ZERO2_ENV = {
    "ACCELERATE_USE_DEEPSPEED": "true",
    "ACCELERATE_DEEPSPEED_CONFIG_FILE": "ds_configs/zero2.json",
    "ACCELERATE_MIXED_PRECISION": "bf16",
    "WORLD_SIZE": "2",
    "LOCAL_WORLD_SIZE": "2",
}


def test_max_grad_norm_must_match_deepspeed_json(tmp_path, cache_dir, monkeypatch):
    # DeepSpeed clips with its JSON's gradient_clipping (1.0): a different flag would be ignored.
    message = "error: --max_grad_norm 0.5 differs from the DeepSpeed JSON's gradient_clipping 1.0"
    proc = launch(
        "deepspeed_zero2",
        "recipes/llama.py",
        "--max_grad_norm",
        0.5,
        "--output_dir",
        tmp_path,
        cache_dir=cache_dir,
        check=False,
        timeout=300,
    )
    fails_with(proc, message)
    # ddp_classifier.py makes the same check before its Accelerator: in this process, with the variables
    # `accelerate launch --config_file accelerate_configs/deepspeed_zero2.yaml` gives its ranks
    monkeypatch.chdir(REPO)
    for key, value in DEEPSPEED_ZERO2_ENV.items():
        monkeypatch.setenv(key, value)
    assert run_in_process(
        monkeypatch,
        "recipes/ddp_classifier.py",
        "--max_grad_norm",
        0.5,
        "--output_dir",
        tmp_path / "classifier",
    ).startswith(message)


def test_an_fsdp_wrap_that_leaves_blocks_unwrapped_is_refused(tmp_path, cache_dir):
    # A class inside the blocks (the MLP) makes units, but no decoder block is one: each block's
    # other parameters would stay gathered in the root unit. Refused after prepare, naming the fix.
    config = tmp_path / "fsdp.yaml"
    config.write_text(
        (REPO / "accelerate_configs" / "fsdp.yaml")
        .read_text()
        .replace(
            "fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP",
            "fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP\n  fsdp_transformer_layer_cls_to_wrap: LlamaMLP",
        )
    )
    proc = launch(
        config,
        "recipes/llama.py",
        "--output_dir",
        tmp_path / "out",
        *FAST,
        "--max_steps",
        2,
        cache_dir=cache_dir,
        mixed_precision="no",
        check=False,
        timeout=300,
    )
    fails_with(
        proc,
        "error: FSDP made 0 of the 4 LlamaDecoderLayer blocks their own unit",
        "set fsdp_transformer_layer_cls_to_wrap: LlamaDecoderLayer in the accelerate config",
    )
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


@pytest.mark.parametrize(
    "variable,value,message",
    [
        ("FSDP_USE_ORIG_PARAMS", "false", "fsdp_use_orig_params: false in the accelerate config"),
        (
            "FSDP_OFFLOAD_PARAMS",
            "true",
            "fsdp_offload_params: true in the accelerate config needs a GPU",
        ),
    ],
)
def test_fsdp1_settings_the_recipes_cannot_use(variable, value, message, tmp_path, monkeypatch):
    # use_orig_params false trained nothing, silently (the optimizer held the unwrapped parameters);
    # parameter offload on a CPU-only host failed deep inside torch's pin_memory. Checked before the
    # Accelerator (config_problems, as the launches of test_max_grad_norm_must_match_deepspeed_json and
    # tests/test_guards.py's launch-line test run it for real): in this process, with the variables an
    # fsdp1.yaml launch with that one setting changed gives its ranks.
    fsdp1 = {
        "ACCELERATE_USE_FSDP": "true",
        "FSDP_VERSION": "1",
        "FSDP_USE_ORIG_PARAMS": "true",
        "FSDP_OFFLOAD_PARAMS": "false",
        "ACCELERATE_MIXED_PRECISION": "bf16",
        "WORLD_SIZE": "2",
        "LOCAL_WORLD_SIZE": "2",
    }
    for name, setting in {**fsdp1, variable: value}.items():
        monkeypatch.setenv(name, setting)
    assert run_in_process(
        monkeypatch, "recipes/llama.py", "--output_dir", tmp_path / "out", *FAST
    ).startswith(f"error: {message}")


@dataclass
class Own:
    """A recipe's own flags."""

    block_size: int = flag(64, low=2)
    per_device_eval_batch_size: int = flag(None, "default: --per_device_train_batch_size", low=1)


def test_core_flags_are_checked_in_one_place(tmp_path):
    # common/args.py parses the core TrainingArguments flags for every recipe (in-process: no launch)
    def error(*argv):
        with pytest.raises(Stop) as exit_info:
            parse_args(Own, argv=["--output_dir", str(tmp_path / "out"), *map(str, argv)])
        return f"error: {exit_info.value}"

    assert error("--report_to", "bogus").startswith(
        "error: --report_to bogus: unknown tracker bogus"
    )
    assert error("--max_steps", 0).startswith("error: --max_steps must be positive")
    assert error("--max_steps", "x").startswith("error: argument --max_steps: invalid int value")
    assert error("--block_sizee", 3).startswith("error: Some specified arguments are not used")
    args = parse_args(
        Own, argv=["--output_dir", str(tmp_path / "out"), "--report_to", "tensorboard"], max_steps=7
    )
    assert (args.max_steps, args.block_size, args.report_to) == (7, 64, "tensorboard")
    # every flag's range, core and own, is the parser's: the recipe's default too
    assert error("--seed", -1) == "error: --seed must be 0 to 4294967295, got -1"
    assert error("--max_grad_norm", -0.5) == "error: --max_grad_norm must be at least 0, got -0.5"
    assert error("--block_size", 1) == "error: --block_size must be at least 2, got 1"
    # a recipe default never overrides a flag the user gave: --num_train_epochs alone means epochs
    out = ["--output_dir", str(tmp_path / "out")]
    args = parse_args(Own, argv=[*out, "--num_train_epochs", "2"], max_steps=300)
    assert (args.max_steps, args.num_train_epochs) == (-1, 2.0)
    assert (
        parse_args(
            Own, argv=[*out, "--num_train_epoch", "2", "--max_step", "5"], max_steps=300
        ).max_steps
        == 5
    )
    assert parse_args(Own, argv=out, max_steps=300).max_steps == 300
    # an eval micro batch left at None is the train micro batch, as the recipes' flags say
    args = parse_args(Own, argv=[*out, "--per_device_train_batch_size", "3"])
    assert (args.per_device_train_batch_size, args.per_device_eval_batch_size) == (3, 3)
    assert (
        parse_args(Own, argv=[*out, "--per_device_eval_batch_size", "5"]).per_device_eval_batch_size
        == 5
    )


def test_report_to_takes_what_training_arguments_takes(tmp_path, monkeypatch, capsys):
    # one name, a comma list, 'all' (the installed trackers Accelerate supports) or 'none', resolved to the
    # comma list the recipes pass to the Accelerator; a tracker that is not installed is one error line
    # (Accelerate would skip it silently, and a comma list reached it as one unknown name)
    import accelerate.utils

    def resolved(value):
        return parse_args(
            Own, argv=["--output_dir", str(tmp_path / "out"), "--report_to", value]
        ).report_to

    def error(value):
        with pytest.raises(Stop) as exit_info:
            resolved(value)
        return f"error: {exit_info.value}"

    for name in (
        "wandb",
        "mlflow",
        "comet_ml",
        "aim",
        "clearml",
        "dvclive",
        "swanlab",
        "trackio",
    ):  # this host's
        monkeypatch.setattr(
            accelerate.utils, f"is_{name}_available", lambda: False
        )  # tensorboard only
    assert (
        error("wandb")
        == "error: --report_to wandb: the wandb package is not installed (pip install wandb)"
    )
    assert error("tensorboard,wandb") == (
        "error: --report_to tensorboard,wandb: the wandb package is not installed "
        "(pip install wandb)"
    )
    assert error("wandb,mlflow,comet_ml") == (
        "error: --report_to wandb,mlflow,comet_ml: the wandb and mlflow and "
        "comet_ml packages are not installed (pip install wandb mlflow comet-ml)"
    )
    assert error("tensorboard,bogus").startswith(
        "error: --report_to tensorboard,bogus: unknown tracker bogus;"
    )
    assert (
        error("none,tensorboard")
        == "error: --report_to none,tensorboard: 'none' cannot be combined with a tracker"
    )
    assert (resolved("tensorboard"), resolved("none"), resolved("all")) == (
        "tensorboard",
        "none",
        "tensorboard",
    )
    assert resolved(" TensorBoard, tensorboard ") == "tensorboard"
    monkeypatch.setattr(accelerate.utils, "is_wandb_available", lambda: True)  # as if installed
    assert resolved("wandb, tensorboard") == "wandb,tensorboard"
    assert (
        resolved("all") == resolved("tensorboard,all") == "tensorboard,wandb"
    )  # LoggerType's order
    for name in ("tensorboard", "wandb"):
        monkeypatch.setattr(accelerate.utils, f"is_{name}_available", lambda: False)
    capsys.readouterr()
    assert resolved("all") == "none"
    assert capsys.readouterr().err == (
        "warning: --report_to all: no tracker Accelerate supports is installed; metrics.jsonl only\n"
    )


def test_an_integer_flag_without_a_range_does_not_build():
    @dataclass
    class NoRange:
        block_size: int = 64

    with pytest.raises(TypeError, match="--block_size: an integer flag needs a range"):
        parse_flags((NoRange,), [])


@pytest.mark.parametrize(
    "recipe",
    ["llama", "ddp_classifier", "mixed_precision", "gradient_checkpointing", "sharded_data"],
)
def test_unknown_flag_is_one_error_line_in_every_recipe(recipe, tmp_path, monkeypatch, capsys):
    # the same parser (common/args.py) in this process; llama.py's run below is the real one
    if recipe != "llama":
        message = run_in_process(
            monkeypatch,
            f"recipes/{recipe}.py",
            "--max_steps",
            "3",
            "--no_such_flag",
            "1",
            "--output_dir",
            tmp_path / "out",
        )
        assert message == (
            "error: Some specified arguments are not used by the HfArgumentParser: "
            "['--no_such_flag', '1']"
        )
        assert "Traceback" not in capsys.readouterr().err
        assert not (tmp_path / "out").exists()
        return
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / f"recipes/{recipe}.py"),
            "--max_steps",
            "3",
            "--no_such_flag",
            "1",
            "--output_dir",
            str(tmp_path / "out"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert [line for line in proc.stderr.splitlines() if line.startswith("error:")] == [
        "error: Some specified arguments are not used by the HfArgumentParser: ['--no_such_flag', '1']"
    ]
    assert not (tmp_path / "out").exists()


# --help of every entry point, in this process (the imports are paid once): exit 0, and the text says
# what the tool does (its docstring, or the line named here).
ENTRY_POINTS = sorted(
    str(p.relative_to(REPO))
    for pattern in ("recipes/*.py", "benchmarks/*.py")
    for p in REPO.glob(pattern)
) + ["tools/launch.py", "tools/plan.py", "tools/consolidate.py", "tools/prepare_shards.py"]
SAYS = {
    "tools/launch.py": "Runs `accelerate launch --config_file accelerate_configs/CONFIG.yaml RECIPE",
}


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_help_of_every_entry_point(entry, monkeypatch, capsys):
    script, *sub = entry.split()
    monkeypatch.setattr(sys, "argv", [str(REPO / script), *sub, "--help"])
    monkeypatch.syspath_prepend(str(REPO))
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(str(REPO / script), run_name="__main__")
    out = " ".join(capsys.readouterr().out.split())
    assert exit_info.value.code in (0, None) and out.startswith("usage:"), out[-2000:]
    says = (
        SAYS.get(entry) or ast.get_docstring(ast.parse((REPO / script).read_text())).splitlines()[0]
    )
    assert " ".join(says.split()) in out, out[:2000]
    if script.startswith("recipes/") and not sub:  # every integer flag states its range
        assert "micro batch per rank (at least 1) (default: " in out


def test_help_of_gpu_sh():
    proc = subprocess.run(
        ["bash", str(REPO / "benchmarks/gpu.sh"), "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0 and proc.stdout.startswith(
        "GPU benchmark, one command on a single-GPU host"
    ), proc
    assert "--cpu-smoke" in proc.stdout and not proc.stderr


# An own flag of each recipe below its range: refused by the parser, before anything is written.
@pytest.mark.parametrize(
    "recipe, argv, message",
    [
        (
            "llama",
            ["--save_steps", 3, "--save_total_limit", -1],
            "--save_total_limit must be at least 1, got -1",
        ),
        ("llama", ["--save_total_limit", 0], "--save_total_limit must be at least 1, got 0"),
        (
            "ddp_classifier",
            ["--num_hidden_layers", 0],
            "--num_hidden_layers must be at least 1, got 0",
        ),
        (
            "gradient_checkpointing",
            ["--timing_rounds", 0],
            "--timing_rounds must be at least 1, got 0",
        ),
        (
            "mixed_precision",
            ["--growth_interval", 0],
            "--growth_interval must be at least 1, got 0",
        ),
        (
            "sharded_data",
            ["--dataloader_num_workers", -1],
            "--dataloader_num_workers must be at least 0, got -1",
        ),
    ],
)
def test_out_of_range_flags_are_refused(recipe, argv, message, tmp_path, monkeypatch):
    message_got = run_in_process(
        monkeypatch, f"recipes/{recipe}.py", "--output_dir", tmp_path / "out", *argv
    )
    assert message_got == f"error: {message}"
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "recipe",
    ["llama", "ddp_classifier", "mixed_precision", "gradient_checkpointing", "sharded_data"],
)
def test_an_output_dir_that_cannot_be_one(recipe, tmp_path, monkeypatch):
    (tmp_path / "a_file").write_text("")
    message = run_in_process(
        monkeypatch, f"recipes/{recipe}.py", "--output_dir", tmp_path / "a_file"
    )
    assert message == f"error: --output_dir {tmp_path / 'a_file'} is a file, not a directory"
    message = run_in_process(
        monkeypatch, f"recipes/{recipe}.py", "--output_dir", "/proc/no_such_dir"
    )
    assert (
        message
        == "error: --output_dir /proc/no_such_dir: cannot create it (No such file or directory)"
    )


def test_an_empty_data_file_is_named_last(tmp_path, cache_dir):
    """The error line is also the launcher's last word: torchrun's failure summary ends with it,
    not with a link to its docs, below its own traceback."""
    (tmp_path / "train.jsonl").write_text("")
    proc = launch(
        "ddp",
        "recipes/llama.py",
        "--train_file",
        tmp_path / "train.jsonl",
        "--output_dir",
        tmp_path / "out",
        *FAST,
        cache_dir=cache_dir,
        check=False,
        timeout=300,
    )
    error = f"error: data file is empty: {tmp_path / 'train.jsonl'}"
    assert proc.returncode != 0 and "StopIteration" not in proc.stderr, proc.stderr[-3000:]
    # the rank's own line (a SIGTERMed peer may not print)
    assert error in proc.stderr.splitlines(), proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-3:]
    assert f"  traceback : {error}" in last, last


def test_num_train_epochs_alone_sets_the_length(tmp_path, cache_dir, small_corpus):
    """A recipe's default --max_steps (150 in llama.py) does not override --num_train_epochs; the run ends with
    one line naming its figures and its export. Like the README's main command, it runs with the
    config's precision and the default tracker: the config alone picks the precision (its bf16
    where this CPU computes bf16, else fp32 with the reason recorded: common/precision.py), and
    TensorBoard gets the values metrics.jsonl holds."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    train, valid, tok = small_corpus
    out = tmp_path / "out"
    proc = launch(
        "single",
        "recipes/llama.py",
        "--train_file",
        train,
        "--validation_file",
        valid,
        "--tokenizer_name_or_path",
        tok,
        "--block_size",
        64,
        "--num_train_epochs",
        1,
        "--output_dir",
        out,
        "--max_eval_samples",
        8,
        "--sample_tokens",
        0,
        "--logging_steps",
        2,
        "--reference_global_batch",
        2,
        cache_dir=cache_dir,
        timeout=300,
    )
    info = json.loads((out / "run_info.json").read_text())
    # a global batch above the one --learning_rate was tuned at, without --scale_lr: said, LR unchanged
    assert "warning: global batch 8 > 2 without --scale_lr" in proc.stderr
    assert info["args"]["learning_rate"] == 3e-3
    native = "bf16" in precision._cpu_native_dtypes()
    assert info["mixed_precision"] == info["precision"]["used"] == ("bf16" if native else "no")
    assert info["precision"]["requested"] == "bf16"
    capped = (
        precision.onednn_cap() and "bf16" in precision.cpu_hardware_dtypes()
    )  # docs/testing.md's stand-in
    lacks = "the cap keeps oneDNN from bf16 instructions" if capped else "no bf16 instructions"
    assert native or lacks in info["precision"]["reason"], info["precision"]["reason"]
    assert info["max_steps"] == info["updates_per_epoch"] and 3 <= info["updates_per_epoch"] <= 8, (
        info
    )
    records = [json.loads(line) for line in open(out / "metrics.jsonl")]
    last = [r for r in records if "loss" in r][-1]
    assert last["step"] == info["max_steps"]
    logged = {r["step"]: r for r in records if "loss" in r and not r.get("summary")}
    assert info["args"]["report_to"] == "tensorboard" and len(logged) >= 2
    board = EventAccumulator(str(out / "llama"))
    board.Reload()
    for key in ("loss", "lr", "grad_norm", "tokens_per_second"):
        scalars = {e.step: e.value for e in board.Scalars(key)}
        assert scalars.keys() == logged.keys(), (key, scalars.keys(), logged.keys())
        for step, value in scalars.items():  # TensorBoard stores float32
            assert value == pytest.approx(logged[step][key], rel=1e-6), (key, step)
    assert proc.stdout.strip().splitlines()[-1] == (
        f"done: {info['max_steps']} steps | loss {last['loss']:.4f} | eval_loss {last['eval_loss']:.4f} | "
        f"model in {out / 'final'}, metrics in {out / 'metrics.jsonl'}"
    )


def test_an_error_line_is_one_write(tmp_path, monkeypatch):
    # Ranks that stop at once share the launcher's stderr: each line must reach it whole, or two
    # ranks' lines splice (Python's own exit writes the message and its newline apart).
    from common import errors

    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "error.json"))
    writes = []
    monkeypatch.setattr(errors.os, "write", lambda fd, data: writes.append((fd, data)) or len(data))

    def main():
        raise errors.Stop("step 2: the training loss is nan")

    with pytest.raises(SystemExit) as exc:
        errors.run(main)
    assert exc.value.code == 1
    assert writes == [(2, b"error: step 2: the training loss is nan\n")]
    assert (
        json.loads((tmp_path / "error.json").read_text())["message"]
        == "error: step 2: the training loss is nan"
    )
    # a bug is not a refusal: its traceback stays, and the launcher's summary names it
    with pytest.raises(ZeroDivisionError):
        errors.run(lambda: 1 / 0)
    assert (
        json.loads((tmp_path / "error.json").read_text())["message"]
        == "ZeroDivisionError: division by zero"
    )


def test_a_text_column_that_is_not_text_in_every_row_is_one_line(tmp_path):
    """--dataset_text_field naming numbers, or a column with a null row, stops in one line (it
    ended in an AttributeError in the data digest); a missing column names the flag."""
    rows = [{"id": i, "body": f"row {i} of the text", "title": "t"} for i in range(40)]
    good = tmp_path / "good.jsonl"
    good.write_text("\n".join(json.dumps(r) for r in rows))
    rows[7]["body"] = None
    holed = tmp_path / "holed.jsonl"
    holed.write_text("\n".join(json.dumps(r) for r in rows))
    for path, field, says in (
        (good, "id", "column 'id' (--dataset_text_field) holds int64: text in every row"),
        (holed, "body", "column 'body' (--dataset_text_field) holds string, 1 null: text in"),
        (good, "text", "has no 'text' column (columns: ['id', 'body', 'title']; "),
    ):
        with pytest.raises(Stop) as err:
            data.load_text_dataset(train_file=str(path), text_field=field)
        assert says in str(err.value) and "--dataset_text_field" in str(err.value), err.value
    raw = data.load_text_dataset(train_file=str(good), text_field="body")
    assert raw["train"].column_names == ["text"] and len(raw["validation"]) == 2
