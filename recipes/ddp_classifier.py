"""Data-parallel basics on a real classification task: which genre is a Shakespeare passage from?

    accelerate launch --config_file accelerate_configs/ddp.yaml recipes/ddp_classifier.py
    accelerate launch --config_file accelerate_configs/fsdp.yaml recipes/ddp_classifier.py
    accelerate launch --config_file accelerate_configs/ddp.yaml --mixed_precision no recipes/ddp_classifier.py --num_train_epochs 5

Task: 128-token passages ([CLS] + 127 tokens of text) of the 42 bundled works, labelled comedy / tragedy / history / poetry
(the First Folio grouping, below). The last 10% of every work's tokens is held out: a contiguous
tail, so no held-out passage overlaps a training one, and every genre appears in both splits.
Model: a ~1M-parameter BERT encoder trained from scratch with cross-entropy.

What this recipe shows, in the order the code does it:
  * per-epoch reshuffling that stays correct across ranks: a seeded sampler plus `set_epoch`,
    so each epoch is a new permutation, the same on every rank, of which each rank takes a
    disjoint share (forgetting `set_epoch` replays epoch 0's order forever);
  * gradient clipping on the global gradient norm, taken in fp64 (`common/grad_norm.py`);
  * accuracy with `gather_for_metrics`, which drops the samples Accelerate repeats to even out
    the last batch, so every held-out passage counts exactly once, against the majority baseline;
  * only the main process logs and writes; the export gathers the full weights on all ranks (a
    collective) and rank 0 writes them once, as safetensors.

Outputs in --output_dir: metrics.jsonl (logging steps, one eval line per epoch, a summary line),
final/ (config.json + model.safetensors + tokenizer) and, with --record_sample_ids,
sample_ids/rank{r}.json (written by rank r alone: the sample ids it trained on, per epoch).
"""

import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import datasets
import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, DistributedType, set_seed
from transformers import BertConfig, BertForSequenceClassification, HfArgumentParser, get_linear_schedule_with_warmup

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere, no install step
from common import data, grad_norm, launch, metrics  # noqa: E402

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
    # data and tokenizer
    block_size: int = field(default=128, metadata={"help": "tokens per passage, the [CLS] token included"})
    validation_split_percentage: int = field(default=10, metadata={"help": "held-out tail of every work, in %"})
    max_train_samples: int = field(default=None, metadata={"help": "train on a seeded random subset (quick runs)"})
    tokenizer_name_or_path: str = field(default=None, metadata={"help": "default: the project's corpus BPE"})
    vocab_size: int = 4096
    cache_dir: str = data.DEFAULT_CACHE_DIR
    # model: a small BERT encoder, trained from scratch
    hidden_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 2
    intermediate_size: int = 512
    # optimisation (transformers.TrainingArguments names)
    output_dir: str = "runs/ddp_classifier"
    seed: int = 42
    per_device_train_batch_size: int = 32
    per_device_eval_batch_size: int = 64
    learning_rate: float = 1e-3
    weight_decay: float = 0.01
    max_grad_norm: float = 1.0
    warmup_steps: int = 30
    num_train_epochs: int = 2
    logging_steps: int = 20
    record_sample_ids: bool = field(default=False, metadata={"help": "each rank writes the sample ids it saw"})
    ddp_timeout: int = field(default=1800, metadata={"help": "collective timeout in seconds"})


args = HfArgumentParser(Args).parse_args_into_dataclasses()[0]
if not 0 < args.validation_split_percentage < 100:
    sys.exit(f"error: --validation_split_percentage must be in (0, 100), got {args.validation_split_percentage}")

# ---------------------------------------------------------------------------------------------
# Accelerator: DDP, FSDP or ZeRO comes from the accelerate config. The seedable sampler makes the
# shuffle a function of (seed, epoch) alone, so every rank draws the same permutation.
# ---------------------------------------------------------------------------------------------
accelerator = Accelerator(
    dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=args.seed),
    step_scheduler_with_optimizer=False,  # else the LR scheduler advances world_size times per step
    kwargs_handlers=[launch.cpu_process_group_kwargs(args.ddp_timeout)],  # real gloo ranks on CPU
)
launch.check_distributed(accelerator)  # refuse to "train distributed" as independent processes
if error := grad_norm.clip_threshold_error(accelerator, args.max_grad_norm):  # DeepSpeed clips by its JSON
    sys.exit(f"error: {error}")
