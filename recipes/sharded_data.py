"""Data that never starves the ranks: tokenized parquet shards, each rank reads only its own.

    python recipes/sharded_data.py prepare --output_dir data_shards --num_shards 4
    accelerate launch --config_file accelerate_configs/ddp.yaml \
        recipes/sharded_data.py --data_dir data_shards [--loader datasets]
    accelerate launch --config_file accelerate_configs/fsdp.yaml \
        recipes/sharded_data.py --data_dir data_shards
    python recipes/sharded_data.py prepare --output_dir /tmp/shards_1gb --num_shards 8 --repeat 200

`prepare` (one process) tokenizes the bundled corpus once into `shard_{i:04d}.parquet` files and
`manifest.json` (--repeat 200: ~1 GB of text). Training: shard i belongs to rank i % world_size;
each rank checks its own shards and streams them one row group at a time, so its memory stays
flat as the corpus grows (`--loader datasets`: the same with `datasets` streaming). The loader is
not passed to `accelerator.prepare` (no "already sharded" switch): each rank iterates its own.
It trains the `debug` Llama for --max_steps (--num_train_epochs is refused: each rank's epoch has
its own length) and prints, per rank, the loader's tokens/s alone against a step's, and the
memory of the rank and its workers. --save_steps, --resume_from_checkpoint: as in llama.py.
Outputs: metrics.jsonl (steps, then a summary with the table), checkpoint-N/, sample_ids/.
Depth (shards, resume, the `datasets` route, measurements): docs/sharded_data.md.
To change the data, model or loss, find the `# ADAPT:` markers.
"""

import gc
import hashlib
import sys
import time
from dataclasses import dataclass
from pathlib import Path

gc.collect()  # the process's earlier garbage (a notebook's), before imports_done freezes
gc.disable()  # the imports below run without it: launch.imports_done()
import numpy as np
import pyarrow.parquet as pq
import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, DistributedType, GradientAccumulationPlugin
from accelerate.utils import gather_object, set_seed
from datasets import load_dataset
from datasets.distributed import split_dataset_by_node
from transformers import LlamaForCausalLM, get_constant_schedule_with_warmup

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere, no install
from common import checkpoint, checks, data, errors, grad_norm, launch, run_dir
from common import metrics, models, precision, workarounds
from common.args import flag, make_output_dir, parse_args, parse_flags
from common.data import SHARD_MANIFEST, own_shards
from common.errors import Stop

launch.imports_done()  # garbage collection back on, the imports' objects frozen


@dataclass
class PrepareArgs:
    output_dir: str = flag(None, "folder for the shards and manifest.json")
    num_shards: int = flag(2, "a multiple of the world size you will train with", low=1)
    repeat: int = flag(1, "repeat the corpus K times (bigger corpora for measurements)", low=1)
    max_blocks: int = flag(None, "keep only the first N blocks (quick tests)", low=1)
    block_size: int = flag(256, low=2)
    rows_per_row_group: int = flag(256, "the unit a loader worker reads and shuffles", low=1)
    tokenizer_name_or_path: str = flag(None, "default: the project's corpus BPE")
    vocab_size: int = flag(4096, low=256)
    cache_dir: str = data.DEFAULT_CACHE_DIR
    overwrite_output_dir: bool = False


@dataclass
class TrainArgs:
    """Training's own flags; the core TrainingArguments ones come from common/args.py."""

    data_dir: str = flag(None, "the prepare step's --output_dir")
    loader: str = flag("parquet", "parquet (row groups per rank) or datasets (streaming)")
    model_config: str = flag("debug", f"preset: {', '.join(models.PRESETS)}")
    # DataLoader (transformers.TrainingArguments names)
    dataloader_num_workers: int = flag(2, low=0)
    dataloader_prefetch_factor: int = flag(4, "batches queued per worker", low=1)
    dataloader_persistent_workers: bool = True
    dataloader_pin_memory: bool = flag(True, "applies only where a GPU exists")
    shuffle_buffer_size: int = flag(1024, "--loader datasets: rows in the shuffle buffer", low=1)
    loader_benchmark_batches: int = flag(40, "batches timed for the loader alone", low=1)
    verify_checksums: bool = flag(True, "SHA-256 of each own shard against the manifest")
    record_sample_ids: bool = flag(False, "each rank writes the block ids it trained on")
    ddp_timeout: int = flag(1800, "collective timeout in seconds", low=1)


