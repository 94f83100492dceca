"""Data-parallel basics on a real classification task: which genre is a Shakespeare passage from?

    accelerate launch --config_file accelerate_configs/ddp.yaml recipes/ddp_classifier.py
    accelerate launch --config_file accelerate_configs/fsdp.yaml recipes/ddp_classifier.py
    accelerate launch --config_file accelerate_configs/ddp.yaml --mixed_precision no recipes/ddp_classifier.py --num_train_epochs 5
    accelerate launch --config_file accelerate_configs/ddp.yaml recipes/ddp_classifier.py --max_steps 50 --save_steps 25
    accelerate launch --config_file accelerate_configs/ddp.yaml recipes/ddp_classifier.py --max_steps 50 --resume_from_checkpoint latest

Task: 128-token passages ([CLS] + 127 tokens of text) of the 42 bundled works, labelled comedy / tragedy / history / poetry
(the First Folio grouping, below). The last 10% of every work's tokens is held out: a contiguous
tail, so no held-out passage overlaps a training one, and every genre appears in both splits.
Model: a ~1M-parameter BERT encoder trained from scratch with cross-entropy.

Flags: the core `transformers.TrainingArguments` ones (common/args.py: --output_dir, --seed,
--per_device_train_batch_size, --gradient_accumulation_steps, --learning_rate, --weight_decay,
--warmup_steps, --max_steps or --num_train_epochs, --logging_steps, --save_steps,
--resume_from_checkpoint {PATH|latest}, --max_grad_norm, --report_to, --overwrite_output_dir)
plus this recipe's own (Args below). global batch = per device x accumulation x world size.

What this recipe shows, in the order the code does it:
  * one seed for the weights, one RNG stream per rank for dropout: every rank builds the same
    initial model, then draws its own dropout masks (identical masks on every rank would make the
    replicas' noise the same, not independent);
  * per-epoch reshuffling that stays correct across ranks: a seeded sampler plus `set_epoch`,
    so each epoch is a new permutation, the same on every rank, of which each rank takes a
    disjoint share (forgetting `set_epoch` replays epoch 0's order forever);
  * AdamW weight decay on weight matrices only, never on LayerNorm gains and biases;
  * gradient clipping on the global gradient norm, taken in fp64 (`common/grad_norm.py`);
  * exact resume: `save_state` keeps every rank's RNG, and the data position follows from the step;
  * accuracy with `gather_for_metrics`, which drops the samples Accelerate repeats to even out
    the last batch, so every held-out passage counts exactly once, against the majority baseline;
  * only the main process logs and writes; the export gathers the full weights on all ranks (a
    collective) and rank 0 writes them once, as safetensors.

Outputs in --output_dir: metrics.jsonl (logging steps, an eval line per epoch and at the end, a
summary line; under fp16 each step line has loss_scale and skipped_steps), checkpoint-N/
(--save_steps), final/ (config.json + model.safetensors + tokenizer) and, with
--record_sample_ids, sample_ids/rank{r}.json (written by rank r alone: the sample ids it trained
on in this launch, per epoch).
"""

import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import datasets
import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, DistributedType, GradientAccumulationPlugin, set_seed
from transformers import BertConfig, BertForSequenceClassification, get_linear_schedule_with_warmup

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere, no install step
from common.args import flag  # noqa: E402
from common import args as common_args, checkpoint, checks, data, grad_norm, launch, metrics, models  # noqa: E402
from common import errors, precision, workarounds  # noqa: E402
from common.errors import Stop  # noqa: E402