if accelerator.distributed_type == DistributedType.FSDP:
    # The shared fsdp.yaml names the Llama block as the unit to shard; this model's block is BertLayer.
    accelerator.state.fsdp_plugin.transformer_cls_names_to_wrap = ["BertLayer"]
set_seed(args.seed)  # same seed on every rank: identical initial weights
world_size, rank = accelerator.num_processes, accelerator.process_index
if accelerator.is_main_process:
    os.makedirs(args.output_dir, exist_ok=True)

# ---------------------------------------------------------------------------------------------
# Data: passages of block_size tokens; each work's tail is held out.
# ---------------------------------------------------------------------------------------------
with accelerator.main_process_first():  # rank 0 trains (or loads) the cached tokenizer first
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
        raise ValueError(f"work {work!r} has {len(ids)} tokens: fewer than 2 passages of --block_size {args.block_size}")
    n_held = max(1, len(blocks) * args.validation_split_percentage // 100)
    for split, part in (("train", blocks[:-n_held]), ("validation", blocks[-n_held:])):
        splits[split]["input_ids"] += part
        splits[split]["labels"] += [GENRES.index(GENRE_OF_WORK[work])] * len(part)
train_set = datasets.Dataset.from_dict(splits["train"])
eval_set = datasets.Dataset.from_dict(splits["validation"])
if args.max_train_samples:
    train_set = train_set.shuffle(seed=args.seed).select(range(min(args.max_train_samples, len(train_set))))
# sample_id: the row index, carried through the loader so a run can record what each rank saw
train_set = train_set.add_column("sample_id", list(range(len(train_set)))).with_format("torch")
eval_set = eval_set.with_format("torch")

train_counts = torch.bincount(train_set["labels"][:], minlength=len(GENRES))
majority = int(train_counts.argmax())  # the baseline: always answer the training set's majority genre
eval_labels = eval_set["labels"][:]
baseline_accuracy = (eval_labels == majority).float().mean().item()
global_batch = args.per_device_train_batch_size * world_size
if len(train_set) < global_batch:
    raise ValueError(f"{len(train_set)} training passages: fewer than one global batch of {global_batch} "
                     f"(= {args.per_device_train_batch_size} per device x {world_size} ranks)")
# shuffle=True + the seedable sampler: a new permutation per epoch (set_epoch), the same on every
# rank; rank r gets batches r, r + world_size, ... of it. drop_last: every step is a full batch.
train_loader = torch.utils.data.DataLoader(train_set, batch_size=args.per_device_train_batch_size,
                                           shuffle=True, drop_last=True)
eval_loader = torch.utils.data.DataLoader(eval_set, batch_size=args.per_device_eval_batch_size)

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
optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=args.weight_decay)
steps_per_epoch = len(train_set) // global_batch
max_steps = steps_per_epoch * args.num_train_epochs
lr_scheduler = get_linear_schedule_with_warmup(optimizer, args.warmup_steps, max_steps)

model, optimizer, train_loader, eval_loader, lr_scheduler = accelerator.prepare(
    model, optimizer, train_loader, eval_loader, lr_scheduler)
accelerator.print(
    f"{str(accelerator.distributed_type).split('.')[-1]} x{world_size} | {accelerator.mixed_precision} | "
    f"{n_params / 1e6:.2f}M params | {len(train_set)} train / {len(eval_set)} held-out passages | "
    f"global batch {global_batch} | {args.num_train_epochs} epochs x {steps_per_epoch} steps")
metrics_path = os.path.join(args.output_dir, "metrics.jsonl")
if accelerator.is_main_process:
    open(metrics_path, "w").close()  # a fresh log per run


@torch.no_grad()
def evaluate():
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


