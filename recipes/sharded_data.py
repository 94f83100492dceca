r"""Data that never starves the ranks: tokenized parquet shards, each rank reads only its own.

    python tools/prepare_shards.py --output_dir data_shards --num_shards 4
    accelerate launch --config_file accelerate_configs/ddp.yaml recipes/sharded_data.py \
        --data_dir data_shards [--loader datasets]

recipes/llama.py, adapted: the diff between the two files is the lesson.
Shard i (tools/prepare_shards.py writes them) belongs to rank i % world_size, which checks it
and streams it one row group at a time (`--loader datasets`: through `datasets`): memory stays
flat as the corpus grows. Each rank's epochs have their own length: the run counts --max_steps.
Per rank, it prints the loader's tokens/s alone against a step's, and the memory of the rank
and its workers. More: docs/sharded_data.md.
To adapt the code, find the `# ADAPT:` markers: data, model, loss, export.
"""

import gc
import hashlib
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

gc.collect()  # the process's earlier garbage (a notebook's), before imports_done freezes
gc.disable()  # the imports below run without it: launch.imports_done()
import numpy as np
import psutil
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, GradientAccumulationPlugin, set_seed
from accelerate.utils import gather_object
from datasets import load_dataset
from datasets.distributed import split_dataset_by_node
from tqdm.auto import tqdm
from transformers import AutoTokenizer, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere, no install
from common import checkpoint, checks, errors, grad_norm, launch, run_dir
from common import metrics, models, precision, schedule, workarounds
from common.args import flag, make_output_dir, parse_args
from common.errors import Stop

launch.imports_done()  # garbage collection back on, the imports' objects frozen


@dataclass
class Args:
    """Flags of this recipe; common/args.py has the core ones."""

    data_dir: str = flag(None, "the folder tools/prepare_shards.py wrote")
    loader: str = flag("parquet", "parquet (row groups per rank) or datasets (streaming)")
    model_config: str = flag("debug", f"Llama preset: {', '.join(models.PRESETS)}")
    max_eval_samples: int = flag(None, "cap on validation blocks per eval; default: all", low=1)
    per_device_eval_batch_size: int = flag(None, "default: --per_device_train_batch_size", low=1)
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_epsilon: float = 1e-8
    eval_steps: int = flag(100, "evaluate every N optimizer steps, and at the end", low=1)
    save_total_limit: int = flag(None, "keep only the newest N complete checkpoints", low=1)
    peak_tflops: float = flag(None, "device peak for MFU; default from a GPU table")
    ddp_timeout: int = flag(1800, "collective timeout in seconds", low=1)
    record_sample_ids: bool = flag(False, "each rank writes the block ids it trained on")
    # DataLoader (transformers.TrainingArguments names)
    dataloader_prefetch_factor: int = flag(4, "batches queued per worker", low=1)
    dataloader_persistent_workers: bool = True
    dataloader_pin_memory: bool = flag(True, "applies only where a GPU exists")
    shuffle_buffer_size: int = flag(1024, "--loader datasets: rows in the shuffle buffer", low=1)
    loader_benchmark_batches: int = flag(40, "batches timed for the loader alone", low=1)
    verify_checksums: bool = flag(True, "SHA-256 of each own shard against the manifest")


def own_shards(
    data_dir: str, world_size: int, rank: int, verify: bool, every_shard: bool = False
) -> tuple[dict, list[Path]]:
    """(manifest.json, the shards `rank` owns: shard i is rank i % world_size's), its own shards
    and validation.parquet checked (`every_shard`: every shard there, for the datasets route)."""
    root, manifest_path = Path(data_dir), Path(data_dir) / "manifest.json"
    if not manifest_path.is_file():
        raise Stop(f"{manifest_path} not found: prepare it first (tools/prepare_shards.py)")
    manifest = json.loads(manifest_path.read_text())
    n = len(manifest["shards"])
    if n % world_size or n != manifest["num_shards"]:
        raise Stop(
            f"{manifest_path} lists {n} shards for a world size of {world_size}: shard i belongs "
            f"to rank i % world_size (prepare a multiple of {world_size} with --num_shards)"
        )
    if manifest.get("packing", "stream") != "stream":  # its loss counts every position a target
        raise Stop(f"{manifest_path}: --packing {manifest['packing']} blocks; prepare stream ones")
    mine = []
    for i, shard in enumerate([*manifest["shards"], manifest["validation"]]):
        path, own = root / shard["name"], i % world_size == rank or i == n
        if (own or every_shard) and not path.is_file():
            raise Stop(f"missing shard {path}: shard {i} of the {n} listed in {manifest_path}")
        if not own:
            continue
        try:
            found = {"bytes": path.stat().st_size, "rows": pq.read_metadata(path).num_rows}
        except (pa.ArrowException, OSError) as e:
            raise Stop(f"corrupt parquet file {path}: {e}") from None
        with open(path, "rb") as f:
            found["sha256"] = hashlib.file_digest(f, "sha256").hexdigest() if verify else None
        for key, name in (("bytes", "bytes"), ("rows", "rows"), ("sha256", "SHA-256")):
            if found[key] not in (None, shard[key]):
                raise Stop(
                    f"corrupt shard {path}: {name} {found[key]}, the manifest says "
                    f"{shard[key]}; prepare it again"
                )
        mine += [path] if i < n else []
    return manifest, mine


