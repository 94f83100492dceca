"""Data loading that never starves the ranks: tokenized parquet shards, each rank reads only its own.

    python recipes/sharded_data.py prepare --output_dir data_shards --num_shards 4
    accelerate launch --config_file accelerate_configs/ddp.yaml recipes/sharded_data.py --data_dir data_shards
    accelerate launch --config_file accelerate_configs/fsdp.yaml recipes/sharded_data.py --data_dir data_shards
    accelerate launch --config_file accelerate_configs/ddp.yaml recipes/sharded_data.py --data_dir data_shards --loader datasets
    python recipes/sharded_data.py prepare --output_dir /tmp/shards_1gb --num_shards 8 --repeat 200   # ~1 GB of text

Prepare (one process): tokenize the bundled corpus once, cut it into blocks of --block_size
tokens, deal block b to shard b % num_shards (so every shard samples the whole corpus), and write
`shard_{i:04d}.parquet` plus `manifest.json` (rows, tokens, bytes and SHA-256 per shard, the
tokenizer, the block size). --repeat K repeats the corpus K times to make a bigger one.

Train: shard i belongs to rank i % world_size. Every rank checks its manifest (the shard count
must be a multiple of the world size; a missing, truncated or corrupt shard of its own is named)
and all ranks compare their manifests, then each streams its own shards one row group at a time
(read into memory that is freed once its rows are batched), so resident memory stays flat as the
corpus grows. Several nodes: a
node needs `manifest.json` and only the shards of its own ranks (node-local disks work: node n of
k processes each runs ranks n*k ... n*k + k - 1), and every node's manifest must be the same file
(else every rank stops at start-up with one line); `--loader datasets` needs every shard everywhere.
The DataLoader has workers, prefetching, persistent workers, and pinned memory where a GPU
exists (batches then go to the device without blocking the host). It is NOT passed to
accelerator.prepare: Accelerate 1.15 has no "already sharded" switch (split_batches slices each
batch across ranks; dispatch_batches, the default for iterable datasets, has rank 0 read
everything and send it out), so each rank iterates its own loader and moves batches to its
device. --loader datasets does the same with `datasets` streaming, one shard per row group
(`reshard`), split by `split_dataset_by_node` (which re-deals the row groups every epoch).
It trains the `debug` Llama for --max_steps and prints, per rank, the loader's tokens/s alone
against the tokens/s a training step consumes, and the resident memory of the rank and its workers.

Flags: training takes the core `transformers.TrainingArguments` flags (common/args.py) with their
usual meaning: --output_dir, --overwrite_output_dir, --seed, --per_device_train_batch_size,
--gradient_accumulation_steps, --learning_rate, --weight_decay (never on norm weights),
--warmup_steps (linear warmup, then the constant --learning_rate), --max_steps, --logging_steps,
--max_grad_norm, --report_to, and --save_steps / --resume_from_checkpoint {PATH|latest|auto} as
in llama.py (common/checkpoint.py: SIGTERM, SIGINT or SIGHUP saves at the next step and exits 143).
Each rank's epoch has its own length, so --num_train_epochs is refused, and a checkpoint records
every rank's data position (its epoch and the batches it consumed of it) to resume exactly.
`accelerate launch --mixed_precision fp16` on CPU ranks trains in real fp16 with a loss-scaling
GradScaler (common/workarounds.py); each logged line then has `loss_scale` and `skipped_steps`, and a
skipped step does not advance the LR schedule.

Outputs in --output_dir (standard JSON: a non-finite number is written as null and named in the
record's "nonfinite" list): metrics.jsonl (logging steps, then a summary with the table),
checkpoint-N/ (--save_steps), and with --record_sample_ids, sample_ids/rank{r}.json (written by
rank r alone: the block ids this process trained on, per epoch).
"""

import gc
import hashlib
import json
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import psutil
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, DistributedType, GradientAccumulationPlugin
from accelerate.utils import gather_object, set_seed
from transformers import LlamaForCausalLM, get_constant_schedule_with_warmup

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere, no install step
from common import checkpoint, checks, data, errors, grad_norm, launch, metrics, models, precision  # noqa: E402
from common import workarounds  # noqa: E402
from common.errors import Stop  # noqa: E402
from common.args import flag, make_output_dir, parse_args, parse_flags, unsupported  # noqa: E402

MANIFEST = "manifest.json"


@dataclass
class PrepareArgs:
    output_dir: str = field(default=None, metadata={"help": "folder for the shards and manifest.json"})
    num_shards: int = flag(2, "a multiple of the world size you will train with", low=1)
    repeat: int = flag(1, "repeat the corpus K times (bigger corpora for measurements)", low=1)
    max_blocks: int = flag(None, "keep only the first N blocks (quick tests)", low=1)
    block_size: int = flag(256, low=2)
    rows_per_row_group: int = flag(256, "the unit a loader worker reads and shuffles", low=1)
    tokenizer_name_or_path: str = field(default=None, metadata={"help": "default: the project's corpus BPE"})
    vocab_size: int = flag(4096, low=256)
    cache_dir: str = data.DEFAULT_CACHE_DIR
    overwrite_output_dir: bool = False


