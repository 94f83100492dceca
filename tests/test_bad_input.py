"""Bad input: one clear line naming the culprit, a non-zero exit, and no hang."""

import subprocess
import sys

import pytest

from conftest import FAST, REPO, launch


def fails_with(proc, *fragments):
    assert proc.returncode != 0
    for fragment in fragments:
        assert fragment in proc.stderr, proc.stderr[-3000:]


def test_missing_config_file(tmp_path):
    # accelerate's own check names the file ...
    proc = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--config_file", "accelerate_configs/nope.yaml",
                           "recipes/llama.py"], cwd=REPO, capture_output=True, text=True, timeout=120)
    fails_with(proc, "accelerate_configs/nope.yaml", "does not exist")
    # ... and our shorthand also lists the configs there are.
    proc = subprocess.run([sys.executable, "common/launch.py", "nope", "recipes/llama.py"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    fails_with(proc, "nope.yaml not found", "available: ddp, deepspeed_zero2, deepspeed_zero3", "fsdp, fsdp1", "single")


def test_unknown_model_config(tmp_path, cache_dir):
    proc = launch("single", "recipes/llama.py", "--model_config", "llama-9000", "--output_dir", tmp_path,
                  cache_dir=cache_dir, check=False, timeout=300)
    fails_with(proc, "unknown --model_config 'llama-9000'", "'debug'", "'llama-3-8b'")


def test_missing_data_file_ends_both_ranks(tmp_path, cache_dir):
    proc = launch("ddp", "recipes/llama.py", "--train_file", tmp_path / "absent.txt", "--output_dir", tmp_path,
                  *FAST, cache_dir=cache_dir, check=False, timeout=300)
    fails_with(proc, f"error: data file not found: {tmp_path / 'absent.txt'}")


def test_corpus_smaller_than_one_global_batch(tmp_path, cache_dir, small_corpus):
    train, valid, tok = small_corpus
    (tmp_path / "tiny.txt").write_text(train.read_text()[:2000])  # about 9 blocks of 64 tokens
    proc = launch("single", "recipes/llama.py", "--train_file", tmp_path / "tiny.txt", "--validation_file", valid,
                  "--tokenizer_name_or_path", tok, "--block_size", 64, "--per_device_train_batch_size", 16,
                  "--output_dir", tmp_path / "out", "--report_to", "none", cache_dir=cache_dir, check=False, timeout=300)
    fails_with(proc, "blocks of 64 tokens, fewer than one global batch of 16 (= 16 per device x 1 accumulation x 1 ranks)")


def test_block_size_above_max_positions(tmp_path, cache_dir):
    proc = launch("single", "recipes/llama.py", "--block_size", 2048, "--output_dir", tmp_path, "--report_to", "none",
                  cache_dir=cache_dir, check=False, timeout=300)
    fails_with(proc, "--block_size 2048 exceeds the model's max_position_embeddings 1024")


@pytest.mark.parametrize("flag,value,message", [
    ("--ddp_timeout", 0, "--ddp_timeout must be a positive number of seconds, got 0"),
    ("--resume_from_checkpoint", "/nonexistent/ckpt", "--resume_from_checkpoint /nonexistent/ckpt: no such directory"),
    ("--resume_from_checkpoint", "latest", "--resume_from_checkpoint latest: no complete checkpoint in"),
    ("--logging_steps", 0, "--logging_steps must be at least 1, got 0"),
    ("--max_stepz", 5, "Some specified arguments are not used by the HfArgumentParser: ['--max_stepz', '5']"),
])
def test_bad_flags(flag, value, message, tmp_path, cache_dir):
    proc = launch("single", "recipes/llama.py", flag, value, "--output_dir", tmp_path, *FAST[:-2],
                  cache_dir=cache_dir, check=False, timeout=300)
    fails_with(proc, message)


@pytest.mark.parametrize("recipe", ["recipes/llama.py", "recipes/ddp_classifier.py"])
def test_max_grad_norm_must_match_deepspeed_json(recipe, tmp_path, cache_dir):
    # DeepSpeed clips with its JSON's gradient_clipping (1.0): a different flag would be ignored.
    proc = launch("deepspeed_zero2", recipe, "--max_grad_norm", 0.5, "--output_dir", tmp_path,
                  cache_dir=cache_dir, check=False, timeout=300)
    fails_with(proc, "error: --max_grad_norm 0.5 differs from the DeepSpeed JSON's gradient_clipping 1.0")


@pytest.mark.parametrize("key,message", [
    ("fsdp_use_orig_params: true", "fsdp_use_orig_params: false in the accelerate config"),
    ("fsdp_offload_params: false", "fsdp_offload_params: true in the accelerate config needs a GPU")])
def test_fsdp1_settings_the_recipes_cannot_use(key, message, tmp_path, cache_dir):
    # use_orig_params false trained nothing, silently (the optimizer held the unwrapped parameters);
    # parameter offload on a CPU-only host failed deep inside torch's pin_memory.
    flipped = key.replace("true", "false") if key.endswith("true") else key.replace("false", "true")
    config = tmp_path / "fsdp1.yaml"
    config.write_text((REPO / "accelerate_configs" / "fsdp1.yaml").read_text().replace(key, flipped))
    proc = launch(config, "recipes/llama.py", "--output_dir", tmp_path / "out", *FAST,
                  cache_dir=cache_dir, check=False, timeout=300)
    fails_with(proc, f"error: {message}")


def test_core_flags_are_checked_in_one_place(tmp_path):
    # common/args.py parses the core TrainingArguments flags for every recipe (in-process: no launch)
    from dataclasses import dataclass

    from common.args import parse_args

    @dataclass
    class Own:
        block_size: int = 64

    def error(*argv):
        with pytest.raises(SystemExit) as exit_info:
            parse_args(Own, argv=["--output_dir", str(tmp_path / "out"), *map(str, argv)])
        return str(exit_info.value.code)

    assert error("--report_to", "bogus").startswith("error: --report_to bogus: unknown tracker bogus")
    assert error("--max_steps", 0).startswith("error: --max_steps must be positive")
    assert error("--max_steps", "x").startswith("error: argument --max_steps/--max-steps: invalid int value")
    assert error("--block_sizee", 3).startswith("error: Some specified arguments are not used")
    args = parse_args(Own, argv=["--output_dir", str(tmp_path / "out"), "--report_to", "tensorboard"], max_steps=7)
    assert (args.max_steps, args.block_size, args.report_to) == (7, 64, "tensorboard")


@pytest.mark.parametrize("recipe", ["llama", "ddp_classifier", "mixed_precision", "gradient_checkpointing",
                                    "sharded_data"])
def test_unknown_flag_is_one_error_line_in_every_recipe(recipe, tmp_path):
    proc = subprocess.run([sys.executable, str(REPO / f"recipes/{recipe}.py"), "--max_steps", "3", "--no_such_flag",
                           "1", "--output_dir", str(tmp_path / "out")], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert [line for line in proc.stderr.splitlines() if line.startswith("error:")] == [
        "error: Some specified arguments are not used by the HfArgumentParser: ['--no_such_flag', '1']"]
    assert not (tmp_path / "out").exists()
