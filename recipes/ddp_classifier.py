r"""Data-parallel basics on a real classification task: which genre is a Shakespeare passage from?

    accelerate launch --config_file accelerate_configs/ddp.yaml recipes/ddp_classifier.py
    accelerate launch --config_file accelerate_configs/fsdp.yaml recipes/ddp_classifier.py
    accelerate launch --config_file accelerate_configs/ddp.yaml recipes/ddp_classifier.py \
        --max_steps 50 --save_steps 25
    accelerate launch --config_file accelerate_configs/ddp.yaml recipes/ddp_classifier.py \
        --max_steps 50 --resume_from_checkpoint latest

Task: 128-token passages ([CLS] + 127 tokens) of the 42 bundled works, labelled comedy, tragedy,
history or poetry; the last 10% of every work's tokens is held out. Model: a ~1M-parameter BERT
encoder trained from scratch. The lesson, in the order of the code: one seed for the weights and
one dropout stream per rank; per-epoch reshuffling with `set_epoch`; no weight decay on LayerNorm
gains and biases; exact resume; accuracy with `gather_for_metrics` (each held-out passage counted
once) against the majority baseline; one writer (rank 0), also for the gathered export.

Outputs in --output_dir: metrics.jsonl, checkpoint-N/, final/ (HF format, safetensors) and, with
--record_sample_ids, sample_ids/rank{r}.json (written by rank r). More: docs/ddp_classifier.md.
To change the data, model, loss or export, find the `# ADAPT:` markers.
"""

import gc
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

gc.collect()  # the process's earlier garbage (a notebook's), before imports_done freezes
gc.disable()  # the imports below run without it: launch.imports_done()
import datasets
import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, DistributedType, GradientAccumulationPlugin
from accelerate.utils import set_seed
from transformers import BertConfig, BertForSequenceClassification

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere, no install
from common.args import flag
from common import args as common_args, checkpoint, checks, data, grad_norm, launch
from common import errors, metrics, models, precision, run_dir, schedule, workarounds
from common.errors import Stop

launch.imports_done()  # garbage collection back on, the imports' objects frozen

# The First Folio (1623) groups the plays as Comedies, Histories and Tragedies; Troilus and
# Cressida and Cymbeline follow its placement. Pericles (not in the Folio) goes with the comedies,
# as the late romances conventionally do. The poems are the fourth class.
GENRES = ["comedy", "tragedy", "history", "poetry"]
GENRE_OF_WORK = {
    **dict.fromkeys(
        [
            "tempest",
            "two_gentlemen_of_verona",
            "merry_wives_of_windsor",
            "measure_for_measure",
            "comedy_of_errors",
            "much_ado_about_nothing",
            "loves_labours_lost",
            "midsummer_nights_dream",
            "merchant_of_venice",
            "as_you_like_it",
            "taming_of_the_shrew",
            "alls_well_that_ends_well",
            "twelfth_night",
            "winters_tale",
            "pericles",
        ],
        "comedy",
    ),
    **dict.fromkeys(
        [
            "john",
            "richard_ii",
            "henry_iv_part_1",
            "henry_iv_part_2",
            "henry_v",
            "henry_vi_part_1",
            "henry_vi_part_2",
            "henry_vi_part_3",
            "richard_iii",
            "henry_viii",
        ],
        "history",
    ),
    **dict.fromkeys(
        [
            "troilus_and_cressida",
            "coriolanus",
            "tragedy_of_titus_andronicus",
            "romeo_and_juliet",
            "timon_of_athens",
            "julius_caesar",
            "macbeth",
            "hamlet",
            "lear",
            "othello",
            "antony_and_cleopatra",
            "cymbeline",
        ],
        "tragedy",
    ),
    **dict.fromkeys(
        [
            "sonnets",
            "lovers_complaint",
            "passionate_pilgrim",
            "phoenix_and_the_turtle",
            "rape_of_lucrece",
            "venus_and_adonis",
        ],
        "poetry",
    ),
}