@dataclass
class TrainArgs:
    """Training's own flags; the core TrainingArguments ones come from common/args.py."""

    data_dir: str = field(default=None, metadata={"help": "the prepare step's --output_dir"})
    loader: str = field(default="parquet", metadata={"help": "parquet (row groups per rank) or datasets (streaming)"})
    model_config: str = field(default="debug", metadata={"help": f"preset: {', '.join(models.PRESETS)}"})
    # DataLoader (transformers.TrainingArguments names)
    dataloader_num_workers: int = flag(2, low=0)
    dataloader_prefetch_factor: int = flag(4, "batches queued per worker", low=1)
    dataloader_persistent_workers: bool = True
    dataloader_pin_memory: bool = field(default=True, metadata={"help": "applies only where a GPU exists"})
    shuffle_buffer_size: int = flag(1024, "--loader datasets: rows in the shuffle buffer", low=1)
    loader_benchmark_batches: int = flag(40, "batches timed for the loader alone", low=1)
    verify_checksums: bool = field(default=True, metadata={"help": "SHA-256 of each own shard against the manifest"})
    record_sample_ids: bool = field(default=False, metadata={"help": "each rank writes the block ids it trained on"})
    ddp_timeout: int = flag(1800, "collective timeout in seconds", low=1)


# Training's defaults for core flags (the rest keep common/args.py's).
TRAIN_DEFAULTS = dict(output_dir="runs/sharded_data", per_device_train_batch_size=8, learning_rate=1e-3,
                      weight_decay=0.1, max_steps=30, logging_steps=5)


def parse_prepare_args(argv: list[str]) -> PrepareArgs:
    """The prepare step's flags; an unknown, malformed or out-of-range one exits with one `error:` line."""
    return parse_flags((PrepareArgs,), argv, description="sharded_data.py prepare: tokenize the bundled corpus "
                       "once and write parquet shards and manifest.json into --output_dir (training: "
                       "sharded_data.py --help)")[0][0]


# ---------------------------------------------------------------------------------------------
# Prepare: tokenize once, write the shards, write the manifest last (its presence = complete set).
# ---------------------------------------------------------------------------------------------
def prepare(args: PrepareArgs) -> None:
    """Write `shard_{i:04d}.parquet` (columns `input_ids`: fixed-size list of uint16 [block_size],
    `block_id`: int64) and `manifest.json` into `args.output_dir`.

    Raises:
        Stop: bad flags, or an existing manifest without --overwrite_output_dir.
    """
    if not args.output_dir:
        raise Stop("prepare needs --output_dir")
    out = Path(args.output_dir)
    if (out / MANIFEST).exists() and not args.overwrite_output_dir:
        raise Stop(f"{out / MANIFEST} exists; pass --overwrite_output_dir to replace the shards")
    make_output_dir(str(out))
    for old in [out / MANIFEST, *out.glob("shard_*.parquet")]:
        old.unlink(missing_ok=True)  # no stale shard of an earlier, larger set may survive
    # The LM recipe's tokenizer and packing (cached): blocks of block_size tokens, eos between works.
    raw = data.load_text_dataset()
    tokenizer = data.get_tokenizer(args.tokenizer_name_or_path, raw, args.vocab_size, args.cache_dir)
    packed = data.pack_dataset(raw, tokenizer, args.block_size, args.cache_dir).with_format("numpy")
    base = np.concatenate([packed[s]["input_ids"][:] for s in ("train", "validation")])  # [n_base, block_size]
    dtype = np.uint16 if len(tokenizer) <= 2**16 else np.int32  # half the bytes for vocabularies < 65,536
    n_blocks = len(base) * args.repeat if args.max_blocks is None else min(args.max_blocks, len(base) * args.repeat)
    per_shard = n_blocks // args.num_shards
    if per_shard == 0:
        raise Stop(f"{n_blocks} blocks cannot fill {args.num_shards} shards")
    corpus_bytes = sum(len(t) for s in ("train", "validation") for t in raw[s]["text"])
    text_bytes = corpus_bytes * n_blocks // len(base)  # the text the blocks hold (pro rata under --max_blocks)
    shards = []
    for i in range(args.num_shards):
        path, ids = out / f"shard_{i:04d}.parquet", np.arange(i, per_shard * args.num_shards, args.num_shards)
        with pq.ParquetWriter(path, pa.schema([("input_ids", pa.list_(pa.from_numpy_dtype(dtype), args.block_size)),
                                               ("block_id", pa.int64())])) as writer:
            for start in range(0, per_shard, args.rows_per_row_group):  # one row group per write
                chunk = ids[start:start + args.rows_per_row_group]
                tokens = pa.array(base[chunk % len(base)].astype(dtype).ravel())  # block b = base block b mod n_base
                writer.write_table(pa.table({"input_ids": pa.FixedSizeListArray.from_arrays(tokens, args.block_size),
                                             "block_id": chunk}))
        with open(path, "rb") as f:
            digest = hashlib.file_digest(f, "sha256").hexdigest()
        shards.append({"name": path.name, "rows": per_shard, "tokens": per_shard * args.block_size,
                       "bytes": path.stat().st_size, "sha256": digest})
    manifest = {"num_shards": args.num_shards, "block_size": args.block_size, "dtype": np.dtype(dtype).name,
                "tokenizer": {"name_or_path": tokenizer.name_or_path, "vocab_size": len(tokenizer),
                              "sha256": hashlib.sha256(tokenizer.backend_tokenizer.to_str().encode()).hexdigest()},
                "source": f"bundled Shakespeare corpus x {args.repeat}", "text_bytes": text_bytes,
                "total_blocks": per_shard * args.num_shards, "dropped_blocks": n_blocks - per_shard * args.num_shards,
                "rows_per_row_group": args.rows_per_row_group, "shards": shards}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1, allow_nan=False))
    print(f"{args.num_shards} shards x {per_shard} blocks of {args.block_size} tokens "
          f"({text_bytes / 1e6:.1f} MB of text, {sum(s['bytes'] for s in shards) / 1e6:.1f} MB of parquet) in {out}")


