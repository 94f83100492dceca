"""common/data.py's packing: every split is one token stream, cut into blocks across rows and
batches; only its last partial block is dropped, and `pack_stats` says how many tokens that was.
With --packing documents each document of a block trains as if alone; every document ends in one
eos, and special-token strings in the text stay text."""

import sys

import datasets
import pytest
import torch
from transformers import LlamaForCausalLM

from conftest import REPO

sys.path.insert(0, str(REPO))
from common import data  # noqa: E402


def test_packing_carries_the_remainder_over(tmp_path):
    # 5,000 rows of "x": 2 tokens each with eos, 10,000 tokens = 9 blocks of 1,024. Packed batch by
    # batch (1,000 rows, 2,000 tokens, one block each), 4,880 tokens were dropped and 5 blocks left.
    lines = [
        f"line {i} " + "ab " * (i % 7) for i in range(1_500)
    ]  # rows of 3 to 10 tokens, in order
    raw = datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_dict({"text": ["x"] * 5_000}),
            "validation": datasets.Dataset.from_dict({"text": lines}),
        }
    )
    tok = data.get_tokenizer(None, raw, 300, str(tmp_path))
    eos = tok.eos_token_id
    assert len(tok("x")["input_ids"]) == 1
    packed = data.pack_dataset(raw, tok, 1_024, str(tmp_path))
    assert len(packed["train"]) == 9
    stats = data.pack_stats(packed)["train"]
    assert len(stats.pop("digest")) == 16
    assert stats == {
        "rows": 5_000,
        "tokens": 10_000,
        "blocks": 9,
        "dropped_tokens": 784,
        "special_text": {},
        "targets": 9 * 1_023,  # every position but a block's first: the model shifts the labels
    }

    # The blocks are the rows' tokens in order, spanning rows and batches of rows.
    stream = [t for ids in tok(lines)["input_ids"] for t in ids + [eos]]
    n = len(stream) // 1_024
    assert n >= 8 and len(packed["validation"]) == n
    blocks = packed["validation"]["input_ids"][:]
    assert [t for b in blocks for t in b] == stream[: n * 1_024]
    assert packed["validation"]["labels"][:] == blocks
    assert (
        data.pack_stats(packed)["validation"]["dropped_tokens"] == len(stream) - n * 1_024 < 1_024
    )


# --packing documents: blocks of several documents, each attending to itself only ---------------------------

DOCS = [
    "Now is the winter of our discontent made glorious summer by this sun of York.",
    "To be, or not to be, that is the question.",
    "Friends, Romans, countrymen, lend me your ears; I come to bury Caesar, not to praise him.",
]
OTHER = "O Romeo, Romeo! wherefore art thou Romeo? Deny thy father and refuse thy name."


@pytest.fixture(scope="module")
def tokenizer(cache_dir):
    """The bundled BPE: `<|endoftext|>` is bos, eos, pad and unk."""
    return data.get_tokenizer(None, data.load_text_dataset(), 4096, cache_dir)


def one_block(tok, texts, tmp_path, packing="documents"):
    """`texts` packed as one train block (block_size = their tokens, eos included) under `packing`."""
    n = sum(len(ids) for ids in data.document_ids(tok, texts)[0])
    raw = datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_dict({"text": texts}),
            "validation": datasets.Dataset.from_dict({"text": texts}),
        }
    )
    block = data.pack_dataset(raw, tok, n, str(tmp_path), packing).with_format("torch")["train"]
    assert len(block) == 1
    return {k: v[None] for k, v in block[0].items()}


@pytest.fixture(scope="module", params=["sdpa", "eager"])
def model(request, tokenizer):
    """The debug Llama (fp32, random init, seed 0) with SDPA or eager attention: transformers' mask
    builder turns position ids that restart into a block-diagonal causal mask for both, when there
    is no attention mask and no KV cache (with use_cache=True it builds a cache, and reads no packing)."""
    from common import models

    torch.manual_seed(0)
    config = models.llama_config(
        "debug", vocab_size=len(tokenizer), use_cache=False
    )  # as the recipe's
    config._attn_implementation = request.param
    return LlamaForCausalLM(config).eval()


def token_losses(model, batch):
    """Per-token cross entropy of each target (label != -100), in order, and the logits."""
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], position_ids=batch.get("position_ids")).logits
    labels = batch["labels"][0, 1:]
    nll = torch.nn.functional.cross_entropy(
        logits[0, :-1].float(), labels.clamp(min=0), reduction="none"
    )
    return nll[labels != -100], logits[0]