@dataclass
class Args:
    """This recipe's own flags; the core TrainingArguments ones come from common/args.py."""

    # data and tokenizer
    block_size: int = flag(128, "tokens per passage, the [CLS] token included", low=2)
    validation_split_percentage: int = flag(10, "held-out tail of every work, in %", low=1, high=99)
    max_train_samples: int = flag(None, "train on a seeded random subset (quick runs)", low=1)
    max_eval_samples: int = flag(None, "evaluate on a seeded random subset (quick runs)", low=1)
    tokenizer_name_or_path: str = field(
        default=None, metadata={"help": "default: the project's corpus BPE"}
    )
    vocab_size: int = flag(4096, low=256)
    cache_dir: str = data.DEFAULT_CACHE_DIR
    # model: a small BERT encoder, trained from scratch
    hidden_size: int = flag(128, low=1)
    num_hidden_layers: int = flag(2, low=1)
    num_attention_heads: int = flag(2, low=1)
    intermediate_size: int = flag(512, low=1)
    per_device_eval_batch_size: int = flag(64, low=1)
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    record_sample_ids: bool = field(
        default=False, metadata={"help": "each rank writes the sample ids it saw"}
    )
    ddp_timeout: int = flag(1800, "collective timeout in seconds", low=1)


# This recipe's defaults for core flags (the rest keep common/args.py's).
DEFAULTS = dict(
    output_dir="runs/ddp_classifier",
    learning_rate=1e-3,
    weight_decay=0.01,
    warmup_steps=30,
    num_train_epochs=2,
    logging_steps=20,
    per_device_train_batch_size=32,
)


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
    # one `error:` line for a bad flag or a non-empty --output_dir, before anything is written
    args = common_args.parse_args(Args, description=__doc__, **DEFAULTS)
    common_args.make_output_dir(args.output_dir)  # a file in the way or an impossible path: now
    if args.hidden_size % args.num_attention_heads:  # BERT would refuse it later
        raise Stop(
            f"--hidden_size {args.hidden_size} is not a multiple of --num_attention_heads "
            f"{args.num_attention_heads}"
        )
    accumulation = args.gradient_accumulation_steps

    # ---------------------------------------------------------------------------------------------
    # Accelerator: DDP, FSDP or ZeRO comes from the accelerate config. The seedable sampler makes
    # the shuffle a function of (seed, epoch) alone, so every rank draws the same permutation.
    # ---------------------------------------------------------------------------------------------
    startup = {}  # nothing known about the model before the data
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
    if accelerator.distributed_type == DistributedType.FSDP:
        # One FSDP unit per BertLayer, whatever the shared fsdp.yaml says (written for decoder LMs).
        accelerator.state.fsdp_plugin.transformer_cls_names_to_wrap = ["BertLayer"]

    # ---------------------------------------------------------------------------------------------
    # ADAPT: data. Passages of block_size tokens; each work's tail is held out.
    # ---------------------------------------------------------------------------------------------
    # Each node's first rank builds the tokenizer cache (home directories are often node-local).
    with launch.node_first(accelerator):  # a missing or broken file: one error line on every rank
        corpus = data.load_shakespeare()
        # The LM recipe's BPE (trained on raw text, no labels): one shared cache for all recipes.
        tokenizer = data.get_tokenizer(
            args.tokenizer_name_or_path, data.load_text_dataset(), args.vocab_size, args.cache_dir
        )
    if unknown := sorted(set(corpus["work"]) - GENRE_OF_WORK.keys()):
        raise Stop(f"works with no genre in GENRE_OF_WORK: {unknown}; add them to the map")
    # Each passage starts with the BPE's one special token, which plays BERT's [CLS]: the classifier
    # reads the final state at position 0, so that position must always hold the same token. The
    # held-out tail of each work overlaps no training passage; every genre is in both splits.
    cls, text_len = tokenizer.eos_token_id, args.block_size - 1
    splits = {split: {"input_ids": [], "labels": []} for split in ("train", "validation")}
    for work, ids in zip(corpus["work"], tokenizer(list(corpus["text"]))["input_ids"]):
        blocks = [
            [cls] + ids[i : i + text_len] for i in range(0, len(ids) - text_len + 1, text_len)
        ]
        if len(blocks) < 2:
            raise Stop(
                f"work {work!r} has {len(ids)} tokens: fewer than 2 passages of "
                f"--block_size {args.block_size}"
            )
        n_held = max(1, len(blocks) * args.validation_split_percentage // 100)
        for split, part in (("train", blocks[:-n_held]), ("validation", blocks[-n_held:])):
            splits[split]["input_ids"] += part
            splits[split]["labels"] += [GENRES.index(GENRE_OF_WORK[work])] * len(part)
    train_set, eval_set = (datasets.Dataset.from_dict(splits[s]) for s in ("train", "validation"))
    if args.max_train_samples:
        n = min(args.max_train_samples, len(train_set))
        train_set = train_set.shuffle(seed=args.seed).select(range(n))
    if args.max_eval_samples:
        eval_set = eval_set.shuffle(seed=args.seed).select(
            range(min(args.max_eval_samples, len(eval_set)))
        )
    # sample_id: the row index, carried through the loader so a run can record what each rank saw
    train_set = train_set.add_column("sample_id", list(range(len(train_set)))).with_format("torch")
    eval_set = eval_set.with_format("torch")

    # the baseline: always answer the training set's majority genre
    majority = int(torch.bincount(train_set["labels"][:], minlength=len(GENRES)).argmax())
    baseline_accuracy = (eval_set["labels"][:] == majority).float().mean().item()
    steps_per_epoch = len(train_set) // global_batch
    max_steps = (
        args.max_steps if args.max_steps > 0 else math.ceil(args.num_train_epochs * steps_per_epoch)
    )
    # The training set against the global batch, warmup against the run (common/checks.py).
    guard.data_ready(train_size=len(train_set), train_unit="passages", steps=max_steps)
    # >>> shared: loaders
    # shuffle=True + the seedable sampler: one permutation per epoch (set_epoch), the same on all
    # ranks; rank r gets every world_size-th micro batch of it. drop_last: full global batches.
    # Private generators: each iter() of a loader draws a seed from its generator, else from the
    # global RNG that dropout uses, and a resume opens an extra iterator mid-epoch.
    pin = accelerator.device.type == "cuda"  # page-locked host memory, for non-blocking copies
    train_loader = torch.utils.data.DataLoader(
        train_set,
        batch_size=args.per_device_train_batch_size,
        shuffle=True,
        drop_last=True,
        generator=torch.Generator(),
        pin_memory=pin,
        num_workers=args.dataloader_num_workers,  # the sampler, in this process, sets the order
        worker_init_fn=checkpoint.leave_signals_to_the_rank,  # a signal: the rank saves first
    )
    eval_loader = torch.utils.data.DataLoader(
        eval_set,
        batch_size=args.per_device_eval_batch_size,
        generator=torch.Generator(),
        pin_memory=pin,
        num_workers=args.dataloader_num_workers,
        worker_init_fn=checkpoint.leave_signals_to_the_rank,
    )
    # <<< shared

    # ---------------------------------------------------------------------------------------------
    # ADAPT: model. A small BERT encoder; its classification head reads the final state at [CLS].
    # ---------------------------------------------------------------------------------------------
    config = BertConfig(
        vocab_size=len(tokenizer),
        hidden_size=args.hidden_size,
        num_hidden_layers=args.num_hidden_layers,
        num_attention_heads=args.num_attention_heads,
        intermediate_size=args.intermediate_size,
        max_position_embeddings=args.block_size,
        type_vocab_size=1,
        pad_token_id=tokenizer.pad_token_id,
        num_labels=len(GENRES),
        id2label=dict(enumerate(GENRES)),
        label2id={g: i for i, g in enumerate(GENRES)},
    )
    model = BertForSequenceClassification(config)
    n_params = sum(p.numel() for p in model.parameters())
    # From here each rank draws its own dropout masks (seed + rank). The data order is unaffected:
    # the sampler reseeds its own generator from (seed, epoch). A resume restores every stream.
    set_seed(args.seed, device_specific=True)
    # Decay on weight matrices and embeddings only: LayerNorm gains centre on 1, biases are offsets.
    peak_lr = args.learning_rate
    optimizer = torch.optim.AdamW(
        models.param_groups(model, args.weight_decay),
        lr=peak_lr,
        betas=(args.adam_beta1, args.adam_beta2),
        eps=args.adam_epsilon,
    )
    lr_scheduler = schedule.lr_scheduler(optimizer, args, max_steps)  # --lr_scheduler_type

    # Resume: a verified, complete checkpoint, refused before prepare unless the data position
    # (recomputed from the step) and what the optimizer state brings back are the same; with
    # dropout, the split of the global batch too (its masks follow it).
    order = {  # what fixes which samples step k trains on
        "global_batch": global_batch,
        "seed": args.seed,
        "block_size": args.block_size,
        "train_passages": len(train_set),
    }
    # >>> shared: run state
    run_state, checked = checkpoint.run_state(accelerator, args, model, peak_lr, max_steps, **order)
    # <<< shared
    resume_path, saved = checkpoint.resume_or_start(accelerator, args, run_state, checked)
    step, strategy = saved["step"], run_state["distributed_type"]  # "FSDP2", "MULTI_CPU", ...

    model, optimizer, train_loader, eval_loader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_loader, eval_loader, lr_scheduler
    )
    workarounds.patch_model(accelerator, model)  # autocast stays; no fp32 copy of every output
    if resume_path:  # model, optimizer, scheduler, grad scaler and every rank's RNG
        checkpoint.load_checkpoint(accelerator, resume_path, model, optimizer, optimizer_steps=step)
    accelerator.print(
        f"{strategy} x{world_size} | {accelerator.mixed_precision} | {n_params / 1e6:.2f}M params"
        f" | {len(train_set)} train / {len(eval_set)} held-out passages"
        f" | global batch {global_batch} | {max_steps} steps ({steps_per_epoch} per epoch)"
        + (f" | resumed from {resume_path} at step {step}" if resume_path else "")
        + (f" ({note})" if (note := run_dir.restart_note()) else "")
    )
    # metrics.jsonl: a fresh log per run; a resume keeps the lines up to its step (no summaries)
    metrics_path = metrics.RunLog(
        accelerator, args, "ddp_classifier", step if resume_path else None
    ).path

    # ---------------------------------------------------------------------------------------------
    # Training loop. One iteration = one optimizer step = one accumulation window of micro batches.
    # ---------------------------------------------------------------------------------------------
    model.train()
    t_start, accuracy = time.perf_counter(), None
    health = precision.StepHealth(accelerator, model, saved)  # skipped steps, inf/NaN: stop
    epoch = step // steps_per_epoch
    seen = metrics.SampleIds(args.record_sample_ids, epoch)  # epochs before a resume stay empty
    # SIGTERM (preemption, a time limit), Ctrl-C or SIGHUP: a checkpoint at the next step boundary
    preempted = checkpoint.stop_on_signal(accelerator, args.ddp_timeout)
    while step < max_steps:
        train_loader.set_epoch(epoch)  # new permutation each epoch, the same on every rank
        done_in_epoch = step % steps_per_epoch  # > 0 only right after a mid-epoch resume
        batches = iter(accelerator.skip_first_batches(train_loader, done_in_epoch * accumulation))
        for _ in range(done_in_epoch, steps_per_epoch):
            lr = lr_scheduler.get_last_lr()[0]  # the LR this optimizer step applies
            window = [next(batches) for _ in range(accumulation)]
            seen.take(epoch, window)  # --record_sample_ids: pops the ids, kept on the device
            window_loss = torch.zeros((), device=accelerator.device)
            for batch in window:
                with accelerator.accumulate(model):
                    logits = model(input_ids=batch["input_ids"]).logits
                    # Every passage is labelled, all micro batches are full: the plain mean per
                    # micro batch, averaged over the window (backward divides by accumulation) and
                    # over the ranks (the all-reduce), is the mean over the global batch.
                    loss = F.cross_entropy(logits.float(), batch["labels"])  # ADAPT: loss
                    window_loss += loss.detach() / accumulation
                    accelerator.backward(loss)
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
            step += 1
            health.after_step(step, True, window_loss, norm_before_clip)  # fp16 skips
            if step % args.logging_steps == 0:  # the norm is a device tensor until now: one sync
                record = {
                    "step": step,
                    "epoch": epoch,
                    "loss": accelerator.reduce(window_loss, reduction="mean").item(),
                    "grad_norm": float(norm_before_clip),
                    "lr": lr,
                    **health.scale_fields(),  # fp16: the loss scale and skipped steps
                }
                accelerator.log(record, step=step)
                if accelerator.is_main_process:
                    metrics.append_jsonl(metrics_path, record)
                accelerator.print(
                    f"step {step}/{max_steps} | loss {record['loss']:.3f} | "
                    f"grad norm {record['grad_norm']:.2f}"
                )
            if step % steps_per_epoch == 0 or step == max_steps:  # each epoch's end, the last step
                preds, labels = evaluate(model, eval_loader, accelerator)
                accuracy = (preds == labels).float().mean().item()
                accelerator.log({"eval_accuracy": accuracy}, step=step)
                if accelerator.is_main_process:
                    metrics.append_jsonl(
                        metrics_path, {"step": step, "epoch": epoch, "eval_accuracy": accuracy}
                    )
                accelerator.print(
                    f"step {step} (epoch {epoch}) | held-out accuracy {accuracy:.3f} "
                    f"(majority baseline {baseline_accuracy:.3f})"
                )
            preempt = preempted()  # a collective: every rank stops at the same step
            save = preempt or (args.save_steps and step % args.save_steps == 0)
            # a non-finite loss or norm stops before any checkpoint or export of its weights
            problem = health.problem(save or step >= max_steps or step % args.logging_steps == 0)
            if save and not problem:  # after the eval, which a resume does not redo
                saved_to = checkpoint.save_checkpoint(
                    accelerator,
                    args.output_dir,
                    step,
                    run_state={**run_state, **health.state()},
                    hf_files=(accelerator.unwrap_model(model).config, tokenizer),
                )
            if problem or preempt:
                if not problem:
                    accelerator.print(
                        f"preempted ({preempt}) at step {step}: saved {saved_to}; "
                        "relaunch with --resume_from_checkpoint auto to continue"
                    )
                del model, optimizer
                launch.teardown(accelerator)
                if problem:
                    raise Stop(problem)
                return checkpoint.PREEMPTED_EXIT_CODE
            if step >= max_steps:
                break
        epoch += 1

    seen.write(accelerator, args.output_dir)  # --record_sample_ids: each rank its own file

    # ---------------------------------------------------------------------------------------------
    # Evaluation table; ADAPT: export (gathering the weights is a collective; rank 0 alone writes).
    # ---------------------------------------------------------------------------------------------
    if accuracy is None:  # resumed from the last step: nothing trained, evaluate what was loaded
        preds, labels = evaluate(model, eval_loader, accelerator)
        accuracy = (preds == labels).float().mean().item()
    per_genre = {
        g: ((preds == i) & (labels == i)).sum().item() / max(1, (labels == i).sum().item())
        for i, g in enumerate(GENRES)
    }
    final = checkpoint.export_model(accelerator, model, tokenizer, args.output_dir)  # final/
    if accelerator.is_main_process:
        metrics.append_jsonl(
            metrics_path,
            {
                "summary": True,
                "step": step,
                "eval_accuracy": accuracy,
                "majority_baseline": baseline_accuracy,
                "majority_genre": GENRES[majority],
                "n_eval": len(labels),
                "n_eval_passages": len(eval_set),
                "n_train_passages": len(train_set),
                "n_params": n_params,
                "world_size": world_size,
                "distributed_type": strategy,
                "skipped_steps": health.skipped_steps,
                "per_genre_recall": per_genre,
                "wall_seconds": time.perf_counter() - t_start,
            },
        )
        # recall per genre (with its number of held-out passages), then accuracy vs the baseline
        table = ["", "| genre (held-out passages) | recall |", "|---|---|"] + [
            f"| {g} ({(labels == i).sum().item()}) | {per_genre[g]:.3f} |"
            for i, g in enumerate(GENRES)
        ]
        print(
            "\n".join(
                [
                    *table,
                    "",
                    f"| held-out passages | accuracy | majority baseline ({GENRES[majority]}) |",
                    "|---|---|---|",
                    f"| {len(labels)} | {accuracy:.3f} | {baseline_accuracy:.3f} |",
                ]
            )
        )
    del model, optimizer
    launch.teardown(accelerator)  # in order: the model before the process group
    accelerator.print(
        metrics.final_line(metrics_path, f"model in {final}, metrics in {metrics_path}")
    )
    return 0


if __name__ == "__main__":
    errors.run(main)