# ---------------------------------------------------------------------------------------------
# Train-time checks: every rank validates the manifest before it touches any data.
# ---------------------------------------------------------------------------------------------
def own_shards(data_dir: str, world_size: int, rank: int, verify: bool,
               every_shard: bool = False) -> tuple[dict, list[Path]]:
    """Validate `{data_dir}/manifest.json` and return (manifest, paths of the shards `rank` owns).

    Shard i belongs to rank i % world_size. Presence, size, parquet footer, row count and (with
    `verify`) SHA-256 are checked for the rank's own shards, which only it reads (so a node-local
    folder may hold only its ranks' shards); with `every_shard`, every listed shard's presence too.

    Raises:
        FileNotFoundError: no manifest, or one of the rank's shards (with `every_shard`: any listed
            shard) is missing (names the file).
        ValueError: the shard count is not a multiple of `world_size`, or a shard is truncated,
            corrupt or does not match the manifest (names the file and the numbers).
    """
    root, manifest_path = Path(data_dir), Path(data_dir) / MANIFEST
    if not manifest_path.is_file():
        raise FileNotFoundError(f"{manifest_path} not found: run `python recipes/sharded_data.py prepare "
                                f"--output_dir {data_dir} --num_shards {world_size}` first")
    manifest = json.loads(manifest_path.read_text())
    n = manifest["num_shards"]
    if n != len(manifest["shards"]):
        raise ValueError(f"{manifest_path} says num_shards={n} but lists {len(manifest['shards'])} shards")
    if n % world_size:
        raise ValueError(f"{manifest_path} lists {n} shards for a world size of {world_size}: shard i belongs to "
                         f"rank i % world_size, so the shard count must be a multiple of {world_size} (re-run "
                         f"prepare with --num_shards {world_size * max(1, round(n / world_size))})")
    mine = []
    for i, shard in enumerate(manifest["shards"]):
        path = root / shard["name"]
        if i % world_size != rank and not every_shard:
            continue
        if not path.is_file():
            raise FileNotFoundError(f"missing shard {path}: shard {i} of the {n} listed in {manifest_path}")
        if i % world_size != rank:
            continue
        if path.stat().st_size != shard["bytes"]:
            raise ValueError(f"corrupt shard {path}: {path.stat().st_size} bytes, the manifest says {shard['bytes']}")
        if verify:
            with open(path, "rb") as f:
                digest = hashlib.file_digest(f, "sha256").hexdigest()
            if digest != shard["sha256"]:
                raise ValueError(f"corrupt shard {path}: SHA-256 {digest[:16]}... differs from the manifest's "
                                 f"{shard['sha256'][:16]}...; re-run prepare")
        try:
            rows = pq.read_metadata(path).num_rows
        except (pa.ArrowException, OSError) as e:
            raise ValueError(f"corrupt parquet file {path}: {e}") from None
        if rows != shard["rows"]:
            raise ValueError(f"corrupt shard {path}: {rows} rows, the manifest says {shard['rows']}")
        mine.append(path)
    return manifest, mine


