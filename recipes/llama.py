"""Train a Llama language model with DDP, FSDP2, FSDP1 or DeepSpeed ZeRO: the config file decides.

    accelerate launch --config_file accelerate_configs/fsdp.yaml recipes/llama.py
    accelerate launch --config_file accelerate_configs/ddp.yaml recipes/llama.py --max_steps 30
    accelerate launch --config_file accelerate_configs/deepspeed_zero3.yaml --mixed_precision bf16 recipes/llama.py
    accelerate launch --config_file accelerate_configs/single.yaml --mixed_precision no recipes/llama.py

Defaults: the bundled Shakespeare corpus, a 4,096-token byte-level BPE trained on it, and the
~4.2M-parameter `debug` Llama; 300 optimizer steps of a 16-sequence global batch. On a CPU-only
host the same commands run 2 real ranks over gloo (see common/launch.py).

Batch arithmetic (the names used throughout):
    global batch = per_device_train_batch_size x gradient_accumulation_steps x world size
Optimizer step k always sees global-batch samples k*G .. (k+1)*G-1 of the epoch's permutation,
whatever the split between micro batch, accumulation and world size (see README).

Outputs in --output_dir: metrics.jsonl (one line per logging step, then a summary), run_info.json
(what the run really was), checkpoint-N/ (--save_steps), final/ (HF format, safetensors).
"""

import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, DistributedType, GradientAccumulationPlugin, set_seed
from tqdm.auto import tqdm
from transformers import AutoConfig, AutoModelForCausalLM, HfArgumentParser, LlamaForCausalLM, get_cosine_schedule_with_warmup

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere, no install step
from common import checkpoint, data, grad_norm, launch, metrics, models, precision, schedule  # noqa: E402


@dataclass
class Args:
    # model and tokenizer
    model_config: str = field(default="debug", metadata={"help": f"preset: {', '.join(models.PRESETS)}"})
    model_name_or_path: str = field(default=None, metadata={"help": "pretrained weights (fine-tuning) instead of a preset"})
    tokenizer_name_or_path: str = field(default=None, metadata={"help": "default: a byte-level BPE trained on the corpus"})
    vocab_size: int = field(default=4096, metadata={"help": "size of the BPE trained when no tokenizer is given"})
    # data (transformers run_clm conventions)
    dataset_name: str = None
    dataset_config_name: str = None
    train_file: str = field(default=None, metadata={"help": ".txt, .json/.jsonl or .parquet with a 'text' column"})
    validation_file: str = None
    validation_split_percentage: int = 5
    block_size: int = 256
    packing: bool = field(default=True, metadata={"help": "concatenate rows into blocks; false: one padded row each"})
    max_eval_samples: int = field(default=None, metadata={"help": "cap on validation blocks per evaluation"})
    cache_dir: str = data.DEFAULT_CACHE_DIR
    # optimisation (transformers.TrainingArguments names)
    output_dir: str = "runs/llama"
    seed: int = 42
    per_device_train_batch_size: int = 8
    per_device_eval_batch_size: int = 8
    gradient_accumulation_steps: int = 1
    learning_rate: float = 3e-3
    scale_lr: bool = field(default=False, metadata={"help": "linear scaling rule vs --reference_global_batch"})
    reference_global_batch: int = field(default=16, metadata={"help": "global batch --learning_rate was tuned at"})
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_epsilon: float = 1e-8
    max_grad_norm: float = 1.0  # clip to this global norm; 0 logs the norm and clips nothing
    warmup_steps: int = 30
    max_steps: int = field(default=300, metadata={"help": "optimizer steps; -1 derives them from num_train_epochs"})
    num_train_epochs: float = 1.0
    gradient_checkpointing: bool = False
    # logging, evaluation, checkpoints
    logging_steps: int = 10
    eval_steps: int = 100
    save_steps: int = field(default=0, metadata={"help": "checkpoint every N optimizer steps; 0 = never"})
    save_total_limit: int = None
    resume_from_checkpoint: str = field(default=None, metadata={"help": "a checkpoint path, or 'latest'"})
    report_to: str = field(default="tensorboard", metadata={"help": "Accelerate tracker(s), or 'none'"})
    peak_tflops: float = field(default=None, metadata={"help": "device peak for MFU; default from a GPU table"})
    ddp_timeout: int = field(default=1800, metadata={"help": "collective timeout in seconds"})