class RankShards(torch.utils.data.IterableDataset):
    """This rank's shards as batches, {"input_ids": int64 [batch, block_size], "block_id": int64
    [batch]}. Each epoch the (file, row group) pairs, permuted by (seed, epoch, rank), are dealt
    to the workers; rows are shuffled within a row group; a worker drops its last partial batch."""

    def __init__(self, paths: list[Path], batch_size: int, seed: int, rank: int):
        self.paths, self.batch_size, self.seed = [str(p) for p in paths], batch_size, [seed, rank]
        groups = [pq.ParquetFile(p).num_row_groups for p in self.paths]
        self.units = [(f, g) for f, n in enumerate(groups) for g in range(n)]
        # shared memory: a persistent worker keeps its own copy of this object, as in datasets
        self.epoch = torch.zeros((), dtype=torch.int64).share_memory_()

    def set_epoch(self, epoch: int) -> None:
        self.epoch.fill_(epoch)

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        worker, n_workers = (info.id, info.num_workers) if info else (0, 1)
        seed = [self.seed[0], int(self.epoch), self.seed[1]]
        files, rows, ids = {}, [], []
        for u in np.random.default_rng(seed).permutation(len(self.units))[worker::n_workers]:
            f, g = self.units[u]
            if f not in files:  # not memory-mapped: every mapped page a worker read stays resident
                files[f] = pq.ParquetFile(self.paths[f], memory_map=False)
            table = files[f].read_row_group(g)  # this row group only, freed once batched
            order = np.random.default_rng([*seed, u]).permutation(len(table))
            tokens = table.column("input_ids").combine_chunks().values.to_numpy()
            rows += list(tokens.reshape(len(table), -1)[order])
            ids += list(table.column("block_id").to_numpy()[order])
            while len(ids) >= (b := self.batch_size):
                yield {"input_ids": torch.tensor(np.stack(rows[:b]), dtype=torch.int64)} | {
                    "block_id": torch.tensor(ids[:b])
                }
                rows, ids = rows[b:], ids[b:]


# >>> shared: evaluate (tests/test_skeleton.py keeps the shared blocks identical across recipes)
@torch.no_grad()
def evaluate(model, eval_loader, accelerator) -> float:
    """Token-weighted mean eval loss in nats/token; each eval block counted exactly once."""
    model.eval()
    nats, tokens = torch.zeros(2, device=accelerator.device)  # (one buffer, two views)
    for batch in eval_loader:
        logits = model(
            input_ids=batch["input_ids"],
            attention_mask=batch.get("attention_mask"),
            position_ids=batch.get("position_ids"),
        ).logits  # --packing documents
        # nats and target tokens per block, in fp32 slices: no fp32 copy of the whole logits
        per_block, targets = metrics.token_nll(logits, batch["labels"])
        del logits
        # gather_for_metrics drops the blocks Accelerate duplicated to even out the last batch
        per_block, targets = accelerator.gather_for_metrics((per_block, targets))
        nats += per_block.sum()
        tokens += targets.sum()
    model.train()
    return (nats / tokens).item()


# <<< shared


