"""Tokenize a corpus once into parquet shards for recipes/sharded_data.py.

    python tools/prepare_shards.py --output_dir data_shards --num_shards 4
    python tools/prepare_shards.py --output_dir shards --train_file corpus.jsonl --num_shards 8
    python tools/prepare_shards.py --output_dir /tmp/shards_1gb --num_shards 8 --repeat 200

The data flags are llama.py's (`--train_file`, `--validation_file`, `--dataset_name`, ...;
default: the bundled corpus), and so are the blocks: common/data.py tokenizes and packs them
(`--packing stream|documents`) on `--num_proc` processes into its cache, on disk, which a rerun
reuses. Writes into --output_dir `shard_{i:04d}.parquet` (the training blocks),
validation.parquet (the held-out blocks), tokenizer/ and, last, manifest.json: present means a
complete set. Each file is written under a temporary name and renamed once whole, and the
manifest is replaced atomically: an interrupted run leaves no manifest, and running it again
starts the shards afresh. Training block b is packed block b mod n (so --repeat K makes the
corpus K times bigger) and goes to shard b % num_shards, so every shard samples the whole
corpus; blocks past a multiple of --num_shards are dropped (counted in the manifest). Columns:
`input_ids`, a fixed-size list of uint16 [block_size] (int32 for vocabularies above 65,536),
`block_id` int64 and, with --packing documents, `position_ids` (0 at each document's first
token); a row group per --rows_per_row_group rows, written as the blocks are read. The manifest
lists rows, tokens, bytes and SHA-256 per file, the tokenizer, the block size and packing.
"""

import hashlib
import json
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere, no install
from common import data, errors  # noqa: E402
from common.args import choice, flag, make_output_dir, parse_flags  # noqa: E402
from common.errors import Stop  # noqa: E402


@dataclass
class Args:
    output_dir: str = flag(None, "folder for the shards and manifest.json")
    num_shards: int = flag(2, "a multiple of the world size you will train with", low=1)
    dataset_name: str = None
    dataset_config_name: str = None
    train_file: str = flag(None, "as llama.py's: .txt, .json, .jsonl or .parquet")
    validation_file: str = None
    validation_split_percentage: int = flag(5, "% held out if no validation set", low=1, high=99)
    dataset_text_field: str = flag("text", "the column that holds the text")
    packing: str = choice(data.PACKING[:2], help="as llama.py's --packing")
    num_proc: int = flag(len(os.sched_getaffinity(0)), "tokenizing processes", low=1)
    repeat: int = flag(1, "repeat the corpus K times (bigger corpora for measurements)", low=1)
    max_blocks: int = flag(None, "keep only the first N training blocks (quick tests)", low=1)
    block_size: int = flag(256, low=2)
    rows_per_row_group: int = flag(256, "the unit a loader worker reads and shuffles", low=1)
    tokenizer_name_or_path: str = flag(None, "default: a BPE trained on the text, as llama.py")
    vocab_size: int = flag(4096, low=256)
    cache_dir: str = data.DEFAULT_CACHE_DIR
    overwrite_output_dir: bool = False


class ShardWriter:
    """One parquet file written under a temporary name, renamed to `path` by `close`, which
    returns its manifest entry (rows, tokens, bytes, SHA-256 of the file on disk)."""

    def __init__(self, path: Path, dtype, block_size: int, documents: bool):
        self.path, self.tmp, self.rows = path, path.with_name(f".{path.name}.tmp"), 0
        token = pa.list_(pa.from_numpy_dtype(dtype), block_size)
        fields = [("input_ids", token), ("block_id", pa.int64())]
        fields += [("position_ids", pa.list_(pa.int32(), block_size))] if documents else []
        self.writer = pq.ParquetWriter(self.tmp, pa.schema(fields))

    def write(self, columns: dict[str, np.ndarray]) -> None:
        """One row group: `input_ids` (and `position_ids`) [rows, block_size], `block_id` [rows]."""
        table = {
            k: pa.FixedSizeListArray.from_arrays(pa.array(v.ravel()), v.shape[1])
            if v.ndim == 2
            else v
            for k, v in columns.items()
        }
        self.writer.write_table(pa.table(table, schema=self.writer.schema))
        self.rows += len(columns["block_id"])

    def close(self) -> dict:
        self.writer.close()
        with open(self.tmp, "rb") as f:
            digest = hashlib.file_digest(f, "sha256").hexdigest()
        self.tmp.rename(self.path)
        tokens = self.rows * self.writer.schema.field("input_ids").type.list_size
        return {
            "name": self.path.name,
            "rows": self.rows,
            "tokens": tokens,
            "bytes": self.path.stat().st_size,
            "sha256": digest,
        }


def read_blocks(packed, ids: np.ndarray, dtype, documents: bool) -> dict[str, np.ndarray]:
    """Blocks `ids` of `packed` (one of pack_dataset's splits, numpy format), as shard columns."""
    rows = packed[ids.tolist()]
    columns = {"input_ids": np.asarray(rows["input_ids"]).astype(dtype)}
    if documents:  # the labels follow: -100 where a position is 0 (pack_dataset's rule)
        columns["position_ids"] = np.asarray(rows["position_ids"]).astype(np.int32)
    return columns


def text_and_tokenizer(args: Args):
    """(the data flags' train and validation splits, a `text` column each; the tokenizer)."""
    field = args.dataset_text_field
    raw = data.load_text_dataset(
        args.dataset_name,
        args.dataset_config_name,
        args.train_file,
        args.validation_file,
        args.validation_split_percentage,
        columns=((field,),),
    )
    if field != "text":
        raw = raw.select_columns(field).rename_column(field, "text")
    return raw, data.get_tokenizer(
        args.tokenizer_name_or_path, raw, args.vocab_size, args.cache_dir
    )