TRAIN_DEFAULTS = dict(
    output_dir="runs/sharded_data",
    per_device_train_batch_size=8,
    learning_rate=1e-3,
    weight_decay=0.1,
    max_steps=30,
    logging_steps=5,
)


def parse_prepare_args(argv: list[str]) -> PrepareArgs:
    """The prepare step's flags; a bad one exits with one `error:` line."""
    return parse_flags(
        (PrepareArgs,),
        argv,
        description="sharded_data.py prepare: tokenize the "
        "bundled corpus once and write parquet shards and manifest.json into "
        "--output_dir (training: sharded_data.py --help)",
    )[0][0]


def prepare(args: PrepareArgs) -> None:
    """Tokenize the bundled corpus once; write the shards, then manifest.json (common/data.py)."""
    data.write_shards(args)


# The two loaders: this rank's own row groups (parquet), or `datasets` streaming.
class RankShards(torch.utils.data.IterableDataset):
    """Batches from this rank's shards, read one row group at a time.

    Yields dicts: `input_ids` int64 [batch_size, block_size] and `block_id` int64 [batch_size].
    Each epoch a seeded permutation (seed, epoch, rank) of the (file, row group) pairs is dealt
    round-robin to the DataLoader workers, and rows are shuffled inside each row group (a local
    shuffle, as in any streaming loader). Each worker drops its last partial batch of the epoch.
    """

    def __init__(self, paths: list[Path], batch_size: int, seed: int, rank: int):
        self.paths, self.batch_size = [str(p) for p in paths], batch_size
        self.seed, self.rank = seed, rank
        self.units = [
            (f, g)
            for f, p in enumerate(self.paths)
            for g in range(pq.ParquetFile(p).num_row_groups)
        ]
        # Shared memory: persistent DataLoader workers keep their own copy of this object and
        # would never see a plain attribute change (datasets' IterableDataset does the same).
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
            if f not in files:  # not memory-mapped: every mapped page a worker read stays resident
                files[f] = pq.ParquetFile(self.paths[f], memory_map=False)
            table = files[f].read_row_group(g)  # this row group only, freed once batched
            rows = np.random.default_rng([self.seed, epoch, self.rank, u]).permutation(len(table))
            t = table.column("input_ids").combine_chunks().values.to_numpy()
            t, b = t.reshape(len(table), -1)[rows], table.column("block_id").to_numpy()[rows]
            tokens, ids = (
                (t, b)
                if tokens is None
                else (np.concatenate([tokens, t]), np.concatenate([ids, b]))
            )
            while len(ids) >= self.batch_size:
                yield {
                    "input_ids": torch.from_numpy(tokens[: self.batch_size].astype(np.int64)),
                    "block_id": torch.from_numpy(ids[: self.batch_size].copy()),
                }
                tokens, ids = tokens[self.batch_size :], ids[self.batch_size :]


def datasets_route(
    manifest: dict, data_dir: str, rank: int, world_size: int, seed: int, buffer_size: int
):
    """The same shards through `datasets` streaming: a torch-formatted IterableDataset of rows
    (`input_ids` int64 [block_size], `block_id` int64) with `set_epoch`. `reshard()` makes each row
    group a shard, and `max_buffer_input_shards=1` reads them one after another: with the defaults,
    memory grows with the corpus and each epoch's end stalls 5 s
    (docs/sharded_data.md#the-datasets-route). strategy="shards" deals whole row groups to ranks
    (the "examples" fallback would have every rank read every row and keep 1 in world_size),
    re-dealt every epoch (seed + epoch): this route needs every shard on every node.
    """
    files = [str(Path(data_dir) / s["name"]) for s in manifest["shards"]]
    stream = load_dataset("parquet", data_files=files, split="train", streaming=True).reshard()
    stream = split_dataset_by_node(stream, rank=rank, world_size=world_size, strategy="shards")
    # row groups, then rows within a buffer; reseeded by set_epoch (shared with persistent workers)
    return stream.shuffle(
        seed=seed, buffer_size=buffer_size, max_buffer_input_shards=1
    ).with_format("torch")


