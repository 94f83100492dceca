"""common/data.py's packing: every split is one token stream, cut into blocks across rows and
batches; only its last partial block is dropped, and `pack_stats` says how many tokens that was."""

import sys

import datasets

from conftest import REPO

sys.path.insert(0, str(REPO))
from common import data  # noqa: E402


def test_packing_carries_the_remainder_over(tmp_path):
    # 5,000 rows of "x": 2 tokens each with eos, 10,000 tokens = 9 blocks of 1,024. Packed batch by
    # batch (1,000 rows, 2,000 tokens, one block each), 4,880 tokens were dropped and 5 blocks left.
    lines = [f"line {i} " + "ab " * (i % 7) for i in range(1_500)]  # rows of 3 to 10 tokens, in order
    raw = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["x"] * 5_000}),
                                "validation": datasets.Dataset.from_dict({"text": lines})})
    tok = data.get_tokenizer(None, raw, 300, str(tmp_path))
    eos = tok.eos_token_id
    assert len(tok("x")["input_ids"]) == 1
    packed = data.pack_dataset(raw, tok, 1_024, str(tmp_path))
    assert len(packed["train"]) == 9
    assert data.pack_stats(packed)["train"] == {"rows": 5_000, "tokens": 10_000, "blocks": 9, "dropped_tokens": 784}

    # The blocks are the rows' tokens in order, spanning rows and batches of rows.
    stream = [t for ids in tok(lines)["input_ids"] for t in ids + [eos]]
    n = len(stream) // 1_024
    assert n >= 8 and len(packed["validation"]) == n
    blocks = packed["validation"]["input_ids"][:]
    assert [t for b in blocks for t in b] == stream[:n * 1_024]
    assert packed["validation"]["labels"][:] == blocks
    assert data.pack_stats(packed)["validation"]["dropped_tokens"] == len(stream) - n * 1_024 < 1_024
