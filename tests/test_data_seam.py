"""The data seam, as a user meets it: a copy of recipes/llama.py whose data stage makes its own
(input_ids, labels) rows, with a label rule of its own, and no change to common/. Under 2 ranks it
trains; the next launch reads the per-node cache; the statistics count exactly the targets the
rule makes; a resume continues exactly; a changed rule changes the fingerprint, and the resume
stops with one `error:` line. Three launches in all. Without launches: nothing outside the data
stages reads a text column, and a pretrained model takes tokens added to its vocabulary."""

import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, LlamaForCausalLM

from common import causal_lm, data, models
from common.errors import Stop
from conftest import FAST, REPO, launch, read_metrics

RECIPE = (REPO / "recipes" / "llama.py").read_text()
STAGE = ("    # ADAPT: data", "    # >>> shared: loaders")  # the data stage lies between them
PACK = """        lm_data = data.pack_dataset(
            raw,
            tokenizer,
            args.block_size,
            args.cache_dir,
            args.packing,
            num_proc=args.preprocessing_num_workers,
        ).with_format("torch")
"""
# The user's own rows: each work, tokenized by the user, with a rule for what trains. EVERY is the
# rule's period; the test changes it between launches.
OWN = """        def my_labels(ids):  # the user's rule: no loss on every EVERY-th token
            return [-100 if i % EVERY == 2 else t for i, t in enumerate(ids)]

        def my_rows(batch):
            ids = [row + [tokenizer.eos_token_id] for row in tokenizer(batch["text"])["input_ids"]]
            return {"input_ids": ids, "labels": [my_labels(row) for row in ids]}

        lm_data = data.pack_dataset(
            raw, tokenizer, args.block_size, args.cache_dir, args.packing, my_rows
        ).with_format("torch")
"""
BLOCK = 128  # FAST's --block_size
FLAGS = [
    *FAST,
    "--packing",
    "none",  # one row per block: the test can count each row's targets itself
    "--max_steps",
    4,
    "--save_steps",
    2,
    "--warmup_steps",
    1,
    "--logging_steps",
    1,
    "--eval_steps",
    4,
    "--sample_tokens",
    0,
    "--record_sample_ids",
]


def split_stage(text):
    """(before, data stage, after) of a recipe's text."""
    before, rest = text.split(STAGE[0], 1)
    stage, after = rest.split(STAGE[1], 1)
    return before, STAGE[0] + stage, STAGE[1] + after


def user_copy(root: Path, every: int) -> Path:
    """recipes/llama.py copied out of the repository, its data stage making its own rows."""
    before, stage, after = split_stage(RECIPE)
    assert stage.count(PACK) == 1
    copy = root / "mine" / "train.py"
    copy.parent.mkdir(parents=True)
    copy.write_text(before + stage.replace(PACK, OWN.replace("EVERY", str(every))) + after)
    # the substitution touched the data stage only
    assert split_stage(copy.read_text())[::2] == (before, after)
    return copy


def own_targets(tokenizer, texts, every):
    """What the rule trains, counted here: per row (one block each, `--packing none`), the labels
    != -100 past the first position (the model shifts them)."""
    counts = []
    for ids in tokenizer(list(texts))["input_ids"]:
        ids = (ids + [tokenizer.eos_token_id])[:BLOCK]
        labels = [-100 if i % every == 2 else t for i, t in enumerate(ids)]
        counts.append(sum(y != -100 for y in labels[1:]))
    return counts


