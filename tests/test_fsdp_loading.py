"""Fine-tuning under FSDP2 (accelerate_configs/fsdp.yaml, fsdp_cpu_ram_efficient_loading: true):
rank 0 alone reads the pretrained weights into host RAM, the other ranks get them from its
broadcast in `accelerator.prepare`, and the run trains exactly as the same fine-tune under DDP.

Without it every rank reads the checkpoint, and `dtype=torch.float32` turns a bf16 one into a
full fp32 copy per rank: 32 GB per rank for an 8B model, 256 GB on an 8-GPU host.

And a checkpoint that does not fit the model (missing or unexpected weights) stops the run."""

import json
import os
import subprocess
import sys

import pytest
import torch
from transformers import AutoConfig, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from conftest import REPO, corpus_args, launch_command, launch_env

sys.path.insert(0, str(REPO / "tests" / "scripts"))
from compare_runs import worst_gaps  # noqa: E402

sys.path.insert(0, str(REPO))
from common import causal_lm, models  # noqa: E402
from common.errors import Stop  # noqa: E402

# fp32 FSDP2 against DDP, 2 steps, 2-core AVX-512 CPU: loss and eval loss measured 0, and required: two ranks'
# gradients averaged as (a + b) / 2 round the same in any order, so both strategies hold the same weights bit for
# bit. Grad norm measured 1.7e-14 (common/grad_norm's fp64 sum over shards, in another order); bound ~10x.
FP32_RTOL = {"loss": 0.0, "grad_norm": 2e-13, "eval_loss": 0.0}
FLAGS = [
    "--block_size",
    64,
    "--per_device_train_batch_size",
    2,
    "--max_steps",
    2,
    "--warmup_steps",
    1,
    "--logging_steps",
    1,
    "--eval_steps",
    2,
    "--max_eval_samples",
    4,
    "--sample_tokens",
    0,
    "--report_to",
    "none",
    "--ddp_timeout",
    120,
]
RECIPE = REPO / "recipes" / "llama.py"
PREPARED = (
    "M params | global batch"  # what llama.py prints once accelerator.prepare is done on every rank
)


def _peak_rss_mib(pid: int) -> float:
    """Peak resident set of process `pid` so far (`VmHWM` of /proc/PID/status), MiB."""
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 1024


def _worker_ranks(launcher_pid: int) -> dict[int, int]:
    """{RANK: pid} of the processes started (at any depth) by `launcher_pid` that have a RANK."""
    parents = {}
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
        except (ValueError, OSError):
            continue
    ranks = {}
    for pid in parents:
        ancestor = parents.get(pid)
        while ancestor not in (None, 0, 1, launcher_pid):
            ancestor = parents.get(ancestor)
        if ancestor == launcher_pid:
            try:
                env = dict(
                    v.split("=", 1)
                    for v in open(f"/proc/{pid}/environ").read().split("\0")
                    if "=" in v
                )
            except OSError:
                continue
            if "RANK" in env and "LOCAL_RANK" in env:
                ranks[int(env["RANK"])] = pid
    return ranks


def _start(config, output_dir, args, cache_dir):
    """Start `accelerate launch` of RECIPE in fp32, stdout and stderr merged into one text pipe.

    As conftest.launch (tests/device_guard on PYTHONPATH), but started without waiting, so that
    the test reads each rank's peak memory while the run is alive."""
    cmd = launch_command(config, RECIPE, "--output_dir", output_dir, *args, mixed_precision="no")
    return subprocess.Popen(
        cmd,
        cwd=REPO,
        env=launch_env(cache_dir),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory, small_corpus):
    """A 35M-parameter Llama saved in bf16, as published checkpoints are; the recipe loads it in fp32.

    Returns (model dir, fp32 bytes of its parameters)."""
    tokenizer = AutoTokenizer.from_pretrained(small_corpus[2])
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=4,
        num_attention_heads=12,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    path = tmp_path_factory.mktemp("pretrained") / "llama-bf16"
    model.save_pretrained(path)
    return path, 4 * sum(p.numel() for p in model.parameters())


def test_fsdp2_fine_tune_loads_weights_on_rank_0_only(
    tmp_path, pretrained, small_corpus, cache_dir
):
    """Rank 1's peak host memory, read when prepare is done, stays below rank 0's by a quarter of
    the model's fp32 size or more (measured: 586 vs 668 MiB for this 132 MiB model; 668 vs 668
    when every rank loads it, 720 vs 669 when they load it and receive rank 0's broadcast too; on
    CPU rank 1 also receives each full tensor in host memory), and both steps' loss, grad norm and
    eval loss match the same fine-tune under DDP: rank 1 trains rank 0's weights and correct
    rotary buffers."""
    model_dir, fp32_bytes = pretrained
    args = ["--model_name_or_path", model_dir, *corpus_args(small_corpus), *FLAGS]
    ddp_out, fsdp_out = tmp_path / "ddp", tmp_path / "fsdp"
    ddp = _start(
        "ddp", ddp_out, args, cache_dir
    )  # first: it also builds the data cache, which only rank 0 does
    ddp_output = ddp.communicate(timeout=600)[0]
    assert ddp.returncode == 0, ddp_output[-4000:]
    proc = _start("fsdp", fsdp_out, args, cache_dir)
    output, peaks = [], None
    for line in proc.stdout:  # the peaks when prepare is done, before training adds its own
        output.append(line)
        if peaks is None and PREPARED in line:
            peaks = {rank: _peak_rss_mib(pid) for rank, pid in _worker_ranks(proc.pid).items()}
    assert proc.wait(timeout=600) == 0, "".join(output[-60:])
    assert peaks is not None and sorted(peaks) == [0, 1], (peaks, "".join(output[-60:]))
    fp32_mib = fp32_bytes / 2**20
    print(
        f"peak host RSS after prepare, MiB: rank 0 {peaks[0]:.0f}, rank 1 {peaks[1]:.0f}; model fp32 {fp32_mib:.0f}"
    )
    assert peaks[0] - peaks[1] >= fp32_mib / 4, (
        f"peak host RSS after prepare: rank 0 {peaks[0]:.0f} MiB, rank 1 {peaks[1]:.0f} MiB; the model is "
        f"{fp32_mib:.0f} MiB in fp32: rank 1 loaded the weights itself"
    )

    # the checkpoint says eos 2 (LlamaConfig's), the tokenizer's is the separator the data is packed
    # with: the exports' configs stop on that one, and start-up says so
    eos = AutoTokenizer.from_pretrained(small_corpus[2]).eos_token_id
    for out, text in ((ddp_out, ddp_output), (fsdp_out, "".join(output))):
        assert f"eos_token_id: 2 -> {eos}" in text, text[-3000:]
        for name in ("config.json", "generation_config.json"):
            assert json.loads((out / "final" / name).read_text())["eos_token_id"] == eos, (
                out,
                name,
            )

    gaps = worst_gaps(fsdp_out, ddp_out)
    assert gaps["steps"] == 2
    for key in ("loss", "grad_norm", "eval_loss"):
        assert gaps[key] is not None and gaps[key] <= FP32_RTOL[key], (
            f"{key}: worst relative gap {gaps[key]} vs DDP"
        )