# ---------------------------------------------------------------------------------------------
# Training loop
# ---------------------------------------------------------------------------------------------
model.train()
step, t_start, seen = 0, time.perf_counter(), []
for epoch in range(args.num_train_epochs):
    train_loader.set_epoch(epoch)  # new permutation each epoch, the same on every rank
    seen.append([])
    for batch in train_loader:
        logits = model(input_ids=batch["input_ids"]).logits
        loss = F.cross_entropy(logits.float(), batch["labels"])  # mean nats per passage on this rank
        accelerator.backward(loss)  # DDP/FSDP average the gradients over ranks
        norm_before_clip = grad_norm.clip_grad_norm_(accelerator, model, args.max_grad_norm)  # global norm
        optimizer.step()
        lr_scheduler.step()
        optimizer.zero_grad()
        step += 1
        seen[-1] += batch["sample_id"].tolist()
        if step % args.logging_steps == 0:
            record = {"step": step, "epoch": epoch,
                      "loss": accelerator.reduce(loss.detach(), reduction="mean").item(),
                      "grad_norm": norm_before_clip,
                      "lr": lr_scheduler.get_last_lr()[0]}
            if accelerator.is_main_process:
                metrics.append_jsonl(metrics_path, record)
            accelerator.print(f"step {step}/{max_steps} | loss {record['loss']:.3f} | grad norm {record['grad_norm']:.2f}")
    preds, labels = evaluate()
    accuracy = (preds == labels).float().mean().item()
    if accelerator.is_main_process:
        metrics.append_jsonl(metrics_path, {"step": step, "epoch": epoch, "eval_accuracy": accuracy})
    accelerator.print(f"epoch {epoch} | held-out accuracy {accuracy:.3f} (majority baseline {baseline_accuracy:.3f})")

if args.record_sample_ids:  # one file per rank, each written by its own rank only
    os.makedirs(os.path.join(args.output_dir, "sample_ids"), exist_ok=True)
    with open(os.path.join(args.output_dir, "sample_ids", f"rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "world_size": world_size, "epochs": seen}, f)

# ---------------------------------------------------------------------------------------------
# Evaluation table and export. full_state_dict is a collective (every rank), the write is not.
# ---------------------------------------------------------------------------------------------
per_genre = {g: ((preds == i) & (labels == i)).sum().item() / max(1, (labels == i).sum().item())
             for i, g in enumerate(GENRES)}
state_dict = launch.full_state_dict(accelerator, model)
final_dir = os.path.join(args.output_dir, "final")
accelerator.unwrap_model(model).save_pretrained(final_dir, is_main_process=accelerator.is_main_process,
                                                save_function=accelerator.save, state_dict=state_dict)
if accelerator.is_main_process:
    tokenizer.save_pretrained(final_dir)
    summary = {"summary": True, "step": step, "eval_accuracy": accuracy, "majority_baseline": baseline_accuracy,
               "majority_genre": GENRES[majority], "n_eval": len(labels), "n_eval_passages": len(eval_set),
               "n_train_passages": len(train_set), "n_params": n_params, "world_size": world_size,
               "distributed_type": accelerator.distributed_type.value,
               "per_genre_recall": per_genre, "wall_seconds": time.perf_counter() - t_start}
    metrics.append_jsonl(metrics_path, summary)
    print(f"\n| genre (held-out passages) | recall |\n|---|---|")
    for i, g in enumerate(GENRES):
        print(f"| {g} ({(labels == i).sum().item()}) | {per_genre[g]:.3f} |")
    print(f"\n| held-out passages | accuracy | majority baseline ({GENRES[majority]}) |\n|---|---|---|\n"
          f"| {len(labels)} | {accuracy:.3f} | {baseline_accuracy:.3f} |")
# Orderly teardown (seen hanging or aborting now and then in gloo's destructor, torch 2.13 CPU):
# no rank destroys the process group while a peer still uses it, and the wrapped model (DDP's
# reducer holds the group) goes before the group.
accelerator.wait_for_everyone()
del model, optimizer
accelerator.free_memory()
accelerator.end_training()
