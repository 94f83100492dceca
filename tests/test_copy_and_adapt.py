"""README "Copy and adapt", for real: copy exactly the files its table lists into fresh
directories, and train there a Qwen2 and a GPT-2 built from local configs (hidden 64, 2 layers,
nothing downloaded) on a user's lone .txt file: Qwen2 under DDP, GPT-2 (tied embeddings, Conv1D)
under FSDP2 (the strategy that depends on the architecture: one unit per block class) and ZeRO-3,
so that every strategy row of the README's table trains a copy; each run agrees with its
architecture's one process in fp32 (the copy's own compare_runs.py), and its export reloads and
generates.

Plus the start-up faults of a copied recipe: a vocabulary mismatch stops every rank with one line
(a launch), an empty tokenizer is caught by the same block of the recipe (its check, run here on
the recipe's inputs); and, without launches, the .txt split, the tokenizer check, the FLOPs of other
architectures and the token ids filled into a config."""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GPT2Config, Qwen2Config

from conftest import REPO, launch, read_metrics

sys.path.insert(0, str(REPO / "tests" / "scripts"))
from compare_runs import KEYS, worst_gaps  # noqa: E402

from common import causal_lm, data, metrics, models  # noqa: E402
from common.errors import Stop  # noqa: E402

STEPS = 5
FLAGS = [
    "--block_size",
    64,
    "--max_steps",
    STEPS,
    "--warmup_steps",
    1,
    "--learning_rate",
    3e-3,
    "--logging_steps",
    1,
    "--eval_steps",
    STEPS,
    "--max_eval_samples",
    4,
    "--per_device_eval_batch_size",
    4,
    "--report_to",
    "none",
    "--ddp_timeout",
    120,
]
# Each copy against its architecture's one process, fp32, 2-core AVX-512 CPU: measured at most 1.6e-7 (loss, GPT-2;
# 2 fp32 ulps), 2.8e-8 (grad norm, Qwen2), 0 (eval loss: the same fp32 value, a gap under one ulp). About 10x;
# the eval loss gets the loss bound (the gap the same weights give a training loss).
FP32_RTOL = {"loss": 2e-6, "grad_norm": 3e-7, "eval_loss": 2e-6}
# Two architectures whose fields differ from Llama's; the files say 4 layers, --config_overrides makes 2.
ARCHS = {
    "qwen2": Qwen2Config(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
        max_position_embeddings=128,
    ),
    "gpt2": GPT2Config(
        n_embd=64,
        n_layer=4,
        n_head=2,
        n_positions=128,
        vocab_size=512,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    ),  # dropout off: parity needs it
}
OVERRIDES = {"qwen2": "num_hidden_layers=2", "gpt2": "n_layer=2"}
BLOCK_CLASS = {"gpt2": "GPT2Block"}
STRATEGIES = {"ddp": "DDP", "fsdp": "FSDP2", "deepspeed_zero3": "ZeRO-3"}  # config -> README row
# Each architecture against its own one-process run. DDP replicates whatever the model is; FSDP2
# wraps each architecture's own block class; ZeRO-3 partitions GPT-2's tied embedding and Conv1D.
RUNS = [("qwen2", "ddp"), ("gpt2", "fsdp"), ("gpt2", "deepspeed_zero3")]
EXPECTED_TYPE = {"ddp": "MULTI_CPU", "fsdp": "FSDP", "deepspeed_zero3": "DEEPSPEED"}