@pytest.fixture(scope="module")
def seam(tmp_path_factory, cache_dir):
    """Three launches of the user's copy under ddp (2 ranks, fp32), with a cache of their own
    (the tokenizer copied in): A trains 4 steps, saving at 2; B resumes A's checkpoint-2; C, whose
    rule has another period, tries the same. Returns what each left behind."""
    root = tmp_path_factory.mktemp("seam")
    raw = data.load_text_dataset()
    tokenizer = data.get_tokenizer(None, raw, 4096, cache_dir)
    cache = root / "cache"
    shutil.copytree(tokenizer.name_or_path, cache / Path(tokenizer.name_or_path).name)
    env = {"PYTHONPATH": os.pathsep.join([str(REPO / "tests" / "device_guard"), str(REPO)])}

    def run(script, out, *args, check=True):
        proc = launch(
            "ddp",
            script,
            "--output_dir",
            out,
            *FLAGS,
            *args,
            cache_dir=str(cache),
            mixed_precision="no",
            env=env,
            check=check,
        )
        return proc, {p: p.stat().st_mtime_ns for p in cache.glob("none-*/stats.json")}

    mine, changed = user_copy(root / "a", 3), user_copy(root / "b", 4)
    a, b, c = root / "a" / "run", root / "b" / "run", root / "c" / "run"
    _, after_a = run(mine, a)
    _, after_b = run(mine, b, "--resume_from_checkpoint", a / "checkpoint-2")
    refused, after_c = run(changed, c, "--resume_from_checkpoint", a / "checkpoint-2", check=False)
    return {
        "raw": raw,
        "tokenizer": tokenizer,
        "runs": (a, b),
        "caches": (after_a, after_b, after_c),
        "refused": refused,
    }


def test_a_copied_data_stage_trains_with_its_own_labels(seam):
    """The statistics and the summary count the rule's targets, as the test counts them."""
    a, _ = seam["runs"]
    raw, tokenizer = seam["raw"], seam["tokenizer"]
    per_row = {s: own_targets(tokenizer, raw[s]["text"], 3) for s in ("train", "validation")}
    info = json.loads((a / "run_info.json").read_text())
    assert info["world_size"] == 2 and info["distributed_type"] == "MULTI_CPU"
    for split, counts in per_row.items():
        assert info["data"][split]["rows"] == len(counts) and len(counts) > 1
        assert info["data"][split]["targets"] == sum(counts)
    # what trained: the rows each rank recorded, 4 steps x 8
    trained = [
        i
        for rank in sorted((a / "sample_ids").glob("rank*.json"))
        for epoch in json.loads(rank.read_text())["epochs"]
        for i in epoch
    ]
    assert len(trained) == 4 * 8 and len(set(trained)) == len(trained)
    steps, (summary,) = read_metrics(a)
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert summary["target_tokens"] == sum(per_row["train"][i] for i in trained)
    # a third of the positions are no target: fewer targets than tokens fed
    assert summary["target_tokens"] < 0.7 * summary["input_tokens"]
    assert steps[-1]["loss"] < steps[0]["loss"]


def test_the_next_launch_reads_the_cache_and_resumes_exactly(seam):
    a, b = seam["runs"]
    after_a, after_b, _ = seam["caches"]
    assert len(after_a) == 1 and after_b == after_a  # no other build, the one there untouched
    want = {r["step"]: r for r in read_metrics(a)[0]}
    got = read_metrics(b)[0]
    assert [r["step"] for r in got] == [3, 4]
    for r in got:
        for key in ("loss", "grad_norm", "lr", "eval_loss", "input_tokens", "target_tokens"):
            assert r.get(key) == want[r["step"]].get(key), (r["step"], key)
    assert read_metrics(b)[1][0]["target_tokens"] == read_metrics(a)[1][0]["target_tokens"]


def test_another_label_rule_is_another_fingerprint(seam):
    """The rule keys the cache (C built its own) and the blocks' digest: the resume is refused."""
    after_a, _, after_c = seam["caches"]
    assert len(after_c) == 2 and after_a.items() <= after_c.items()
    proc = seam["refused"]
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert lines and len(set(lines)) == 1, proc.stderr[-3000:]
    assert "cannot resume from" in lines[0] and "data_digest " in lines[0], lines[0]
    assert "train_blocks" not in lines[0]  # the same rows: only what they train on differs
    assert 'train.py", line' not in proc.stderr, proc.stderr[-3000:]  # no traceback of the copy


def test_nothing_outside_the_data_stage_reads_text():
    """The recipes read `raw` and its text in their data stages only; common/ names a text
    column only in data.py."""
    for recipe in ("llama.py", "sft.py"):
        _, _, after = split_stage((REPO / "recipes" / recipe).read_text())
        assert not re.search(r"\braw\b|['\"]text['\"]", after), recipe
    for path in (REPO / "common").glob("*.py"):
        if path.name != "data.py":
            assert not re.search(r"\[['\"]text['\"]\]", path.read_text()), path.name


