r"""Fine-tune a pretrained causal LM on chat data, full or LoRA, with DDP, FSDP2, FSDP1 or ZeRO.

    accelerate launch --config_file accelerate_configs/fsdp.yaml recipes/sft.py \
        --model_name_or_path runs/llama/final --use_peft
    accelerate launch --config_file accelerate_configs/deepspeed_zero3.yaml recipes/sft.py \
        --model_name_or_path my_model --train_file chats.jsonl --chat_template my.jinja

recipes/llama.py, adapted: the diff between the two files is the lesson. Each row of the data
is one conversation, a `messages` column (the Hugging Face chat format) or `prompt` and
`completion`, rendered by the tokenizer's chat template (--chat_template where it has none).
The loss is on the assistant's tokens only (--assistant_only_loss false: on every token). Rows
are padded to --max_length (longer ones lose their tail, counted) or packed without attending to
each other (--packing documents). --use_peft trains LoRA adapters (peft) on the frozen base.
To adapt the code, find the `# ADAPT:` markers: data, model, loss, export.

Defaults: the bundled chat set (data/chat/, made from the bundled corpus by data/make_chat.py),
60 optimizer steps of a 16-conversation global batch. Outputs in --output_dir: as llama.py's,
and with --use_peft, final/ holds the merged model and final/adapter/ the adapter alone.
"""

import gc
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

gc.collect()  # the process's earlier garbage (a notebook's), before imports_done freezes
gc.disable()  # the imports below run without it: launch.imports_done()
import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, GradientAccumulationPlugin, set_seed
from tqdm.auto import tqdm
from peft import LoraConfig, get_peft_model
from transformers import AutoConfig

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere, no install
from common import causal_lm, checkpoint, checks, data, errors, grad_norm, launch, run_dir
from common import metrics, models, precision, schedule, workarounds
from common.args import choice, flag, make_output_dir, parse_args

launch.imports_done()  # garbage collection back on, the imports' objects frozen
CHAT = Path(__file__).resolve().parent.parent / "data" / "chat"  # the bundled chat set


@dataclass
class Args:
    """Flags of this recipe (the data ones as in run_clm); common/args.py has the core ones."""

    model_name_or_path: str = flag(None, "the pretrained model to fine-tune (required)")
    tokenizer_name_or_path: str = flag(None, "default: the model's")
    chat_template: str = flag(None, "a Jinja chat template file, for a tokenizer that has none")
    assistant_only_loss: bool = flag(True, "loss on the assistant's tokens only; false: on all")
    dataset_name: str = None
    dataset_config_name: str = None
    train_file: str = flag(
        None,
        ".json/.jsonl/.parquet with a 'messages' column, or 'prompt' and "
        "'completion'; default: the bundled chat set",
    )
    validation_file: str = None
    validation_split_percentage: int = flag(5, "% held out if no validation set", low=1, high=99)
    max_length: int = flag(256, "tokens per sequence: a longer conversation loses its tail", low=2)
    packing: str = choice(
        ("none", "documents"),
        {"false": "none"},
        "pad each row, or pack rows that never attend to each other",
    )
    use_peft: bool = flag(False, "train LoRA adapters on the frozen model")
    lora_r: int = flag(16, "LoRA rank", low=1)
    lora_alpha: int = flag(32, "LoRA scaling numerator (scale: alpha / r)", low=1)
    lora_dropout: float = flag(0.05, "dropout on the adapters' input", low=0, high=1)
    lora_target_modules: str = flag("all-linear", "comma list of module names, or all-linear")
    max_eval_samples: int = flag(None, "cap on validation blocks per eval; default: all", low=1)
    cache_dir: str = data.DEFAULT_CACHE_DIR
    per_device_eval_batch_size: int = flag(None, "default: --per_device_train_batch_size", low=1)
    scale_lr: bool = flag(False, "linear scaling rule vs --reference_global_batch")
    reference_global_batch: int = flag(16, "global batch --learning_rate was tuned at", low=1)
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_epsilon: float = 1e-8
    gradient_checkpointing: bool = False
    eval_steps: int = flag(20, "evaluate every N optimizer steps, and at the end", low=1)
    save_total_limit: int = flag(None, "keep only the newest N complete checkpoints", low=1)
    peak_tflops: float = flag(None, "device peak for MFU; default from a GPU table")
    ddp_timeout: int = flag(1800, "collective timeout in seconds", low=1)
    save_logits_probe: bool = flag(False, "write final_logits.safetensors (tests of the export)")
    sample_tokens: int = flag(None, "tokens sampled from the export (default 40; 0 from 1B)", low=0)
    record_sample_ids: bool = flag(False, "each rank writes the block ids it trained on")


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