def main() -> int:
    args = parse_args(
        Args,
        description=__doc__,
        refuse=dict(num_train_epochs="each rank streams its own shards: give --max_steps"),
        output_dir="runs/sharded_data",
        per_device_train_batch_size=8,
        learning_rate=1e-3,
        weight_decay=0.1,
        lr_scheduler_type="constant_with_warmup",
        dataloader_num_workers=2,
        max_steps=30,
        logging_steps=5,
    )
    checks.sharded_data_flags(args)  # --max_steps, not --num_train_epochs
    make_output_dir(args.output_dir)  # a file in the way or an impossible path: one line, now
    if args.data_dir is None or args.loader not in ("parquet", "datasets"):
        raise Stop("training needs --data_dir (a prepared folder) and --loader parquet|datasets")
    startup = {"steps": args.max_steps}  # known before the data: every rank streams that many
    handlers = []  # the Accelerator's kwargs_handlers besides the process group's

    # >>> shared: accelerator
    applied = workarounds.die_with_launcher()  # a SIGKILLed launcher takes its workers with it
    guard = checks.Startup(args, **startup)  # the flags and the hardware, before any work
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

    # ADAPT: data. This rank's shards only, read while the model computes. Each rank checks its
    # own; one rank's bad shard, or a node whose manifest differs, stops every rank.
    rank, data_dir, max_steps = accelerator.process_index, Path(args.data_dir), args.max_steps
    datasets_route = args.loader == "datasets"  # it deals every shard to some rank each epoch
    manifest, paths = checks.stop_if_any_rank_fails(
        accelerator, own_shards, data_dir, world_size, rank, args.verify_checksums, datasets_route
    )
    manifest_sha256 = hashlib.sha256((data_dir / "manifest.json").read_bytes()).hexdigest()
    checks.same_on_every_rank(
        accelerator, f"shard manifest {data_dir / 'manifest.json'}", manifest_sha256[:16]
    )
    tokenizer = AutoTokenizer.from_pretrained(data_dir / "tokenizer")
    block_size, batch = manifest["block_size"], args.per_device_train_batch_size
    model_cls, config = LlamaForCausalLM, models.llama_config(args.model_config, len(tokenizer))
    config.bos_token_id = config.eos_token_id = config.pad_token_id = tokenizer.eos_token_id
    if block_size > config.max_position_embeddings:
        raise Stop(
            f"the shards' block size {block_size} exceeds --model_config {args.model_config}"
            f"'s max_position_embeddings {config.max_position_embeddings}"
        )
    if not datasets_route:
        train_set = RankShards(paths, batch, args.seed, rank)
    else:  # row groups as shards, read in turn, dealt to the ranks anew each epoch (set_epoch)
        files = [str(data_dir / s["name"]) for s in manifest["shards"]]
        stream = load_dataset("parquet", data_files=files, split="train", streaming=True)
        stream = split_dataset_by_node(stream.reshard(), rank, world_size, strategy="shards")
        train_set = stream.shuffle(
            args.seed, buffer_size=args.shuffle_buffer_size, max_buffer_input_shards=1
        ).with_format("torch")
    held_out = pq.read_table(data_dir / "validation.parquet")[: args.max_eval_samples]
    eval_ids = torch.tensor(held_out.column("input_ids").to_pylist())  # [blocks, block_size]
    eval_set = [{"input_ids": x, "labels": x} for x in eval_ids]  # the model shifts the labels
    full_blocks = True  # prepared as full blocks: every position a target, no count
    guard.facts["flags"]["block_size"] = block_size  # (for the ZeRO-3 check)
    # the data against the global batch, warmup against the run, FSDP and ZeRO-3 against the model
    guard.data_ready(
        train_size=manifest["total_blocks"],
        train_unit=f"blocks of {block_size} tokens",
        steps=max_steps,
        model_cls=model_cls,
        model_config=config,
    )
    # Not prepared: split_batches would slice batches across ranks; dispatch_batches, read all
    pin = accelerator.device.type == "cuda"  # page-locked host memory, for non-blocking copies
    workers = args.dataloader_num_workers
    train_loader = torch.utils.data.DataLoader(
        train_set,
        batch_size=batch if datasets_route else None,  # RankShards: whole batches
        drop_last=datasets_route,
        num_workers=workers,
        prefetch_factor=args.dataloader_prefetch_factor if workers else None,
        persistent_workers=args.dataloader_persistent_workers and workers > 0,  # no re-forks
        worker_init_fn=checkpoint.leave_signals_to_the_rank,  # the rank saves, then stops them
        generator=torch.Generator(),  # iter() seeds from here, not the RNG a resume restores
        pin_memory=pin and args.dataloader_pin_memory,
    )
    eval_loader = torch.utils.data.DataLoader(
        eval_set,
        batch_size=args.per_device_eval_batch_size,
        generator=torch.Generator(),
        pin_memory=pin,
    )

    def epochs(epoch: int, done: int):
        """(epoch, batches of it consumed, batch), forever; the order follows from the seed."""
        while True:
            train_set.set_epoch(epoch)
            n = 0
            for n, b in enumerate(train_loader, 1):
                if n > done:  # the labels are the inputs (the model shifts them)
                    ids = b["input_ids"].long().to(accelerator.device, non_blocking=True)
                    sample_ids = {"sample_id": b["block_id"]} if args.record_sample_ids else {}
                    yield epoch, n, {**sample_ids, "input_ids": ids, "labels": ids}
            if n == 0:
                raise Stop(
                    f"rank {rank}: shards {[p.name for p in paths]} hold less than one batch "
                    f"of {batch} per loader worker ({workers}); prepare more blocks"
                )
            epoch, done = epoch + 1, 0

    # ADAPT: model. fp32 master weights; the launch config picks the compute precision.
    model = model_cls(config)
    model.config.use_cache = False
    n_params = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())  # ZeRO-3 too
    set_seed(args.seed, device_specific=True)  # from here on each rank draws its own (dropout)
    flops_per_token, flops_method = metrics.model_flops_per_token(model, block_size)

    peak_lr = args.learning_rate  # (llama.py scales it with --scale_lr)
    # AdamW without weight decay on norm weights and biases (1-D tensors), as most LLM recipes.
    optimizer = torch.optim.AdamW(
        models.param_groups(model, args.weight_decay),
        lr=peak_lr,
        betas=(args.adam_beta1, args.adam_beta2),
        eps=args.adam_epsilon,
    )
    accelerator.print(metrics.weight_decay_line(optimizer))
    lr_scheduler = schedule.lr_scheduler(optimizer, args, max_steps)  # --lr_scheduler_type
    if accelerator.deepspeed_plugin:  # DeepSpeed cannot see our loader: its micro batch
        accelerator.deepspeed_plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = batch

    order = {  # what fixes each rank's data order: its shards (the world size), the reading
        "global_batch": global_batch,
        "seed": args.seed,
        "block_size": block_size,
        "world_size": world_size,
        "per_device_train_batch_size": batch,
        "loader": args.loader,
        "dataloader_num_workers": workers,
        "shuffle_buffer_size": args.shuffle_buffer_size,
        "manifest_sha256": manifest_sha256,
    }
    # >>> shared: run state
    run_state, checked = checkpoint.run_state(accelerator, args, model, peak_lr, max_steps, **order)
    # <<< shared
    resume_path, saved = checkpoint.resume_or_start(accelerator, args, run_state, checked)
    step = saved["step"]

    model, optimizer, eval_loader, lr_scheduler = accelerator.prepare(
        model, optimizer, eval_loader, lr_scheduler
    )
    applied += workarounds.patch_model(accelerator, model)  # logits copy; torch.compile key names
    device = accelerator.device
    run_info = metrics.run_info(  # + strategy, ranks' parameter elements, torch.compile, flags
        accelerator,
        model,
        args,
        precision=guard.precision,
        global_batch=global_batch,
        n_params=n_params,
        max_steps=max_steps,
        model_type=config.model_type,
        model_class=model_cls.__name__,
        data={k: manifest[k] for k in ("source", "text_bytes", "total_blocks", "num_shards")},
        flops_per_token=flops_per_token,
        flops_per_token_method=flops_method,
        **guard.prepared(accelerator, model, model_cls, global_batch),
    )  # FSDP units, DeepSpeed
    accelerator.print(metrics.start_line(run_info))
    if resume_path:  # + scheduler, scaler, per-rank RNG; micro steps follow this accumulation
        applied += checkpoint.load_checkpoint(accelerator, resume_path, model, optimizer, step)
        accelerator.print(checkpoint.resumed_line(resume_path, step))
    run_info["workarounds"] = applied  # the library workarounds that ran, in order
    log = metrics.RunLog(
        accelerator, args, Path(__file__).stem, step if resume_path else None, run_info, saved
    )
    # The loader alone: the tokens/s it delivers with nothing else running (start-up excluded).
    stream = iter(train_loader)
    t0, _ = time.perf_counter(), next(stream)
    n = sum(1 for _, _ in zip(range(args.loader_benchmark_batches), stream))
    loader_tps = n * batch * block_size / (time.perf_counter() - t0)
    del stream
    accelerator.print(f"{args.loader} loader alone: {loader_tps:,.0f} tokens/s, {workers} workers")

    # ---- Training loop: one iteration = one optimizer step = one accumulation window ---------
    model.train()
    progress = tqdm(
        total=max_steps, initial=step, desc="train", disable=not accelerator.is_local_main_process
    )
    t_start = log.start_clock(device, flops_per_token, args.peak_tflops)  # tokens/s, MFU
    epoch, done = saved.get("data_position", [[0, 0]] * world_size)[rank]  # this rank's own
    health = precision.StepHealth(accelerator, model, saved)  # skipped steps, inf/NaN: stop
    seen = metrics.SampleIds(args.record_sample_ids, epoch)  # epochs before a resume stay empty
    preempted = checkpoint.stop_on_signal(accelerator, args.ddp_timeout)  # SIGTERM, Ctrl-C, SIGHUP
    problem = preempt = None  # why the loop ends early: one error line, or a signal's name
    batches, start, wait_s, t_last = epochs(epoch, done), step, 0.0, t_start
    while step < max_steps and not (problem or preempt):
        for _ in range(step, max_steps):  # (one pass: each rank's own epochs are in `batches`)
            lr = lr_scheduler.get_last_lr()[0]  # the LR this optimizer step applies
            t0 = time.perf_counter()
            window = [next(batches) for _ in range(args.gradient_accumulation_steps)]
            wait_s += (wait := time.perf_counter() - t0)
            log.count(data_wait=wait)
            for epoch, done, batch in window:  # an epoch may end inside a window
                seen.take(epoch, [batch])  # --record_sample_ids: pops the ids, kept on the device
            window = [batch for *_, batch in window]  # and [epoch, done]: this rank's position
            # >>> shared: loss
            # ADAPT: loss. Token-weighted accumulation: normalise by the target tokens of the whole
            # window on all ranks, so the gradient is the full global batch's even with padding.
            # Scaling by (accumulation x world size) undoes backward's and the all-reduce's means.
            if full_blocks:  # block length - 1 targets a block: no collective, no sync
                num_items, has_targets = global_batch * (window[0]["labels"].shape[1] - 1), True
            else:  # padding, masks, document starts: count on every rank (one sync a step)
                local_items = sum((b["labels"][:, 1:] != -100).sum() for b in window)
                # a tensor: a changing int would recompile a compiled model each step
                num_items = launch.data_parallel_sum(accelerator, local_items)  # (tp: once)
                has_targets = num_items.item() > 0
            # No targets: a loss of 0/0 would step AdamW on zero gradients (its moments and weight
            # decay still move the weights). Skip the window whole; its loss is NaN.
            loss_total = torch.full((), 0.0 if has_targets else float("nan"), device=device)
            norm_before_clip = float("nan")
            # <<< shared
            for batch in window if has_targets else []:
                with accelerator.accumulate(model):
                    loss = model(**batch, num_items_in_batch=num_items).loss  # sum / num_items
                    loss_total += loss.detach()
                    accelerator.backward(loss * args.gradient_accumulation_steps * world_size)
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
            t_last = time.perf_counter()  # the step's end, on the host
            # >>> shared: end of step
            step += 1
            progress.update(1)
            health.after_step(step, has_targets, loss_total, norm_before_clip)  # fp16 skips
            if has_targets:  # this rank's tokens, padding left out; an empty window trained none
                log.count(window)
            do_eval = step % args.eval_steps == 0 or step == max_steps
            if step % args.logging_steps == 0 or do_eval:
                record = log.record(  # + tokens/s, data wait, memory, MFU of the window
                    step=step,
                    epoch=epoch,
                    lr=lr,
                    empty_windows=health.empty_windows,
                    loss=launch.data_parallel_sum(accelerator, loss_total).item(),  # nats/token
                    grad_norm=float(norm_before_clip),
                    **health.scale_fields(),
                )  # fp16 scale
                if do_eval:
                    record["eval_loss"] = evaluate(model, eval_loader, accelerator)
                log.log(record)  # NaN (an empty window) is written as null
                progress.set_postfix(
                    loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_second']:.0f}"
                )
            preempt = preempted()  # a collective: every rank stops at the same step, or none
            save = preempt or (args.save_steps and step % args.save_steps == 0)
            # <<< shared
            if save:  # every rank's own [epoch, batches consumed in it]: epochs differ
                run_state["data_position"] = gather_object([[epoch, done]])
            # >>> shared: save or stop
            # a non-finite loss or norm stops before any checkpoint or export of its weights
            problem = health.problem(save or step >= max_steps or step % args.logging_steps == 0)
            if save and not problem:
                hf_config = accelerator.unwrap_model(model, keep_torch_compile=False).config
                saved_to = checkpoint.save_checkpoint(
                    accelerator,
                    args.output_dir,
                    step,
                    args.save_total_limit,
                    {**run_state, **health.state(), **log.tokens_seen()},  # (a collective)
                    hf_files=(hf_config, tokenizer),
                )
            if preempt and not problem:
                accelerator.print(
                    f"preempted ({preempt}) at step {step}: saved {saved_to}; "
                    "relaunch with --resume_from_checkpoint auto to continue"
                )
            if problem or preempt or step >= max_steps:
                break
            # <<< shared
    # >>> shared: export
    progress.close()
    if problem or preempt:  # in order: the model before the process group, then the exit
        del model, optimizer
        launch.teardown(accelerator)
        if problem:
            raise errors.Stop(problem)
        return checkpoint.PREEMPTED_EXIT_CODE
    skipped = health.end_of_run(step)  # one warning for each kind of skipped step
    # ADAPT: export. Gather the full state dict on every rank (a collective); rank 0 writes.
    final_dir = checkpoint.export_model(accelerator, model, tokenizer, args.output_dir)
    # <<< shared
    gc.collect()  # memory, the workers alive: RSS counts pages a worker shares with the rank
    workarounds.trim_malloc_heap()  # glibc keeps freed heap pages: RSS then counts what is live
    me, compute_s = psutil.Process(), t_last - t_start - wait_s
    kids = [p.memory_full_info().uss for p in me.children(recursive=True) if p.is_running()]
    step_tps = (step - start) * global_batch // world_size * block_size / compute_s or float("nan")
    wait_share = wait_s / (t_last - t_start)
    row = [rank, len(paths), loader_tps, step_tps, loader_tps / step_tps, wait_share]
    row += [me.memory_info().rss, me.memory_full_info().uss, sum(kids), len(kids)]
    rows = accelerator.gather(torch.tensor([row], dtype=torch.float64, device=device)).tolist()
    keys = "rank shards loader_tokens_per_second step_tokens_per_second loader_to_step_ratio "
    keys += "data_wait_share rss_bytes uss_bytes workers_uss_bytes workers"  # memory in bytes
    per_rank = [metrics.strict_json(dict(zip(keys.split(), r))) for r in rows]  # nan: null
    shards = None if datasets_route else [p.name for p in paths]
    seen.write(accelerator, args.output_dir, shards=shards)  # --record_sample_ids: each rank's
    accelerator.wait_for_everyone()
    log.summary(
        {
            "step": step,
            "wall_seconds": time.perf_counter() - t_start,
            **skipped,
            **log.tokens_seen(),  # input (padding left out) and target tokens, all ranks
            **metrics.end_figures(accelerator, model),
            "loader": args.loader,
            "text_bytes": manifest["text_bytes"],
            "precision": guard.precision,
            "per_rank": per_rank,
        }
    )  # peak memory, buffer dtypes
    table = "\n| corpus | loader | rank | shards | loader tokens/s | step tokens/s | loader/step "
    table += "| data wait | rank RSS MiB | rank USS MiB | workers USS MiB |\n" + "|---" * 11 + "|"
    for r in rows:  # the memory in MiB, the workers' count in brackets
        cells = [f"{manifest['text_bytes'] / 1e6:.0f} MB", args.loader]
        cells += [format(x, f) for x, f in zip(r, (".0f", ".0f", ",.0f", ",.0f", ".0f", ".1%"))]
        table += f"\n| {' | '.join(cells + [f'{x / 2**20:.0f}' for x in r[6:9]])} ({r[9]:.0f}) |"
    accelerator.print(table)
    del model, optimizer
    launch.teardown(accelerator)  # in order: the model before the process group
    accelerator.print(log.final_line(f"model in {final_dir}, metrics in {log.path}"))
    return 0


if __name__ == "__main__":  # the guard keeps spawned DataLoader workers from re-running main()
    errors.run(main)
