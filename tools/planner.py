"""Will it fit, and how fast? Bytes per rank and step time for each strategy, before you launch: the
memory and time models behind `tools/plan.py`, the command line. The time model (step time split
into compute, exposed communication and optimizer, tokens/s per rank) is at the end: `time_strategy`.

Ψ = parameters, N = ranks (num_processes x num_machines), T = tokens per micro batch (batch x
block), h hidden, h_kv = kv heads x head dim, I intermediate, a heads, V vocabulary, L layers.

Model states (bytes per rank; ZeRO paper, Rajbhandari et al. 2020, arXiv 1910.02054, with the
dtypes these configs really hold: measured by benchmarks/measure_model_states.py, equal within
0.001% for 3 shapes on 2 CPU ranks, tests/test_plan.py):

| strategy            | params          | grads         | fp32 master | Adam (2 moments) |
|---------------------|-----------------|---------------|-------------|------------------|
| single / DDP        | 4Ψ fp32         | 4Ψ fp32       | (the params)| 8Ψ               |
| FSDP2 / FSDP1       | 4Ψ/N fp32 shard | 4Ψ/N fp32     | (the params)| 8Ψ/N             |
| HSDP (R replicas)   | 4Ψ/S, S = N/R   | 4Ψ/S fp32     | (the params)| 8Ψ/S             |
| ZeRO-2 (our JSON)   | 2Ψ bf16, whole  | 4Ψ/N fp32 (*) | 4Ψ/N        | 8Ψ/N             |
| ZeRO-3 (our JSON)   | 2Ψ/N + 2P bf16  | 4Ψ/N fp32 (*) | 4Ψ/N        | 8Ψ/N             |

LoRA (`--use_peft`, Ψt trainable adapter elements, r x (in + out) per adapted Linear): the params
column is unchanged (Ψ counts base and adapters; the frozen base is stored, and sharded, as every
parameter), the grads, fp32 master and Adam columns take Ψt for Ψ (`plan_strategy`). Measured by
benchmarks/lora_states.py (benchmarks/results/lora_states_cpu2.md) and tests/test_plan.py.
ZeRO-3 keeps its fp32 master as a copy also without mixed precision (measured, deepspeed 0.19.8).

(*) "data_types.grad_accum_dtype": "fp32"; bf16 (2Ψ/N) without it. P = parameters of at most
`stage3_param_persistence_threshold` elements ("auto": 10h), kept whole on every rank. Offload
moves the master, Adam and (ZeRO-3) gradients, and with offload_param the params, to host RAM.
Sharded figures are those of the fullest rank (each tensor's dim 0 rounded up per rank).
With gradient accumulation > 1, FSDP holds the unsharded gradients between micro batches
(Accelerate's no_sync: FSDP2 `set_requires_gradient_sync(False)` keeps them in the fp32 reduce
dtype): +4Ψ(1 - 1/N) in the grads row. Not measured here (the measurement runs one micro batch).

HSDP (accelerate_configs/hsdp.yaml) is FSDP2 over S = N/R ranks (one machine's), replicated R times (the
machines): FSDP's memory and collectives at S ranks, plus an all-reduce of each rank's fp32 gradient
shard with its R - 1 replicas (2 x Ψ/S x 4 B x (R-1)/R), the only traffic that crosses machines.
"comm_inter_node" is that all-reduce; for the other strategies, whose rings run over all N ranks machine
by machine, the 1 in N/machines of each rank's bytes whose hop crosses a machine boundary.

Communication buffers (transient, not measured on CPU): DDP's reducer buckets, a second copy of
the gradients (4Ψ: Accelerate leaves `gradient_as_bucket_view` off); FSDP: the root unit
(embeddings, final norm, head: FSDP2 does not reshard the root after forward) plus two blocks
all-gathered in the compute dtype (current + prefetched) and one block's unsharded fp32
gradients; ZeRO-2: two reduce buckets (overlap_comm) of `reduce_bucket_size` ("auto": h^2
elements) in the compute dtype; ZeRO-3: one reduce bucket in the communication dtype, the
prefetch bucket (0.9 h^2) and the largest module gathered with its full gradient (2 x 2 bytes
x largest module, DeepSpeed's "4 x largest layer").

Activations: bytes autograd saves per micro batch for one Llama block (HF transformers 5,
SDPA's flash kernel, SwiGLU, RMSNorm, rotary), derived op by op as Korthikanti et al. 2022
(arXiv 2205.05198, table 2) did for GPT. r = bytes of the residual stream (the params' dtype:
4 under DDP's fp32 params + autocast, 2 under FSDP/DeepSpeed bf16 params), c = compute bytes
(2 under bf16/fp16, 4 without mixed precision). Bytes per token:

| op (saved for backward)                          | bytes / token                  |
|--------------------------------------------------|--------------------------------|
| 2 RMSNorms: fp32 input (or its fp32 upcast), normed output, rsqrt | 2 x ((4 + r)h + 4) |
| inputs of q,k,v and gate,up: autocast's 5 casts when r != c, else | 5ch, or 2ch        |
|   the 2 norm outputs themselves                                   |                    |
| SDPA: rotated q, rotated k, v, output (= o_proj input)            | c(2h + 2h_kv)      |
| SDPA: logsumexp, fp32                                             | 4a                 |
| SwiGLU: gate out, SiLU out, up out, product (= down_proj input)   | 4cI                |

DDP bf16 (r 4, c 2): 30h + 4h_kv + 8I + 4a + 8; FSDP/DeepSpeed bf16 (r = c = 2): 20h + 4h_kv + 8I
+ 4a + 8. Korthikanti's GPT block is 34h + 5as/h in 16 bits: here no
s^2 attention scores (flash SDPA keeps only the logsumexp), no dropout masks, but fp32 norms and
(DDP) fp32 residuals. Per model: token ids and labels (16 T), the final norm ((4 + r)h + 4 per
token), the lm_head input (ch), the loss scalar, rotary cos and sin (2 x s x head_dim x r), and
under autocast with fp32 params the bf16 weight copies autocast caches for the forward (2 bytes x
every Linear weight, the head included): held until backward like activations.
`--packing documents` and `none` give SDPA an explicit mask: every block saves it as a c-byte bias
(s^2 per sample) and k, v repeated to every query head; documents' per-sample positions make cos and
sin per sample too (`activation_bytes`). With --gradient_checkpointing (non-reentrant, every block)
a block keeps only its input (rh per token); the backward recomputes one block at a time (one
block's bytes, plus its weight copies).
Measured with common/memory.SavedTensorBytes: equal to the byte (tests/test_plan.py).

Logits and loss (transient, at the start of backward): HF's loss upcasts the logits to fp32
and log-softmaxes them: bf16 logits 2TV + fp32 copy 4TV + log-softmax 4TV in the forward, saved
log-softmax + its gradient + the logits' gradient (4TV each) in the backward: 12TV at the peak
(measured 12.3TV with common/memory.PeakTensorBytes on CPU, transformers 5). The factor depends on
the loss code (`logits_factor`): 16TV reported for transformers 4.4x, whose loss keeps a second fp32
copy, and 4TV for a compiled loss (the fused kernel keeps the bf16 logits and their gradient); neither
of those two is measured in this repository. Reserved memory (what out-of-memory is about, and what
torch.cuda.max_memory_reserved and torchtitan's logs report) exceeds the allocated bytes counted here
by the allocator's slack: the "reserved" figure adds RESERVED_SLACK (assumed 6%, the middle of the 5-8%
gap reported for these models). Eval (no grad, metrics.token_nll):
logits cTV plus at most two fp32 chunks of LOSS_CHUNK_ELEMENTS; not added to training's peak.

Against DeepSpeed's estimators (deepspeed/runtime/zero: stage_1_and_2
`estimate_zero2_model_states_mem_needs`: 2Ψ + 18Ψ/N; stage3 `estimate_zero3_model_states_mem_needs`:
4 x largest layer + 18Ψ/N), by design:
- ZeRO-2: DeepSpeed counts a 16-bit gradient partition (2Ψ/N) besides the fp32 one; our JSON
  accumulates in fp32 only (measured): planner = estimator - 2Ψ/N.
- ZeRO-3: the 18Ψ/N terms agree; DeepSpeed puts 4 x largest layer in model states, the planner
  in communication buffers, and adds the persistent parameters (2P) that DeepSpeed leaves out.
- DDP (estimator at N = 1: 20Ψ): DDP keeps no 16-bit params or grads (its fp32 params are the
  masters; autocast's bf16 copies are counted under activations): planner = estimator - 4Ψ.
- FSDP (ZeRO-3 estimator): FSDP shards fp32 params only and casts at the all-gather, so no
  16-bit partition: planner = estimator - 2Ψ/N - 4 x largest layer (the gathered units are in
  communication buffers). Neither counts activations, logits, buckets or DDP's reducer copy.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from common import metrics, models  # noqa: E402
from common.checks import DTYPE_BYTES  # noqa: E402

PRESET_VOCAB = {
    "debug": 4096,
    "llama-3.2-1b": 128256,
    "llama-3-8b": 128256,
}  # recipe BPE / Llama 3 tokenizer
CATEGORIES = (
    "params",
    "grads",
    "fp32_master",
    "adam_moments",
    "comm_buffers",
    "activations",
    "logits_loss",
)


COMM_KINDS = ("ddp", "zero2", "zero2_allreduce", "zero3")
CHECKPOINTING = (
    "none",
    "full",
    "selective_layer",
    "selective_op",
)  # activation checkpointing modes


def checkpoint_mode(checkpointing) -> str:
    """False -> "none", True -> "full", else one of CHECKPOINTING.

    Raises:
        ValueError: anything else.
    """
    mode = {False: "none", True: "full"}.get(checkpointing, checkpointing)
    if mode not in CHECKPOINTING:
        raise ValueError(
            f"checkpointing {checkpointing!r}: expected one of {', '.join(CHECKPOINTING)}"
        )
    return mode


def predicted_comm_bytes(
    kind: str,
    n_params: int,
    grad_bytes: int,
    param_bytes: int | None = None,
    world_size: int | None = None,
) -> float:
    """Bytes each rank sends per optimizer step, by the ZeRO paper's analysis (arXiv 1910.02054, §7).

    Args:
        kind: "ddp" (all-reduce of gradients: 2Ψ), "zero2" (ZeRO-1/2 as in the paper, FSDP
            SHARD_GRAD_OP: reduce-scatter Ψ + parameter all-gather Ψ), "zero2_allreduce"
            (DeepSpeed 0.19.8's ZeRO-1/2 with its default `use_multi_rank_bucket_allreduce`:
            it all-reduces the gradients, 2Ψ, then all-gathers the parameters, Ψ) or "zero3"
            (ZeRO-3 / FSDP FULL_SHARD: reduce-scatter Ψ + two parameter all-gathers 2Ψ).
        n_params: Ψ, the number of parameter elements of the full model.
        grad_bytes: bytes per element of the gradient reduction (4 for fp32, 2 for bf16/fp16).
        param_bytes: bytes per element of the parameter all-gathers (required for zero2/zero3).
        world_size: N. None gives the paper's figure (a ring's (N-1)/N share rounded to 1);
            an int multiplies by (N-1)/N, what a ring collective sends per rank (nccl-tests
            doc/PERFORMANCE.md), so N=1 gives 0.

    Returns:
        Bytes per rank per step (float when world_size is given).

    Raises:
        ValueError: unknown kind, negative n_params, world_size < 1, or param_bytes missing.
    """
    if kind not in COMM_KINDS:
        raise ValueError(f"unknown communication kind {kind!r}; expected one of {COMM_KINDS}")
    if n_params < 0:
        raise ValueError(f"n_params must be >= 0, got {n_params}")
    if world_size is not None and world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if kind != "ddp" and param_bytes is None:
        raise ValueError(f"{kind} all-gathers parameters: give param_bytes")
    if kind == "ddp":
        volume = 2 * n_params * grad_bytes
    else:
        reduce = (2 if kind == "zero2_allreduce" else 1) * n_params * grad_bytes
        volume = reduce + (2 if kind == "zero3" else 1) * n_params * param_bytes
    return volume if world_size is None else volume * (world_size - 1) / world_size


def comm_pattern(kind: str, grad_bytes: int, param_bytes: int | None = None) -> str:
    """Human-readable collectives per step, e.g. "RS Ψ×4B + 2×AG Ψ×2B" (RS reduce-scatter, AG all-gather)."""
    if kind == "ddp":
        return f"AR 2Ψ×{grad_bytes}B"
    reduce = f"AR 2Ψ×{grad_bytes}B" if kind == "zero2_allreduce" else f"RS Ψ×{grad_bytes}B"
    return f"{reduce} + {'2×' if kind == 'zero3' else ''}AG Ψ×{param_bytes}B"


def model_shape(config, lora: dict | None = None) -> dict:
    """Shapes the planner needs, read from a model built on the meta device (no memory, any HF causal LM).

    With `lora` ({"r": rank, "target_modules": "all-linear" or a list of names}, recipes/sft.py's
    --use_peft meanings) peft adds its adapters to the meta model as sft.py does: the counts below are
    then those of the adapted model (base and adapters), and "trainable" the adapters' elements, r x (in
    + out) per adapted Linear (all-linear on a Llama: q, k, v, o, gate, up, down in every block).

    Returns a dict of ints: n_params (Ψ, tied weights once), param_dim0_rest (list of (dim 0, other
    elements) per parameter), linear_weights (elements of every nn.Linear weight, lm_head included),
    largest_module (most parameters directly owned by one module, DeepSpeed's "largest layer"),
    gathered_modules (modules owning more than 10h parameter elements: ZeRO-3's all-gathers),
    block_params (one decoder block), root_params (outside the blocks), small_params (elements of
    parameters of at most 10h elements: ZeRO-3's persistent ones), and hidden, layers, heads,
    kv_dim, head_dim, intermediate, vocab; trainable (elements that get gradients and optimizer state: Ψ,
    or the adapters), trainable_dim0_rest, block_trainable, largest_trainable (most trainable elements
    directly owned by one module), lora_r (0 without LoRA). linear_weights counts the base's Linears only.

    Raises:
        ValueError: the config has no causal-LM class (from `models.causal_lm_class`), or peft refuses
            `lora` (e.g. target modules the model lacks).
    """
    with torch.device("meta"):
        model = models.causal_lm_class(config)(config)
        if lora:
            from peft import LoraConfig, get_peft_model

            model = get_peft_model(
                model,
                LoraConfig(
                    task_type="CAUSAL_LM",
                    r=lora["r"],
                    target_modules=lora.get("target_modules", "all-linear"),
                ),
            )
    params = list({id(p): p for p in model.parameters()}.values())
    trainable = [p for p in params if p.requires_grad]
    blocks = models.decoder_blocks(model)
    block_params = sum(p.numel() for p in blocks[0].parameters()) if blocks is not None else 0
    block_trainable = (
        sum(p.numel() for p in blocks[0].parameters() if p.requires_grad)
        if blocks is not None
        else 0
    )
    adapters = {id(m) for name, m in model.named_modules() if ".lora_" in name}
    h = config.hidden_size
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or h // heads
    n = sum(p.numel() for p in params)
    return {
        "n_params": n,
        "param_dim0_rest": [(p.shape[0], p.numel() // p.shape[0]) for p in params],
        "linear_weights": sum(
            m.weight.numel()
            for m in model.modules()
            if isinstance(m, torch.nn.Linear) and id(m) not in adapters
        ),
        "largest_module": max(
            sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()
        ),
        "block_params": block_params,
        "root_params": n - block_params * config.num_hidden_layers,
        "small_params": sum(p.numel() for p in params if p.numel() <= 10 * h),
        "gathered_modules": sum(
            1
            for m in model.modules()
            if sum(p.numel() for p in m.parameters(recurse=False)) > 10 * h
        ),
        "hidden": h,
        "layers": config.num_hidden_layers,
        "heads": heads,
        "head_dim": head_dim,
        "kv_dim": getattr(config, "num_key_value_heads", heads) * head_dim,
        "intermediate": getattr(config, "intermediate_size", 4 * h),
        "vocab": config.vocab_size,
        "trainable": sum(p.numel() for p in trainable),
        "trainable_dim0_rest": [(p.shape[0], p.numel() // p.shape[0]) for p in trainable],
        "block_trainable": block_trainable,
        "largest_trainable": max(
            sum(p.numel() for p in m.parameters(recurse=False) if p.requires_grad)
            for m in model.modules()
        ),
        "lora_r": lora["r"] if lora else 0,
    }


def shard_elements(shape: dict, ranks: int, trainable: bool = False) -> int:
    """Parameter elements on the fullest rank when each tensor is split along dim 0 over `ranks`: all the
    parameters, or (trainable) those that train (the LoRA adapters under LoRA)."""
    return sum(
        math.ceil(d0 / ranks) * rest
        for d0, rest in shape["trainable_dim0_rest" if trainable else "param_dim0_rest"]
    )


def activation_bytes(
    shape: dict,
    batch: int,
    seq: int,
    residual_bytes: int,
    compute_bytes: int,
    checkpointing: bool,
    weight_copies: bool,
    packing: str = "stream",
) -> dict:
    """Bytes autograd saves in one micro batch's forward (the module docstring's table).

    Args:
        shape: `model_shape(config)`.
        batch, seq: micro batch size and tokens per sample (T = batch x seq).
        residual_bytes: r, element size of the params and residual stream (4 fp32, 2 bf16/fp16).
        compute_bytes: c, element size autocast computes in (2 bf16/fp16, 4 without mixed precision).
        checkpointing: False / "none"; True / "full": every block checkpointed (non-reentrant), a block
            keeps its input only; "selective_layer": every second block so; "selective_op": torchtitan's
            per-op policy, a block keeps its input (r h), the q, v, gate and down projections' outputs and
            attention's output (c(2 h_q + h_kv + I + h)) and its fp32 log-sum-exp (4a), per token.
        weight_copies: autocast casts fp32 weights to c bytes (params fp32 and c == 2).
        packing: `--packing`. "documents" (position ids that restart) and "none" (padding) give SDPA
            an explicit mask: each block saves it as a c-byte bias (batch x seq x seq), and transformers
            repeats k and v to every query head (its grouped-query path needs no mask), c(2 h_q - 2 h_kv)
            more per token; "documents" also makes the rotary cos and sin per sample (batch x as much).
            Measured to the byte on CPU (tests/test_plan.py).

    Returns:
        {"blocks": all L blocks, "head": ids, labels, final norm, head input cast, cos/sin,
        "log_softmax": the fp32 log-softmax the loss saves (4TV), "weight_copies", "recompute":
        one block's bytes rebuilt during backward (checkpointing only), "saved": the sum of the
        first four (what `common.memory.SavedTensorBytes` counts)}; ints, bytes.
    """
    mode = checkpoint_mode(checkpointing)
    r, c, t = residual_bytes, compute_bytes, batch * seq
    h, hkv, i, a = shape["hidden"], shape["kv_dim"], shape["intermediate"], shape["heads"]
    hq, layers = shape["heads"] * shape["head_dim"], shape["layers"]
    casts = r != c
    block = t * (
        2 * ((4 + r) * h + 4)
        + (5 if casts else 2) * c * h
        + c * (2 * h + 2 * hkv)
        + 4 * a
        + 4 * c * i
    )
    if (
        packing != "stream"
    ):  # an explicit mask: saved as a bias, and k, v repeated to every query head
        block += batch * seq * seq * c + t * c * 2 * (hq - hkv)
    rotary_batch = (
        batch if packing == "documents" else 1
    )  # cos and sin follow the position ids' batch
    block_weights = (
        2 * (shape["linear_weights"] - shape["vocab"] * h) // layers if weight_copies else 0
    )
    kept = {
        "none": block,
        "full": t * r * h,
        # torchtitan's per-op policy: the block input, the outputs of q, v, gate and down projections,
        # attention's output and log-sum-exp
        "selective_op": t * (r * h + c * (2 * hq + hkv + i + h) + 4 * a),
    }
    if (
        mode == "selective_layer"
    ):  # every second block checkpointed (torchtitan's default frequency 2)
        blocks = (layers // 2) * kept["full"] + (layers - layers // 2) * block
    else:
        blocks = layers * kept[mode]
    checkpointed = mode != "none"
    rotary = 0 if checkpointed else 2 * rotary_batch * seq * shape["head_dim"] * r  # cos, sin
    head = t * (16 + (4 + r) * h + 4 + c * h) + 4 + rotary
    copies = (
        2 * (shape["vocab"] * h if checkpointed else shape["linear_weights"])
        if weight_copies
        else 0
    )
    out = {
        "blocks": blocks,
        "head": head,
        "log_softmax": 4 * t * shape["vocab"],
        "weight_copies": copies,
        "recompute": block + block_weights if checkpointed else 0,
    }
    out["saved"] = blocks + head + out["log_softmax"] + copies
    return out


def read_strategy(config_path: Path) -> dict:
    """The planner's view of an accelerate YAML (and its DeepSpeed JSON).

    Returns {"name", "kind": "single" | "ddp" | "fsdp" | "fsdp1" | "zero2" | "zero3", "mixed_precision",
    "num_processes", "num_machines", "reshard" (FSDP), "offload_optimizer", "offload_param",
    "grad_accum_bytes", "comm_bytes" (DeepSpeed gradient reduction), "ds" (the zero_optimization dict),
    "replicas" (HSDP's parallelism_config_dp_replicate_size: FSDP shards over ranks / replicas; 1 otherwise)}.

    Raises:
        ValueError: an unreadable file, or a strategy the planner does not know (one line, naming the file).
    """
    import yaml

    try:
        cfg = yaml.safe_load(config_path.read_text()) or {}
    except (OSError, yaml.YAMLError) as err:
        raise ValueError(
            f"--config {config_path}: cannot read it: {' '.join(str(err).split())}"
        ) from None
    if not isinstance(cfg, dict):
        raise ValueError(
            f"--config {config_path}: not an accelerate config (a YAML mapping of keys)"
        )
    out = {
        "name": config_path.stem,
        "mixed_precision": str(cfg.get("mixed_precision", "no")),
        "num_processes": int(cfg.get("num_processes", 1)),
        "num_machines": int(cfg.get("num_machines", 1)),
        "reshard": True,
        "offload_optimizer": False,
        "offload_param": False,
        "grad_accum_bytes": None,
        "comm_bytes": None,
        "ds": {},
        "replicas": 1,
    }
    kind = str(cfg.get("distributed_type", "NO"))
    if kind == "NO":
        out["kind"] = "single"
    elif kind in ("MULTI_GPU", "MULTI_CPU"):
        out["kind"] = "ddp"
    elif kind == "FSDP":
        fsdp = cfg.get("fsdp_config") or {}
        out["kind"] = "fsdp1" if int(fsdp.get("fsdp_version", 1)) == 1 else "fsdp"
        reshard = fsdp.get("fsdp_reshard_after_forward", fsdp.get("fsdp_sharding_strategy", True))
        if "HYBRID" in str(reshard).upper():
            raise ValueError(
                f"--config {config_path}: {reshard} shards within a node only; the planner does not "
                "model it (plan FULL_SHARD for one node's ranks instead)"
            )
        if str(reshard).upper() == "NO_SHARD":
            out["kind"] = (
                "ddp"  # every rank holds everything, gradients all-reduced: DDP's memory and traffic
            )
        out["reshard"] = reshard is True or str(reshard).upper() in ("TRUE", "FULL_SHARD")
        out["offload_param"] = out["offload_optimizer"] = bool(
            fsdp.get("fsdp_offload_params", False)
        )
        mesh = cfg.get("parallelism_config") or {}
        if int(mesh.get("parallelism_config_tp_size") or 1) > 1:
            raise ValueError(
                f"--config {config_path}: tensor parallel (parallelism_config_tp_size "
                f"{mesh['parallelism_config_tp_size']}): the planner does not model it"
            )
        if (
            out["kind"] == "fsdp" and int(mesh.get("parallelism_config_dp_replicate_size") or 1) > 1
        ):  # HSDP
            out["replicas"] = int(mesh["parallelism_config_dp_replicate_size"])
    elif kind == "DEEPSPEED":
        ds_yaml = cfg.get("deepspeed_config") or {}
        path = ds_yaml.get("deepspeed_config_file")
        if path and path != "none":
            try:
                ds = json.loads((REPO / path).read_text())
            except (OSError, ValueError) as err:
                raise ValueError(
                    f"--config {config_path}: deepspeed_config_file {path!r}: {err}"
                ) from None
        else:  # the keys in the YAML itself, as `accelerate config` writes them
            ds = {
                "zero_optimization": {
                    "stage": ds_yaml.get("zero_stage", 0),
                    "offload_optimizer": {
                        "device": ds_yaml.get("offload_optimizer_device", "none")
                    },
                    "offload_param": {"device": ds_yaml.get("offload_param_device", "none")},
                }
            }
        zero = ds.get("zero_optimization", {})
        stage = zero.get("stage", 0)
        if str(stage) not in ("0", "1", "2", "3"):
            raise ValueError(
                f"--config {config_path}: zero_optimization.stage {stage!r}: expected 0, 1, 2 or 3"
            )
        out["kind"] = {0: "ddp", 1: "zero2", 2: "zero2", 3: "zero3"}[int(stage)]
        out["ds"] = zero
        out["offload_optimizer"] = (zero.get("offload_optimizer") or {}).get(
            "device", "none"
        ) != "none"
        out["offload_param"] = (zero.get("offload_param") or {}).get("device", "none") != "none"
        out["grad_accum_bytes"] = DTYPE_BYTES.get(
            str((ds.get("data_types") or {}).get("grad_accum_dtype"))
        )
        out["comm_bytes"] = DTYPE_BYTES.get(str(ds.get("communication_data_type")))
    else:
        raise ValueError(
            f"--config {config_path}: distributed_type {kind!r} is not one the planner knows"
        )
    return out


RESERVED_SLACK = (
    0.06  # reserved over allocated: the allocator's slack (assumed, see the module docstring)
)


def logits_factor(compiled_loss: bool = False, transformers_version: str | None = None) -> float:
    """Bytes per token and vocabulary entry at the loss's peak: 12 with transformers >= 5 (measured),
    16 before (reported), 4 for a compiled loss (reported); the installed version by default."""
    if compiled_loss:
        return 4.0
    if transformers_version is None:
        import transformers

        transformers_version = transformers.__version__
    return 12.0 if int(transformers_version.split(".")[0]) >= 5 else 16.0


def _ds_size(zero: dict, key: str, auto: float) -> float:
    value = zero.get(key, "auto")
    return auto if value == "auto" else float(value)


def plan_strategy(
    strategy: dict,
    shape: dict,
    ranks: int,
    batch: int,
    seq: int,
    accumulation: int,
    checkpointing: bool | str,
    mixed_precision: str,
    logits_bytes: float | None = None,
    grads_at_peak: bool = True,
    machines: int = 1,
    packing: str = "stream",
) -> dict:
    """Bytes per rank (fullest rank) and communication per optimizer step for one strategy.

    Args:
        strategy: `read_strategy(...)`. shape: `model_shape(...)`. ranks: N (all machines).
        batch, seq: micro batch and block size; accumulation: micro batches per optimizer step.
        checkpointing: `--gradient_checkpointing` (True: "full") or a CHECKPOINTING mode.
        mixed_precision: "no", "bf16" or "fp16".
        logits_bytes: bytes per token and vocabulary entry at the loss's peak; default `logits_factor()`.
        grads_at_peak: False when the gradients are set to None between steps (torch's zero_grad default):
            then, with one micro batch per step, DDP's and FSDP's gradients (4Ψ, 4Ψ/N) do not exist at the
            activation peak, and the total is the larger of that peak and the optimizer step's (every
            gradient, no activations or logits). DeepSpeed keeps its gradient partition allocated.
        machines: the ranks' machines (nodes), for the share of the communication that crosses the network.
        packing: `--packing` (`activation_bytes`: a mask and its consequences outside "stream").

    Returns:
        A dict of ints in bytes: the CATEGORIES on the device, "host" (offloaded states), "total"
        (device, allocated), "reserved" (total x (1 + RESERVED_SLACK)), plus "comm_per_step" (ring
        collectives, bytes sent per rank), "comm_inter_node" (the part of it that crosses machines), "comm_pattern",
        and "activations_detail" (`activation_bytes`).

    LoRA (`model_shape(config, lora)`): the frozen base is stored as every parameter is (fp32, sharded
    under FSDP and ZeRO-3, whole under DDP, ZeRO-2 in the compute dtype: DeepSpeed casts the whole
    module), while gradients, the fp32 master and Adam exist for the trainable elements only (torch
    gives frozen parameters no .grad; the optimizer and DeepSpeed's partitions take only parameters
    that require grad), and so do DDP's reducer buckets and the gradient reductions. FSDP and ZeRO-3
    still all-gather every parameter, frozen or not, in forward and backward; ZeRO-2 all-gathers only
    the updated (trainable) partitions. Measured by benchmarks/measure_model_states.py:
    benchmarks/results/lora_states_cpu2.md.
    """
    kind, n, h = strategy["kind"], shape["n_params"], shape["hidden"]
    t = shape.get(
        "trainable", n
    )  # elements with gradients and optimizer state (the adapters under LoRA)
    low = 4 if mixed_precision == "no" else 2
    replicas = strategy.get(
        "replicas", 1
    )  # HSDP: FSDP shards over ranks / replicas, replicates across
    shard = shard_elements(shape, ranks // replicas)
    tshard = shard_elements(shape, ranks // replicas, trainable=True)
    zero = strategy["ds"]
    states = {"params": 4 * n, "grads": 4 * t, "fp32_master": 0, "adam_moments": 8 * t}
    host = 0
    if kind == "single":
        ranks = 1
    if kind in ("fsdp", "fsdp1"):
        states = {
            "params": 4 * shard,
            "grads": 4 * tshard,
            "fp32_master": 0,
            "adam_moments": 8 * tshard,
        }
        if accumulation > 1:  # unsharded fp32 gradients held between micro batches (no_sync)
            states["grads"] += 4 * (t - tshard)
    elif kind in ("zero2", "zero3"):
        part, tpart = math.ceil(n / ranks), math.ceil(t / ranks)
        grad_bytes = strategy["grad_accum_bytes"] or low
        persistent = shape["small_params"] if kind == "zero3" else 0
        states = {
            "params": low * (part + persistent) if kind == "zero3" else low * n,
            "grads": grad_bytes * tpart,
            "fp32_master": 4 * tpart,  # ZeRO-3 in fp32 too: a copy (measured)
            "adam_moments": 8 * tpart,
        }
    if strategy["offload_optimizer"]:
        moved = ["fp32_master", "adam_moments"] + (["grads"] if kind == "zero3" else [])
        if kind in ("fsdp", "fsdp1"):
            moved = ["params", "grads", "adam_moments"]
        host += sum(states[k] for k in moved)
        states.update({k: 0 for k in moved})
    if strategy["offload_param"] and kind == "zero3":
        host += states["params"]
        states["params"] = low * persistent

    # communication buffers (transient)
    if kind in ("single", "ddp"):
        buffers = (
            0 if kind == "single" else 4 * t
        )  # DDP reducer buckets: a second copy of the grads
    elif kind in ("fsdp", "fsdp1"):
        buffers = (
            low * shape["root_params"]
            + 2 * low * shape["block_params"]
            + 4 * shape.get("block_trainable", shape["block_params"])
        )  # one block's unsharded gradients
        if not strategy[
            "reshard"
        ]:  # every unit's gathered parameters stay from its forward to its backward
            buffers += low * (n - shard)
    elif kind == "zero2":
        buffers = 2 * low * _ds_size(zero, "reduce_bucket_size", h * h)
    else:
        buffers = (
            (strategy["comm_bytes"] or low) * _ds_size(zero, "reduce_bucket_size", h * h)
            + low * _ds_size(zero, "stage3_prefetch_bucket_size", 0.9 * h * h)
            + low
            * (shape["largest_module"] + shape.get("largest_trainable", shape["largest_module"]))
        )

    residual = (
        4 if kind in ("single", "ddp") else low
    )  # FSDP / DeepSpeed compute on low-precision params
    act = activation_bytes(
        shape,
        batch,
        seq,
        residual,
        low,
        checkpointing,
        weight_copies=residual == 4 and low == 2,
        packing=packing,
    )
    activations = act["saved"] - act["log_softmax"] + act["recompute"]
    factor = logits_factor() if logits_bytes is None else logits_bytes
    logits = int(
        factor * batch * seq * shape["vocab"]
    )  # peak at the loss: see the module docstring
    out = {
        **states,
        "comm_buffers": int(buffers),
        "activations": activations,
        "logits_loss": logits,
    }
    out["total"] = sum(out[k] for k in CATEGORIES)
    if not grads_at_peak and accumulation == 1 and kind in ("single", "ddp", "fsdp", "fsdp1"):
        # set to None between steps: no gradients at the activation peak (the start of the backward);
        # the other peak is the optimizer step, with every gradient and no activations
        out["total"] = max(out["total"] - states["grads"], out["total"] - activations - logits)
    out["reserved"] = int(out["total"] * (1 + RESERVED_SLACK))
    out["host"] = host
    eval_tokens = batch * seq
    out["eval_peak"] = (
        sum(states.values())
        + low * eval_tokens * shape["vocab"]
        + 2 * 4 * min(metrics.LOSS_CHUNK_ELEMENTS, eval_tokens * shape["vocab"])
    )

    # communication per optimizer step (ZeRO paper volumes, ring share (N-1)/N, each in its dtype)
    grad_comm = 4 if kind in ("single", "ddp", "fsdp", "fsdp1") else (strategy["comm_bytes"] or low)
    g = "Ψ" if t == n else "Ψt"  # Ψt: the trainable elements (LoRA adapters)
    if kind in ("single", "ddp"):
        comm, pattern = (
            predicted_comm_bytes("ddp", t, grad_comm, world_size=ranks),
            f"AR 2{g}×{grad_comm}B",
        )
    else:
        gathers = 2 if kind == "zero3" or (kind.startswith("fsdp") and strategy["reshard"]) else 1
        # DeepSpeed 0.19.8's ZeRO-1/2 all-reduces the gradients (2Ψ) unless the JSON sets
        # use_multi_rank_bucket_allreduce: false; ZeRO-3 and FSDP reduce-scatter them (Ψ)
        allreduce = kind == "zero2" and zero.get("use_multi_rank_bucket_allreduce", True)
        group = ranks // replicas  # the ranks a parameter is sharded over
        reduce = predicted_comm_bytes(
            "zero2_allreduce" if allreduce else "zero2", t, grad_comm, 0, group
        )
        gathered = (
            t if kind == "zero2" else n
        )  # ZeRO-2 gathers the updated partitions; FSDP, ZeRO-3 every param
        gather = predicted_comm_bytes("zero3" if gathers == 2 else "zero2", gathered, 0, low, group)
        # DeepSpeed reduces every micro batch; FSDP (no_sync) once per step but gathers every micro batch
        reduces = accumulation if kind.startswith("zero") else 1
        gather_times = 1 if kind == "zero2" else accumulation
        comm = reduce * reduces + gather * gather_times
        pattern = (
            f"{reduces}×{f'AR 2{g}' if allreduce else f'RS {g}'}×{grad_comm}B + "
            f"{gather_times * gathers}×AG {g if kind == 'zero2' else 'Ψ'}×{low}B"
        )
    # Across machines: a ring over all ranks (node by node) crosses a machine boundary in 1 of every
    # ranks-per-machine hops, so that share of each rank's bytes rides the network. HSDP keeps its
    # reduce-scatters and all-gathers inside a machine (shards: a machine's ranks) and all-reduces each
    # rank's gradient shard with its replicas on the other machines: 2 x Ψ/shards x 4B x (R-1)/R.
    inter = comm * machines / ranks if machines > 1 and kind != "single" else 0
    if replicas > 1:
        across = predicted_comm_bytes(
            "ddp", math.ceil(t / (ranks // replicas)), grad_comm, world_size=replicas
        )
        inter = across if machines > 1 else 0
        comm += across
        pattern += f" + AR 2{g}/{ranks // replicas}×{grad_comm}B across {replicas} replicas"
    out.update(
        comm_per_step=int(comm),
        comm_inter_node=int(inter),
        comm_pattern=pattern,
        activations_detail=act,
    )
    return out


def parse_memory(text: str) -> tuple[int, str]:
    """'80GB' -> (80e9 bytes, "GB"), '80GiB' -> (80 x 2^30, "GiB"), '1.5TB', '512MB'. A bare number is
    refused: 80 GB and 80 GiB differ by 6.9 GB, enough to turn a verdict.

    Raises:
        ValueError: an unreadable size or one without a unit (names it).
    """
    m = re.fullmatch(r"\s*([\d.]+)\s*([KMGT]I?B)?\s*", text.upper())
    if not m:
        raise ValueError(f"--device_memory {text!r}: expected a size such as 80GB or 141GiB")
    unit = m.group(2) or "B"
    try:
        size = int(float(m.group(1)) * ((1024 if "I" in unit else 1000) ** "BKMGT".index(unit[0])))
    except ValueError:
        size = 0
    if size <= 0:
        raise ValueError(
            f"--device_memory {text!r}: expected a positive size such as 80GB or 141GiB"
        )
    if not m.group(2):
        raise ValueError(
            f"--device_memory {text!r}: give a unit, {text.strip()}GB (10^9 bytes) or "
            f"{text.strip()}GiB (2^30 bytes)"
        )
    return size, ("GiB" if "I" in unit else "GB")


MODEL_CONFIGS = REPO / "tools" / "model_configs"  # public HF config.json files (its README.md)


def model_names() -> list[str]:
    """The presets, then the stored public configs."""
    return [*models.PRESETS, *sorted(p.parent.name for p in MODEL_CONFIGS.glob("*/config.json"))]


def load_model_config(name: str, vocab_size: int | None):
    """A preset name (vocabulary: PRESET_VOCAB unless `vocab_size`), a config in MODEL_CONFIGS, or a
    local HF config/model directory or file.

    Raises:
        ValueError: neither a preset nor a readable local config (one line).
    """
    if name in models.PRESETS:
        return models.llama_config(name, vocab_size or PRESET_VOCAB.get(name, 128256))
    from transformers import AutoConfig

    if (MODEL_CONFIGS / name / "config.json").is_file():  # a public config stored here
        name = str(MODEL_CONFIGS / name)
    if not os.path.exists(name):
        raise ValueError(
            f"--model_config {name!r}: not a preset ({', '.join(model_names())}) and no such local path"
        )
    try:
        config = AutoConfig.from_pretrained(name, local_files_only=True)
    except (OSError, ValueError) as err:
        raise ValueError(
            f"--model_config {name!r}: cannot read a config there: {' '.join(str(err).split())}"
        ) from None
    if vocab_size:
        config.vocab_size = vocab_size
    return config


# ---------------------------------------------------------------------------------------------
# Time: step time and tokens/s per rank for each strategy
# ---------------------------------------------------------------------------------------------

DEFAULT_EFFICIENCY = (
    0.6  # uncalibrated: matmuls at 60% of the dense peak (assumed; torchtitan's rows fit 0.45-0.65)
)
MEMORY_EFFICIENCY = (
    0.8  # share of the datasheet memory bandwidth elementwise kernels reach (assumed)
)
DDP_BUCKET_BYTES = 25 * 2**20  # torch DDP's bucket_cap_mb default (25 MiB)
DS_ALLGATHER_BUCKET = 5e8  # DeepSpeed ZeRO-1/2 allgather_bucket_size default (elements)


class Device(dict):
    """One rank's hardware for the time model (a dict with attribute names, SI units).

    Keys: name; peak_flops (dense bf16 FLOP/s); memory_bandwidth (bytes/s of the device memory);
    intra_node (bus bandwidth inside a node, bytes/s: a float, or a dict by collective "all_reduce",
    "all_gather", "reduce_scatter"); network (bytes/s of each GPU's NIC between nodes);
    gpus_per_node; latency (seconds per ring hop of a collective); overlap (collectives run beside compute: True on
    GPUs, which have copy engines and NCCL's own SMs; False on CPU ranks, whose collectives use the
    cores that compute); host_bandwidth (bytes/s of host RAM per rank, for offloaded AdamW); pcie
    (host <-> device bytes/s per rank; 0 when the device is the host); source (where the figures are from).
    """

    __getattr__ = dict.__getitem__


# Peaks: torchtitan torchtitan/tools/utils.py (dense bf16). Memory bandwidth, NVLink and PCIe: NVIDIA's
# A100 / H100 / H200 datasheets. Bus bandwidths are what nccl-tests would report (its "busbw"), assumed
# to be 80% of the link's one-way datasheet rate: NVLink 3 300 GB/s -> 240, NVLink 4 450 -> 360,
# PCIe Gen5 x16 64 -> 51; the network is one NIC per GPU, HDR 200 Gb/s (25 GB/s -> 20) for A100
# nodes (DGX A100), NDR 400 Gb/s (50 GB/s -> 40) for H100/H200 (DGX H100). Latency: 5 us per ring
# hop (assumed; 0.6 ms for a collective over 128 ranks). memory: what nvidia-smi reports as
# memory.total, in MiB (H100 80GB HBM3 81,559 and H200 143,771 in public nvidia-smi printouts; A100
# 80 GiB and 40 GiB exactly; H100 NVL 94 GB and torchtitan's H100 96 GB HBM2e their datasheet GB).
MIB = 2**20
GPUS = {
    "a100": dict(
        peak_flops=312e12,
        memory_bandwidth=2.039e12,
        intra_node=240e9,
        network=20e9,
        pcie=25e9,
        memory=81920 * MIB,
        label="A100 SXM 80GB",
    ),
    "a100-40gb": dict(
        peak_flops=312e12,
        memory_bandwidth=1.555e12,
        intra_node=240e9,
        network=20e9,
        pcie=25e9,
        memory=40960 * MIB,
        label="A100 SXM 40GB",
    ),
    "h100": dict(
        peak_flops=989e12,
        memory_bandwidth=3.35e12,
        intra_node=360e9,
        network=40e9,
        pcie=51e9,
        memory=81559 * MIB,
        label="H100 SXM 80GB",
    ),
    "h100-96gb": dict(  # torchtitan's H100 benchmarks: 96 GB HBM2e, 2.4 TB/s, 500 W
        peak_flops=989e12,
        memory_bandwidth=2.4e12,
        intra_node=360e9,
        network=40e9,
        pcie=51e9,
        memory=96 * 10**9,
        label="H100 SXM 96GB HBM2e",
        memory_from="the datasheet's GB",
    ),
    "h100-nvl": dict(
        peak_flops=835e12,
        memory_bandwidth=3.9e12,
        intra_node=240e9,
        network=40e9,
        pcie=51e9,
        memory=94 * 10**9,
        label="H100 NVL 94GB",
        memory_from="the datasheet's GB",
    ),
    "h100-pcie": dict(
        peak_flops=756e12,
        memory_bandwidth=2.0e12,
        intra_node=51e9,
        network=40e9,
        pcie=51e9,
        memory=81559 * MIB,
        label="H100 PCIe 80GB",
    ),
    "h200": dict(
        peak_flops=989e12,
        memory_bandwidth=4.8e12,
        intra_node=360e9,
        network=40e9,
        pcie=51e9,
        memory=143771 * MIB,
        label="H200 SXM 141GB",
    ),
}
GPU_ALIASES = {"a100-80gb": "a100", "h100-sxm": "h100", "h100-80gb": "h100", "h200-141gb": "h200"}
# CPU ranks (gloo): no datasheet peak; 1e12 FLOP/s and 20 GB/s of memory per rank are placeholders
# for calibration (the efficiency fitted against them is a scale, not a share of a real peak). The gloo
# bus bandwidths and latency are measured on this project's
# 2-core host, 2 ranks, 32 MiB buffers (benchmarks/results/gloo_cpu2.md): all-reduce 1.15 GB/s,
# all-gather 0.30, reduce-scatter 0.22; 0.3-0.6 ms for a 4-byte collective (one hop at 2 ranks).
CPU = dict(
    peak_flops=1e12,
    memory_bandwidth=20e9,
    network=1e9,
    pcie=0.0,
    gpus_per_node=1 << 30,
    intra_node={"all_reduce": 1.15e9, "all_gather": 0.30e9, "reduce_scatter": 0.22e9},
    latency=0.4e-3,
    overlap=False,
    host_bandwidth=10e9,
)


def device_spec(name: str, **overrides) -> Device:
    """The Device for "a100", "h100", "h100-nvl", "h100-pcie", "h200" or "cpu", with `overrides` (None
    values ignored) for any key, e.g. intra_node=300e9, network=50e9, gpus_per_node=4.

    Raises:
        ValueError: an unknown name.
    """
    if name == "cpu":
        base = {
            **CPU,
            "source": "CPU ranks over gloo: bus bandwidths measured (benchmarks/results/gloo_cpu2.md), "
            "peak FLOP/s a placeholder",
        }
    elif GPU_ALIASES.get(name, name) in GPUS:
        name = GPU_ALIASES.get(name, name)
        base = {
            "gpus_per_node": 8,
            "latency": 5e-6,
            "overlap": True,
            "host_bandwidth": 20e9,
            **GPUS[name],
            "source": f"{name} ({GPUS[name]['label']}) datasheet",
        }
    else:
        raise ValueError(
            f"--gpu {name!r}: expected one of {', '.join([*GPUS, *GPU_ALIASES, 'cpu'])}"
        )
    changed = {k: v for k, v in overrides.items() if v is not None}
    if changed:
        base["source"] += " with " + ", ".join(sorted(changed))
    return Device(name=name, **{**base, **changed})


def gpu_key(name: str, memory: int | None = None) -> str:
    """The GPUS key of a device name as CUDA or nvidia-smi spell it ("NVIDIA H100 NVL" -> h100-nvl,
    "NVIDIA A100-SXM4-40GB" -> a100-40gb), "cpu" for "cpu", None for a GPU not in GPUS."""
    name = name.upper()
    if name == "CPU":
        return "cpu"
    for key, words in (
        ("h200", ("H200",)),
        ("h100-nvl", ("H100 NVL",)),
        ("h100-pcie", ("H100 PCIE",)),
        ("h100", ("H100", "H800")),
        ("a100", ("A100", "A800")),
    ):
        if any(w in name for w in words):
            small = "40GB" in name or (memory is not None and memory < 60 * 2**30)
            return "a100-40gb" if key == "a100" and small else key
    return None


def detect_gpu() -> str:
    """The GPUS key of the first CUDA device, "h100" for a GPU not in GPUS, "cpu" without one."""
    if not torch.cuda.is_available():
        return "cpu"
    props = torch.cuda.get_device_properties(0)
    return gpu_key(props.name, props.total_memory) or "h100"


def bus_bandwidth(device: Device, op: str, ranks: int) -> float:
    """Bus bandwidth (bytes/s) of collective `op` over `ranks`: the intra-node figure within one node;
    across nodes the smaller of it and network x GPUs per node. A ring enters and leaves each node once
    per channel, and NCCL runs one channel per NIC, so with a NIC per GPU all of a node's NICs carry
    the ring's inter-node hops in parallel (NCCL's rings; nccl-tests doc/PERFORMANCE.md)."""
    intra = device.intra_node[op] if isinstance(device.intra_node, dict) else device.intra_node
    return (
        intra
        if ranks <= device.gpus_per_node
        else min(intra, device.network * device.gpus_per_node)
    )


def collective_seconds(device: Device, op: str, nbytes: float, ranks: int, count: int = 1) -> float:
    """Seconds for `count` collectives moving `nbytes` in all (the all-reduced buffer, the gathered
    output, the reduce-scattered input): count x steps x latency + nbytes x share / bus bandwidth, with
    share 2(N-1)/N for an all-reduce and (N-1)/N for an all-gather or reduce-scatter, and steps the
    ring's N-1 hops (2(N-1) for an all-reduce): ring algorithms, as NVIDIA nccl-tests
    doc/PERFORMANCE.md defines bus bandwidth. 0 for one rank."""
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    share = (2 if op == "all_reduce" else 1) * (ranks - 1) / ranks
    return count * share * ranks * device.latency + nbytes * share / bus_bandwidth(
        device, op, ranks
    )


def compute_work(
    shape: dict,
    seq: int,
    checkpointing: str = "none",
    compiled: bool = False,
    compute_bytes: int = 2,
) -> dict:
    """Matmul FLOPs and elementwise memory traffic per token of one training micro batch (forward,
    backward and recomputation), split forward / backward.

    FLOPs: a Linear of k x n costs 2kn per token forward and 4kn backward (6N in all, the PaLM paper's
    appendix B count that torchtitan's metrics use), over every Linear weight (the head included, the
    embedding lookup excluded); causal attention 2·L·a·d·s per token forward (QK^T and AV over half of
    the s keys on average: PaLM's 12·L·H·Q·T halved, as flash kernels skip the masked blocks), twice
    that backward. Recomputation adds forward work in the backward pass: "full" every block's
    Linears and attention; "selective_layer" (torchtitan's every-second-block) half of that;
    "selective_op" (torchtitan's per-op policy: it keeps the outputs of attention and of every
    other matmul, so of the q, v, gate and down projections) the k, o and up projections again.

    Memory traffic (bytes per token, bf16, derived for a Llama block): the elementwise kernels eager
    PyTorch runs read and write whole tensors. Forward per block: 2 RMSNorms in fp32 (casts, square,
    mean, scale, weight: 36h each), rotary on q and k (20 per element), q/k/v layout copies
    (4(h + 2h_kv)), 2 residual adds (6h each), SiLU and the gate product (10I): 108h + 28h_kv + 10I;
    the backward moves about twice that, 3x in all. Compiled (torch.compile of each block), the
    fused kernels read each input and write each output once: 3 x (16h + 4h_kv + 6I). The loss
    (fp32 upcast, log-softmax, its backward, the cast back) moves 36V per token either way (torchtitan
    compiles the blocks, not the loss). Recomputation adds the recomputed blocks' forward traffic.
    compute_bytes 4 (no mixed precision) doubles the traffic.

    Returns:
        {"flops_fwd", "flops_bwd", "bytes_fwd", "bytes_bwd"}: floats per token.

    Raises:
        ValueError: an unknown checkpointing mode.
    """
    checkpointing = checkpoint_mode(checkpointing)
    h, hkv, i, layers, v = (
        shape["hidden"],
        shape["kv_dim"],
        shape["intermediate"],
        shape["layers"],
        shape["vocab"],
    )
    hq = shape["heads"] * shape["head_dim"]
    head = v * h
    linear = shape["linear_weights"]
    attention = 2 * layers * hq * seq  # causal, forward
    block_linear = linear - head
    recompute_flops = {
        "none": 0.0,
        "full": 2 * block_linear + attention,
        "selective_layer": block_linear + attention / 2,
        "selective_op": 2 * layers * (h * hkv + hq * h + h * i),
    }[checkpointing]
    fwd_layer = (16 * h + 4 * hkv + 6 * i) if compiled else (108 * h + 28 * hkv + 10 * i)
    recompute_share = {"none": 0.0, "full": 1.0, "selective_layer": 0.5, "selective_op": 1.0}[
        checkpointing
    ]
    scale = compute_bytes / 2
    return {
        "flops_fwd": 2.0 * linear + attention,
        "flops_bwd": 4.0 * linear + 2 * attention + recompute_flops,
        "bytes_fwd": scale * (layers * fwd_layer + 12 * v),
        "bytes_bwd": scale * (layers * fwd_layer * (2 + recompute_share) + 24 * v),
    }


def time_strategy(
    strategy: dict,
    shape: dict,
    device: Device,
    ranks: int,
    batch: int,
    seq: int,
    accumulation: int = 1,
    checkpointing: str = "none",
    compiled: bool = False,
    efficiency: float = 0.5,
    mixed_precision: str = "bf16",
) -> dict:
    """Seconds per optimizer step and tokens/s per rank for one strategy: compute, the communication
    left exposed, and the optimizer.

    compute = tokens x (FLOPs / (peak x efficiency) + bytes / (memory bandwidth x MEMORY_EFFICIENCY))
    (`compute_work`), forward a third of the FLOPs. `efficiency` is the one fitted factor (`calibrate`):
    the share of the datasheet peak the matmuls reach on this stack.

    Communication per micro batch (`collective_seconds`; bytes in the dtypes sent, as `plan_strategy`):
    - DDP: all-reduce of the fp32 gradients (4Ψ) in 25 MiB buckets during the last micro batch's
      backward (no_sync before it); the last bucket waits for the end of the backward.
    - FSDP2 / FSDP1 (FULL_SHARD): all-gather of each unit's bf16 parameters in the forward (the root
      unit, embeddings, final norm and head, first: exposed) and again in the backward when resharding,
      reduce-scatter of fp32 gradients (4Ψ) once per step (no_sync), the root's last (exposed).
    - ZeRO-1/2 (DeepSpeed): gradients reduced every micro batch in reduce_bucket_size buckets during
      the backward (an all-reduce of 2Ψ, DeepSpeed's use_multi_rank_bucket_allreduce, else a
      reduce-scatter), the last bucket exposed; after the optimizer the bf16 parameters are all-gathered
      (2Ψ), not overlapped.
    - ZeRO-3: bf16 parameters all-gathered module by module (`gathered_modules`, forward and
      backward), gradients reduce-scattered in reduce_bucket_size buckets; the first module's gather
      and the last module's gradient reduction exposed (taken as the largest module, the embedding in
      a Llama, at least one bucket). DeepSpeed's
      per-module hooks (Python, on the critical path) are not counted: on 2 CPU ranks ZeRO-2 and
      ZeRO-3 measured 10-15% slower than predicted (tests/test_plan_time.py).
    Collectives overlap the compute of their phase on a GPU (ZeRO paper §7 and FSDP's prefetching):
    exposed = max(0, forward comm - forward compute) + max(0, backward comm - backward compute) + the
    exposed pieces above; on CPU ranks (device.overlap False) every collective is exposed.

    Optimizer: AdamW over the rank's shard (Ψ for DDP, Ψ/N sharded) reads fp32 params, grads, 2 moments
    and writes params and moments (28 bytes per element) after the grad-norm clip reads the grads (4):
    32 bytes per element over the memory bandwidth; DeepSpeed then casts its fp32 master to the bf16
    parameters (6 more). Offloaded (DeepSpeed offload_optimizer, FSDP offload), the AdamW runs on the
    host (host_bandwidth) after the gradients go down and before the parameters come up over PCIe
    (4 + 2 bytes per element); offloaded parameters also cross PCIe at each gather.

    LoRA (`shape["trainable"]` below Ψ): the gradient reductions and the AdamW cover the trainable
    elements only, ZeRO-2's parameter all-gather too; FSDP's and ZeRO-3's all-gathers still carry every
    parameter. The compute is not changed: it still counts the frozen weights' gradient matmuls (2kn
    per token of the 4kn backward), which LoRA skips, so it overestimates a LoRA step's compute.

    Args:
        strategy: `read_strategy(...)`. shape: `model_shape(...)`. device: `device_spec(...)`.
        ranks: N. batch, seq: micro batch and block size; accumulation: micro batches per step.
        checkpointing: one of CHECKPOINTING. compiled: torch.compile of the blocks.
        efficiency: share of the peak FLOP/s the matmuls reach (0-1]. mixed_precision: "no", "bf16", "fp16".

    Returns:
        Floats in seconds: "compute", "exposed_comm", "optimizer", "step" (their sum), "comm" (all
        collectives, hidden or not); "tokens_per_s" (per rank), "collectives" (count per step),
        "efficiency".
    """
    kind, n = strategy["kind"], shape["n_params"]
    t = shape.get("trainable", n)  # LoRA: gradients reduced and AdamW run over the adapters only
    low = 4 if mixed_precision == "no" else 2
    work = compute_work(shape, seq, checkpointing, compiled, low)
    tokens = batch * seq
    flops_rate = device.peak_flops * efficiency
    mem_rate = device.memory_bandwidth * MEMORY_EFFICIENCY
    fwd = tokens * (work["flops_fwd"] / flops_rate + work["bytes_fwd"] / mem_rate)
    bwd = tokens * (work["flops_bwd"] / flops_rate + work["bytes_bwd"] / mem_rate)
    ranks = 1 if kind == "single" else ranks
    zero = strategy.get("ds") or {}
    grad = 4 if kind in ("single", "ddp", "fsdp", "fsdp1") else (strategy.get("comm_bytes") or low)

    replicas = strategy.get(
        "replicas", 1
    )  # HSDP: FSDP's collectives within a shard group of ranks / replicas

    def cs(op, nbytes, count=1):
        return collective_seconds(
            device, op, nbytes, ranks // replicas if kind == "fsdp" else ranks, count
        )

    # per micro batch: (forward comm, backward comm, exposed extra); the last micro batch may differ
    micro, last, step_comm, count = (0.0, 0.0, 0.0), None, 0.0, 0
    if kind in ("single", "ddp"):
        buckets = max(1, math.ceil(4 * t / DDP_BUCKET_BYTES))
        last = (
            0.0,
            cs("all_reduce", 4 * t, buckets),
            cs("all_reduce", min(4 * t, DDP_BUCKET_BYTES)),
        )
        count = buckets if ranks > 1 else 0
    elif kind in ("fsdp", "fsdp1"):
        units, blocks, root = (
            shape["layers"] + 1,
            shape["block_params"] * shape["layers"],
            shape["root_params"],
        )
        tblocks = shape.get("block_trainable", shape["block_params"]) * shape["layers"]
        troot = t - tblocks  # trainable elements outside the blocks
        gather_fwd = cs("all_gather", low * blocks, units - 1)
        gather_bwd = (
            cs("all_gather", low * blocks, units - 1) if strategy.get("reshard", True) else 0.0
        )
        first = cs("all_gather", low * root)
        micro = (gather_fwd, gather_bwd, first)
        last = (
            gather_fwd,
            gather_bwd + cs("reduce_scatter", 4 * tblocks, units - 1),
            first + cs("reduce_scatter", 4 * troot),
        )
        if (
            replicas > 1
        ):  # HSDP: each block's gradient shard all-reduced with its replicas; beyond one node,
            # over each rank's own network link (the replicas are on other machines); the last one is exposed
            link = (
                device if ranks <= device.gpus_per_node else Device({**device, "gpus_per_node": 1})
            )
            shards = ranks // replicas
            last = (
                last[0],
                last[1]
                + collective_seconds(link, "all_reduce", 4 * tblocks / shards, replicas, units - 1),
                last[2] + collective_seconds(link, "all_reduce", 4 * troot / shards, replicas),
            )
        count = (2 * units - 1) * accumulation + units if ranks > 1 else 0
    elif kind in ("zero2", "zero3"):
        bucket = _ds_size(zero, "reduce_bucket_size", shape["hidden"] ** 2)
        buckets = max(1, math.ceil(t / bucket))
        op = (
            "all_reduce"
            if kind == "zero2" and zero.get("use_multi_rank_bucket_allreduce", True)
            else "reduce_scatter"
        )
        reduce = cs(op, grad * t, buckets)
        tail = cs(op, grad * min(t, bucket))
        if kind == "zero2":
            micro = (0.0, reduce, tail)
            gathers = max(1, math.ceil(t / DS_ALLGATHER_BUCKET))
            step_comm = cs("all_gather", low * t, gathers)
            count = (buckets * accumulation + gathers) if ranks > 1 else 0
        else:
            modules = max(1, shape["gathered_modules"])
            gather = cs("all_gather", low * n, modules)
            largest = shape[
                "largest_module"
            ]  # gathered first in the forward, its gradients reduced last
            micro = (
                gather,
                gather + reduce,
                cs("all_gather", low * largest) + cs(op, grad * max(largest, bucket)),
            )
            count = (2 * modules + buckets) * accumulation if ranks > 1 else 0
    last = last or micro

    def exposed(comm):
        f, b, extra = comm
        return (
            f + b + extra if not device.overlap else max(0.0, f - fwd) + max(0.0, b - bwd) + extra
        )

    exposed_comm = (accumulation - 1) * exposed(micro) + exposed(last) + step_comm
    total_comm = (accumulation - 1) * sum(micro) + sum(last) + step_comm

    shard = t if kind in ("single", "ddp") else t / ranks
    opt_bytes = (32 + (6 if kind in ("zero2", "zero3") else 0)) * shard
    if strategy.get("offload_optimizer"):
        optimizer = opt_bytes / device.host_bandwidth + (
            6 * shard / device.pcie if device.pcie else 0.0
        )
    else:
        optimizer = opt_bytes / mem_rate
    if (
        strategy.get("offload_param") and device.pcie
    ):  # parameters cross PCIe at each forward and backward gather
        exposed_comm += (
            accumulation * 2 * low * (n if kind in ("single", "ddp") else n / ranks) / device.pcie
        )
    compute = accumulation * (fwd + bwd)
    step = compute + exposed_comm + optimizer
    return {
        "compute": compute,
        "exposed_comm": exposed_comm,
        "optimizer": optimizer,
        "step": step,
        "comm": total_comm,
        "tokens_per_s": accumulation * tokens / step,
        "collectives": count,
        "efficiency": efficiency,
    }


def calibrate(
    measured_tokens_per_s: float,
    strategy: dict,
    shape: dict,
    device: Device,
    ranks: int,
    batch: int,
    seq: int,
    **kwargs,
) -> float:
    """The efficiency at which `time_strategy` predicts `measured_tokens_per_s` (per rank) for this run:
    bisection (tokens/s rises with the efficiency). kwargs: time_strategy's other arguments.

    Raises:
        ValueError: the measurement is out of reach (faster than the peak allows, or not positive).
    """

    def rate(e):
        return time_strategy(strategy, shape, device, ranks, batch, seq, efficiency=e, **kwargs)[
            "tokens_per_s"
        ]

    low, high = 1e-6, 1.0
    if (
        measured_tokens_per_s <= 0
        or rate(high) < measured_tokens_per_s
        or rate(low) > measured_tokens_per_s
    ):
        raise ValueError(
            f"{measured_tokens_per_s:,.0f} tokens/s per rank is out of the model's reach on "
            f"{device.name} (at 100% of the peak: {rate(high):,.0f}); give --peak_tflops or --gpu"
        )
    for _ in range(60):
        mid = (low * high) ** 0.5
        low, high = (mid, high) if rate(mid) < measured_tokens_per_s else (low, mid)
    return (low * high) ** 0.5


def read_measurement(path: str | Path) -> list[dict]:
    """Measured tokens/s to calibrate on, from `benchmarks/compare_strategies.py`'s results (its .md
    or .json) or from a `recipes/llama.py` output directory (its run_info.json and metrics.jsonl).

    compare_strategies: one row per strategy; its tokens/s (all ranks) divided by the ranks, batch
    and block from the header line ("N ranks, ..., micro batch B x S tokens"), the model from the
    header's first word. llama.py: the median per-device `tokens_per_second` of metrics.jsonl after the
    first 2 steps (compare_strategies' warm-up), batch, block, accumulation, model and checkpointing
    from run_info.json's args, the strategy from its distributed_type (and deepspeed zero_stage).

    Returns:
        [{"strategy", "kind", "tokens_per_s" (per rank), "ranks", "batch", "seq", "accumulation",
        "checkpointing", "compiled", "mixed_precision", "model_config", "gpu" (a GPUS key, "cpu", or
        None where the file does not say: run_info.json's device_name), "source"}].

    Raises:
        ValueError: no such file, or one the planner cannot read (one line naming it).
    """
    path = Path(path)
    try:
        if path.is_dir():
            return [_read_run(path)]
        text = path.read_text()
        if path.suffix == ".json":
            data = json.loads(text)
            header, rows = (
                data["header"],
                [(r["strategy"], r["tokens_per_second"]) for r in data["rows"]],
            )
        else:
            header = next(line for line in text.splitlines() if "micro batch" in line)
            rows = [
                (cells[1].strip(), float(cells[3].replace(",", "")))
                for line in text.splitlines()
                if len(cells := line.split("|")) > 4 and re.fullmatch(r"\s*[\d,.]+\s*", cells[3])
            ]
        ranks = int(re.search(r"(\d+) ranks", header).group(1))
        batch, seq = map(int, re.search(r"micro batch (\d+) x (\d+) tokens", header).groups())
        precision = next((p for p in ("bf16", "fp16") if f", {p}," in header), "no")
        gpu = (
            "cpu"
            if "no GPU" in header
            else gpu_key(header.split("; ")[-2] if "; " in header else "")
        )
    except (OSError, ValueError, KeyError, AttributeError, StopIteration) as err:
        raise ValueError(
            f"--calibrate {path}: not a compare_strategies result or llama.py run directory "
            f"({type(err).__name__}: {' '.join(str(err).split())})"
        ) from None
    if not rows:
        raise ValueError(f"--calibrate {path}: no strategy rows with tokens/s")
    kinds = {"ddp": "ddp", "fsdp": "fsdp", "fsdp1": "fsdp1", "single": "single"}
    return [
        {
            "strategy": name,
            "kind": kinds.get(name, "zero2" if "zero2" in name else "zero3"),
            "tokens_per_s": rate / ranks,
            "ranks": ranks,
            "batch": batch,
            "seq": seq,
            "accumulation": 1,
            "checkpointing": "none",
            "compiled": False,
            "mixed_precision": precision,
            "model_config": header.split()[0],
            "gpu": gpu,
            "source": f"{path} ({name})",
        }
        for name, rate in rows
    ]


def _read_run(run: Path) -> dict:
    info = json.loads((run / "run_info.json").read_text())
    records = [
        json.loads(line)
        for line in (run / "metrics.jsonl").read_text().splitlines()
        if line.strip()
    ]
    rates = sorted(
        r["tokens_per_second"] for r in records if "tokens_per_second" in r and r.get("step", 0) > 2
    )
    if not rates:
        raise ValueError(
            f"{run / 'metrics.jsonl'} has no step after the first 2 with tokens_per_second"
        )
    args, ds = info["args"], info.get("deepspeed") or {}
    kind = {"MULTI_CPU": "ddp", "MULTI_GPU": "ddp", "FSDP": "fsdp", "NO": "single"}.get(
        info["distributed_type"]
    )
    if info["distributed_type"] == "DEEPSPEED":
        kind = (
            "zero3"
            if int(ds.get("zero_stage", 0)) == 3
            else "zero2"
            if int(ds.get("zero_stage", 0))
            else "ddp"
        )
    if kind is None:
        raise ValueError(f"distributed_type {info['distributed_type']!r}")
    name = {"zero2": "deepspeed_zero2", "zero3": "deepspeed_zero3"}.get(kind, kind)
    if kind == "zero3" and ds.get("offload_optimizer_device", "none") != "none":
        name += "_offload"
    return {
        "strategy": name,
        "kind": kind,
        "tokens_per_s": rates[len(rates) // 2],
        "ranks": info["world_size"],
        "batch": args["per_device_train_batch_size"],
        "seq": args["block_size"],
        "accumulation": args.get("gradient_accumulation_steps", 1),
        "checkpointing": checkpoint_mode(
            args.get("activation_checkpointing") or bool(args.get("gradient_checkpointing"))
        ),
        "compiled": bool(info.get("torch_compile")),
        "mixed_precision": info["mixed_precision"],
        "model_config": args.get("model_config") or args.get("model_name_or_path"),
        "gpu": gpu_key(info["device_name"]) if info.get("device_name") else None,
        "source": f"{run} ({name}, median of {len(rates)} steps)",
    }


FIGURE_KEYS = ("tokens_per_s", "gpu", "model", "ranks", "batch", "seq", "checkpointing", "compile")


def parse_figure(text: str) -> dict:
    """A published or measured figure given on the command line, as `read_measurement` returns rows:
    "tokens_per_s=2904,gpu=a100,model=llama-3-8b,ranks=64,batch=1,seq=8192,checkpointing=selective_layer,
    compile=no" (tokens/s per GPU); optional strategy (an accelerate_configs name, default fsdp),
    accumulation (1) and mixed_precision (bf16). Every key of FIGURE_KEYS is required: each changes
    the efficiency fitted.

    Raises:
        ValueError: a missing or unknown key, or a bad value (one line).
    """
    fields = dict(kv.split("=", 1) for kv in text.split(",") if "=" in kv)
    if missing := [k for k in FIGURE_KEYS if k not in fields]:
        raise ValueError(
            f"--calibrate {text!r}: give {', '.join(f'{k}=' for k in missing)} too (a figure needs "
            f"{', '.join(FIGURE_KEYS)})"
        )
    extra = set(fields) - {*FIGURE_KEYS, "strategy", "accumulation", "mixed_precision"}
    if extra or text.count("=") != len(fields):
        raise ValueError(f"--calibrate {text!r}: unknown key {sorted(extra)[0] if extra else ''!r}")
    try:
        gpu = GPU_ALIASES.get(fields["gpu"], fields["gpu"])
        if gpu not in (*GPUS, "cpu"):
            raise ValueError(f"gpu {gpu!r} is not one of {', '.join([*GPUS, 'cpu'])}")
        if fields["compile"] not in ("yes", "no"):
            raise ValueError(f"compile {fields['compile']!r}: yes or no")
        strategy = fields.get("strategy", "fsdp")
        kinds = {"ddp": "ddp", "fsdp": "fsdp", "fsdp1": "fsdp1", "single": "single"}
        return {
            "strategy": strategy,
            "kind": kinds.get(strategy, "zero2" if "zero2" in strategy else "zero3"),
            "tokens_per_s": float(fields["tokens_per_s"]),
            "ranks": int(fields["ranks"]),
            "batch": int(fields["batch"]),
            "seq": int(fields["seq"]),
            "accumulation": int(fields.get("accumulation", 1)),
            "checkpointing": checkpoint_mode(fields["checkpointing"]),
            "compiled": fields["compile"] == "yes",
            "mixed_precision": fields.get("mixed_precision", "bf16"),
            "model_config": fields["model"],
            "gpu": gpu,
            "source": "the figure given",
        }
    except ValueError as err:
        raise ValueError(f"--calibrate {text!r}: {err}") from None
