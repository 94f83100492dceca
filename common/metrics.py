"""What a run reports, in one place: throughput, MFU and memory figures (torchtitan-style), the
evaluation loss, and `RunLog`, which writes metrics.jsonl, run_info.json and the trackers."""

from __future__ import annotations

import json
import math
import os
import resource
import sys
import time

import torch

from common import launch, workarounds

# Peak dense bf16 FLOP/s per device. Source: torchtitan `torchtitan/tools/utils.py`
# (`get_peak_flops`). Order matters: "H100 NVL" must match before "H100".
PEAK_BF16_FLOPS = [
    ("H200", 989e12),
    ("H100 NVL", 835e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("A100", 312e12),
]


def _llama_params(config) -> int:
    """N of `flops_per_token` from Llama config fields; AttributeError/TypeError when one is missing."""
    h, layers, heads = config.hidden_size, config.num_hidden_layers, config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or h // heads
    kv = config.num_key_value_heads * head_dim
    attn = h * (h + 2 * kv) + h * h  # q, k, v, o projections
    mlp = 3 * h * config.intermediate_size  # gate, up, down
    norms = 2 * h
    # + final norm + the output head: a real matmul even when tied to the input embedding
    # (the embedding lookup itself does no FLOPs, so its parameters are left out)
    return layers * (attn + mlp + norms) + h + config.vocab_size * h


def _attention_flops(config, seq_len: int) -> int | None:
    """12·L·H·Q·T, or None when the config lacks layers, heads or hidden size."""
    layers = getattr(config, "num_hidden_layers", None)
    heads = getattr(config, "num_attention_heads", None)
    hidden = getattr(config, "hidden_size", None)
    if not all(isinstance(x, int) for x in (layers, heads, hidden)):
        return None
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    return 12 * layers * heads * head_dim * seq_len


def flops_per_token(config, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward) of a decoder-only transformer.

    6·N + 12·L·H·Q·T, with N the parameter count *excluding* the token embedding, L layers,
    H heads, Q head dimension and T the sequence length. Source: PaLM (Chowdhery et al. 2022),
    appendix B, as computed by torchtitan (`torchtitan/models/llama3/model/args.py`).

    Args:
        config: a `LlamaConfig` (or any config with the same fields: `num_key_value_heads`,
            `intermediate_size`, ...; see `model_flops_per_token` for other models).
        seq_len: tokens per sequence (`--block_size`).

    Returns:
        FLOPs per trained token.

    Raises:
        AttributeError: the config lacks one of the Llama fields.
    """
    return 6 * _llama_params(config) + _attention_flops(config, seq_len)


def model_flops_per_token(model: torch.nn.Module, seq_len: int) -> tuple[float, str]:
    """Training FLOPs per token of any causal LM, with the way they were computed.

    The same PaLM formula as `flops_per_token`, 6·N + 12·L·H·Q·T, with N taken from the model
    itself: every parameter except embedding lookups (`nn.Embedding`: token and, in GPT-2,
    position embeddings), plus the output head once more when it is tied to the token embedding
    (it is still a vocab x hidden matmul). When the config's Llama fields give exactly this N
    (Llama, Mistral: no biases), that formula is named; otherwise (Qwen2's q/k/v biases, GPT-2's
    fields) the count is. The attention term uses the config fields that exist; without
    layers, heads or hidden size it is left out, and the method says so.

    Args:
        model: the model before `accelerator.prepare` (ZeRO-3-partitioned parameters count by `ds_numel`).
        seq_len: tokens per sequence (`--block_size`).

    Returns:
        (FLOPs per trained token, a one-line description of how N and the attention term were found).
    """
    numel = lambda p: getattr(p, "ds_numel", p.numel())  # noqa: E731
    lookups = {
        id(p) for m in model.modules() if isinstance(m, torch.nn.Embedding) for p in m.parameters()
    }
    params = {id(p): p for p in model.parameters()}
    n = sum(numel(p) for i, p in params.items() if i not in lookups)
    head = model.get_output_embeddings()
    if head is not None and id(head.weight) in lookups:  # tied: the head matmul is still done
        n += numel(head.weight)
    attention = _attention_flops(model.config, seq_len)
    try:
        fields_match = _llama_params(model.config) == n
    except (AttributeError, TypeError):
        fields_match = False
    how = (
        "N from the config's Llama fields (equal to the parameter count)"
        if fields_match
        else "N counted from the model's parameters (embedding lookups out, output head in)"
    )
    how += (
        ", attention term 12·L·H·Q·T from the config"
        if attention is not None
        else ", attention term left out (the config names no layers/heads/hidden size)"
    )
    return float(6 * n + (attention or 0)), f"PaLM 6N + 12LHQT: {how}"


def peak_flops(device: torch.device, override_tflops: float | None = None) -> float | None:
    """Peak dense bf16 FLOP/s of one device, for MFU.

    Args:
        device: the training device.
        override_tflops: `--peak_tflops`, in TFLOP/s; wins over the table.

    Returns:
        FLOP/s, or None when unknown (CPUs, unlisted GPUs): MFU is then not reported.
    """
    if override_tflops:
        return override_tflops * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((flops for key, flops in PEAK_BF16_FLOPS if key in name), None)


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this process in bytes: CUDA max allocated, else the peak resident set size."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024  # Linux reports KiB


LOSS_CHUNK_ELEMENTS = (
    1 << 26
)  # fp32 logits converted at once by `token_nll`: 256 MB (tokens x vocab)


def token_nll(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token negative log-likelihood per sample, without fp32 copies of the whole logits.

    Position t predicts labels[:, t + 1], as transformers' causal-LM loss does: the labels are
    shifted (a [B, T] copy) rather than the logits sliced (a [B, T, V] copy), and the
    cross-entropy runs over slices of at most `LOSS_CHUNK_ELEMENTS` logits, each cast to fp32
    on its own. At 8 x 2048 tokens and a 128k vocabulary, the whole-batch `.float()`, slice and
    log-softmax would each be 8.4 GB; here the fp32 temporaries are ~2 x 256 MB.

    Args:
        logits: [B, T, V], any float dtype (bf16 under autocast), on any device.
        labels: [B, T] int64 token ids; -100 marks tokens that are not targets.

    Returns:
        (nats, tokens): [B] fp32 summed NLL in nats and [B] int64 target-token counts, on
        `logits.device`. The mean loss is nats.sum() / tokens.sum() (nats/token).
    """
    targets = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=-100).flatten()
    flat = logits.flatten(0, 1)  # a view for contiguous logits
    nats = torch.zeros(targets.shape, dtype=torch.float32, device=logits.device)
    rows = max(1, LOSS_CHUNK_ELEMENTS // logits.shape[-1])
    for start in range(0, len(targets), rows):
        part = slice(start, start + rows)
        nats[part] = torch.nn.functional.cross_entropy(
            flat[part].float(), targets[part], reduction="none", ignore_index=-100
        )
    return nats.view(labels.shape).sum(1), (targets != -100).view(labels.shape).sum(1)


def local_parameter_elements(model: torch.nn.Module) -> int:
    """Number of parameter elements this rank actually holds.

    Handles FSDP2 DTensors (`to_local`), DeepSpeed ZeRO-3 partitions (`ds_tensor`) and FSDP1
    `use_orig_params` views (already local). Plain modules count every element.
    """
    total = 0
    for p in model.parameters():
        if hasattr(p, "ds_tensor"):
            total += p.ds_tensor.numel()
        elif hasattr(p, "to_local"):
            total += p.to_local().numel()
        else:
            total += p.numel()
    return total


def buffer_dtypes(model: torch.nn.Module) -> dict[str, str]:
    """{name: dtype} of the floating-point buffers of a live model (pass the unwrapped module), e.g.
    {"model.rotary_emb.inv_freq": "float32"}: what the strategy's mixed precision left them in."""
    return {
        name: str(b.dtype).removeprefix("torch.")
        for name, b in model.named_buffers()
        if b.is_floating_point()
    }


def strict_json(record: dict) -> dict:
    """`record` with every non-finite float (NaN, inf), at any depth, replaced by None, and the
    top-level keys that held one listed under `"nonfinite"`, so that the result is standard JSON
    (Python's `json` would write the literals `NaN` and `Infinity`, which strict parsers reject)."""

    def clean(v):
        if isinstance(v, float) and not math.isfinite(v):
            return None
        if isinstance(v, dict):
            return {k: clean(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [clean(x) for x in v]
        return v

    cleaned = {k: clean(v) for k, v in record.items()}
    bad = [
        k for k, v in record.items() if json.dumps(v) != json.dumps(cleaned[k])
    ]  # NaN -> null changed it
    return {**cleaned, "nonfinite": bad} if bad else record


def append_jsonl(path: str, record: dict) -> None:
    """Append one JSON object as a line to `path` (call on the main process only).

    Non-finite floats are written as null, named in the line's `"nonfinite"` list (`strict_json`).
    """
    with open(path, "a") as f:
        f.write(json.dumps(strict_json(record), allow_nan=False) + "\n")


def final_line(metrics_path: str, outputs: str, **figures) -> str:
    """The line that ends a successful run: steps, the last logged loss and evaluation, where the outputs are.

    Args:
        metrics_path: the run's metrics.jsonl (step records, then a summary).
        outputs: where the user finds the result, e.g. "model in runs/llama/final".
        figures: ones the file does not hold, or newer ones (e.g. `eval_loss=4.56`).

    Returns:
        e.g. "done: 300 steps | loss 4.1234 | eval_loss 4.5678 | model in runs/llama/final"; a
        figure the run did not log is left out, a non-finite one (null in the file) shows as nan.
    """
    records = [json.loads(line) for line in open(metrics_path)]
    losses = [r for r in records if "loss" in r]
    evals = [r for r in records if any(k.startswith("eval_") for k in r)]
    parts = [f"done: {records[-1]['step']} steps" if records else "done"]
    if losses:
        parts.append(f"loss {_figure(losses[-1]['loss'])}")
    last_eval = {k: v for k, v in (evals[-1].items() if evals else ()) if k.startswith("eval_")}
    parts += [f"{k} {_figure(v)}" for k, v in {**last_eval, **figures}.items()]
    return " | ".join([*parts, outputs])


def _figure(value) -> str:
    return "nan" if value is None else f"{value:.4f}" if isinstance(value, float) else str(value)


class RunLog:
    """metrics.jsonl, the trackers (--report_to), run_info.json and the run's last line.

    metrics.jsonl holds one JSON object per logged step, then a summary (`{"summary": true, ...}`).
    A resumed run keeps the step lines up to the step it resumes from and drops later ones and
    the summaries, so the file reads as one run; a fresh run starts it empty. TensorBoard's history
    follows the same rule (`purge_step`); run_info.json records the trackers started ("trackers").
    Only the main process writes; `log` sends the finite numbers to the trackers from every rank
    (Accelerate keeps the trackers on the main process).

    Args:
        accelerator: the run's `Accelerator`; args: the flags (output_dir; all of them go to the
            trackers' config and into run_info.json).
        project: the trackers' project name (TensorBoard: the folder under --output_dir).
        resumed_step: the step a resume starts from, or None for a fresh run.
        run_info: what the run really is (strategy, precision, batch, model), for run_info.json.
        saved: the marker of the checkpoint resumed from: its token counts (`tokens_seen`) go on.
    """

    def __init__(
        self,
        accelerator,
        args,
        project: str,
        resumed_step: int | None = None,
        run_info: dict | None = None,
        saved: dict | None = None,
    ):
        self.accelerator = accelerator
        # the run's token counts before this launch (`tokens_seen`); None: a marker without them
        saved = saved or {}
        self.seen_before = (
            [saved["input_tokens"], saved["target_tokens"]]
            if "target_tokens" in saved
            else [0, 0]
            if resumed_step is None
            else None
        )
        self.seen = torch.zeros(2, dtype=torch.int64, device=accelerator.device)  # this launch's
        config = getattr(
            accelerator, "parallelism_config", None
        )  # tensor parallel: a tp group trains one batch
        self.share = (
            1 / config.non_data_parallel_size if config is not None and config.tp_enabled else 1
        )
        self.path = os.path.join(args.output_dir, "metrics.jsonl")
        # TensorBoard drops the events of earlier attempts past the resumed step (all of them on a fresh
        # start), as metrics.jsonl does: SummaryWriter's purge_step, which EventAccumulator applies
        purge = {"tensorboard": {"purge_step": 0 if resumed_step is None else resumed_step + 1}}
        accelerator.init_trackers(
            project,
            config={k: v for k, v in vars(args).items() if v is not None},
            init_kwargs=purge,
        )
        if accelerator.is_main_process:
            if run_info is not None:  # the trackers started (main process only), not just asked for
                with open(os.path.join(args.output_dir, "run_info.json"), "w") as f:
                    json.dump(
                        {**run_info, "trackers": [t.name for t in accelerator.trackers]},
                        f,
                        indent=1,
                    )
            kept = []
            if resumed_step is not None and os.path.exists(self.path):
                kept = [
                    line
                    for line in open(self.path)
                    if not (r := json.loads(line)).get("summary") and r["step"] <= resumed_step
                ]
            with open(self.path, "w") as f:
                f.writelines(kept)

    def start_clock(
        self, device, flops_per_token: float | None = None, peak_tflops: float | None = None
    ) -> float:
        """Start timing the logging windows: tokens/s, the share spent waiting for data, MFU.
        Returns the start, a `time.perf_counter()` value."""
        self.device, self.flops_per_token = device, flops_per_token
        self.peak = peak_flops(device, peak_tflops)
        self.tokens, self.data_wait, self.t_window = 0, 0.0, time.perf_counter()
        return self.t_window

    def count(self, window: list[dict] = (), data_wait: float = 0.0) -> None:
        """Add the tokens of this rank's trained micro batches `window` (`input_tokens`: those fed
        to the model, padding left out; `target_tokens`: those with a label, trained on) and its
        seconds spent waiting for batches. Counts stay on the device: no host sync a step."""
        for batch in window:
            fed = (
                batch["attention_mask"].sum()
                if "attention_mask" in batch
                else batch["input_ids"].numel()
            )
            targets = (batch["labels"][:, 1:] != -100).sum()  # position t predicts label t + 1
            self.seen += torch.stack([torch.as_tensor(fed, device=self.seen.device), targets])
            self.tokens += fed * self.share  # tensor parallel: the tp group trains them together
        self.data_wait += data_wait

    def tokens_seen(self) -> dict:
        """The run's tokens so far, over all data-parallel ranks and the earlier launches of a
        resumed run, {"input_tokens": n, "target_tokens": m} (for the records, the summary and a
        checkpoint's marker); None where the checkpoint resumed from did not record them. A
        collective."""
        now = launch.data_parallel_sum(self.accelerator, self.seen).tolist()
        if self.seen_before is None:
            return {"input_tokens": None, "target_tokens": None}
        return {
            "input_tokens": self.seen_before[0] + now[0],
            "target_tokens": self.seen_before[1] + now[1],
        }

    def record(self, **fields) -> dict:
        """`fields` (step, loss, ...: read them first, so a GPU's queued kernels count in the window)
        plus the run's input_tokens and target_tokens (`tokens_seen`: a collective), the window's
        tokens_per_second (input tokens per device, padding left out), data_wait_share,
        peak_memory_bytes and, where the device's peak is known, mfu (model FLOPs of the input
        tokens: padding is no useful work); then a new window starts."""
        seen = self.tokens_seen()
        elapsed = time.perf_counter() - self.t_window
        record = {
            **fields,
            **seen,
            "tokens_per_second": float(self.tokens) / elapsed,
            "data_wait_share": self.data_wait / elapsed,
            "peak_memory_bytes": peak_memory_bytes(self.device),
        }
        if self.peak and self.flops_per_token:
            record["mfu"] = self.flops_per_token * record["tokens_per_second"] / self.peak
        self.tokens, self.data_wait, self.t_window = 0, 0.0, time.perf_counter()
        return record

    def log(self, record: dict) -> None:
        """One step's record (its "step" key included): a line of metrics.jsonl (non-finite values as
        null, named in "nonfinite") and the trackers (finite numbers only)."""
        numbers = {
            k: v for k, v in record.items() if isinstance(v, (int, float)) and math.isfinite(v)
        }
        self.accelerator.log(numbers, step=record["step"])
        if self.accelerator.is_main_process:
            append_jsonl(self.path, record)

    def summary(self, record: dict) -> None:
        """The run's last line of metrics.jsonl, `{"summary": true, **record}` (main process)."""
        if self.accelerator.is_main_process:
            append_jsonl(self.path, {"summary": True, **record})

    def final_line(self, outputs: str, **figures) -> str:
        """`final_line` of this run's metrics.jsonl."""
        return final_line(self.path, outputs, **figures)


def gathered_parameter_elements(accelerator, model) -> list[list[int]]:
    """`local_parameter_elements` of every rank, [[rank 0's], [rank 1's], ...]. A collective."""
    counts = torch.tensor([local_parameter_elements(model)], device=accelerator.device)
    return accelerator.gather(counts).tolist()


def memory_summary(device: torch.device) -> dict:
    """The peak memory figures of the summary: bytes allocated at the peak and, on CUDA, the most
    the caching allocator held (allocated + cached blocks)."""
    out = {"peak_memory_bytes": peak_memory_bytes(device)}
    if device.type == "cuda":
        out["peak_memory_reserved_bytes"] = torch.cuda.max_memory_reserved(device)
    return out


def compile_settings(accelerator) -> dict | None:
    """torch.compile as the run uses it (`accelerate launch --dynamo_backend inductor`, or the
    config's dynamo_config): {"backend", "mode", "regional"} for run_info.json, or None uncompiled.
    Its checkpoints and export keep eager key names (`workarounds.eager_state_dict_keys`)."""
    dynamo = accelerator.state.dynamo_plugin
    if dynamo.backend.value == "NO":
        return None
    return {
        "backend": dynamo.backend.value.lower(),
        "mode": dynamo.mode,
        "regional": bool(dynamo.use_regional_compilation),
    }


def start_line(run_info: dict) -> str:
    """The run's first line: strategy x ranks, ZeRO stage and offload, precision, size, batch, steps."""
    ds, compiled = run_info.get("deepspeed"), run_info.get("torch_compile")
    zero = ""
    if ds:
        offload = ", ".join(
            f"{part} to {ds[f'offload_{part}_device']}"
            for part in ("optimizer", "param")
            if ds[f"offload_{part}_device"] != "none"
        )
        zero = f" | ZeRO-{ds['zero_stage']}" + (f" (offload: {offload})" if offload else "")
    mesh = (
        " (" + " x ".join(f"{dim} {n}" for dim, n in run_info["mesh"].items()) + ")"
        if run_info.get("mesh")
        else ""
    )
    return (
        f"{run_info['distributed_type']} x{run_info['world_size']}{mesh}{zero} | {run_info['mixed_precision']} | "
        f"{run_info['n_params'] / 1e6:.2f}M params{_trainable(run_info)} | "
        f"global batch {run_info['global_batch']} | "
        f"{run_info['max_steps']} steps"
        + (f" | torch.compile {compiled['backend']}" if compiled else "")
    )


def _trainable(run_info: dict) -> str:
    """ " (0.16M trainable)" where only some parameters train (LoRA), else ""."""
    n = run_info.get("trainable_params")
    return f" ({n / 1e6:.2f}M trainable)" if n is not None and n < run_info["n_params"] else ""


def save_logits_probe(accelerator, model, eval_set, output_dir: str) -> None:
    """final_logits.safetensors: the live (still sharded) model's logits on the first 2 validation
    blocks, for tests that compare the export with them (2 x block x vocab fp32: 2.1 GB at 2048
    tokens and a 128k vocabulary). Call on every rank (a sharded forward); rank 0 writes."""
    from safetensors.torch import save_file

    with torch.no_grad():
        probe = eval_set[:2]["input_ids"].to(accelerator.device)
        model.eval()
        # the keywords evaluate() passes: a compiled model reuses its graph instead of compiling another
        logits = model(input_ids=probe, attention_mask=None, position_ids=None).logits.float().cpu()
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        path = os.path.join(output_dir, "final_logits.safetensors")
        save_file({"input_ids": probe.cpu(), "logits": logits}, path)
        workarounds.safetensors_mode_from_umask(path)  # (safetensors writes 0600)


def run_info(accelerator, model, args, **facts) -> dict:
    """run_info.json: the strategy, world size and precision as Accelerate runs them, `facts`
    (batch, model, FLOPs, ...), a 2-D layout's "mesh" (`launch.mesh_layout`), each rank's parameter
    elements (a collective: call on every rank), torch.compile's settings and every flag."""
    return {
        "distributed_type": accelerator.distributed_type.value,
        "world_size": accelerator.num_processes,
        "mixed_precision": accelerator.mixed_precision,
        **(
            {"mesh": mesh} if (mesh := launch.mesh_layout(accelerator)) else {}
        ),  # HSDP, tensor parallel
        **facts,
        "local_param_elements": gathered_parameter_elements(accelerator, model),
        "torch_compile": compile_settings(accelerator),
        "args": vars(args),
    }


class SampleIds:
    """--record_sample_ids: the ids of the samples each rank trained on, per epoch, in
    OUTPUT_DIR/sample_ids/rank{r}.json ({"rank", "world_size", "epochs"}), written by rank r.

    `take` pops the "sample_id" entry from each batch of a window (the model must not see it) and
    keeps the ids where they are (on the device: a host copy per step would wait for the GPU);
    `write` copies them to the host once, at the end. Epochs before a resume, or that this rank
    skipped, stay empty lists. Off (`on` false), both do nothing.
    """

    def __init__(self, on: bool, first_epoch: int = 0):
        self.on, self.epochs = on, [[] for _ in range(first_epoch)]

    def take(self, epoch: int, window: list[dict]) -> None:
        """Keep the ids of `window` (its micro batches), trained in `epoch` (0-based)."""
        if not self.on:
            return
        while len(self.epochs) <= epoch:
            self.epochs.append([])
        self.epochs[epoch] += [b.pop("sample_id") for b in window]

    def write(self, accelerator, output_dir: str, **extra) -> None:
        """This rank's file (every rank writes its own), with `extra` keys after "epochs". Under tensor
        parallel the ranks of a tp group trained the same samples: its first rank writes them, as
        data-parallel rank r of `launch.data_parallel_size` ranks (tp is the mesh's innermost dimension)."""
        if not self.on:
            return
        world = launch.data_parallel_size(accelerator)
        shared = accelerator.num_processes // world
        if accelerator.process_index % shared:
            return
        os.makedirs(os.path.join(output_dir, "sample_ids"), exist_ok=True)
        rank = accelerator.process_index // shared
        with open(os.path.join(output_dir, "sample_ids", f"rank{rank}.json"), "w") as f:
            json.dump(
                {
                    "rank": rank,
                    "world_size": world,
                    "epochs": [torch.cat(ids).tolist() if ids else [] for ids in self.epochs],
                    **extra,
                },
                f,
            )


def end_figures(accelerator, model) -> dict:
    """The summary's figures of the finished run: its peak memory (`memory_summary`) and the
    dtypes of the unwrapped model's buffers (rotary inv_freq: fp32 under every strategy)."""
    return {
        **memory_summary(accelerator.device),
        "buffer_dtypes": buffer_dtypes(accelerator.unwrap_model(model, keep_torch_compile=False)),
    }


OADER_KEYS = [
    "rank",
    "shards",
    "loader_tokens_per_second",
    "step_tokens_per_second",
    "loader_to_step_ratio",
    "data_wait_share",
    "rss_bytes",
    "uss_bytes",
    "workers_uss_bytes",
    "workers",
]  # a row of recipes/sharded_data.py's summary