@pytest.fixture(scope="module")
def small_export(tmp_path_factory, small_corpus):
    """A 4-layer tied Llama as the recipe exports it (hidden 64), and configs that do not fit it:
    6 layers, 2 layers, and untied embeddings. Returns {name: path}."""
    tokenizer = AutoTokenizer.from_pretrained(small_corpus[2])
    config = models.llama_config(
        "debug", len(tokenizer), hidden_size=64, intermediate_size=128, max_position_embeddings=128
    )
    causal_lm.set_token_ids(config, tokenizer, from_scratch=True)
    root = tmp_path_factory.mktemp("export")
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(root / "A")
    paths = {"A": root / "A"}
    for name, change in {
        "six": {"num_hidden_layers": 6},
        "two": {"num_hidden_layers": 2},
        "untied": {"tie_word_embeddings": False},
    }.items():
        LlamaConfig(**{**config.to_dict(), **change}).save_pretrained(root / name)
        paths[name] = root / name
    return paths


def test_load_pretrained_names_missing_and_unexpected_weights(small_export):
    """transformers starts the missing weights random and drops the unexpected ones, and only logs it."""
    a = str(small_export["A"])

    def refusal(name, allow_new_weights=False):
        try:
            causal_lm.load_pretrained(
                a, AutoConfig.from_pretrained(small_export[name]), allow_new_weights
            )
        except Stop as err:
            return str(err)
        return None

    load = {name: refusal(name) for name in ("six", "two", "untied")}
    assert load["six"].startswith(
        "the checkpoint lacks 18 of the model's weights, which would start random: "
        "model.layers.{4,5}.* (18 tensors); pass a --config_name"
    )
    assert load["six"].endswith("or --allow_new_weights to train new weights on purpose")
    assert load["two"].startswith(
        "18 of the checkpoint's weights have no place in the model and would be dropped: "
        "model.layers.{2,3}.* (18 tensors)"
    )
    assert load["untied"].startswith(
        "the checkpoint lacks 1 of the model's weights, which would start random: lm_head.weight;"
    )
    assert refusal("A") is None
    # new layers on purpose: the 4 saved ones load, the 2 new ones keep their init
    model = causal_lm.load_pretrained(
        a, AutoConfig.from_pretrained(small_export["six"]), allow_new_weights=True
    )
    saved = LlamaForCausalLM.from_pretrained(a).state_dict()
    assert torch.equal(
        model.state_dict()["model.layers.3.mlp.up_proj.weight"],
        saved["model.layers.3.mlp.up_proj.weight"],
    )
    assert refusal("two", allow_new_weights=True) is not None


def test_partial_pretrained_load_stops_every_rank(tmp_path, small_export, small_corpus, cache_dir):
    """Fine-tuning the 4-layer export with a --config_name that unties the embeddings, under FSDP2,
    where rank 0 alone loads: unchecked, it would train (a random output head, loss ln V at the start).
    Rank 0 runs `load_pretrained` as every rank does under DDP, and rank 1, which loads nothing,
    stops on its error too; the message of a missing layer (a 6-layer config) is
    test_load_pretrained_names_missing_and_unexpected_weights's."""
    out = tmp_path / "out"
    proc = _start(
        "fsdp",
        out,
        [
            "--model_name_or_path",
            small_export["A"],
            "--config_name",
            small_export["untied"],
            *corpus_args(small_corpus),
            *FLAGS,
        ],
        cache_dir,
    )
    output = proc.communicate(timeout=600)[0]
    assert proc.returncode != 0, output[-4000:]
    lines = [line for line in output.splitlines() if line.startswith("error:")]
    # one line per rank; torchrun may end the second rank before it prints its own
    assert 1 <= len(lines) <= 2 and len(set(lines)) == 1, output[-4000:]
    assert lines[0].startswith(
        f"error: cannot load --model_name_or_path {small_export['A']}: the checkpoint lacks "
        "1 of the model's weights, which would start random: lm_head.weight; pass a "
        "--config_name that matches"
    ), lines[0]
    assert not (out / "metrics.jsonl").exists() and not (out / "final").exists()