class RankShards(torch.utils.data.IterableDataset):
    """Batches from this rank's shards, read one row group at a time.

    Yields dicts: `input_ids` int64 [batch_size, block_size] and `block_id` int64 [batch_size].
    Each epoch a seeded permutation (seed, epoch, rank) of the (file, row group) pairs is dealt
    round-robin to the DataLoader workers, and rows are shuffled inside each row group: a local
    shuffle whose reach is the row group, as in any streaming loader. Each worker drops its last
    partial batch of the epoch.
    """

    def __init__(self, paths: list[Path], batch_size: int, seed: int, rank: int):
        self.paths, self.batch_size, self.seed, self.rank = [str(p) for p in paths], batch_size, seed, rank
        self.units = [(f, g) for f, p in enumerate(self.paths) for g in range(pq.ParquetFile(p).num_row_groups)]
        # Shared memory: persistent DataLoader workers keep their own copy of this object and would
        # never see a plain attribute change (datasets' IterableDataset does the same for its epoch).
        self.epoch = torch.zeros((), dtype=torch.int64).share_memory_()

    def set_epoch(self, epoch: int) -> None:
        self.epoch.fill_(epoch)

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        worker, n_workers = (info.id, info.num_workers) if info else (0, 1)
        epoch = int(self.epoch)
        order = np.random.default_rng([self.seed, epoch, self.rank]).permutation(len(self.units))
        files, tokens, ids = {}, None, None
        for u in order[worker::n_workers]:
            f, g = self.units[u]
            if f not in files:  # not memory-mapped: every mapped page a worker had read stayed in its
                files[f] = pq.ParquetFile(self.paths[f], memory_map=False)  # resident set: +185 MB by 40k batches
            table = files[f].read_row_group(g)  # reads and decodes this row group only, freed once batched
            rows = np.random.default_rng([self.seed, epoch, self.rank, u]).permutation(table.num_rows)
            t = table.column("input_ids").combine_chunks().values.to_numpy().reshape(table.num_rows, -1)[rows]
            b = table.column("block_id").to_numpy()[rows]
            tokens, ids = (t, b) if tokens is None else (np.concatenate([tokens, t]), np.concatenate([ids, b]))
            while len(ids) >= self.batch_size:
                yield {"input_ids": torch.from_numpy(tokens[:self.batch_size].astype(np.int64)),
                       "block_id": torch.from_numpy(ids[:self.batch_size].copy())}
                tokens, ids = tokens[self.batch_size:], ids[self.batch_size:]


def leave_signals_to_the_rank(worker_id: int) -> None:
    """DataLoader worker init: ignore SIGTERM, SIGINT and SIGHUP. torchrun signals each rank's whole
    process group, and Ctrl-C the terminal's: a worker killed by one failed its rank's next batch
    before the rank could save. The rank saves at the next step, then shuts its workers down."""
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)


def datasets_route(manifest: dict, data_dir: str, rank: int, world_size: int, seed: int, buffer_size: int):
    """The same shards through `datasets`: streaming parquet, one shard per row group, split by node.

    Two `datasets` defaults made this route's memory grow with the corpus (15-fold at 1 GB) and
    its data wait reach 29%, measured with datasets 5.2 / pyarrow 26:
      * a shard was a whole file, and pyarrow's scanner (`Fragment.to_batches` with its threads,
        which `datasets` uses) reads ahead of a slower consumer whatever `batch_readahead=0` says:
        a 68 MB shard of the 1 GB corpus held 75 MB of Arrow memory after 40 batches of 256 rows,
        its whole decoded file (`ParquetFile.iter_batches` held under 1 MB). Each worker so held
        every file it had open, and `shuffle` keeps up to 10 open (`max_buffer_input_shards`).
        `reshard()` makes each row group a shard: the scanner cannot read past one row group;
      * interleaving several shards runs a thread per shard, and closing that iterator (a new
        epoch, or the loader benchmark's end) sleeps 5 s in every worker
        (`datasets.config.SLEEP_TIME_ON_THREADS_SHUTDOWN`, a pyarrow-crash workaround). With
        `max_buffer_input_shards=1` there are no threads: the row groups come one after another
        in a shuffled order, and the buffer shuffles rows across its `buffer_size` rows.
    strategy="shards" gives each rank whole row groups (never the "examples" fallback, where every
    rank would read every row and keep 1 in world_size). Unlike the parquet route, ownership is
    not fixed: `datasets` shuffles the row groups (seed + epoch, the same on every rank) before it
    deals them to ranks, so each epoch the ranks read disjoint row groups of every file. Fine on a
    shared filesystem; with node-local disks use the parquet route.

    Returns:
        A torch-formatted `datasets.IterableDataset` of rows: `input_ids` int64 [block_size],
        `block_id` int64; it has `set_epoch`.
    """
    from datasets import load_dataset
    from datasets.distributed import split_dataset_by_node

    files = [str(Path(data_dir) / s["name"]) for s in manifest["shards"]]
    stream = load_dataset("parquet", data_files=files, split="train", streaming=True).reshard()  # row groups
    stream = split_dataset_by_node(stream, rank=rank, world_size=world_size, strategy="shards")
    # row groups, then rows within a buffer; reseeded by set_epoch (a shared tensor: persistent workers see it)
    return stream.shuffle(seed=seed, buffer_size=buffer_size, max_buffer_input_shards=1).with_format("torch")