def main() -> int:
    if sys.argv[1:2] == ["prepare"]:
        return prepare(parse_prepare_args(sys.argv[2:]))
    args = parse_args(TrainArgs, description=__doc__, **TRAIN_DEFAULTS)  # bad flag: an error line
    checks.sharded_data_flags(args)  # --max_steps, not --num_train_epochs
    make_output_dir(args.output_dir)  # a file in the way or an impossible path: one error line, now
    if args.data_dir is None or args.loader not in ("parquet", "datasets"):
        raise Stop("training needs --data_dir (a prepared folder) and --loader parquet|datasets")
    startup = {"steps": args.max_steps}  # known before the data: every rank streams that many
    handlers = []  # the Accelerator's kwargs_handlers besides the process group's
    # >>> shared: accelerator
    # Library workarounds (common/workarounds.py) return the names of those applied
    applied = workarounds.die_with_launcher()  # a SIGKILLed launcher takes its workers with it
    # The launch against the flags and the hardware, before any work (common/checks.py lists
    # the checks): a DeepSpeed JSON's batch, clipping or precision would win over the flags, ...
    guard = checks.Startup(args, **startup)
    group, patched = launch.process_group(args.ddp_timeout)  # timeout; gloo ranks on CPU
    accelerator = Accelerator(
        mixed_precision=guard.precision["used"],
        # we fetch whole accumulation windows: sync on the step count, not the loader's end
        gradient_accumulation_plugin=GradientAccumulationPlugin(
            num_steps=args.gradient_accumulation_steps, sync_with_dataloader=False
        ),
        # non_blocking: batches go to the GPU from pinned memory without waiting for the last step
        dataloader_config=DataLoaderConfiguration(
            use_seedable_sampler=True, data_seed=args.seed, non_blocking=True
        ),
        step_scheduler_with_optimizer=False,  # one LR step per optimizer step, on any world size
        log_with=None if args.report_to == "none" else args.report_to.split(","),
        project_dir=args.output_dir,
        kwargs_handlers=[group, *handlers],
    )
    launch.check_distributed(accelerator)  # distributed for real, as the launcher asked
    run_dir.claim(accelerator, args)  # this job's output dir: locked, one for every node
    # a GradScaler for fp16 on CPU ranks, FSDP's gradient reduction in fp32
    applied += patched + workarounds.patch_accelerator(accelerator)
    set_seed(args.seed)  # the same seed on every rank: identical initial weights, no broadcast
    world_size = launch.data_parallel_size(accelerator)  # tensor parallel: ranks / tp size
    global_batch = args.per_device_train_batch_size * args.gradient_accumulation_steps * world_size
    # <<< shared
    rank, device = accelerator.process_index, accelerator.device
    accumulation = args.gradient_accumulation_steps

    # -----------------------------------------------------------------------------------------
    # ADAPT: data. This rank's shards only, through a DataLoader that overlaps reading with compute.
    # -----------------------------------------------------------------------------------------
    # Each rank checks its own shards (the datasets route re-deals every file each epoch: all),
    # then all compare: one rank's bad shard, or a node whose manifest differs, stops every rank.
    manifest, paths = checks.stop_if_any_rank_fails(
        accelerator,
        own_shards,
        args.data_dir,
        world_size,
        rank,
        args.verify_checksums,
        every_shard=args.loader == "datasets",
    )
    manifest_path = Path(args.data_dir) / SHARD_MANIFEST
    manifest_sha256 = hashlib.sha256(manifest_path.read_bytes()).hexdigest()
    checks.same_on_every_rank(accelerator, f"shard manifest {manifest_path}", manifest_sha256[:16])
    block_size, batch = manifest["block_size"], args.per_device_train_batch_size
    dataset = (
        RankShards(paths, batch, args.seed, rank)
        if args.loader == "parquet"
        else datasets_route(
            manifest, args.data_dir, rank, world_size, args.seed, args.shuffle_buffer_size
        )
    )
    loader_batch = None if args.loader == "parquet" else batch  # RankShards yields whole batches
    workers = args.dataloader_num_workers
    # Not for accelerator.prepare: split_batches would slice each batch across the ranks, and
    # dispatch_batches (the default for iterable datasets) has rank 0 read everything.
    loader = torch.utils.data.DataLoader(
        dataset,
        batch_size=loader_batch,
        drop_last=loader_batch is not None,
        num_workers=workers,
        pin_memory=args.dataloader_pin_memory and device.type == "cuda",  # async copies to GPU
        prefetch_factor=args.dataloader_prefetch_factor if workers else None,
        persistent_workers=args.dataloader_persistent_workers and workers > 0,  # no re-forks
        generator=torch.Generator(),  # iter() seeds from here, not the RNG a resume restores
        worker_init_fn=data.leave_signals_to_the_rank,
    )  # the rank saves first, then stops them

    def epochs(epoch: int, done: int):
        """(epoch, batches of it consumed, batch) forever, from `done` batches into `epoch`. The
        order is a function of (--seed, epoch, rank): a resume re-creates its epoch and discards
        the `done` batches already trained on (no loader state to save)."""
        while True:
            dataset.set_epoch(epoch)
            n = 0
            for n, b in enumerate(loader, 1):
                if n > done:
                    yield (
                        epoch,
                        n,
                        {
                            "sample_id": b["block_id"],
                            "input_ids": b["input_ids"].long().to(device, non_blocking=True),
                        },
                    )
            if n == 0:
                raise ValueError(
                    f"rank {rank}: shards {[p.name for p in paths]} hold less than "
                    f"one batch of {batch} per loader worker ({workers}); prepare "
                    "more blocks or lower the batch size"
                )
            epoch, done = epoch + 1, 0

    # -----------------------------------------------------------------------------------------
    # ADAPT: model. Then accelerator.prepare: model, optimizer and LR schedule (not the loader).
    # -----------------------------------------------------------------------------------------
    config = models.llama_config(args.model_config, vocab_size=manifest["tokenizer"]["vocab_size"])
    if block_size > config.max_position_embeddings:
        raise Stop(
            f"the shards' block size {block_size} exceeds --model_config {args.model_config}"
            f"'s max_position_embeddings {config.max_position_embeddings}"
        )
    # With the model config: the FSDP wrap class against the model, ZeRO-3 against the plan.
    guard.check(
        flags={**guard.facts["flags"], "block_size": block_size},
        model_cls=LlamaForCausalLM,
        model_config=config,
    )
    set_seed(args.seed)  # same initial weights on every rank
    model = LlamaForCausalLM(config)
    # From here each rank draws its own random numbers (dropout); the data order does not use
    # them: RankShards seeds with (--seed, epoch, rank), the datasets route with --seed + epoch.
    set_seed(args.seed, device_specific=True)
    model.config.use_cache = False
    # Decay on weight matrices and embeddings only: a norm's gain is centred on 1, not 0.
    optimizer = torch.optim.AdamW(
        models.param_groups(model, args.weight_decay), lr=args.learning_rate, betas=(0.9, 0.95)
    )
    accelerator.print(metrics.weight_decay_line(optimizer))
    lr_scheduler = get_constant_schedule_with_warmup(optimizer, args.warmup_steps)  # then constant
    if accelerator.distributed_type == DistributedType.DEEPSPEED:  # it cannot see our loader
        ds_config = accelerator.state.deepspeed_plugin.deepspeed_config
        ds_config["train_micro_batch_size_per_gpu"] = batch
    model, optimizer, lr_scheduler = accelerator.prepare(model, optimizer, lr_scheduler)
    workarounds.patch_model(accelerator, model)  # autocast stays; no unread fp32 copy of the logits
    # Resume only into the same run: what fixes each rank's data order (its shards: the world size;
    # the manifest, seed, loader, workers, batch) and what the optimizer state would bring back.
    run_state = {
        "distributed_type": checkpoint.strategy_name(accelerator),
        "world_size": world_size,
        "seed": args.seed,
        "global_batch": global_batch,
        "per_device_train_batch_size": batch,
        "loader": args.loader,
        "dataloader_num_workers": workers,
        "shuffle_buffer_size": args.shuffle_buffer_size,
        "block_size": block_size,
        "manifest_sha256": manifest_sha256,
        "model_config": models.config_state(config),
        "learning_rate": args.learning_rate,
        "weight_decay": args.weight_decay,
        "warmup_steps": args.warmup_steps,
        "max_grad_norm": args.max_grad_norm,
        **checkpoint.precision_state(accelerator),
        "max_steps": args.max_steps,
    }  # (never compared: the LR is constant after warmup)
    resume_path, saved = checkpoint.resume_or_start(accelerator, args, run_state)  # all must match
    if resume_path:  # + scheduler, scaler, per-rank RNG; micro steps follow the step
        checkpoint.load_checkpoint(accelerator, resume_path, model, optimizer, saved["step"])
        accelerator.print(checkpoint.resumed_line(resume_path, saved["step"]))
    accelerator.print(
        f"{accelerator.distributed_type.name} x{world_size} | {args.loader} loader "
        f"| {len(paths)} shard(s) per rank | {manifest['text_bytes'] / 1e6:.1f} MB "
        f"corpus | {workers} workers | batch {batch} x {block_size} tokens x "
        f"{accumulation} accumulation per rank | {accelerator.mixed_precision}"
    )
    # metrics.jsonl (a resume keeps the step lines up to its step) and the trackers
    log = metrics.RunLog(accelerator, args, "sharded_data", saved["step"] if resume_path else None)

    # 1. The loader alone: tokens/s it delivers with nothing else running (start-up excluded).
    loader_tps = metrics.loader_tokens_per_second(
        loader, args.loader_benchmark_batches, batch * block_size
    )

    # 2. Training: what one step consumes, and how long the step waits for data. GPU work is
    # asynchronous: no per-step synchronize (it would stall the host every step); the step time is
    # the loop's wall time, the queued GPU work included at the end, less the waits and the saves.
    model.train()
    wait_s, save_s, start, t_loop = 0.0, 0.0, saved["step"], time.perf_counter()
    seen = metrics.SampleIds(args.record_sample_ids)  # ids stay tensors until the end
    # fp16 bookkeeping the scaler does not keep, and this rank's data position: from COMPLETE.json
    skipped_steps, in_a_row = saved.get("skipped_steps", 0), saved.get("skipped_in_a_row", 0)
    epoch, done = saved.get("data_position", [[0, 0]] * world_size)[rank]
    batches = epochs(epoch, done)

    def teardown():
        nonlocal model, optimizer
        batches.close()  # release the loader's iterator (and its workers' queues)
        del model, optimizer
        launch.teardown(accelerator)  # in order: the model before the process group

    # SIGTERM (preemption, a time limit), Ctrl-C or SIGHUP: save a checkpoint at the next step.
    preempted = checkpoint.stop_on_signal(accelerator, args.ddp_timeout)
    nonfinite = precision.NonFiniteGuard(accelerator, model)  # inf/NaN outside fp16 scaling stops
    for step in range(start + 1, args.max_steps + 1):
        lr = lr_scheduler.get_last_lr()[0]  # the LR this optimizer step applies
        window_loss = torch.zeros((), device=device)
        for _ in range(accumulation):
            t0 = time.perf_counter()
            epoch, done, b = next(batches)
            wait_s += time.perf_counter() - t0
            with accelerator.accumulate(model):  # backward divides the loss by the accumulation
                loss = model(input_ids=b["input_ids"], labels=b["input_ids"]).loss  # ADAPT: loss
                accelerator.backward(loss)  # under fp16: backward of loss x scale
                # >>> shared: step
                if accelerator.sync_gradients:  # the window's last micro batch
                    # the global norm in fp64: every strategy clips with the same number
                    norm_before_clip = grad_norm.clip_grad_norm_(
                        accelerator, model, args.max_grad_norm
                    )
                optimizer.step()  # no-op until the window's last micro batch; fp16 may skip
                if accelerator.sync_gradients and not accelerator.optimizer_step_was_skipped:
                    lr_scheduler.step()  # a skipped step did not happen: the LR holds
                optimizer.zero_grad()
                # <<< shared
            window_loss += loss.detach() / accumulation
            seen.take(epoch, [b])  # --record_sample_ids (an epoch may end inside a window)
        nonfinite.record(step, window_loss, norm_before_clip)  # on the device, read when logging
        skipped = accelerator.optimizer_step_was_skipped
        skipped_steps, in_a_row = skipped_steps + skipped, in_a_row + 1 if skipped else 0
        scale = precision.loss_scale(accelerator, model)  # None unless fp16 loss scaling is on
        # the same verdict on every rank: the scale and the skips are the same everywhere
        scale_error = precision.loss_scale_verdict(scale, in_a_row, step)
        if step % args.logging_steps == 0 or step == args.max_steps:
            fp16 = {} if scale is None else {"loss_scale": scale, "skipped_steps": skipped_steps}
            record = {
                "step": step,
                "epoch": epoch,  # the only host reads of the step
                "loss": accelerator.reduce(window_loss, reduction="mean").item(),
                "lr": lr,
                "grad_norm": float(norm_before_clip),
                **fp16,
            }
            accelerator.print(
                f"step {step} | epoch {epoch} | loss {record['loss']:.3f} "
                f"| lr {lr:.3g}"
                + (f" | loss scale {scale:g} | skipped steps {skipped_steps}" if fp16 else "")
            )
            log.log(record)  # strict JSON: inf/NaN -> null, named in "nonfinite"
        preempt = preempted()  # a collective: every rank stops at the same step (a signal, or None)
        save = preempt or (args.save_steps and step % args.save_steps == 0)
        # a non-finite loss or norm stops before any checkpoint or export of its weights
        problem = (
            f"step {step}: {scale_error}"
            if scale_error
            else (
                (save or step == args.max_steps or step % args.logging_steps == 0)
                and nonfinite.problem()
            )
        )
        if save and not problem:
            t_save = time.perf_counter()
            saved_to = checkpoint.save_checkpoint(
                accelerator,
                args.output_dir,
                step,
                run_state={
                    **run_state,
                    "skipped_steps": skipped_steps,
                    "skipped_in_a_row": in_a_row,
                    # every rank's own [epoch, batches consumed in it] (epochs differ in length)
                    "data_position": gather_object([[epoch, done]]),
                },
            )
            save_s += time.perf_counter() - t_save
        if problem or preempt:
            if not problem:
                accelerator.print(
                    f"preempted ({preempt}) at step {step}: saved {saved_to}; "
                    "relaunch with --resume_from_checkpoint auto to continue"
                )
            teardown()
            if problem:
                raise Stop(problem)
            return checkpoint.PREEMPTED_EXIT_CODE

    if device.type == "cuda":
        torch.cuda.synchronize(device)  # the GPU work still queued belongs to the steps
    compute_s = time.perf_counter() - t_loop - wait_s - save_s
    trained = (args.max_steps - start) * accumulation * batch * block_size  # 0: resumed at the end
    step_tps = trained / compute_s if compute_s and trained else float("nan")

    # 3. Live memory, with the persistent workers still alive: the rank's and its workers'.
    per_rank = metrics.gather_loader_rows(
        accelerator,
        [
            rank,
            len(paths),
            loader_tps,
            step_tps,
            loader_tps / step_tps,
            wait_s / (wait_s + compute_s or float("nan")),
        ],
    )  # + memory, every rank's row
    seen.write(
        accelerator,
        args.output_dir,  # --record_sample_ids: each rank its own file
        shards=[p.name for p in paths] if args.loader == "parquet" else None,
    )
    log.summary(
        {
            "step": args.max_steps,
            "loader": args.loader,
            "text_bytes": manifest["text_bytes"],
            "world_size": world_size,
            "precision": guard.precision,
            "per_rank": per_rank,
        }
    )
    accelerator.print(metrics.loader_table(per_rank, manifest["text_bytes"], args.loader))
    teardown()
    accelerator.print(log.final_line(f"metrics in {log.path}"))
    return 0


if __name__ == "__main__":  # the guard keeps spawned DataLoader workers from re-running main()
    errors.run(main)