try:
    args = HfArgumentParser(Args).parse_args_into_dataclasses()[0]
except ValueError as err:  # e.g. an unknown flag
    sys.exit(f"error: {err}")
if args.model_name_or_path is None and args.model_config not in models.PRESETS:
    sys.exit(f"error: unknown --model_config {args.model_config!r}; choose one of {sorted(models.PRESETS)}")
for flag in ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps",
             "block_size", "logging_steps", "eval_steps"):
    if getattr(args, flag) < 1:
        sys.exit(f"error: --{flag} must be at least 1, got {getattr(args, flag)}")

# ---------------------------------------------------------------------------------------------
# Accelerator. Everything about the strategy comes from the accelerate config; the recipe only
# says how to accumulate and keeps the data order seeded and identical on every rank.
# ---------------------------------------------------------------------------------------------
try:
    pg_kwargs = launch.cpu_process_group_kwargs(args.ddp_timeout)  # no-op on GPUs, real gloo ranks on CPU
except ValueError as err:
    sys.exit(f"error: {err}")
accelerator = Accelerator(
    # we prefetch whole accumulation windows, so sync on the step count, not the dataloader end
    gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=args.gradient_accumulation_steps,
                                                            sync_with_dataloader=False),
    dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=args.seed),
    step_scheduler_with_optimizer=False,  # we step the LR once per optimizer update, on every world size
    log_with=None if args.report_to == "none" else args.report_to,
    project_dir=args.output_dir,
    kwargs_handlers=[pg_kwargs],
)
is_fsdp = accelerator.distributed_type == DistributedType.FSDP
is_deepspeed = accelerator.distributed_type == DistributedType.DEEPSPEED
try:
    launch.check_distributed(accelerator)  # refuse to "train distributed" as independent processes
    launch.install_cpu_grad_scaler(accelerator)  # fp16 on CPU ranks: Accelerate builds no GradScaler there
except ValueError as err:
    sys.exit(f"error: {err}")
# FSDP: compute in bf16/fp16 but reduce gradients (and return the loss) in fp32; summing
# low-precision gradients across ranks is where most of the precision is lost.
precision.keep_fp32_reduction(accelerator)
if error := grad_norm.clip_threshold_error(accelerator, args.max_grad_norm):
    sys.exit(f"error: {error}")
set_seed(args.seed)  # same seed on every rank: identical initial weights, so no broadcast needed
os.makedirs(args.output_dir, exist_ok=True)

# ---------------------------------------------------------------------------------------------
# Data: tokenize and pack once (rank 0 first, the others read its cache), then shard by rank.
# ---------------------------------------------------------------------------------------------
# Bad input (missing file, tiny corpus, oversized block) exits with one clear line on every rank:
# every rank reads the raw text itself, so every rank meets the same error.
try:
    raw = data.load_text_dataset(args.dataset_name, args.dataset_config_name, args.train_file,
                                 args.validation_file, args.validation_split_percentage)
    with accelerator.main_process_first():
        tokenizer = data.get_tokenizer(args.tokenizer_name_or_path or args.model_name_or_path, raw,
                                       args.vocab_size, args.cache_dir)
        model_max = (AutoConfig.from_pretrained(args.model_name_or_path).max_position_embeddings
                     if args.model_name_or_path else models.PRESETS[args.model_config]["max_position_embeddings"])
        if args.block_size > model_max:
            raise ValueError(f"--block_size {args.block_size} exceeds the model's max_position_embeddings {model_max}")
        lm_data = data.pack_dataset(raw, tokenizer, args.block_size, args.cache_dir, args.packing).with_format("torch")