def chat_rows(tokenizer, template_file: str | None, assistant_only: bool):
    """The data stage's `to_rows` (`data.pack_dataset`): each conversation through the chat template
    (`template_file`'s, else the tokenizer's), its labels -100 but on the assistant's turns (all
    tokens without `assistant_only`): what the template adds after the generation prompt."""
    if template_file:
        if not Path(template_file).is_file():
            raise errors.Stop(f"--chat_template {template_file}: no such file")
        tokenizer.chat_template = Path(template_file).read_text()
    if not tokenizer.chat_template:
        raise errors.Stop(
            "the tokenizer has no chat template: pass --chat_template FILE (a Jinja "
            "template; data/chat_template.jinja is a plain-text one)"
        )

    def render(messages, prompt=False) -> list[int]:
        return list(
            tokenizer.apply_chat_template(
                messages, add_generation_prompt=prompt, tokenize=True, return_dict=False
            )
        )

    def to_rows(batch: dict) -> dict:
        rows = {"input_ids": [], "labels": []}
        for messages in batch.get("messages") or [
            [{"role": "user", "content": p}, {"role": "assistant", "content": c}]
            for p, c in zip(batch["prompt"], batch["completion"])
        ]:
            ids = render(messages)
            labels = [-100] * len(ids) if assistant_only else list(ids)
            for k, turn in enumerate(messages if assistant_only else []):
                if turn["role"] != "assistant":
                    continue
                which = f"the conversation that starts {messages[0]['content'][:40]!r}"
                if k == 0:
                    raise errors.Stop(f"{which} starts with an assistant turn: it answers nothing")
                prompt, whole = render(messages[:k], prompt=True), render(messages[: k + 1])
                if ids[: len(whole)] != whole or whole[: len(prompt)] != prompt:
                    raise errors.Stop(
                        f"the chat template is not prefix-stable: in {which}, "
                        f"turn {k} changes the tokens before it"
                    )
                labels[len(prompt) : len(whole)] = whole[len(prompt) :]  # the reply and its eos
            rows["input_ids"].append(ids)
            rows["labels"].append(labels)
        return rows

    return to_rows