def test_each_document_in_a_block_trains_as_if_alone(tokenizer, model, tmp_path):
    """(a) Per-token losses of A, B and C in one documents block equal those of each document alone
    in its own row (fp32, 1e-5; measured max 9.5e-7 with SDPA and eager), and the model's own loss
    averages exactly those targets (measured 9.5e-7). Packed as a stream, they differ (measured 1.39)."""
    block = one_block(tokenizer, DOCS, tmp_path)
    ids, _ = data.document_ids(tokenizer, DOCS)
    assert block["position_ids"][0].tolist() == [p for d in ids for p in range(len(d))]
    assert (block["labels"][0] == -100).sum() == len(DOCS)  # each document's first token, no other
    packed, _ = token_losses(model, block)
    alone = torch.cat(
        [
            token_losses(model, {"input_ids": torch.tensor([d]), "labels": torch.tensor([d])})[0]
            for d in ids
        ]
    )
    assert len(packed) == len(alone) == sum(len(d) - 1 for d in ids)
    torch.testing.assert_close(packed, alone, rtol=0, atol=1e-5)
    with torch.no_grad():
        loss = model(**block).loss
    assert loss.item() == pytest.approx(alone.mean().item(), abs=1e-5)
    stream = one_block(tokenizer, DOCS, tmp_path, "stream")
    crossed, _ = token_losses(model, {**stream, "labels": block["labels"]})
    assert (crossed - alone).abs().max() > 0.05  # the test sees attention across documents


def test_a_document_does_not_see_the_one_before(tokenizer, model, tmp_path):
    """(b) B's logits are the same (1e-5, measured max 4.2e-7) whatever text comes before it."""

    def logits_of_b(first):
        block = one_block(tokenizer, [first, *DOCS[1:]], tmp_path)
        start = len(data.document_ids(tokenizer, [first])[0][0])
        return token_losses(model, block)[1][
            start : start + len(data.document_ids(tokenizer, [DOCS[1]])[0][0])
        ]

    torch.testing.assert_close(logits_of_b(DOCS[0]), logits_of_b(OTHER), rtol=0, atol=1e-5)


def test_special_token_text_stays_text_and_is_counted(tokenizer, tmp_path, capsys):
    """`<|endoftext|>` written in a document is eos, bos and pad of the bundled BPE: it is encoded as
    the plain text it is (10 ordinary tokens), never as the control token, and rank 0 counts it."""
    text = "The end of one story <|endoftext|> is no end of the text."
    ids, found = data.document_ids(tokenizer, [text, "no such string"])
    assert found == {"<|endoftext|>": 1}
    assert ids[0].count(tokenizer.eos_token_id) == 1 and ids[0][-1] == tokenizer.eos_token_id
    assert ids[0][:-1] == tokenizer(text, split_special_tokens=True)["input_ids"]
    assert (
        tokenizer.eos_token_id in tokenizer(text)["input_ids"][:-1]
    )  # what plain encoding would train on
    capsys.readouterr()
    block = one_block(tokenizer, [text, text, DOCS[0]], tmp_path)
    assert (block["input_ids"][0] == tokenizer.eos_token_id).sum() == 3  # one per document
    warnings = [w for w in capsys.readouterr().err.splitlines() if "special-token strings" in w]
    assert len(warnings) == 2 and "(<|endoftext|> x 2)" in warnings[0]  # train and validation


def with_template(tokenizer, single, bos=None):
    """A copy of `tokenizer` whose own post-processor adds special tokens: `single` is a
    TemplateProcessing template such as "$A <|endoftext|>" (it appends eos itself)."""
    import copy

    from tokenizers.processors import TemplateProcessing

    tok = copy.deepcopy(tokenizer)
    if bos:
        tok.add_special_tokens({"bos_token": bos})
    names = {t for t in single.split() if t != "$A"}
    tok.backend_tokenizer.post_processor = TemplateProcessing(
        single=single, special_tokens=[(t, tok.convert_tokens_to_ids(t)) for t in names]
    )
    return tok


@pytest.mark.parametrize(
    "template,bos",
    [
        ("$A <|endoftext|>", None),
        ("<|endoftext|> $A", None),
        ("<|endoftext|> $A <|endoftext|>", None),
        ("<s> $A", "<s>"),
    ],
)
def test_one_separator_between_documents(tokenizer, tmp_path, template, bos):
    """A tokenizer that appends eos itself, or prepends a bos that is its eos, gives one eos per
    boundary, not `eos eos`; a distinct bos (Llama's `<|begin_of_text|>`) stays at each document's start."""
    tok = with_template(tokenizer, template, bos)
    text = DOCS[1]
    plain = tok(text, add_special_tokens=False)["input_ids"]
    assert tok(text)["input_ids"] != plain  # the template does add tokens
    eos = tok.eos_token_id
    start = [tok.bos_token_id] if bos else []
    ids, _ = data.document_ids(tok, [text, text])
    assert ids == [start + plain + [eos]] * 2
    for packing in ("stream", "documents"):
        block = one_block(tok, [text, text, text], tmp_path / packing, packing)["input_ids"][
            0
        ].tolist()
        assert block == (start + plain + [eos]) * 3


def test_a_model_without_position_ids_cannot_pack_documents():
    """Bloom (ALiBi) takes no position ids: --packing documents would attend across documents, so the
    start-up check stops it in one line; Llama and GPT-2 take them."""
    from transformers import BloomForCausalLM, GPT2LMHeadModel

    from common import checks
    from common.errors import Stop

    checks._documents_kept_apart(LlamaForCausalLM)
    checks._documents_kept_apart(GPT2LMHeadModel)
    with pytest.raises(Stop) as stop:
        checks._documents_kept_apart(BloomForCausalLM)
    assert str(stop.value).startswith(
        "--packing documents keeps documents apart through position_ids, which BloomForCausalLM's forward"
    )