except (ValueError, FileNotFoundError, OSError) as err:
    sys.exit(f"error: {err}")
train_set, eval_set = lm_data["train"], lm_data["validation"]
if args.max_eval_samples:
    eval_set = eval_set.select(range(min(args.max_eval_samples, len(eval_set))))

world_size = accelerator.num_processes
global_batch = args.per_device_train_batch_size * args.gradient_accumulation_steps * world_size
if len(train_set) < global_batch:
    sys.exit(f"error: the training split has {len(train_set)} blocks of {args.block_size} tokens, fewer than one "
                     f"global batch of {global_batch} (= {args.per_device_train_batch_size} per device x "
                     f"{args.gradient_accumulation_steps} accumulation x {world_size} ranks)")
# shuffle=True + the seedable sampler: one permutation per epoch (set_epoch), the same on all
# ranks; Accelerate gives rank r every world_size-th micro batch of it. drop_last keeps every
# optimizer step a full global batch.
train_loader = torch.utils.data.DataLoader(train_set, batch_size=args.per_device_train_batch_size,
                                           shuffle=True, drop_last=True)
eval_loader = torch.utils.data.DataLoader(eval_set, batch_size=args.per_device_eval_batch_size)

# ---------------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------------
if args.model_name_or_path:
    model = AutoModelForCausalLM.from_pretrained(args.model_name_or_path, dtype=torch.float32)
else:
    config = models.llama_config(args.model_config, vocab_size=len(tokenizer), bos_token_id=tokenizer.eos_token_id,
                                 eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)
    if is_deepspeed and accelerator.state.deepspeed_plugin.zero3_init_flag:
        # built already sharded (deepspeed.zero.Init), for models too big for one device; its
        # random init differs from the plain one, so the strategies no longer start identical
        model = AutoModelForCausalLM.from_config(config)
    else:
        model = LlamaForCausalLM(config)  # fp32 master weights; the launch config picks compute precision
if args.gradient_checkpointing:
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
model.config.use_cache = False
n_params = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())  # ds_numel: ZeRO-3 pre-sharded
flops_per_token = metrics.flops_per_token(model.config, args.block_size)

# A bigger global batch averages away gradient noise, so it tolerates a bigger LR (linear
# scaling rule), but only after a warmup. Without either, a large batch just trains slower.
peak_lr = schedule.scaled_learning_rate(args.learning_rate, global_batch, args.reference_global_batch) \
    if args.scale_lr else args.learning_rate
accelerator.print(f"LR: base {args.learning_rate:g} (tuned at global batch {args.reference_global_batch}), "
                  f"effective {peak_lr:g} at global batch {global_batch}, {args.warmup_steps} warmup steps")
if global_batch > args.reference_global_batch and (not args.scale_lr or args.warmup_steps == 0):
    accelerator.print(f"warning: global batch {global_batch} > {args.reference_global_batch} without "
                      f"{'--scale_lr' if not args.scale_lr else '--warmup_steps'}: expect slower or unstable training")

# AdamW without weight decay on norms (1-D tensors), as in most LLM recipes. (Under ZeRO-3
# transformers builds the model already partitioned, with empty tensors: ds_shape is the real one.)
matrices = [p for p in model.parameters() if len(getattr(p, "ds_shape", p.shape)) >= 2]
vectors = [p for p in model.parameters() if len(getattr(p, "ds_shape", p.shape)) < 2]
groups = [{"params": matrices, "weight_decay": args.weight_decay}, {"params": vectors, "weight_decay": 0.0}]
optimizer = torch.optim.AdamW(groups, lr=peak_lr, betas=(args.adam_beta1, args.adam_beta2),
                              eps=args.adam_epsilon)
updates_per_epoch = len(train_set) // global_batch
max_steps = args.max_steps if args.max_steps > 0 else math.ceil(args.num_train_epochs * updates_per_epoch)
lr_scheduler = get_cosine_schedule_with_warmup(optimizer, args.warmup_steps, max_steps)