# The First Folio (1623) groups the plays as Comedies, Histories and Tragedies; Troilus and
# Cressida (printed between the histories and the tragedies) and Cymbeline (the last tragedy)
# follow its placement. Pericles is not in the Folio; it goes with the comedies, as the late
# romances conventionally do. The poems (Sonnets, A Lover's Complaint, The Passionate Pilgrim,
# The Phoenix and the Turtle, The Rape of Lucrece; Venus and Adonis is not in this corpus) form
# the fourth class.
GENRES = ["comedy", "tragedy", "history", "poetry"]
GENRE_OF_WORK = {
    **dict.fromkeys([
        "tempest", "two_gentlemen_of_verona", "merry_wives_of_windsor", "measure_for_measure",
        "comedy_of_errors", "much_ado_about_nothing", "loves_labours_lost", "midsummer_nights_dream",
        "merchant_of_venice", "as_you_like_it", "taming_of_the_shrew", "alls_well_that_ends_well",
        "twelfth_night", "winters_tale", "pericles"], "comedy"),
    **dict.fromkeys([
        "john", "richard_ii", "henry_iv_part_1", "henry_iv_part_2", "henry_v", "henry_vi_part_1",
        "henry_vi_part_2", "henry_vi_part_3", "richard_iii", "henry_viii"], "history"),
    **dict.fromkeys([
        "troilus_and_cressida", "coriolanus", "tragedy_of_titus_andronicus", "romeo_and_juliet",
        "timon_of_athens", "julius_caesar", "macbeth", "hamlet", "lear", "othello",
        "antony_and_cleopatra", "cymbeline"], "tragedy"),
    **dict.fromkeys([
        "sonnets", "lovers_complaint", "passionate_pilgrim", "phoenix_and_the_turtle",
        "rape_of_lucrece", "venus_and_adonis"], "poetry"),
}


@dataclass
class Args:
    """This recipe's own flags; the core TrainingArguments ones come from common/args.py."""
    # data and tokenizer
    block_size: int = flag(128, "tokens per passage, the [CLS] token included", low=2)
    validation_split_percentage: int = flag(10, "held-out tail of every work, in %", low=1, high=99)
    max_train_samples: int = flag(None, "train on a seeded random subset (quick runs)", low=1)
    max_eval_samples: int = flag(None, "evaluate on a seeded random subset (quick runs)", low=1)
    tokenizer_name_or_path: str = field(default=None, metadata={"help": "default: the project's corpus BPE"})
    vocab_size: int = flag(4096, low=256)
    cache_dir: str = data.DEFAULT_CACHE_DIR
    # model: a small BERT encoder, trained from scratch
    hidden_size: int = flag(128, low=1)
    num_hidden_layers: int = flag(2, low=1)
    num_attention_heads: int = flag(2, low=1)
    intermediate_size: int = flag(512, low=1)
    per_device_eval_batch_size: int = flag(64, low=1)
    record_sample_ids: bool = field(default=False, metadata={"help": "each rank writes the sample ids it saw"})
    ddp_timeout: int = flag(1800, "collective timeout in seconds", low=1)


# Bad flags and a non-empty --output_dir (without --overwrite_output_dir or a resume) end here,
# with one `error:` line, before anything is written.


@torch.no_grad()
def evaluate(model, eval_loader, accelerator):
    """Held-out predictions and labels, int64 [len(eval_set)] each, identical on every rank.

    `gather_for_metrics` concatenates the ranks' batches and drops the duplicates Accelerate added
    to even out the last batch, so each held-out passage appears exactly once.
    """
    model.eval()
    preds, labels = [], []
    for batch in eval_loader:
        logits = model(input_ids=batch["input_ids"]).logits
        p, y = accelerator.gather_for_metrics((logits.argmax(-1), batch["labels"]))
        preds.append(p)
        labels.append(y)
    model.train()
    return torch.cat(preds).cpu(), torch.cat(labels).cpu()