def copy_list():
    """{"needed for" cell: [paths]} from the table in docs/copy_and_adapt.md ("The files a copy needs")."""
    page = (REPO / "docs" / "copy_and_adapt.md").read_text()
    section = page.split("## The files a copy needs\n", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| `") and len(cells) == 2:
            rows[cells[1]] = re.findall(r"`([^`]+)`", cells[0])
    return rows


def copy_project(dest: Path, paths) -> Path:
    for rel in paths:
        src = REPO / rel
        if src.is_dir():
            shutil.copytree(src, dest / rel, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    return dest


def launch_in(project: Path, config: str, *args, cache_dir, mixed_precision="no", check=True):
    """`accelerate launch` of the copy's recipe and config, from the copy's root (as its README says),
    with nothing from this repository on PYTHONPATH: only the copy."""
    return launch(
        config,
        "recipes/llama.py",
        *args,
        root=project,
        cache_dir=cache_dir,
        mixed_precision=mixed_precision,
        check=check,
        env={"PYTHONPATH": None},
        device_guard=False,
    )


@pytest.fixture(scope="module")
def user_files(tmp_path_factory):
    """What a user brings: one .txt of paragraphs, and a config.json per architecture."""
    root = tmp_path_factory.mktemp("user")
    raw = data.load_text_dataset()
    macbeth = next(t for t, w in zip(raw["train"]["text"], raw["train"]["work"]) if w == "macbeth")
    text = macbeth[30_000:54_000]
    assert text.count("\n\n") > 40  # speeches: blank-line paragraphs
    (root / "my_text.txt").write_text(text)
    for name, config in ARCHS.items():
        config.save_pretrained(root / name)
    return root


@pytest.fixture(scope="module")
def runs(tmp_path_factory, user_files, cache_dir):
    """One copy per README row used (every run + that row), a one-process fp32 reference per
    architecture in the parity copy, then each architecture under its strategies (RUNS)."""
    rows = copy_list()
    root = tmp_path_factory.mktemp("copies")
    copies = {
        row: copy_project(root / row.split()[0].lower(), rows["every run"] + rows[row])
        for row in [*STRATEGIES.values(), "the parity check against one process"]
    }
    out, logs = tmp_path_factory.mktemp("runs"), {}
    for arch in ARCHS:
        args = [
            "--config_name",
            user_files / arch / "config.json",
            "--config_overrides",
            OVERRIDES[arch],
            "--train_file",
            user_files / "my_text.txt",
            "--vocab_size",
            512,
            "--save_logits_probe",
            *FLAGS,
        ]
        logs[arch, "single"] = launch_in(
            copies["the parity check against one process"],
            "single",
            *args,
            "--per_device_train_batch_size",
            4,
            "--output_dir",
            out / f"{arch}-single",
            cache_dir=cache_dir,
        ).stdout
        for config in (config for run_arch, config in RUNS if run_arch == arch):
            logs[arch, config] = launch_in(
                copies[STRATEGIES[config]],
                config,
                *args,
                "--per_device_train_batch_size",
                2,
                "--output_dir",
                out / f"{arch}-{config}",
                cache_dir=cache_dir,
            ).stdout
    return out, copies, logs


def test_copy_list_covers_every_config():
    """Every accelerate config has its row, with the DeepSpeed JSON it names; every path exists."""
    rows = copy_list()
    listed = {p for paths in rows.values() for p in paths}
    assert {"recipes/llama.py", "common/", "requirements.txt"} <= set(rows["every run"])
    for path in listed:
        assert (REPO / path).exists(), path
    for yaml in (REPO / "accelerate_configs").glob("*.yaml"):
        row = next(
            (paths for paths in rows.values() if f"accelerate_configs/{yaml.name}" in paths), None
        )
        assert row is not None, f"README copy list misses accelerate_configs/{yaml.name}"
        named = re.search(r"deepspeed_config_file:\s*(\S+)", yaml.read_text())
        if named:
            assert named.group(1) in row, (yaml.name, named.group(1), row)


@pytest.mark.parametrize("arch,config", RUNS)
def test_copied_project_trains_any_causal_lm(arch, config, runs, user_files):
    out, copies, logs = runs
    run, ref = out / f"{arch}-{config}", out / f"{arch}-single"

    # Parity with one process, printed by the copy's own compare_runs.py.
    proc = subprocess.run(
        [sys.executable, "tests/scripts/compare_runs.py", ref, run],
        cwd=copies["the parity check against one process"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    gaps = worst_gaps(run, ref)
    assert gaps["steps"] == STEPS
    for key in KEYS:
        assert gaps[key] is not None and gaps[key] < FP32_RTOL[key], (
            f"{arch} {config} {key}: {gaps[key]:.2e}\n{proc.stdout}"
        )
    steps, _ = read_metrics(run)
    assert steps[-1]["loss"] < steps[0]["loss"]

    # What the run was: the architecture, 2 ranks, FLOPs counted from the model, one FSDP unit per block.
    info = json.loads((run / "run_info.json").read_text())
    assert info["distributed_type"] == EXPECTED_TYPE[config] and info["world_size"] == 2
    assert info["model_type"] == arch and info["n_params"] < 300_000
    assert "counted from the model's parameters" in info["flops_per_token_method"]
    if config == "fsdp":
        assert info["fsdp_units"] == {"block_class": BLOCK_CLASS[arch], "blocks": 2, "units": 2}

    # The lone .txt was split into paragraphs; the sample's prompt came from the validation text.
    assert info["args"]["validation_file"] is None
    printed = logs[arch, config].split("prompt from the validation data ---\n", 1)[1]
    validation = data.split_text((user_files / "my_text.txt").read_text(), 5)[1]
    assert validation.startswith(printed.split("|", 1)[0]) and len(printed.split("|", 1)[0]) > 20

    # The export: reloads with plain transformers to the live logits, has eos/pad, and generates.
    final = run / "final"
    tokenizer = AutoTokenizer.from_pretrained(final)
    exported = AutoConfig.from_pretrained(final)
    assert exported.model_type == arch and exported.num_hidden_layers == 2
    assert exported.eos_token_id == tokenizer.eos_token_id is not None
    assert exported.pad_token_id is not None
    model = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32).eval()
    probe = load_file(run / "final_logits.safetensors")
    with torch.no_grad():
        logits = model(input_ids=probe["input_ids"]).logits
        sample = model.generate(probe["input_ids"][:1, :8], max_new_tokens=8, do_sample=False)
    # bit-equal: measured 0 difference on all 3 copies (fp32), as tests/test_llama.py's exports
    assert torch.equal(logits, probe["logits"]), (logits - probe["logits"]).abs().max()
    assert sample.shape == (1, 16)


def test_empty_tokenizer_is_refused(tmp_path, small_corpus, cache_dir):
    """A model directory without tokenizer files: transformers 5.24 loads an empty tokenizer
    (1 entry, no tokens for any text). Before: every row became one end-of-text token; with
    these .txt files rank 0 said "train split has 1 tokens" and rank 1 died in a gloo traceback.
    The recipe's check on the recipe's inputs (its data, its get_tokenizer, its first 100 rows);
    its Stop ends the same block as the vocabulary check below, whose launch shows that
    such an error stops every rank with one line."""
    train, valid, _ = small_corpus
    model_dir = tmp_path / "qwen2_no_tokenizer"
    AutoModelForCausalLM.from_config(ARCHS["qwen2"]).save_pretrained(model_dir)
    raw = data.load_text_dataset(None, None, str(train), str(valid), 5)
    tokenizer = data.get_tokenizer(str(model_dir), raw, 4096, cache_dir)
    with pytest.raises(Stop) as stopped:
        causal_lm._stop_unless_tokenizer_encodes(
            tokenizer, str(model_dir), raw["train"][:100]["text"]
        )
    problem = str(stopped.value)
    assert problem and "\n" not in problem, problem
    assert f"the tokenizer loaded from {model_dir} has 1 entries" in problem
    assert "pass --tokenizer_name_or_path" in problem
    source = (
        REPO / "recipes" / "llama.py"
    ).read_text()  # raised in the block whose errors end every rank
    lines = source.split("    with launch.node_first(accelerator):\n", 1)[1].splitlines()
    end = next(i for i, line in enumerate(lines) if line.strip() and not line.startswith(" " * 8))
    block = "\n".join(lines[:end])  # the with-block: every line indented past it
    assert "causal_lm.tokenizer_fits(\n            tokenizer, tokenizer_source," in block
    fits = (
        (REPO / "common" / "causal_lm.py")
        .read_text()
        .split("def tokenizer_fits(", 1)[1]
        .split("\ndef ", 1)[0]
    )
    assert "_stop_unless_tokenizer_encodes(tokenizer, source," in fits


def test_vocab_smaller_than_tokenizer_stops_every_rank(tmp_path, small_corpus, cache_dir):
    """A 512-token model with a 4,096-entry tokenizer. Before: IndexError at the first forward."""
    train, valid, tokenizer_dir = small_corpus
    model_dir = tmp_path / "qwen2_512"
    AutoModelForCausalLM.from_config(ARCHS["qwen2"]).save_pretrained(model_dir)
    proc = launch_in(
        REPO,
        "ddp",
        "--model_name_or_path",
        model_dir,
        "--tokenizer_name_or_path",
        tokenizer_dir,
        "--train_file",
        train,
        "--validation_file",
        valid,
        "--output_dir",
        tmp_path / "out",
        *FLAGS,
        cache_dir=cache_dir,
        mixed_precision="bf16",
        check=False,
    )
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    # one line per rank; torchrun may end the second rank before it prints its own
    assert len(lines) in (1, 2) and len(set(lines)) == 1, proc.stderr[-4000:]
    assert "the tokenizer has 4096 entries but the model's vocab_size is 512" in lines[0]
    assert 'llama.py", line' not in proc.stderr, proc.stderr[-4000:]


def test_lone_txt_splits_at_paragraphs(tmp_path):
    text = "\n".join(f"Speech {i}, line one\nline two\n" for i in range(40))  # 40 paragraphs
    train, validation = data.split_text(text, 5)
    assert validation + train == text
    assert (
        validation == "Speech 0, line one\nline two\n\nSpeech 1, line one\nline two\n\n"
    )  # 5% of 40
    assert train.startswith("Speech 2,")
    assert data.split_text("a\nb\nc\nd\n", 50) == ("c\nd\n", "a\nb\n")  # no blank line: by lines
    with pytest.raises(ValueError, match="1 line, too few"):
        data.split_text("one line only", 5, "x.txt")
    path = tmp_path / "t.txt"
    path.write_text(text)
    raw = data.load_text_dataset(
        train_file=str(path)
    )  # before: "only 1 training rows: too few ..."
    assert raw["validation"]["text"] == [validation] and raw["train"]["text"] == [train]


def test_tokenizer_check(tmp_path, small_corpus):
    model_dir = tmp_path / "no_tokenizer"
    AutoModelForCausalLM.from_config(ARCHS["gpt2"]).save_pretrained(model_dir)
    empty = AutoTokenizer.from_pretrained(model_dir)
    texts = ["To be, or not to be, that is the question. " * 100]
    with pytest.raises(Stop) as stopped:
        causal_lm._stop_unless_tokenizer_encodes(empty, str(model_dir), texts)
    problem = str(stopped.value)
    assert problem and str(model_dir) in problem and "--tokenizer_name_or_path" in problem
    causal_lm._stop_unless_tokenizer_encodes(
        AutoTokenizer.from_pretrained(small_corpus[2]), "bpe", texts
    )


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_flops_per_token_of_any_model(arch):
    """Before: GPT-2 failed at start-up (flops_per_token read num_key_value_heads)."""
    config = models.llama_config("debug", 4096) if arch == "llama" else ARCHS[arch]
    model = models.causal_lm_class(config)(config)
    flops, how = metrics.model_flops_per_token(model, 64)
    lookups = sum(
        p.numel()
        for m in model.modules()
        if isinstance(m, torch.nn.Embedding)
        for p in m.parameters()
    )
    n = (
        model.num_parameters()
        - lookups
        + (config.vocab_size * config.hidden_size if config.tie_word_embeddings else 0)
    )
    attention = 12 * config.num_hidden_layers * config.hidden_size * 64
    assert flops == 6 * n + attention
    if arch == "llama":  # N from the config fields equals the count above, and is named
        assert "Llama fields" in how
    else:
        assert "counted" in how
    for p in (
        model.model.layers.parameters() if arch != "gpt2" else model.transformer.h.parameters()
    ):
        p.requires_grad_(False)  # as under LoRA: their backward computes input gradients only
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    assert metrics.model_flops_per_token(model, 64)[0] == 6 * n - 2 * frozen + attention


def test_token_ids_from_the_tokenizer(small_corpus):
    tokenizer = AutoTokenizer.from_pretrained(small_corpus[2])
    eos = tokenizer.eos_token_id
    scratch = GPT2Config(vocab_size=4096)  # bos/eos 50256, pad None
    assert causal_lm.set_token_ids(scratch, tokenizer, from_scratch=True)
    assert (scratch.bos_token_id, scratch.eos_token_id, scratch.pad_token_id) == (eos, eos, eos)
    # pretrained: keeps its bos, gets the missing pad and the eos the data separates documents with
    pretrained = GPT2Config(vocab_size=4096)
    assert causal_lm.set_token_ids(pretrained, tokenizer, from_scratch=False) == [
        f"eos_token_id: 50256 -> {eos}",
        f"pad_token_id: None -> {eos}",
    ]
    assert (pretrained.bos_token_id, pretrained.eos_token_id, pretrained.pad_token_id) == (
        50256,
        eos,
        eos,
    )
    # several stop ids (chat models) keep theirs and gain the trained one; a pad of its own (not the
    # eos, whose embedding row padding_idx would freeze) replaces the config's
    chat = GPT2Config(vocab_size=4096, eos_token_id=[7, 8], pad_token_id=9)
    assert causal_lm.set_token_ids(chat, tokenizer, from_scratch=False) == [
        f"eos_token_id: [7, 8] -> [{eos}, 7, 8]"
    ]
    tokenizer.add_special_tokens({"pad_token": "<pad>"})
    pad = tokenizer.pad_token_id
    assert pad != eos and causal_lm.set_token_ids(chat, tokenizer, from_scratch=False) == [
        f"pad_token_id: 9 -> {pad}"
    ]
    # its generation config (generation_config.json) follows: generate() stops on the trained eos
    small = GPT2Config(vocab_size=4096, n_layer=1, n_embd=8, n_head=2, eos_token_id=7)
    model = models.causal_lm_class(small)(small)
    assert (model.generation_config.eos_token_id, model.generation_config.pad_token_id) == (7, None)
    causal_lm.set_token_ids(model.config, tokenizer, from_scratch=False)
    causal_lm._align_generation_ids(model, tokenizer)
    assert (model.generation_config.eos_token_id, model.generation_config.pad_token_id) == (
        eos,
        pad,
    )


def test_a_title_never_becomes_the_whole_validation_split():
    # the share counts characters: a short first paragraph (a title) is not 5% of the text
    essay = "A Story of the Mill\n\n" + "\n\n".join(["word " * 45] * 14)
    train, validation = data.split_text(essay, 5)
    assert validation.startswith("A Story of the Mill\n\nword") and validation + train == essay
    play = "MACBETH\n\n" + "\n".join(["a line of the play here"] * 1000)  # title, then one block
    train, validation = data.split_text(play, 5)
    assert 0.04 < len(validation) / len(play) < 0.06


def test_config_overrides_that_break_the_shapes_are_caught_before_training():
    import copy

    broken = causal_lm.apply_overrides(
        copy.deepcopy(ARCHS["qwen2"]), "hidden_size=60"
    )  # head_dim stays 16
    with pytest.raises(Stop, match="does not run: .*must match"):
        causal_lm.model_runs(AutoModelForCausalLM.from_config(broken), "hidden_size=60")
    assert causal_lm.model_runs(AutoModelForCausalLM.from_config(ARCHS["qwen2"]), "") is None