def main() -> int:
    if sys.argv[1:2] == ["prepare"]:
        return prepare(parse_prepare_args(sys.argv[2:]))
    args = parse_args(TrainArgs, description=__doc__, **TRAIN_DEFAULTS)  # one `error:` line for a bad flag or a non-empty --output_dir
    unsupported(args, "sharded_data.py",
                num_train_epochs="each rank streams its own shards, whose epochs differ in length: give --max_steps")
    if args.max_steps < 1:
        raise Stop("sharded_data.py needs --max_steps: each rank streams its own shards, whose epochs differ "
                   "in length, so --num_train_epochs cannot fix one step count for every rank")
    make_output_dir(args.output_dir)  # a file in the way or an impossible path: one error line, now
    if args.data_dir is None or args.loader not in ("parquet", "datasets"):
        raise Stop("training needs --data_dir (a prepared folder) and --loader parquet|datasets")
    startup = {"steps": args.max_steps}  # known before the data: every rank streams that many
    # >>> shared: accelerator
    # Library workarounds (common/workarounds.py) return the names of those applied
    applied = workarounds.die_with_launcher()  # a SIGKILLed launcher takes its workers with it
    # The launch against the flags and the hardware, before any work (common/checks.py lists
    # the checks): a DeepSpeed JSON's batch, clipping or precision would win over the flags, ...
    guard = checks.Startup(args, **startup)
    accelerator = Accelerator(
        mixed_precision=guard.precision["used"],
        # we fetch whole accumulation windows: sync on the step count, not the loader's end
        gradient_accumulation_plugin=GradientAccumulationPlugin(
            num_steps=args.gradient_accumulation_steps, sync_with_dataloader=False),
        # non_blocking: batches go to the GPU from pinned memory without waiting for the last step
        dataloader_config=DataLoaderConfiguration(
            use_seedable_sampler=True, data_seed=args.seed, non_blocking=True),
        step_scheduler_with_optimizer=False,  # one LR step per optimizer step, on any world size
        log_with=None if args.report_to == "none" else args.report_to,
        project_dir=args.output_dir,
        kwargs_handlers=guard.handlers,
    )
    guard.accelerator_built(accelerator, args)  # really distributed; this job's output dir
    # Startup's (real gloo ranks on a CPU-only host), then a GradScaler for fp16 on CPU ranks
    # and FSDP's gradient reduction in fp32
    applied += guard.workarounds + workarounds.accelerator_built(accelerator)
    set_seed(args.seed)  # the same seed on every rank: identical initial weights, no broadcast
    world_size = accelerator.num_processes
    global_batch = args.per_device_train_batch_size * args.gradient_accumulation_steps * world_size
    # <<< shared
    rank, device = accelerator.process_index, accelerator.device
    accumulation = args.gradient_accumulation_steps

    # -----------------------------------------------------------------------------------------
    # Data: this rank's shards only, through a DataLoader that overlaps reading with compute.
    # -----------------------------------------------------------------------------------------
    # Each rank checks its own manifest and shards (a node-local folder holds only its ranks' shards;
    # the datasets route re-deals every file each epoch, so it needs them all), then all ranks
    # compare: one rank's bad shard, or a node whose manifest differs, stops every rank alike.
    manifest_path, error = Path(args.data_dir) / MANIFEST, None
    try:
        manifest, paths = own_shards(args.data_dir, world_size, rank, args.verify_checksums,
                                     every_shard=args.loader == "datasets")
    except (FileNotFoundError, ValueError) as err:  # (a library's as well as our own)
        error = f"rank {rank}: {err}"
    if error := next(filter(None, gather_object([error])), None):
        raise Stop(error)
    manifest_sha256 = hashlib.sha256(manifest_path.read_bytes()).hexdigest()
    if error := checks.rank_mismatch(accelerator, f"shard manifest {manifest_path}", manifest_sha256[:16]):
        raise Stop(error)
    block_size, batch = manifest["block_size"], args.per_device_train_batch_size
    if args.loader == "parquet":
        dataset = RankShards(paths, batch, args.seed, rank)
        loader_batch = None  # the dataset yields whole batches
    else:
        dataset = datasets_route(manifest, args.data_dir, rank, world_size, args.seed, args.shuffle_buffer_size)
        loader_batch = batch
    workers = args.dataloader_num_workers
    loader = torch.utils.data.DataLoader(
        dataset, batch_size=loader_batch, drop_last=loader_batch is not None, num_workers=workers,
        pin_memory=args.dataloader_pin_memory and device.type == "cuda",  # page-locked: async host-to-GPU copies
        prefetch_factor=args.dataloader_prefetch_factor if workers else None,  # batches queued per worker
        persistent_workers=args.dataloader_persistent_workers and workers > 0,  # no re-fork every epoch
        generator=torch.Generator(),  # iter() draws its seed here, not from the global RNG a resume restores
        worker_init_fn=leave_signals_to_the_rank)

    def epochs(epoch: int, done: int):
        """(epoch, batches of it consumed, batch) forever, from `done` batches into `epoch`; a new permutation
        (set_epoch) whenever the loader runs dry. The order is a function of (--seed, epoch, rank), so a
        resume re-creates its epoch and reads and discards the `done` batches already trained on: no loader
        state to save, for up to one epoch of this rank's shards read (not trained on) at loader speed."""
        while True:
            dataset.set_epoch(epoch)
            n = 0
            for n, b in enumerate(loader, 1):
                if n > done:
                    yield epoch, n, {"input_ids": b["input_ids"].long().to(device, non_blocking=True),
                                     "block_id": b["block_id"]}
            if n == 0:
                raise ValueError(f"rank {rank}: shards {[p.name for p in paths]} hold less than one batch of {batch} "
                                 f"per loader worker ({workers}); prepare more blocks or lower the batch size")
            epoch, done = epoch + 1, 0

    # -----------------------------------------------------------------------------------------
    # Model, and accelerator.prepare for the model, optimizer and LR schedule (the loader stays ours).
    # -----------------------------------------------------------------------------------------
    config = models.llama_config(args.model_config, vocab_size=manifest["tokenizer"]["vocab_size"])
    if block_size > config.max_position_embeddings:
        raise Stop(f"the shards' block size {block_size} exceeds --model_config {args.model_config}'s "
                   f"max_position_embeddings {config.max_position_embeddings}")
    # With the model config: the FSDP wrap class against the model, a ZeRO-3 config against the plan.
    guard.check(flags={**guard.facts["flags"], "block_size": block_size}, model_cls=LlamaForCausalLM,
                model_config=config)
    set_seed(args.seed)  # same initial weights on every rank
    model = LlamaForCausalLM(config)
    # From here each rank draws its own random numbers (dropout, if a config has any). The data
    # order does not use them: RankShards seeds its own generators with (--seed, epoch, rank), and
    # the datasets route shuffles with --seed + epoch.
    set_seed(args.seed, device_specific=True)
    model.config.use_cache = False
    # Decay on weight matrices and embeddings only: a norm's gain is centred on 1, not 0.
    optimizer = torch.optim.AdamW(models.param_groups(model, args.weight_decay), lr=args.learning_rate,
                                  betas=(0.9, 0.95))
    accelerator.print("AdamW weight decay: " + ", ".join(
        f"{g['weight_decay']:g} on {len(g['params'])} tensors "
        f"({sum(getattr(p, 'ds_numel', p.numel()) for p in g['params']):,} elements)" for g in optimizer.param_groups))
    lr_scheduler = get_constant_schedule_with_warmup(optimizer, args.warmup_steps)  # linear warmup, then constant
    if accelerator.distributed_type == DistributedType.DEEPSPEED:  # it cannot read the micro batch off a loader
        accelerator.state.deepspeed_plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = batch
    model, optimizer, lr_scheduler = accelerator.prepare(model, optimizer, lr_scheduler)
    workarounds.prepared(accelerator, model)  # autocast stays; no unread fp32 copy of the logits
    # Resume only into the same run: what fixes each rank's data order (its shards: the world size;
    # the manifest, seed, loader, workers, batch) and what the optimizer state would bring back.
    run_state = {"distributed_type": checkpoint.strategy_name(accelerator), "world_size": world_size, "seed": args.seed,
                 "global_batch": global_batch, "per_device_train_batch_size": batch,
                 "loader": args.loader, "dataloader_num_workers": workers,
                 "shuffle_buffer_size": args.shuffle_buffer_size, "block_size": block_size,
                 "manifest_sha256": manifest_sha256,
                 "model_config": models.config_state(config), "learning_rate": args.learning_rate,
                 "weight_decay": args.weight_decay, "warmup_steps": args.warmup_steps,
                 "max_grad_norm": args.max_grad_norm, **checkpoint.precision_state(accelerator),
                 "max_steps": args.max_steps}  # (not compared: a resume may train longer; see resume_error)
    try:
        resume_path, saved = checkpoint.resolve_checkpoint(args.output_dir, args.resume_from_checkpoint, accelerator)
    except Stop as err:
        raise Stop(f"cannot resume: {err}") from None
    if resume_path:
        if error := checkpoint.resume_error(resume_path, saved, run_state, list(run_state)):  # all of it must match
            raise Stop(error)
        # model, optimizer, scheduler, scaler, RNG; the micro-step count follows the step
        checkpoint.load_checkpoint(accelerator, resume_path, model, optimizer, optimizer_steps=saved["step"])
        accelerator.print(f"resumed from {resume_path} at step {saved['step']}"
                          + (f" ({note})" if (note := checkpoint.restart_note()) else ""))
    else:
        checkpoint.start_fresh(accelerator, args.output_dir)  # an overwritten run's checkpoints must not be resumed
    accelerator.print(f"{str(accelerator.distributed_type).split('.')[-1]} x{world_size} | {args.loader} loader | "
                      f"{len(paths)} shard(s) per rank | {manifest['text_bytes'] / 1e6:.1f} MB corpus | "
                      f"{workers} workers | batch {batch} x {block_size} tokens x {accumulation} accumulation per rank"
                      f" | {accelerator.mixed_precision}")
    metrics_path = os.path.join(args.output_dir, "metrics.jsonl")
    if accelerator.is_main_process:  # a resume keeps the step lines up to its step; a fresh run starts the file
        kept = [line for line in open(metrics_path) if not json.loads(line).get("summary") and
                json.loads(line)["step"] <= saved["step"]] if resume_path and os.path.exists(metrics_path) else []
        with open(metrics_path, "w") as f:
            f.writelines(kept)
    accelerator.init_trackers("sharded_data", config={k: v for k, v in vars(args).items() if v is not None})

    # 1. The loader alone: tokens/s it delivers with nothing else running (start-up excluded).
    stream = iter(loader)
    next(stream)
    t0, n = time.perf_counter(), 0
    for n, _ in enumerate(stream, 1):
        if n == args.loader_benchmark_batches:
            break
    loader_tps = n * batch * block_size / (time.perf_counter() - t0)
    del stream

    # 2. Training: what one step consumes, and how long the step waits for data. GPU work is
    # asynchronous: no per-step synchronize (it would stall the host every step); the step time is
    # the loop's wall time, the queued GPU work included at the end, less the waits and the saves.
    model.train()
    seen, wait_s, save_s, start, t_loop = {}, 0.0, 0.0, saved["step"], time.perf_counter()
    # fp16 bookkeeping the scaler does not keep, and this rank's data position: from COMPLETE.json
    skipped_steps, skipped_in_a_row = saved.get("skipped_steps", 0), saved.get("skipped_in_a_row", 0)
    epoch, done = saved.get("data_position", [[0, 0]] * world_size)[rank]
    batches = epochs(epoch, done)

    def teardown():
        """launch.teardown, after this function's own references and the loader's iterator."""
        nonlocal model, optimizer
        batches.close()  # release the loader's iterator (and its workers' queues)
        del model, optimizer
        launch.teardown(accelerator)  # in order: the model before the process group

    # SIGTERM (preemption, a time limit), Ctrl-C or SIGHUP: save a checkpoint at the next step boundary.
    preempted = checkpoint.stop_on_signal(accelerator, args.ddp_timeout)
    guard = precision.NonFiniteGuard(accelerator, model)  # an inf/NaN loss or norm outside fp16 loss scaling stops the run
    for step in range(start + 1, args.max_steps + 1):
        lr = lr_scheduler.get_last_lr()[0]  # the LR this optimizer step applies
        window_loss = torch.zeros((), device=device)
        for _ in range(accumulation):
            t0 = time.perf_counter()
            epoch, done, b = next(batches)
            wait_s += time.perf_counter() - t0
            with accelerator.accumulate(model):  # backward divides the loss by the accumulation steps
                loss = model(input_ids=b["input_ids"], labels=b["input_ids"]).loss
                accelerator.backward(loss)  # under fp16: backward of loss x scale
                # >>> shared: step
                if accelerator.sync_gradients:  # the window's last micro batch
                    # the global norm in fp64: every strategy clips with the same number
                    norm_before_clip = grad_norm.clip_grad_norm_(accelerator, model,
                                                                 args.max_grad_norm)
                optimizer.step()  # no-op until the window's last micro batch; fp16 may skip
                if accelerator.sync_gradients and not accelerator.optimizer_step_was_skipped:
                    lr_scheduler.step()  # a skipped step did not happen: the LR holds
                optimizer.zero_grad()
                # <<< shared
            window_loss += loss.detach() / accumulation
            if args.record_sample_ids:  # kept as tensors: no value is read in an ordinary step
                seen.setdefault(epoch, []).append(b["block_id"])
        guard.record(step, window_loss, norm_before_clip)  # on the device: read at logging and saving steps
        skipped = accelerator.optimizer_step_was_skipped
        skipped_steps, skipped_in_a_row = skipped_steps + skipped, skipped_in_a_row + 1 if skipped else 0
        scale = precision.loss_scale(accelerator, model)  # None unless fp16 loss scaling is on
        # the same verdict on every rank: the scale and the skips are the same everywhere
        warning, scale_error = precision.loss_scale_verdict(scale, skipped_in_a_row)
        if warning and accelerator.is_main_process:
            print(f"step {step}: {warning}", file=sys.stderr, flush=True)
        if step % args.logging_steps == 0 or step == args.max_steps:
            record = {"step": step, "epoch": epoch,
                      "loss": accelerator.reduce(window_loss, reduction="mean").item(), "lr": lr,
                      "grad_norm": float(norm_before_clip),  # on the device until now: no sync elsewhere
                      **({"loss_scale": scale, "skipped_steps": skipped_steps} if scale is not None else {})}
            accelerator.print(f"step {step} | epoch {epoch} | loss {record['loss']:.3f} | lr {lr:.3g}" + (
                f" | loss scale {scale:g} | skipped steps {skipped_steps}" if scale is not None else ""))
            accelerator.log(record, step=step)
            if accelerator.is_main_process:
                metrics.append_jsonl(metrics_path, record)  # strict JSON: inf/NaN -> null, named in "nonfinite"
        preempt = preempted()  # a collective: every rank stops at the same step (a signal name, or None)
        save = preempt or (args.save_steps and step % args.save_steps == 0)
        # a non-finite loss or norm stops before any checkpoint or export of its weights
        problem = f"step {step}: {scale_error}" if scale_error else (
            (save or step == args.max_steps or step % args.logging_steps == 0) and guard.problem())
        if save and not problem:
            t_save = time.perf_counter()
            saved_to = checkpoint.save_checkpoint(accelerator, args.output_dir, step, run_state={
                **run_state, "skipped_steps": skipped_steps, "skipped_in_a_row": skipped_in_a_row,
                # every rank's own [epoch, batches consumed in it] (epochs differ in length per rank)
                "data_position": gather_object([[epoch, done]])})
            save_s += time.perf_counter() - t_save
        if problem or preempt:
            if not problem:
                accelerator.print(f"preempted ({preempt}) at step {step}: saved {saved_to}; "
                                  "relaunch with --resume_from_checkpoint auto to continue")
            teardown()
            if problem:
                raise Stop(problem)
            return checkpoint.PREEMPTED_EXIT_CODE

    if device.type == "cuda":
        torch.cuda.synchronize(device)  # the GPU work still queued belongs to the steps
    compute_s = time.perf_counter() - t_loop - wait_s - save_s

    # 3. Resident memory now, with the persistent workers still alive. RSS counts pages a forked
    # worker still shares with its parent (libraries, torch); USS counts only the pages a process
    # alone holds, so the workers' cost is their USS.
    gc.collect()
    workarounds.trim_malloc_heap()  # glibc keeps freed heap pages: RSS then counts what is live
    me = psutil.Process()
    kids = [p.memory_full_info().uss for p in me.children(recursive=True) if p.is_running()]
    step_tps = (args.max_steps - start) * accumulation * batch * block_size / compute_s \
        if compute_s and args.max_steps > start else float("nan")  # (a resume at the end of the run trains none)
    row = [rank, len(paths), loader_tps, step_tps, loader_tps / step_tps, wait_s / (wait_s + compute_s or float("nan")),
           me.memory_info().rss, me.memory_full_info().uss, sum(kids), len(kids)]
    table = accelerator.gather(torch.tensor([row], dtype=torch.float64, device=device)).cpu().tolist()
    if args.record_sample_ids:  # one file per rank, each written by its own rank only
        os.makedirs(os.path.join(args.output_dir, "sample_ids"), exist_ok=True)
        with open(os.path.join(args.output_dir, "sample_ids", f"rank{rank}.json"), "w") as f:
            epochs = [torch.cat(seen[e]).tolist() if e in seen else [] for e in range(max(seen, default=-1) + 1)]
            json.dump({"rank": rank, "world_size": world_size, "epochs": epochs,  # (a resume starts in a later epoch)
                       "shards": [p.name for p in paths] if args.loader == "parquet" else None}, f, allow_nan=False)
    if accelerator.is_main_process:
        keys = ["rank", "shards", "loader_tokens_per_second", "step_tokens_per_second", "loader_to_step_ratio",
                "data_wait_share", "rss_bytes", "uss_bytes", "workers_uss_bytes", "workers"]
        per_rank = [metrics.strict_json(dict(zip(keys, r))) for r in table]  # nested: strict one by one
        metrics.append_jsonl(metrics_path, {"summary": True, "step": args.max_steps, "loader": args.loader,
                                            "text_bytes": manifest["text_bytes"], "world_size": world_size,
                                            "precision": guard.precision, "per_rank": per_rank})
        print("\n| corpus | loader | rank | shards | loader tokens/s | step tokens/s | loader/step | data wait "
              "| rank RSS MiB | rank USS MiB | workers USS MiB |\n|---|---|---|---|---|---|---|---|---|---|---|")
        for r in per_rank:
            print(f"| {manifest['text_bytes'] / 1e6:.0f} MB | {args.loader} | {r['rank']:.0f} | {r['shards']:.0f} "
                  f"| {r['loader_tokens_per_second']:,.0f} | {r['step_tokens_per_second']:,.0f} "
                  f"| {r['loader_to_step_ratio']:.0f} | {r['data_wait_share']:.1%} | {r['rss_bytes'] / 2**20:.0f} "
                  f"| {r['uss_bytes'] / 2**20:.0f} | {r['workers_uss_bytes'] / 2**20:.0f} ({r['workers']:.0f}) |")
    teardown()
    accelerator.print(metrics.final_line(metrics_path, f"metrics in {metrics_path}"))
    return 0


if __name__ == "__main__":  # the guard keeps spawned DataLoader workers from re-running main()
    errors.run(main)