def main() -> int:
    args = common_args.parse_args(Args, description=__doc__, output_dir="runs/ddp_classifier", learning_rate=1e-3, weight_decay=0.01,
                                  warmup_steps=30, num_train_epochs=2, logging_steps=20, per_device_train_batch_size=32)
    common_args.make_output_dir(args.output_dir)  # a file in the way or an impossible path: one error line, now
    if args.hidden_size % args.num_attention_heads:
        raise Stop(f"--hidden_size {args.hidden_size} is not a multiple of --num_attention_heads "
                   f"{args.num_attention_heads}")
    accumulation = args.gradient_accumulation_steps

    # ---------------------------------------------------------------------------------------------
    # Accelerator: DDP, FSDP or ZeRO comes from the accelerate config. The seedable sampler makes the
    # shuffle a function of (seed, epoch) alone, so every rank draws the same permutation.
    # ---------------------------------------------------------------------------------------------
    startup = {}  # nothing known about the model before the data
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
    if accelerator.distributed_type == DistributedType.FSDP:
        # One FSDP unit per BertLayer, whatever the shared fsdp.yaml says (written for decoder LMs).
        accelerator.state.fsdp_plugin.transformer_cls_names_to_wrap = ["BertLayer"]
    rank = accelerator.process_index

    # ---------------------------------------------------------------------------------------------
    # Data: passages of block_size tokens; each work's tail is held out.
    # ---------------------------------------------------------------------------------------------
    # Each node's first rank trains (or loads) the cached tokenizer first: home directories are often
    # node-local. On a shared filesystem the nodes may build at once; the first complete cache wins.
    with launch.node_first(accelerator):  # a missing or broken file: one error line on every rank
        corpus = data.load_shakespeare()
        # The LM recipe's BPE (trained on raw text, no labels): one shared cache for all recipes.
        tokenizer = data.get_tokenizer(args.tokenizer_name_or_path, data.load_text_dataset(), args.vocab_size, args.cache_dir)
    unknown = sorted(set(corpus["work"]) - GENRE_OF_WORK.keys())
    if unknown:
        raise ValueError(f"works with no genre in GENRE_OF_WORK: {unknown}; add them to the map")

    # Each passage starts with the BPE's one special token, which plays BERT's [CLS]: the classifier
    # reads the final state at position 0, so that position must always hold the same token.
    cls, text_len = tokenizer.eos_token_id, args.block_size - 1
    splits = {"train": {"input_ids": [], "labels": []}, "validation": {"input_ids": [], "labels": []}}
    for work, ids in zip(corpus["work"], tokenizer(list(corpus["text"]))["input_ids"]):
        blocks = [[cls] + ids[i:i + text_len] for i in range(0, len(ids) - text_len + 1, text_len)]
        if len(blocks) < 2:
            raise Stop(f"work {work!r} has {len(ids)} tokens: fewer than 2 passages of --block_size {args.block_size}")
        n_held = max(1, len(blocks) * args.validation_split_percentage // 100)
        for split, part in (("train", blocks[:-n_held]), ("validation", blocks[-n_held:])):
            splits[split]["input_ids"] += part
            splits[split]["labels"] += [GENRES.index(GENRE_OF_WORK[work])] * len(part)
    train_set = datasets.Dataset.from_dict(splits["train"])
    eval_set = datasets.Dataset.from_dict(splits["validation"])
    if args.max_train_samples:
        train_set = train_set.shuffle(seed=args.seed).select(range(min(args.max_train_samples, len(train_set))))
    if args.max_eval_samples:
        eval_set = eval_set.shuffle(seed=args.seed).select(range(min(args.max_eval_samples, len(eval_set))))
    # sample_id: the row index, carried through the loader so a run can record what each rank saw
    train_set = train_set.add_column("sample_id", list(range(len(train_set)))).with_format("torch")
    eval_set = eval_set.with_format("torch")

    train_counts = torch.bincount(train_set["labels"][:], minlength=len(GENRES))
    majority = int(train_counts.argmax())  # the baseline: always answer the training set's majority genre
    eval_labels = eval_set["labels"][:]
    baseline_accuracy = (eval_labels == majority).float().mean().item()
    steps_per_epoch = len(train_set) // global_batch
    max_steps = args.max_steps if args.max_steps > 0 else math.ceil(args.num_train_epochs * steps_per_epoch)
    # With the data: the training set against the global batch, warmup against the run (common/checks.py).
    guard.data_ready(train_size=len(train_set), train_unit="passages", steps=max_steps)
    # >>> shared: loaders
    # shuffle=True + the seedable sampler: one permutation per epoch (set_epoch), the same on all
    # ranks; rank r gets every world_size-th micro batch of it. drop_last: full global batches.
    # Private generators: each iter() of a loader draws a seed from its generator, else from the
    # global RNG that dropout uses, and a resume opens an extra iterator mid-epoch.
    pin = accelerator.device.type == "cuda"  # page-locked host memory, for non-blocking copies
    train_loader = torch.utils.data.DataLoader(
        train_set, batch_size=args.per_device_train_batch_size, shuffle=True, drop_last=True,
        generator=torch.Generator(), pin_memory=pin)
    eval_loader = torch.utils.data.DataLoader(
        eval_set, batch_size=args.per_device_eval_batch_size, generator=torch.Generator(),
        pin_memory=pin)
    # <<< shared

    # ---------------------------------------------------------------------------------------------
    # Model: a small BERT encoder; its classification head reads the final state at the [CLS] position.
    # ---------------------------------------------------------------------------------------------
    config = BertConfig(vocab_size=len(tokenizer), hidden_size=args.hidden_size, num_hidden_layers=args.num_hidden_layers,
                        num_attention_heads=args.num_attention_heads, intermediate_size=args.intermediate_size,
                        max_position_embeddings=args.block_size, type_vocab_size=1, pad_token_id=tokenizer.pad_token_id,
                        num_labels=len(GENRES), id2label=dict(enumerate(GENRES)),
                        label2id={g: i for i, g in enumerate(GENRES)})
    model = BertForSequenceClassification(config)
    n_params = sum(p.numel() for p in model.parameters())
    # From here each rank draws its own dropout masks (seed + rank). The data order is unaffected: the
    # sampler reseeds its own generator from (seed, epoch). A resume restores each rank's stream.
    set_seed(args.seed, device_specific=True)
    # Decay on weight matrices and embeddings only: a LayerNorm gain is centred on 1, a bias is an offset.
    optimizer = torch.optim.AdamW(models.param_groups(model, args.weight_decay), lr=args.learning_rate)
    lr_scheduler = get_linear_schedule_with_warmup(optimizer, args.warmup_steps, max_steps)

    # Resume: a verified, complete checkpoint. The data position is recomputed from the step, so the
    # global batch, seed and passages must be the ones it was saved with; refused before prepare.
    try:
        resume_path, saved = checkpoint.resolve_checkpoint(args.output_dir, args.resume_from_checkpoint, accelerator)
    except Stop as err:
        raise Stop(f"cannot resume: {err}") from None
    step, skipped_steps = saved["step"], saved.get("skipped_steps", 0)
    strategy = checkpoint.strategy_name(accelerator)  # "FSDP2", "DEEPSPEED_ZERO3": the sharded layout
    data_state = {"global_batch": global_batch, "seed": args.seed, "block_size": args.block_size,
                  "train_passages": len(train_set)}  # what fixes which samples step k trains on
    # The optimizer's LR and decay come back from its state whatever the flags say, and BERT's dropout
    # masks depend on how a step's samples are split over ranks and micro batches.
    same_run = {"learning_rate": args.learning_rate, "weight_decay": args.weight_decay, "warmup_steps": args.warmup_steps,
                **checkpoint.precision_state(accelerator), "max_grad_norm": args.max_grad_norm,
                "model_config": models.config_state(model.config),
                "per_device_train_batch_size": args.per_device_train_batch_size, "gradient_accumulation_steps": accumulation,
                "world_size": world_size}
    run_state = {"distributed_type": strategy, "max_steps": max_steps, **data_state, **same_run}
    if resume_path:  # with dropout, even the batch split must match (the masks depend on it)
        if error := checkpoint.resume_error(resume_path, saved, run_state, [*data_state, *same_run]):
            raise Stop(error)
    else:
        checkpoint.start_fresh(accelerator, args.output_dir)  # an overwritten run's checkpoints must not be resumed

    model, optimizer, train_loader, eval_loader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_loader, eval_loader, lr_scheduler)
    workarounds.prepared(accelerator, model)  # autocast stays; no fp32 copy of every output
    if resume_path:  # model, optimizer, scheduler, grad scaler and every rank's RNG
        checkpoint.load_checkpoint(accelerator, resume_path, model, optimizer, optimizer_steps=step)
    accelerator.print(
        f"{strategy} x{world_size} | {accelerator.mixed_precision} | {n_params / 1e6:.2f}M params | "
        f"{len(train_set)} train / {len(eval_set)} held-out passages | global batch {global_batch} | "
        f"{max_steps} steps ({steps_per_epoch} per epoch)"
        + (f" | resumed from {resume_path} at step {step}" if resume_path else "")
        + (f" ({note})" if (note := checkpoint.restart_note()) else ""))
    metrics_path = os.path.join(args.output_dir, "metrics.jsonl")
    if accelerator.is_main_process:
        # a fresh log per run; a resume keeps the lines up to its step and drops later ones and summaries
        kept = [] if not (resume_path and os.path.exists(metrics_path)) else [
            line for line in open(metrics_path) if not json.loads(line).get("summary") and json.loads(line)["step"] <= step]
        with open(metrics_path, "w") as f:
            f.writelines(kept)
    accelerator.init_trackers("ddp_classifier", config={k: v for k, v in vars(args).items() if v is not None})

    # ---------------------------------------------------------------------------------------------
    # Training loop. One iteration = one optimizer step = one accumulation window of micro batches.
    # ---------------------------------------------------------------------------------------------
    model.train()
    t_start, skipped_in_a_row, accuracy = time.perf_counter(), 0, None
    guard = precision.NonFiniteGuard(accelerator, model)  # an inf/NaN loss or norm outside fp16 loss scaling stops the run
    epoch = step // steps_per_epoch
    seen = [[] for _ in range(epoch)]  # --record_sample_ids: epochs before a resume stay empty
    # SIGTERM (preemption, a time limit), Ctrl-C or SIGHUP: save a checkpoint at the next step boundary.
    preempted = checkpoint.stop_on_signal(accelerator, args.ddp_timeout)
    while step < max_steps:
        train_loader.set_epoch(epoch)  # new permutation each epoch, the same on every rank
        done_in_epoch = step % steps_per_epoch  # > 0 only right after a mid-epoch resume
        batches = iter(accelerator.skip_first_batches(train_loader, done_in_epoch * accumulation))
        seen.append([])
        for _ in range(done_in_epoch, steps_per_epoch):
            lr = lr_scheduler.get_last_lr()[0]  # the LR this optimizer step applies
            window = [next(batches) for _ in range(accumulation)]
            window_loss = torch.zeros((), device=accelerator.device)
            for batch in window:
                with accelerator.accumulate(model):
                    logits = model(input_ids=batch["input_ids"]).logits
                    # Every passage is labelled, all micro batches are full: the plain mean per micro
                    # batch, averaged over the window (backward divides by accumulation) and over the
                    # ranks (the all-reduce), is the mean over the global batch.
                    loss = F.cross_entropy(logits.float(), batch["labels"])
                    window_loss += loss.detach() / accumulation
                    accelerator.backward(loss)
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
            if args.record_sample_ids:  # kept on the device: a host copy here would wait for the GPU every step
                seen[-1] += [b["sample_id"] for b in window]
            step += 1
            guard.record(step, window_loss, norm_before_clip)  # on the device: read at logging and saving steps
            scale = precision.loss_scale(accelerator, model)  # None unless fp16
            scale_error = None
            if scale is not None:
                skipped = accelerator.optimizer_step_was_skipped
                skipped_steps, skipped_in_a_row = skipped_steps + skipped, skipped_in_a_row + 1 if skipped else 0
                warning, scale_error = precision.loss_scale_verdict(scale, skipped_in_a_row)
                if warning and accelerator.is_main_process:
                    print(f"step {step}: {warning}")
            if step % args.logging_steps == 0:
                record = {"step": step, "epoch": epoch, "loss": accelerator.reduce(window_loss, reduction="mean").item(),
                          "grad_norm": float(norm_before_clip), "lr": lr}  # on the device until now: no sync elsewhere
                if scale is not None:
                    record.update(loss_scale=scale, skipped_steps=skipped_steps)
                accelerator.log(record, step=step)
                if accelerator.is_main_process:
                    metrics.append_jsonl(metrics_path, record)
                accelerator.print(f"step {step}/{max_steps} | loss {record['loss']:.3f} | grad norm {record['grad_norm']:.2f}")
            if step % steps_per_epoch == 0 or step == max_steps:  # held-out accuracy at each epoch's end and the last step
                preds, labels = evaluate(model, eval_loader, accelerator)
                accuracy = (preds == labels).float().mean().item()
                accelerator.log({"eval_accuracy": accuracy}, step=step)
                if accelerator.is_main_process:
                    metrics.append_jsonl(metrics_path, {"step": step, "epoch": epoch, "eval_accuracy": accuracy})
                accelerator.print(f"step {step} (epoch {epoch}) | held-out accuracy {accuracy:.3f} "
                                  f"(majority baseline {baseline_accuracy:.3f})")
            preempt = preempted()  # a collective: every rank stops at the same step (a signal name, or None)
            save = preempt or (args.save_steps and step % args.save_steps == 0)
            # a non-finite loss or norm stops before any checkpoint or export of its weights
            problem = f"step {step}: {scale_error}" if scale_error else (
                (save or step >= max_steps or step % args.logging_steps == 0) and guard.problem())
            if save and not problem:  # after the eval, which a resume does not redo
                saved_to = checkpoint.save_checkpoint(accelerator, args.output_dir, step,
                                                      run_state={**run_state, "skipped_steps": skipped_steps},
                                                      hf_files=(accelerator.unwrap_model(model).config, tokenizer))
            if problem or preempt:
                if not problem:
                    accelerator.print(f"preempted ({preempt}) at step {step}: saved {saved_to}; "
                                      "relaunch with --resume_from_checkpoint auto to continue")
                del model, optimizer
                launch.teardown(accelerator)
                if problem:
                    raise Stop(problem)
                return checkpoint.PREEMPTED_EXIT_CODE
            if step >= max_steps:
                break
        if args.record_sample_ids:  # one host copy per epoch, at its end (after the evaluation, which syncs anyway)
            seen[-1] = torch.cat(seen[-1]).tolist()
        epoch += 1

    if args.record_sample_ids:  # one file per rank, each written by its own rank only
        os.makedirs(os.path.join(args.output_dir, "sample_ids"), exist_ok=True)
        with open(os.path.join(args.output_dir, "sample_ids", f"rank{rank}.json"), "w") as f:
            json.dump({"rank": rank, "world_size": world_size, "epochs": seen}, f)

    # ---------------------------------------------------------------------------------------------
    # Evaluation table and export. full_state_dict is a collective (every rank), the write is not.
    # ---------------------------------------------------------------------------------------------
    if accuracy is None:  # resumed from the last step: nothing trained, evaluate what was loaded
        preds, labels = evaluate(model, eval_loader, accelerator)
        accuracy = (preds == labels).float().mean().item()
    per_genre = {g: ((preds == i) & (labels == i)).sum().item() / max(1, (labels == i).sum().item())
                 for i, g in enumerate(GENRES)}
    state_dict = checkpoint.full_state_dict(accelerator, model)
    with checkpoint.atomic_export(accelerator, args.output_dir) as export_dir:  # final/ is never half written
        accelerator.unwrap_model(model).save_pretrained(export_dir, is_main_process=accelerator.is_main_process,
                                                        save_function=accelerator.save, state_dict=state_dict)
        if accelerator.is_main_process:
            tokenizer.save_pretrained(export_dir)
    if accelerator.is_main_process:
        summary = {"summary": True, "step": step, "eval_accuracy": accuracy, "majority_baseline": baseline_accuracy,
                   "majority_genre": GENRES[majority], "n_eval": len(labels), "n_eval_passages": len(eval_set),
                   "n_train_passages": len(train_set), "n_params": n_params, "world_size": world_size,
                   "distributed_type": strategy, "skipped_steps": skipped_steps,
                   "per_genre_recall": per_genre, "wall_seconds": time.perf_counter() - t_start}
        metrics.append_jsonl(metrics_path, summary)
        print("\n| genre (held-out passages) | recall |\n|---|---|")
        for i, g in enumerate(GENRES):
            print(f"| {g} ({(labels == i).sum().item()}) | {per_genre[g]:.3f} |")
        print(f"\n| held-out passages | accuracy | majority baseline ({GENRES[majority]}) |\n|---|---|---|\n"
              f"| {len(labels)} | {accuracy:.3f} | {baseline_accuracy:.3f} |")
    del model, optimizer
    launch.teardown(accelerator)  # in order: the model before the process group
    accelerator.print(metrics.final_line(metrics_path, f"model in {os.path.join(args.output_dir, 'final')}, metrics in {metrics_path}"))
    return 0


if __name__ == "__main__":
    errors.run(main)
