"""Tokenize the bundled corpus once into parquet shards for recipes/sharded_data.py.

    python tools/prepare_shards.py --output_dir data_shards --num_shards 4
    python tools/prepare_shards.py --output_dir /tmp/shards_1gb --num_shards 8 --repeat 200

Writes into --output_dir `shard_{i:04d}.parquet` (the training blocks), validation.parquet (the
held-out blocks), tokenizer/ and, last, manifest.json: present means a complete set. The blocks
are the LM recipes' (the cached tokenizer and packing: blocks of --block_size tokens, eos between
works). Training block b is packed block b mod n (so --repeat K makes the corpus K times bigger)
and goes to shard b % num_shards, so every shard samples the whole corpus; blocks past a
multiple of --num_shards are dropped (counted in the manifest). Columns: `input_ids`, a
fixed-size list of uint16 [block_size] (int32 for vocabularies above 65,536), and `block_id`
int64; a row group per --rows_per_row_group rows. The manifest lists rows, tokens, bytes and
SHA-256 per file, the tokenizer and the block size.
"""

import hashlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere, no install
from common import data, errors  # noqa: E402
from common.args import flag, make_output_dir, parse_flags  # noqa: E402
from common.errors import Stop  # noqa: E402


@dataclass
class Args:
    output_dir: str = flag(None, "folder for the shards and manifest.json")
    num_shards: int = flag(2, "a multiple of the world size you will train with", low=1)
    repeat: int = flag(1, "repeat the corpus K times (bigger corpora for measurements)", low=1)
    max_blocks: int = flag(None, "keep only the first N training blocks (quick tests)", low=1)
    block_size: int = flag(256, low=2)
    rows_per_row_group: int = flag(256, "the unit a loader worker reads and shuffles", low=1)
    tokenizer_name_or_path: str = flag(None, "default: the project's corpus BPE")
    vocab_size: int = flag(4096, low=256)
    cache_dir: str = data.DEFAULT_CACHE_DIR
    overwrite_output_dir: bool = False


def write_parquet(path: Path, blocks: np.ndarray, ids: np.ndarray, rows_per_group: int) -> dict:
    """`blocks[ids]` ([rows, block_size]) as `input_ids`, `ids` as `block_id`, one row group per
    `rows_per_group` rows; returns the file's manifest entry."""
    block_size = blocks.shape[1]
    schema = pa.schema(
        [
            ("input_ids", pa.list_(pa.from_numpy_dtype(blocks.dtype), block_size)),
            ("block_id", pa.int64()),
        ]
    )
    with pq.ParquetWriter(path, schema) as writer:
        for start in range(0, len(ids), rows_per_group):  # one row group per write
            chunk = ids[start : start + rows_per_group]
            tokens = pa.array(blocks[chunk % len(blocks)].ravel())
            columns = {"input_ids": pa.FixedSizeListArray.from_arrays(tokens, block_size)}
            writer.write_table(pa.table({**columns, "block_id": chunk}))
    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    return {
        "name": path.name,
        "rows": len(ids),
        "tokens": len(ids) * block_size,
        "bytes": path.stat().st_size,
        "sha256": digest,
    }


def prepare(args: Args) -> dict:
    """Write the shards, validation.parquet, tokenizer/ and then manifest.json; returns it.

    Raises:
        Stop: no --output_dir, an existing manifest without --overwrite_output_dir, or fewer
            blocks than shards.
    """
    if not args.output_dir:
        raise Stop("prepare_shards.py needs --output_dir")
    out = Path(args.output_dir)
    if (out / "manifest.json").exists() and not args.overwrite_output_dir:
        raise Stop(f"{out / 'manifest.json'} exists; pass --overwrite_output_dir to replace it")
    make_output_dir(str(out))
    for old in [out / "manifest.json", *out.glob("shard_*.parquet")]:
        old.unlink(missing_ok=True)  # no stale shard of an earlier, larger set may survive
    raw = data.load_text_dataset()
    tokenizer = data.get_tokenizer(
        args.tokenizer_name_or_path, raw, args.vocab_size, args.cache_dir
    )
    packed = data.pack_dataset(raw, tokenizer, args.block_size, args.cache_dir).with_format("numpy")
    dtype = np.uint16 if len(tokenizer) <= 2**16 else np.int32  # half the bytes below 65,536
    train, held_out = (packed[s]["input_ids"][:].astype(dtype) for s in ("train", "validation"))
    n_blocks = len(train) * args.repeat
    n_blocks = n_blocks if args.max_blocks is None else min(args.max_blocks, n_blocks)
    per_shard = n_blocks // args.num_shards
    if per_shard == 0:
        raise Stop(f"{n_blocks} blocks cannot fill {args.num_shards} shards")
    shards = [
        write_parquet(
            out / f"shard_{i:04d}.parquet",
            train,
            np.arange(i, per_shard * args.num_shards, args.num_shards),
            args.rows_per_row_group,
        )
        for i in range(args.num_shards)
    ]
    validation = write_parquet(
        out / "validation.parquet", held_out, np.arange(len(held_out)), args.rows_per_row_group
    )
    tokenizer.save_pretrained(out / "tokenizer")
    train_bytes = sum(len(t) for t in raw["train"]["text"])
    manifest = {
        "num_shards": args.num_shards,
        "block_size": args.block_size,
        "dtype": np.dtype(dtype).name,
        "tokenizer": {
            "name_or_path": tokenizer.name_or_path,
            "vocab_size": len(tokenizer),
            "sha256": hashlib.sha256(tokenizer.backend_tokenizer.to_str().encode()).hexdigest(),
        },
        "source": f"bundled Shakespeare corpus x {args.repeat}",
        "text_bytes": train_bytes * n_blocks // len(train),  # the text the blocks hold, pro rata
        "total_blocks": per_shard * args.num_shards,
        "dropped_blocks": n_blocks - per_shard * args.num_shards,
        "rows_per_row_group": args.rows_per_row_group,
        "shards": shards,
        "validation": validation,
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1, allow_nan=False))
    print(
        f"{args.num_shards} shards x {per_shard} blocks of {args.block_size} tokens "
        f"({manifest['text_bytes'] / 1e6:.1f} MB of text, "
        f"{sum(s['bytes'] for s in shards) / 1e6:.1f} MB of parquet) and {len(held_out)} "
        f"validation blocks in {out}"
    )
    return manifest


def main() -> int:
    prepare(parse_flags((Args,), sys.argv[1:], description=__doc__)[0][0])
    return 0


if __name__ == "__main__":
    errors.run(main)