def test_a_pretrained_model_takes_added_tokens(tmp_path, cache_dir):
    """Tokens added to a pretrained model's vocabulary (a data stage's markers) pass the tokenizer
    check and grow its embeddings, the pretrained rows unchanged; from scratch, the config's
    vocabulary must hold them."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    raw = data.load_text_dataset()
    tokenizer = data.get_tokenizer(None, raw, 4096, cache_dir)
    torch.manual_seed(0)
    base = LlamaForCausalLM(models.llama_config("debug", vocab_size=len(tokenizer)))
    base.save_pretrained(tmp_path / "base")
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|user|>", "<|bot|>"]})
    config = AutoConfig.from_pretrained(tmp_path / "base")
    with pytest.raises(Stop, match="the tokenizer has 4098 entries but the model's vocab_size is"):
        causal_lm.tokenizer_fits(tokenizer, None, raw, config, 64)
    causal_lm.tokenizer_fits(tokenizer, None, raw, config, 64, pretrained=True)
    try:  # (one process: no launch)
        model = causal_lm.load_pretrained_on_ranks(
            Accelerator(cpu=True), str(tmp_path / "base"), config, False, tokenizer
        )
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    rows = model.get_input_embeddings().weight
    assert rows.shape[0] == len(tokenizer) == 4098
    assert torch.equal(rows[:4096], base.get_input_embeddings().weight)
    ids = torch.tensor([tokenizer.convert_tokens_to_ids(["<|user|>", "<|bot|>"]) + [5, 6]])
    assert torch.isfinite(model(input_ids=ids, labels=ids).loss)


def test_rows_that_cannot_key_the_cache_stop_in_one_line(tmp_path, cache_dir):
    """`to_rows` keys the cache through `datasets`' hash of what it closes over: a value that cannot
    be pickled (here a generator) stops with one line, and the tokenizer keeps its directory."""
    raw = data.load_text_dataset()
    tokenizer = data.get_tokenizer(None, raw, 4096, cache_dir)
    where = tokenizer.name_or_path
    lines = (line for line in ["a"])

    def rows(batch):
        return {"input_ids": [[next(lines, 1)]], "labels": [[1]]}

    with pytest.raises(
        Stop, match=r"^to_rows cannot key the data cache \(TypeError: cannot pickle"
    ):
        data.pack_dataset(raw, tokenizer, 64, str(tmp_path), "none", rows)
    assert tokenizer.name_or_path == where


# The user's module's own `to_rows`, beside its rule.
ROWS = """
def rows(batch):
    return {"input_ids": batch["text"], "labels": [labels(r) for r in batch["text"]]}
"""


def test_a_rule_in_another_module_keys_the_cache_by_its_code(tmp_path, cache_dir, monkeypatch):
    """A `to_rows` (or the rule it calls) from the user's own module: `datasets` hashes a module's
    function by its name, so the key reads that module's file too. An edit there is a new cache (and so a new
    fingerprint), never the old blocks under a resume."""
    import importlib
    import sys

    raw = data.load_text_dataset()
    tokenizer = data.get_tokenizer(None, raw, 4096, cache_dir)
    rule = tmp_path / "my_label_rule.py"
    rule.write_text("def labels(ids):\n    return list(ids)\n" + ROWS)
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("my_label_rule")
    keys = [data._cache_key(raw, tokenizer, 64, "none", f) for f in (module.rows, module.labels)]
    assert data._cache_key(raw, tokenizer, 64, "none", module.rows) == keys[0]
    rule.write_text("def labels(ids):\n    return [-100] * len(ids)\n" + ROWS)
    importlib.reload(module)  # (the hash of a module's function: its name only, in datasets 5)
    assert data._cache_key(raw, tokenizer, 64, "none", module.rows) != keys[0]
    assert data._cache_key(raw, tokenizer, 64, "none", module.labels) != keys[1]
    sys.modules.pop("my_label_rule")