# Resume: a verified, complete checkpoint; the data position follows from the step count, so the
# global batch must be unchanged, and sharded states (FSDP, ZeRO) need the same world size.
# Checked before prepare, so a refused resume leaves before any wrapped model exists.
try:
    resume_path, saved = checkpoint.resolve_checkpoint(args.output_dir, args.resume_from_checkpoint)
except (ValueError, FileNotFoundError) as err:
    sys.exit(f"error: cannot resume: {err}")
step = saved["step"]
strategy = accelerator.distributed_type.value + (  # the ZeRO stage / FSDP version matters on resume too
    f"_ZERO{accelerator.state.deepspeed_plugin.zero_stage}" if is_deepspeed else "2" if is_fsdp and accelerator.is_fsdp2
    else "1" if is_fsdp else "")
# What fixes the data order besides the global batch: the seed, the blocks and their number.
data_state = {"seed": args.seed, "block_size": args.block_size, "packing": args.packing, "train_blocks": len(train_set)}
run_state = {"world_size": world_size, "global_batch": global_batch, "distributed_type": strategy,
             "max_steps": max_steps, **data_state}
if resume_path:
    if saved["global_batch"] != global_batch:
        sys.exit(f"error: {resume_path} was trained with global batch {saved['global_batch']}, this run has "
                 f"{global_batch}; keep per_device_train_batch_size x gradient_accumulation_steps x world size equal")
    changed = [f"{k} {saved[k]} -> {v}" for k, v in data_state.items() if k in saved and saved[k] != v]
    if changed:  # the step alone would then point into a different data order
        sys.exit(f"error: {resume_path} was trained on other data or order ({', '.join(changed)}); resume with the "
                 "same --seed, --block_size, --packing and data, or start over from its weights (--model_name_or_path)")
    if saved.get("max_steps", max_steps) != max_steps:  # allowed (training longer), but not exact
        accelerator.print(f"warning: {resume_path} was saved by a {saved['max_steps']}-step run, this one has "
                          f"{max_steps}: the LR schedule follows the new length from here, which matches the old "
                          "run only while both are still in warmup")
    replicated = {"NO", "MULTI_CPU", "MULTI_GPU"}  # full model state on every rank: any world size
    if not ({saved["distributed_type"], strategy} <= replicated) and (
            saved["distributed_type"] != strategy or saved["world_size"] != world_size):
        sys.exit(f"error: {resume_path} holds a {saved['distributed_type']} state of {saved['world_size']} rank(s); "
                 f"this run is {strategy} with {world_size}. Sharded (FSDP, ZeRO) checkpoints "
                 "resume on the same strategy and world size; convert one with common/consolidate.py and pass "
                 "--model_name_or_path to start over from its weights. DDP/single ones may change world size.")

# ---------------------------------------------------------------------------------------------
# accelerator.prepare: wraps/shards the model (DDP, FSDP, ZeRO), the optimizer and the loaders.
# ---------------------------------------------------------------------------------------------
model, optimizer, train_loader, eval_loader, lr_scheduler = accelerator.prepare(
    model, optimizer, train_loader, eval_loader, lr_scheduler)
device = accelerator.device
run_info = {
    "distributed_type": accelerator.distributed_type.value, "world_size": world_size,
    "mixed_precision": accelerator.mixed_precision, "global_batch": global_batch, "n_params": n_params,
    "local_param_elements": accelerator.gather(
        torch.tensor([metrics.local_parameter_elements(model)], device=device)).tolist(),
    "updates_per_epoch": updates_per_epoch, "max_steps": max_steps, "flops_per_token": flops_per_token,
    "args": asdict(args),
}
accelerator.print(f"{run_info['distributed_type']} x{world_size} | {accelerator.mixed_precision} | "
                  f"{n_params / 1e6:.2f}M params | global batch {global_batch} | {max_steps} steps")

if resume_path:
    checkpoint.load_checkpoint(accelerator, resume_path, model, optimizer)  # + scheduler, scaler, per-rank RNG
    accelerator.print(f"resumed from {resume_path} at step {step}")