def prepare(args: Args, tokenized: dict | None = None) -> dict:
    """Write the shards, validation.parquet, tokenizer/ and then manifest.json; returns it.
    `tokenized`: splits of token rows made already (`data.pack_dataset`'s).

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
    (out / "manifest.json").unlink(missing_ok=True)  # first: no manifest over half-written shards
    for old in [*out.glob("shard_*.parquet"), *out.glob(".*.parquet.tmp")]:
        old.unlink()  # no stale shard of an earlier, larger or interrupted set may survive
    raw, tokenizer = text_and_tokenizer(args)
    packed = data.pack_dataset(
        raw,
        tokenizer,
        args.block_size,
        args.cache_dir,
        args.packing,
        num_proc=args.num_proc,
        tokenized=tokenized,
    ).with_format("numpy")
    documents = args.packing == "documents"
    dtype = np.uint16 if len(tokenizer) <= 2**16 else np.int32  # half the bytes below 65,536
    train, held_out = packed["train"], packed["validation"]
    n_blocks = len(train) * args.repeat
    n_blocks = n_blocks if args.max_blocks is None else min(args.max_blocks, n_blocks)
    per_shard = n_blocks // args.num_shards
    if per_shard == 0:
        raise Stop(f"{n_blocks} blocks cannot fill {args.num_shards} shards")
    # Blocks in order, a row group per shard at a time: memory holds num_shards row groups.
    writers = [
        ShardWriter(out / f"shard_{i:04d}.parquet", dtype, args.block_size, documents)
        for i in range(args.num_shards)
    ]
    step, total = args.num_shards * args.rows_per_row_group, per_shard * args.num_shards
    with tqdm(total=total, desc="writing shards", unit=" blocks") as progress:
        for start in range(0, total, step):
            ids = np.arange(start, min(start + step, total))
            columns = read_blocks(train, ids % len(train), dtype, documents) | {"block_id": ids}
            for i, writer in enumerate(writers):
                writer.write({k: v[i :: args.num_shards] for k, v in columns.items()})
            progress.update(len(ids))
    shards = [writer.close() for writer in writers]
    writer = ShardWriter(out / "validation.parquet", dtype, args.block_size, documents)
    for start in range(0, len(held_out), args.rows_per_row_group):
        ids = np.arange(start, min(start + args.rows_per_row_group, len(held_out)))
        writer.write(read_blocks(held_out, ids, dtype, documents) | {"block_id": ids})
    validation = writer.close()
    tokenizer.save_pretrained(out / "tokenizer")
    text = raw["train"].data.column("text")
    train_bytes = pc.sum(pc.binary_length(text)).as_py() or 0  # (Arrow's: no copy of the text)
    source = args.dataset_name or args.train_file or "the bundled Shakespeare corpus"
    manifest = {
        "num_shards": args.num_shards,
        "block_size": args.block_size,
        "packing": args.packing,
        "dtype": np.dtype(dtype).name,
        "tokenizer": {
            "name_or_path": tokenizer.name_or_path,
            "vocab_size": len(tokenizer),
            "sha256": hashlib.sha256(tokenizer.backend_tokenizer.to_str().encode()).hexdigest(),
        },
        "source": f"{source} x {args.repeat}",
        "packed_digest": data.pack_stats(packed)["train"]["digest"],  # llama.py's blocks' digest
        "text_bytes": train_bytes * n_blocks // len(train),  # the text the blocks hold, pro rata
        "total_blocks": total,
        "dropped_blocks": n_blocks - total,
        "rows_per_row_group": args.rows_per_row_group,
        "shards": shards,
        "validation": validation,
    }
    tmp = out / ".manifest.json.tmp"
    tmp.write_text(json.dumps(manifest, indent=1, allow_nan=False))
    os.replace(tmp, out / "manifest.json")  # last, and whole: present means complete
    print(
        f"{args.num_shards} shards x {per_shard} blocks of {args.block_size} tokens "
        f"({manifest['text_bytes'] / 1e6:.1f} MB of text, "
        f"{sum(s['bytes'] for s in shards) / 1e6:.1f} MB of parquet) and {len(held_out)} "
        f"validation blocks in {out}"
    )
    return manifest


def tokenize_part(args: Args, _data=None, rank: int = 0, world_size: int = 1) -> None:
    """A datatrove task (slurm/prepare_shards.py): the `rank`-th of `world_size` contiguous parts of
    the training rows, tokenized into `<output_dir>/.parts/<rank>` (renamed there when whole)."""
    final = Path(args.output_dir) / ".parts" / f"{rank:05d}"
    if final.exists():  # a rerun of a task that had finished
        return
    raw, tokenizer = text_and_tokenizer(args)
    part = raw["train"].shard(world_size, rank, contiguous=True)
    rows = data.tokenize_rows(part, tokenizer, args.packing, num_proc=args.num_proc)
    tmp = final.with_name(f".{final.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    rows.save_to_disk(str(tmp))
    tmp.rename(final)


def merge_parts(args: Args, parts: int, _data=None, _rank: int = 0, _world_size: int = 1) -> None:
    """The datatrove task after `tokenize_part`'s: the parts in order are the training rows one
    process would tokenize; `prepare` packs them into the shards and manifest, then they go."""
    folder = Path(args.output_dir) / ".parts"
    rows = [datasets.load_from_disk(str(folder / f"{r:05d}")) for r in range(parts)]
    prepare(args, tokenized={"train": datasets.concatenate_datasets(rows)})
    for r in range(parts):
        shutil.rmtree(folder / f"{r:05d}")


def main() -> int:
    prepare(parse_flags((Args,), sys.argv[1:], description=__doc__)[0][0])
    return 0


if __name__ == "__main__":
    errors.run(main)
