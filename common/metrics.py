"""What a run reports: throughput, MFU and memory (torchtitan-style), the evaluation loss, and
`RunLog`, which writes metrics.jsonl, run_info.json and the trackers."""

from __future__ import annotations

import json
import math
import os
import resource
import sys
import time
import traceback

import torch
from accelerate.tracking import GeneralTracker
from accelerate.utils import broadcast_object_list

from common import launch
from common.errors import Stop

# Peak dense bf16 FLOP/s per device, from torchtitan's `get_peak_flops`. "H100 NVL" before "H100".
PEAK_BF16_FLOPS = [
    ("H200", 989e12),
    ("H100 NVL", 835e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("A100", 312e12),
]


def _llama_params(config) -> int:
    """N of the PaLM formula from Llama config fields: every parameter but the embedding lookup."""
    h, layers, heads = config.hidden_size, config.num_hidden_layers, config.num_attention_heads
    kv = config.num_key_value_heads * (getattr(config, "head_dim", None) or h // heads)
    attn = h * (h + 2 * kv) + h * h  # q, k, v, o
    mlp = 3 * h * config.intermediate_size  # gate, up, down
    return layers * (attn + mlp + 2 * h) + h + config.vocab_size * h  # + norms, the output head


def model_flops_per_token(model: torch.nn.Module, seq_len: int) -> tuple[float, str]:
    """(training FLOPs per token of a causal LM, how they were counted): PaLM's 6·N + 12·L·H·Q·T
    (Chowdhery et al. 2022, appendix B, as torchtitan): N the parameters but embedding lookups (a
    tied output head counts), L layers, H heads, Q head dimension, T `seq_len`. Before `prepare`."""
    numel = lambda p: getattr(p, "ds_numel", p.numel())  # noqa: E731
    lookups = {
        id(p) for m in model.modules() if isinstance(m, torch.nn.Embedding) for p in m.parameters()
    }
    params = {id(p): p for p in model.parameters()}
    counted = [p for i, p in params.items() if i not in lookups]
    head = model.get_output_embeddings()
    if head is not None and id(head.weight) in lookups:  # tied: the head matmul is still done
        counted.append(head.weight)
    n = sum(numel(p) for p in counted)
    frozen = sum(numel(p) for p in counted if not p.requires_grad)
    config = model.config
    layers, heads, hidden = (
        getattr(config, k, None)
        for k in ("num_hidden_layers", "num_attention_heads", "hidden_size")
    )
    attention = None
    if all(isinstance(x, int) for x in (layers, heads, hidden)):
        attention = 12 * layers * heads * (getattr(config, "head_dim", None) or hidden // heads)
        attention *= seq_len
    try:
        fields_match = _llama_params(config) == n
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
    if frozen:  # LoRA: a frozen weight's backward computes input gradients only, 4 not 6
        how += f", {frozen:,} frozen weights at 4 FLOPs per token"
    return float(6 * n - 2 * frozen + (attention or 0)), f"PaLM 6N + 12LHQT: {how}"


def peak_flops(device: torch.device, override_tflops: float | None = None) -> float | None:
    """Peak dense bf16 FLOP/s of one device (`--peak_tflops` wins), or None: no MFU reported."""
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


LOSS_CHUNK_ELEMENTS = 1 << 26  # logits `token_nll` casts to fp32 at once: 256 MB


def token_nll(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """([B] fp32 summed next-token NLL, [B] int64 target counts) of `logits` [B, T, V] and `labels`
    [B, T] (-100: no target); position t predicts labels[:, t + 1]. The labels are shifted, not the
    logits, and slices are cast to fp32 one at a time (not an 8.4 GB copy at 8 x 2048 x 128k)."""
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


def strict_json(record: dict) -> dict:
    """`record` with each non-finite float as None and the keys that held one in "nonfinite"."""

    def clean(v):
        if isinstance(v, float) and not math.isfinite(v):
            return None
        if isinstance(v, dict):
            return {k: clean(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [clean(x) for x in v]
        return v

    cleaned = {k: clean(v) for k, v in record.items()}
    bad = [k for k, v in record.items() if json.dumps(v) != json.dumps(cleaned[k])]
    return {**cleaned, "nonfinite": bad} if bad else record


def append_jsonl(path: str, record: dict) -> None:
    """Append `record` to `path` as one line of `strict_json` (call on the main process only)."""
    with open(path, "a") as f:
        f.write(json.dumps(strict_json(record), allow_nan=False) + "\n")


def final_line(metrics_path: str, outputs: str, **figures) -> str:
    """A run's last line, from its metrics.jsonl and newer `figures`: "done: 300 steps | loss 4.1234
    | eval_loss 4.5678 | model in runs/llama/final" (`outputs` last)."""
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


# Each tracker's keyword for a run's name (--run_name; TensorBoard's folder is the recipe's name).
RUN_NAME = {"wandb": "name", "trackio": "name", "mlflow": "run_name", "clearml": "task_name"}


class RunLog:
    """metrics.jsonl (a line per logged step, then `{"summary": true, ...}`), the trackers
    (--report_to), run_info.json (with the trackers started) and the run's last line. A resume
    keeps the lines up to `resumed_step` (TensorBoard's `purge_step`); `saved`, its checkpoint's
    marker, holds the token counts so far. The main process writes."""

    def __init__(self, accelerator, args, project, resumed_step=None, run_info=None, saved=None):
        self.accelerator, saved = accelerator, saved or {}
        if "target_tokens" in saved:  # the tokens of earlier launches
            self.seen_before = [saved["input_tokens"], saved["target_tokens"]]
        else:  # a fresh run, or None: resumed from a marker without them
            self.seen_before = [0, 0] if resumed_step is None else None
        self.seen = torch.zeros(2, dtype=torch.int64, device=accelerator.device)  # this launch's
        config = getattr(accelerator, "parallelism_config", None)  # tp: a group trains one batch
        self.share = 1 / config.non_data_parallel_size if config and config.tp_enabled else 1
        self.path = os.path.join(args.output_dir, "metrics.jsonl")
        purge = {"tensorboard": {"purge_step": 0 if resumed_step is None else resumed_step + 1}}
        purge |= {t: {key: args.run_name} for t, key in RUN_NAME.items() if args.run_name}
        if args.logging_dir:  # the trackers' folder (TensorBoard's events), else --output_dir
            accelerator.project_configuration.logging_dir = args.logging_dir
        flags = {k: v for k, v in vars(args).items() if v is not None}
        problem = None
        try:  # on the main process: no login, no network, no store would end in a traceback
            accelerator.init_trackers(project, config=flags, init_kwargs=purge)
        except Exception as err:  # (those that started end at exit, as their libraries do)
            tb = (frame.f_locals.get("self") for frame, _ in traceback.walk_tb(err.__traceback__))
            name = next((t.name for t in tb if isinstance(t, GeneralTracker)), args.report_to)
            why = f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[0]}"
            problem = f"--report_to {args.report_to}: {name} failed to start: {why}"
        if args.report_to != "none" and accelerator.num_processes > 1:  # every rank stops
            problem = broadcast_object_list([problem])[0]
        if problem:
            raise Stop(problem)
        if not accelerator.is_main_process:
            return
        if run_info is not None:  # the trackers started (main process only), not just asked for
            with open(os.path.join(args.output_dir, "run_info.json"), "w") as f:
                trackers = [t.name for t in accelerator.trackers]
                json.dump({**run_info, "trackers": trackers}, f, indent=1)
        kept = []
        if resumed_step is not None and os.path.exists(self.path):
            kept = [
                line
                for line in open(self.path)
                if not (r := json.loads(line)).get("summary") and r["step"] <= resumed_step
            ]
        with open(self.path, "w") as f:
            f.writelines(kept)

    def start_clock(self, device, flops_per_token=None, peak_tflops=None) -> float:
        """Start the first logging window (tokens/s, data wait, MFU); returns `perf_counter()`."""
        self.device, self.flops_per_token = device, flops_per_token
        self.peak = peak_flops(device, peak_tflops)
        self.tokens, self.data_wait, self.t_window = 0, 0.0, time.perf_counter()
        return self.t_window

    def count(self, window: list[dict] = (), data_wait: float = 0.0) -> None:
        """Add this rank's trained micro batches `window` (input tokens: padding left out; target
        tokens: with a label) and seconds spent waiting for data. On the device: no host sync."""
        for batch in window:
            mask = batch.get("attention_mask")
            fed = mask.sum() if mask is not None else batch["input_ids"].numel()
            targets = (batch["labels"][:, 1:] != -100).sum()  # position t predicts label t + 1
            self.seen += torch.stack([torch.as_tensor(fed, device=self.seen.device), targets])
            self.tokens += fed * self.share  # tensor parallel: the tp group trains them together
        self.data_wait += data_wait

    def tokens_seen(self) -> dict:
        """{"input_tokens", "target_tokens"} of the run so far, over the data-parallel ranks and
        earlier launches (None where the resumed checkpoint lacks them). A collective."""
        now = launch.data_parallel_sum(self.accelerator, self.seen).tolist()
        if self.seen_before is None:
            return {"input_tokens": None, "target_tokens": None}
        before = self.seen_before
        return {"input_tokens": before[0] + now[0], "target_tokens": before[1] + now[1]}

    def record(self, **fields) -> dict:
        """`fields` (read them first: a GPU's queued kernels then count in the window), the token
        counts (a collective), the window's tokens_per_second (input tokens per device),
        data_wait_share, peak_memory_bytes and, where the peak is known, mfu. Starts a new window."""
        elapsed = time.perf_counter() - self.t_window
        record = {
            **fields,
            **self.tokens_seen(),
            "tokens_per_second": float(self.tokens) / elapsed,
            "data_wait_share": self.data_wait / elapsed,
            "peak_memory_bytes": peak_memory_bytes(self.device),
        }
        if self.peak and self.flops_per_token:
            record["mfu"] = self.flops_per_token * record["tokens_per_second"] / self.peak
        self.tokens, self.data_wait, self.t_window = 0, 0.0, time.perf_counter()
        return record

    def log(self, record: dict) -> None:
        """A step's record: a line of metrics.jsonl (`strict_json`), finite numbers to trackers."""
        numbers = {
            k: v for k, v in record.items() if isinstance(v, (int, float)) and math.isfinite(v)
        }
        self.accelerator.log(numbers, step=record["step"])
        if self.accelerator.is_main_process:
            append_jsonl(self.path, record)

    def summary(self, record: dict) -> None:
        """The last line of metrics.jsonl: `{"summary": true, **record}`."""
        if self.accelerator.is_main_process:
            append_jsonl(self.path, {"summary": True, **record})

    def final_line(self, outputs: str, **figures) -> str:
        return final_line(self.path, outputs, **figures)


def start_line(run_info: dict) -> str:
    """The run's first line: strategy x ranks, ZeRO, precision, size, batch, steps, compile."""
    ds, compiled, n = run_info.get("deepspeed"), run_info.get("torch_compile"), run_info["n_params"]
    parts = [f"{run_info['distributed_type']} x{run_info['world_size']}"]
    if run_info.get("mesh"):
        parts[0] += " (" + " x ".join(f"{dim} {k}" for dim, k in run_info["mesh"].items()) + ")"
    if ds:
        offload = ", ".join(
            f"{part} to {ds[f'offload_{part}_device']}"
            for part in ("optimizer", "param")
            if ds[f"offload_{part}_device"] != "none"
        )
        parts.append(f"ZeRO-{ds['zero_stage']}" + (f" (offload: {offload})" if offload else ""))
    trainable = run_info.get("trainable_params")
    lora = f" ({trainable / 1e6:.2f}M trainable)" if trainable is not None and trainable < n else ""
    parts += [run_info["mixed_precision"], f"{n / 1e6:.2f}M params{lora}"]
    parts += [f"global batch {run_info['global_batch']}", f"{run_info['max_steps']} steps"]
    parts += [f"torch.compile {compiled['backend']}"] if compiled else []
    return " | ".join(parts)


def run_info(accelerator, model, args, **facts) -> dict:
    """run_info.json: the strategy, `facts`, ranks' parameter elements (a collective), the flags."""
    held = [getattr(p, "ds_tensor", p) for p in model.parameters()]  # ZeRO-3: the partition
    local = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in held)  # FSDP2
    local = torch.tensor([local], device=accelerator.device)
    dynamo = accelerator.state.dynamo_plugin  # (its checkpoints keep eager key names)
    compiled = dynamo.backend.value != "NO"
    return {
        "distributed_type": accelerator.distributed_type.value,
        "world_size": accelerator.num_processes,
        "mixed_precision": accelerator.mixed_precision,
        "device_name": torch.cuda.get_device_name(accelerator.device)
        if accelerator.device.type == "cuda"
        else "cpu",  # (tools/plan.py --calibrate: an efficiency holds for one device kind)
        **({"mesh": mesh} if (mesh := launch.mesh_layout(accelerator)) else {}),
        **facts,
        "local_param_elements": accelerator.gather(local).tolist(),
        "torch_compile": {
            "backend": dynamo.backend.value.lower(),
            "mode": dynamo.mode,
            "regional": bool(dynamo.use_regional_compilation),
        }
        if compiled
        else None,
        "args": vars(args),
    }


class SampleIds:
    """--record_sample_ids: each rank's trained sample ids per epoch in sample_ids/rank{r}.json;
    `take` keeps them on the device, `write` copies them to the host once."""

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
        """This rank's file, with `extra` keys (a tensor-parallel group's first rank writes)."""
        if not self.on:
            return
        world = launch.data_parallel_size(accelerator)
        shared = accelerator.num_processes // world
        if accelerator.process_index % shared:
            return
        os.makedirs(os.path.join(output_dir, "sample_ids"), exist_ok=True)
        rank = accelerator.process_index // shared
        epochs = [torch.cat(ids).tolist() if ids else [] for ids in self.epochs]
        with open(os.path.join(output_dir, "sample_ids", f"rank{rank}.json"), "w") as f:
            json.dump({"rank": rank, "world_size": world, "epochs": epochs, **extra}, f)


def end_figures(accelerator, model) -> dict:
    """The summary's peak memory and the dtypes of the model's float buffers (rotary inv_freq)."""
    device, unwrapped = (
        accelerator.device,
        accelerator.unwrap_model(model, keep_torch_compile=False),
    )
    out = {"peak_memory_bytes": peak_memory_bytes(device)}
    if device.type == "cuda":
        out["peak_memory_reserved_bytes"] = torch.cuda.max_memory_reserved(device)
    floats = [(n, b) for n, b in unwrapped.named_buffers() if b.is_floating_point()]
    return {**out, "buffer_dtypes": {n: str(b.dtype).removeprefix("torch.") for n, b in floats}}


def weight_decay_line(optimizer) -> str:
    """ "AdamW weight decay: 0.1 on 29 tensors (4,210,688 elements), 0 on 9 tensors (2,304 elements)"
    (ZeRO-3's partitioned parameters counted whole)."""
    return "AdamW weight decay: " + ", ".join(
        f"{g['weight_decay']:g} on {len(g['params'])} tensors "
        f"({sum(getattr(p, 'ds_numel', p.numel()) for p in g['params']):,} elements)"
        for g in optimizer.param_groups
    )
