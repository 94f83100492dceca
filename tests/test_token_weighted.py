"""Token-weighted gradient accumulation: with padding and four unequal lengths (14, 30, 50 and 100
target tokens), the loss is the sum of token losses over the target tokens of the whole window on
all ranks, so 2 ranks x 1 sequence x 2 accumulation steps train exactly like 1 rank x 4 sequences,
under DDP, FSDP2 and ZeRO-2. A per-micro-batch mean would weight the 14 tokens like the 100, and a
per-rank count would weight the ranks alike: however the four rows fall on two ranks, their counts
differ."""

import json

import pytest

from common import data
from conftest import launch, read_metrics

SHORT = "Now is the winter of our discontent made glorious summer."
LONG = " ".join(
    ["But soft, what light through yonder window breaks? It is the east, and Juliet is the sun."]
    * 6
)


@pytest.fixture(scope="module")
def files(tmp_path_factory, cache_dir):
    root = tmp_path_factory.mktemp("tw")
    tok = data.get_tokenizer(None, data.load_text_dataset(), 4096, cache_dir)
    tok.save_pretrained(root / "tokenizer")
    ids = tok(LONG)["input_ids"]
    train = [tok.decode(tok(SHORT)["input_ids"])] + [tok.decode(ids[:n]) for n in (30, 50, 100)]
    rows = {"train.jsonl": train, "valid.jsonl": [SHORT, LONG[:200], LONG[:50]]}
    for name, texts in rows.items():
        (root / name).write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return root, [
        len(tok(t)["input_ids"]) for t in train
    ]  # target tokens: + eos, - the first token


def run(root, tmp_path, cache_dir, config, per_device, accum):
    out = tmp_path / f"{config}-{per_device}x{accum}"
    launch(
        config,
        "recipes/llama.py",
        "--output_dir",
        out,
        "--train_file",
        root / "train.jsonl",
        "--validation_file",
        root / "valid.jsonl",
        "--tokenizer_name_or_path",
        root / "tokenizer",
        "--packing",
        "false",
        "--block_size",
        128,
        "--per_device_train_batch_size",
        per_device,
        "--gradient_accumulation_steps",
        accum,
        "--max_steps",
        4,
        "--warmup_steps",
        0,
        "--learning_rate",
        1e-3,
        "--logging_steps",
        1,
        "--eval_steps",
        4,
        "--report_to",
        "none",
        "--ddp_timeout",
        120,
        cache_dir=cache_dir,
        mixed_precision="no",
    )
    return read_metrics(out)[0]


@pytest.fixture(scope="module")
def reference(files, tmp_path_factory, cache_dir):
    """1 rank, all four sequences in one micro batch: the full-batch gradient."""
    return run(files[0], tmp_path_factory.mktemp("ref"), cache_dir, "single", 4, 1)


# Each case weights over the micro batches of a window and over the ranks at once (the recipe's one
# code path: the window's target count summed over the ranks, the loss scaled by accumulation x world
# size), under each strategy's own backward and gradient mean (DeepSpeed's engine divides by its
# accumulation steps itself). One process with accumulation runs the same lines with a world of 1.
@pytest.mark.parametrize(
    "config,per_device,accum", [("ddp", 1, 2), ("fsdp", 1, 2), ("deepspeed_zero2", 1, 2)]
)
def test_token_weighted_accumulation(
    files, reference, config, per_device, accum, tmp_path, cache_dir
):
    root, targets = files
    # all shorter than the 128-token block (padding). Every global batch is the four rows, so the two
    # ranks hold 44 and 150, 64 and 130, or 114 and 80 targets: never alike
    assert targets == [14, 30, 50, 100]
    ref_steps = reference
    steps = run(root, tmp_path, cache_dir, config, per_device, accum)
    # what trained: every step the four rows, 194 targets and 198 tokens (each row's first token is no
    # target), not the 4 x 128 padded positions; counted over the ranks, as in the 1-rank reference
    for r in [*steps, *ref_steps]:
        assert (r["input_tokens"], r["target_tokens"]) == (r["step"] * 198, r["step"] * 194), (
            config,
            r,
        )
    # fp32; the split regroups the token sums (rounding only); the fault this guards, a mean of per-micro-batch
    # means, weights these very unequal lengths differently: 1e-5 is a reason-based bound, not a measured one
    for r, q in zip(steps, ref_steps):
        assert r["loss"] == pytest.approx(q["loss"], rel=1e-5), (config, r["step"])
        assert r["grad_norm"] == pytest.approx(q["grad_norm"], rel=1e-5), (config, r["step"])
    assert steps[-1]["eval_loss"] == pytest.approx(ref_steps[-1]["eval_loss"], rel=1e-5)


def test_packing_false_warns_about_cut_rows(files, tmp_path, capsys):
    """One padded row per example: a row longer than the block loses its tail, and the user is
    told how many rows and tokens, on a fresh build and from the cache alike."""
    import datasets
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(files[0] / "tokenizer")
    raw = datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_dict({"text": [SHORT, LONG]}),
            "validation": datasets.Dataset.from_dict({"text": [SHORT]}),
        }
    )
    long_tokens = len(tok(LONG)["input_ids"]) + 1  # + eos
    for _ in ("build", "cached"):
        capsys.readouterr()
        padded = data.pack_dataset(raw, tok, 32, str(tmp_path), packing="none")
        warnings = [w for w in capsys.readouterr().err.splitlines() if "--packing none" in w]
        assert len(warnings) == 1 and warnings[0] == (
            f"warning: --packing none: 1 of 2 train rows are longer than --block_size 32 and lose their "
            f"tail ({long_tokens - 32} tokens never trained on); raise --block_size or pack them (--packing "
            "documents)"
        )
    assert [len(r) for r in padded["train"]["input_ids"]] == [32, 32]