metrics_path = os.path.join(args.output_dir, "metrics.jsonl")
if accelerator.is_main_process:
    with open(os.path.join(args.output_dir, "run_info.json"), "w") as f:
        json.dump(run_info, f, indent=1)
    # tracker continuity: keep the step lines up to the resumed step, drop later ones and summaries
    kept = [] if not (resume_path and os.path.exists(metrics_path)) else [
        line for line in open(metrics_path) if not json.loads(line).get("summary") and json.loads(line)["step"] <= step]
    with open(metrics_path, "w") as f:
        f.writelines(kept)
accelerator.init_trackers("llama", config={k: v for k, v in asdict(args).items() if v is not None})


@torch.no_grad()
def evaluate():
    """Token-weighted mean eval loss in nats/token; each eval block counted exactly once."""
    model.eval()
    loss_sum, n_tokens = torch.zeros((), device=device), torch.zeros((), device=device)
    for batch in eval_loader:
        logits = model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask")).logits.float()
        targets = batch["labels"][:, 1:]
        per_token = F.cross_entropy(logits[:, :-1].flatten(0, 1), targets.flatten(), reduction="none", ignore_index=-100)
        per_sample = per_token.view(targets.shape).sum(1)  # nats per block
        # gather_for_metrics drops the samples Accelerate duplicated to even out the last batch
        sums, counts = accelerator.gather_for_metrics((per_sample, (targets != -100).sum(1)))
        loss_sum += sums.sum()
        n_tokens += counts.sum()
    model.train()
    return (loss_sum / n_tokens).item()


# ---------------------------------------------------------------------------------------------
# Training loop. One iteration = one optimizer step = one accumulation window of micro batches.
# ---------------------------------------------------------------------------------------------
model.train()
progress = tqdm(total=max_steps, initial=step, disable=not accelerator.is_local_main_process, desc="train")
window_tokens, data_wait, t_window, t_start = 0, 0.0, time.perf_counter(), time.perf_counter()
tokens_seen = step * global_batch * args.block_size
epoch = step // updates_per_epoch
while step < max_steps:
    train_loader.set_epoch(epoch)  # new permutation each epoch, the same on every rank
    done_in_epoch = step % updates_per_epoch  # > 0 only right after a mid-epoch resume
    loader = accelerator.skip_first_batches(train_loader, done_in_epoch * args.gradient_accumulation_steps)
    batches = iter(loader)
    for _ in range(done_in_epoch, updates_per_epoch):
        lr = lr_scheduler.get_last_lr()[0]  # the LR this optimizer step applies
        t0 = time.perf_counter()
        window = [next(batches) for _ in range(args.gradient_accumulation_steps)]
        data_wait += time.perf_counter() - t0
        # Token-weighted accumulation: normalise by the target tokens of the whole window on all
        # ranks, so the gradient equals the one of the full global batch even with padding.
        # Scaling by (accumulation x world size) undoes the mean that backward/all-reduce apply.
        local_items = sum((b["labels"][:, 1:] != -100).sum() for b in window)
        num_items = accelerator.reduce(local_items.clone(), reduction="sum").item()
        loss_total = torch.zeros((), device=device)
        for batch in window:
            with accelerator.accumulate(model):
                loss = model(**batch, num_items_in_batch=num_items).loss  # sum of token losses / num_items
                loss_total += loss.detach()
                accelerator.backward(loss * args.gradient_accumulation_steps * world_size)
                if accelerator.sync_gradients:  # the last micro batch of the window
                    # The global norm in fp64, so every strategy reports and clips with the same number
                    norm_before_clip = grad_norm.clip_grad_norm_(accelerator, model, args.max_grad_norm)
                optimizer.step()  # no-op until the window's last micro batch
                if accelerator.sync_gradients:
                    lr_scheduler.step()
                optimizer.zero_grad()
        step += 1
        progress.update(1)
        window_tokens += sum(b["input_ids"].numel() for b in window)  # tokens this rank trained on
        tokens_seen += global_batch * args.block_size

        do_eval = step % args.eval_steps == 0 or step == max_steps
        if step % args.logging_steps == 0 or do_eval:
            elapsed = time.perf_counter() - t_window
            record = {
                "step": step, "epoch": epoch,
                "loss": accelerator.reduce(loss_total, reduction="sum").item(),  # mean nats/token of the window
                "lr": lr,
                "grad_norm": norm_before_clip,
                "tokens_per_second": window_tokens / elapsed,  # per device
                "data_wait_share": data_wait / elapsed,
                "peak_memory_bytes": metrics.peak_memory_bytes(device),
            }
            peak = metrics.peak_flops(device, args.peak_tflops)
            if peak:
                record["mfu"] = flops_per_token * record["tokens_per_second"] / peak
            if do_eval:
                record["eval_loss"] = evaluate()
            accelerator.log(record, step=step)
            if accelerator.is_main_process:
                metrics.append_jsonl(metrics_path, record)
            progress.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_second']:.0f}")
            window_tokens, data_wait, t_window = 0, 0.0, time.perf_counter()
        if args.save_steps and step % args.save_steps == 0:
            checkpoint.save_checkpoint(accelerator, args.output_dir, step, args.save_total_limit, run_state,
                                       hf_files=(accelerator.unwrap_model(model).config, tokenizer))
        if step >= max_steps:
            break
    epoch += 1