def main() -> int:
    args = parse_args(
        Args,
        description=__doc__,
        output_dir="runs/sft",
        per_device_train_batch_size=8,
        learning_rate=1e-3,
        weight_decay=0.0,
        warmup_steps=6,
        lr_scheduler_type="cosine",
        max_steps=60,
        logging_steps=10,
        report_to="tensorboard",
    )
    make_output_dir(args.output_dir)  # a file in the way or an impossible path: one line, now
    causal_lm.sft_flags(args)  # a model to fine-tune; LoRA flags only with --use_peft
    startup = {"compiles": True, "tensor_parallel": False}  # compile: eager keys
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

    # ADAPT: data. Conversations rendered, labelled and padded (or packed) by each node's first
    # rank; the others read its cache. The labels mark what trains: the assistant's tokens.
    with launch.node_first(accelerator):
        config = AutoConfig.from_pretrained(args.model_name_or_path)
        model_cls = models.causal_lm_class(config)
        raw = data.load_text_dataset(
            args.dataset_name,
            args.dataset_config_name,
            args.train_file,
            args.validation_file,
            args.validation_split_percentage,
            columns=(("messages",), ("prompt", "completion")),
            bundled=(f"{CHAT}/train.jsonl", f"{CHAT}/validation.jsonl"),
        )
        tokenizer_source = args.tokenizer_name_or_path or args.model_name_or_path
        tokenizer = data.get_tokenizer(tokenizer_source, raw, 0, args.cache_dir)
        to_rows = chat_rows(tokenizer, args.chat_template, args.assistant_only_loss)
        causal_lm.tokenizer_fits(
            tokenizer, tokenizer_source, raw, config, args.max_length, pretrained=True
        )
        ids = causal_lm.set_token_ids(config, tokenizer, from_scratch=False)  # the data's eos, pad
        lm_data = data.pack_dataset(
            raw, tokenizer, args.max_length, args.cache_dir, args.packing, to_rows, "--max_length"
        ).with_format("torch")
    full_blocks = False  # the labels say which tokens train (the assistant's): count them
    data_digest = data.same_data(accelerator, lm_data)  # every node's copy; resume fingerprint
    if ids:
        accelerator.print(f"token ids from the tokenizer into the model config: {', '.join(ids)}")
    train_set, eval_set = data.train_and_eval_sets(  # + each block's index: --record_sample_ids
        lm_data, args.max_eval_samples, sample_ids=args.record_sample_ids
    )
    updates_per_epoch = len(train_set) // global_batch
    epoch_steps = math.ceil(args.num_train_epochs * updates_per_epoch)  # --num_train_epochs
    max_steps = args.max_steps if args.max_steps > 0 else epoch_steps  # --max_steps wins
    # the data against the global batch, warmup against the run, FSDP and ZeRO-3 against the model
    guard.data_ready(
        train_size=len(train_set),
        train_unit="conversations",
        steps=max_steps,
        model_cls=model_cls,
        model_config=config,
    )
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

    # ADAPT: model. fp32 master weights; the launch config picks the compute precision. With
    # --use_peft the pretrained weights are frozen and LoRA adapters train (peft).
    model = causal_lm.load_pretrained_on_ranks(
        accelerator, args.model_name_or_path, config, False, tokenizer
    )  # missing or unexpected weights stop it
    if args.gradient_checkpointing:
        model.activation_checkpointing_enable(
            activation_checkpointing_kwargs={"use_reentrant": False}
        )
    model.config.use_cache = False
    targets = args.lora_target_modules  # "all-linear": every Linear but the output head
    lora = args.use_peft and {
        "r": args.lora_r,
        "lora_alpha": args.lora_alpha,
        "lora_dropout": args.lora_dropout,
        "target_modules": targets if targets == "all-linear" else targets.split(","),
    }
    if lora:
        try:  # (peft says which target modules the model lacks)
            model = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", **lora))
        except ValueError as err:
            raise errors.Stop(f"--lora_target_modules {targets}: {err}") from None
        causal_lm.lora_targets_found(model, targets)  # peft adapts what it finds, names it does not
    n_params = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())  # ZeRO-3 too
    n_trainable = sum(
        getattr(p, "ds_numel", p.numel()) for p in model.parameters() if p.requires_grad
    )  # LoRA: the adapters
    set_seed(args.seed, device_specific=True)  # from here on each rank draws its own (dropout)
    flops_per_token, flops_method = metrics.model_flops_per_token(model, args.max_length)

    peak_lr, lr_line = causal_lm.peak_learning_rate(args, global_batch)  # --scale_lr: linear rule
    accelerator.print(lr_line)
    # AdamW without weight decay on norm weights and biases (1-D tensors), as most LLM recipes.
    optimizer = torch.optim.AdamW(
        models.param_groups(model, args.weight_decay),
        lr=peak_lr,
        betas=(args.adam_beta1, args.adam_beta2),
        eps=args.adam_epsilon,
    )
    lr_scheduler = schedule.lr_scheduler(optimizer, args, max_steps)  # --lr_scheduler_type

    order = {  # what fixes the data order; the step count gives the position in it
        "global_batch": global_batch,
        "seed": args.seed,
        "block_size": args.max_length,
        "packing": args.packing,
        "lora": lora,
        "train_blocks": len(train_set),
        "data_digest": data_digest,
    }
    if lora:  # the frozen base, which the checkpoints do not hold: a resume needs the same one
        order["frozen_base"] = causal_lm.weights_digest(args.model_name_or_path)
    # >>> shared: run state
    run_state, checked = checkpoint.run_state(accelerator, args, model, peak_lr, max_steps, **order)
    # <<< shared
    resume_path, saved = checkpoint.resume_or_start(accelerator, args, run_state, checked)
    step = saved["step"]

    model, optimizer, train_loader, eval_loader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_loader, eval_loader, lr_scheduler
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
        trainable_params=n_trainable,
        updates_per_epoch=updates_per_epoch,
        max_steps=max_steps,
        model_type=config.model_type,
        model_class=model_cls.__name__,
        data=data.pack_stats(lm_data),
        flops_per_token=flops_per_token,
        flops_per_token_method=flops_method,
        **guard.prepared(accelerator, model, model_cls, global_batch),
    )  # FSDP units, DeepSpeed
    accelerator.print(metrics.start_line(run_info))
    if resume_path:  # + scheduler, scaler, per-rank RNG; micro steps follow this accumulation
        applied += checkpoint.load_checkpoint(accelerator, resume_path, model, optimizer, step)
        accelerator.print(causal_lm.record_resume(run_info, resume_path, step, saved))
    run_info["workarounds"] = applied  # the library workarounds that ran, in order
    log = metrics.RunLog(
        accelerator, args, Path(__file__).stem, step if resume_path else None, run_info, saved
    )

    # ---- Training loop: one iteration = one optimizer step = one accumulation window ---------
    model.train()
    progress = tqdm(
        total=max_steps, initial=step, desc="train", disable=not accelerator.is_local_main_process
    )
    t_start = log.start_clock(device, flops_per_token, args.peak_tflops)  # tokens/s, MFU
    epoch = step // updates_per_epoch
    health = precision.StepHealth(accelerator, model, saved)  # skipped steps, inf/NaN: stop
    seen = metrics.SampleIds(args.record_sample_ids, epoch)  # epochs before a resume stay empty
    preempted = checkpoint.stop_on_signal(accelerator, args.ddp_timeout)  # SIGTERM, Ctrl-C, SIGHUP
    problem = preempt = None  # why the loop ends early: one error line, or a signal's name
    while step < max_steps and not (problem or preempt):
        train_loader.set_epoch(epoch)  # a new permutation each epoch, the same on every rank
        done_in_epoch = step % updates_per_epoch  # > 0 only right after a mid-epoch resume
        batches = iter(
            accelerator.skip_first_batches(
                train_loader, done_in_epoch * args.gradient_accumulation_steps
            )
        )
        for _ in range(done_in_epoch, updates_per_epoch):
            lr = lr_scheduler.get_last_lr()[0]  # the LR this optimizer step applies
            t0 = time.perf_counter()
            window = [next(batches) for _ in range(args.gradient_accumulation_steps)]
            log.count(data_wait=time.perf_counter() - t0)
            seen.take(epoch, window)  # --record_sample_ids: pops the ids, kept on the device
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
        epoch += 1
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
    seen.write(accelerator, args.output_dir)  # --record_sample_ids: each rank its own file
    if args.save_logits_probe:  # the live (still sharded) model's logits, for tests of the export
        causal_lm.save_logits_probe(accelerator, model, eval_set, args.output_dir)
    accelerator.wait_for_everyone()
    log.summary(
        {
            "step": step,
            "wall_seconds": time.perf_counter() - t_start,
            **skipped,
            **log.tokens_seen(),  # input (padding left out) and target tokens, all ranks
            **metrics.end_figures(accelerator, model),
        }
    )  # peak memory, buffer dtypes
    # Proof that the export works: rank 0 reloads it with plain transformers and answers the first
    # validation conversation: its tokens up to the first target, the assistant's header included.
    sample_tokens = 40 if args.sample_tokens is None and n_params < 1e9 else args.sample_tokens or 0
    if accelerator.is_main_process and sample_tokens > 0:
        first = eval_set[0]  # (a reply cut whole by --max_length: the conversation as it is)
        end = next(iter((first["labels"] != -100).nonzero().flatten().tolist()), None)
        prompt = {k: v[:end] for k, v in first.items() if k in ("input_ids", "attention_mask")}
        print(
            causal_lm.sample_from_export(final_dir, prompt, tokenizer, sample_tokens, device, None)
        )
    del model, optimizer
    launch.teardown(accelerator)  # in order: the model before the process group
    accelerator.print(log.final_line(f"model in {final_dir}, metrics in {log.path}"))
    return 0


if __name__ == "__main__":
    errors.run(main)