progress.close()

# ---------------------------------------------------------------------------------------------
# Export: gather the full state dict on every rank (a collective), write from rank 0 only.
# ---------------------------------------------------------------------------------------------
final_dir = os.path.join(args.output_dir, "final")
state_dict = launch.full_state_dict(accelerator, model)
unwrapped = accelerator.unwrap_model(model)
if state_dict and unwrapped.config.tie_word_embeddings:  # (non-zero ranks may hold none)
    state_dict.pop("lm_head.weight", None)  # gathered copies no longer share storage: store the tie once, as HF does
unwrapped.save_pretrained(final_dir, is_main_process=accelerator.is_main_process,
                          save_function=accelerator.save, state_dict=state_dict)
if accelerator.is_main_process:
    tokenizer.save_pretrained(final_dir)
# A fixed batch's logits from the live (still sharded) model: tests compare the export to them.
with torch.no_grad():
    probe = eval_set[:2]["input_ids"].to(device)
    model.eval()
    live_logits = model(input_ids=probe).logits.float().cpu()
accelerator.wait_for_everyone()
if accelerator.is_main_process:
    from safetensors.torch import save_file
    save_file({"input_ids": probe.cpu(), "logits": live_logits}, os.path.join(args.output_dir, "final_logits.safetensors"))
    summary = {"summary": True, "step": step, "total_tokens": tokens_seen, "wall_seconds": time.perf_counter() - t_start,
               "peak_memory_bytes": metrics.peak_memory_bytes(device)}
    metrics.append_jsonl(metrics_path, summary)
    # Reload with plain transformers (no project code) and sample, proving the export works.
    if is_deepspeed:
        from transformers.integrations import unset_hf_deepspeed_config
        unset_hf_deepspeed_config()  # else from_pretrained would build a ZeRO-3-partitioned model
    reloaded = AutoModelForCausalLM.from_pretrained(final_dir)
    prompt = tokenizer("ROMEO:", return_tensors="pt")
    sample = reloaded.generate(**prompt, max_new_tokens=40, do_sample=True, top_k=50, pad_token_id=tokenizer.eos_token_id)
    print(f"--- sample from {final_dir} ---\n{tokenizer.decode(sample[0])}\n---")
# Orderly teardown (seen hanging or aborting now and then in gloo's destructor, torch 2.13 CPU):
# no rank destroys the process group while a peer still uses it, and the wrapped model (DDP's
# reducer holds the group) goes before the group.
accelerator.wait_for_everyone()
del model, optimizer
accelerator.free_memory()
accelerator.end_training()
