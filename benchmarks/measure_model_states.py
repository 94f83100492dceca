r"""Per-rank bytes of parameters, gradients and optimizer state, measured from the live tensors.

A companion of `benchmarks/compare_strategies.py`, launched under the same accelerate config as
`recipes/llama.py`:

    accelerate launch --config_file accelerate_configs/deepspeed_zero3.yaml --mixed_precision bf16 \
        benchmarks/measure_model_states.py --output_file /tmp/states.json

It builds the recipe's model and optimizer (same `common/` preset, tokenizer and AdamW groups),
lets `accelerator.prepare` shard them, trains one step (optimizers create their state lazily),
then runs a second forward/backward and, between backward and the optimizer step, counts what
each rank holds:

| category        | DDP / FSDP2 (torch optimizer)     | DeepSpeed ZeRO-1/2/3                                 |
|-----------------|-----------------------------------|------------------------------------------------------|
| params          | `p` (FSDP2: the DTensor's shard)  | `p.data` (ZeRO-3: `p.ds_tensor` + persistent params) |
| grads           | `p.grad` (FSDP2: its shard)       | the rank's gradient partition (`averaged_gradients`, |
|                 |                                   | or the fp32 master's `.grad` when offloaded)         |
| fp32 master     | none: the fp32 params are it      | `single_partition_of_fp32_groups` (ZeRO-1/2),        |
|                 |                                   | `fp32_partitioned_groups_flat` (ZeRO-3)              |
| Adam moments    | `optimizer.state` tensors         | the inner optimizer's `state` (torch or CPU Adam)    |

Each byte is counted once: tensors are reduced to byte ranges of their storage and a range
already claimed by an earlier category is not counted again (a master copy that shared the
parameter partition's storage would count once; ZeRO-3 in fp32 measured a separate copy). Not counted: activations,
communication buckets (DDP's reducer buckets, DeepSpeed's `reduce_bucket_size` buffers) and
FSDP's transient all-gather buffers. The DeepSpeed attribute names are those of deepspeed 0.19.8.

Only the main process writes `--output_file` (JSON, per-rank lists gathered from all ranks). With
several shapes in `--config_overrides` ("num_hidden_layers=8;num_key_value_heads=2", each measured
with a fresh Accelerator in the same process group) it holds one such object per shape, a list.
An entry may also set `lora_r=R`: that model then trains LoRA adapters of rank R on every Linear but
the head (recipes/sft.py's `--use_peft --lora_r R`, its default all-linear targets, alpha 2R, dropout
0.05) on the frozen base, and the optimizer holds the adapters only (";lora_r=8": the same model, full
and LoRA, in one launch).
"""

import json
import os
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from accelerate.utils import DistributedType
from transformers import LlamaForCausalLM

sys.path.insert(
    0, str(Path(__file__).resolve().parent.parent)
)  # run from anywhere, no install step
from common import causal_lm, data, launch, models  # noqa: E402
from common import errors  # noqa: E402
from common.args import SEED_MAX, flag, parse_flags  # noqa: E402


@dataclass
class Args:
    output_file: str = field(
        default=None, metadata={"help": "JSON written by the main process (required)"}
    )
    model_config: str = field(
        default="debug", metadata={"help": f"preset: {', '.join(models.PRESETS)}"}
    )
    config_overrides: str = field(
        default="",
        metadata={
            "help": (
                "LlamaConfig changes, 'key=value,key=value' (as recipes/llama.py); several model "
                "shapes measured in this one launch: separate them with ';' (an empty entry is "
                "the preset itself); --output_file then holds a list. "
                "lora_r=R in an entry: LoRA adapters of rank R on every Linear but the head, the base frozen"
            )
        },
    )
    vocab_size: int = flag(4096, low=256)
    block_size: int = flag(256, low=2)
    per_device_train_batch_size: int = flag(8, low=1)
    learning_rate: float = 3e-3
    weight_decay: float = 0.1
    cache_dir: str = data.DEFAULT_CACHE_DIR
    seed: int = flag(42, low=0, high=SEED_MAX)
    ddp_timeout: int = flag(600, "collective timeout in seconds", low=1)


class ByteLedger:
    """Bytes per category, each storage byte counted once across all categories.

    A tensor counts as the byte range [offset, offset + numel * element_size) of its storage
    (the tensors measured here are contiguous: flat buffers and narrow views of them).
    """

    def __init__(self):
        self.bytes: dict[str, int] = {}
        self.devices: dict[str, set] = {}
        self._claimed: dict[int, list[tuple[int, int]]] = {}  # storage address -> merged ranges

    def add(self, category: str, tensor) -> None:
        """Count `tensor` (a torch.Tensor, DTensor or None) under `category`, minus bytes already counted."""
        self.bytes.setdefault(category, 0)
        if tensor is None:
            return
        if hasattr(tensor, "to_local"):  # FSDP2 DTensor: this rank's shard only
            tensor = tensor.to_local()
        if tensor.numel() == 0:
            return
        start = tensor.storage_offset() * tensor.element_size()
        end = start + tensor.numel() * tensor.element_size()
        ranges = self._claimed.setdefault(tensor.untyped_storage().data_ptr(), [])
        covered = sum(max(0, min(end, e) - max(start, s)) for s, e in ranges)
        self.bytes[category] += end - start - covered
        self.devices.setdefault(category, set()).add(tensor.device.type)
        ranges.append((start, end))
        ranges.sort()
        merged = [ranges[0]]
        for s, e in ranges[1:]:
            if s <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], e))
            else:
                merged.append((s, e))
        ranges[:] = merged


def measure(model, optimizer, deepspeed: bool) -> ByteLedger:
    """Count params, grads, fp32 master and Adam moments of this rank (call between backward and step)."""
    ledger = ByteLedger()
    params = list((model.module if deepspeed else model).parameters())
    for p in params:
        ledger.add("params", getattr(p, "ds_tensor", None))  # ZeRO-3 partition
        ledger.add(
            "params", p.data if not hasattr(p, "to_local") else p
        )  # ZeRO-3: empty unless persistent
    if deepspeed:
        zero = model.optimizer  # DeepSpeedZeroOptimizer(_Stage3)
        masters = (
            getattr(zero, "single_partition_of_fp32_groups", None)
            or zero.fp32_partitioned_groups_flat
        )
        for grads in zero.averaged_gradients.values():
            for g in grads or []:
                ledger.add("grads", g)
        for m in masters:
            ledger.add("grads", m.grad)  # where offloaded ZeRO-3 keeps the gradient partition
        for m in masters:
            ledger.add("fp32_master", m)
        inner = zero.optimizer
    else:
        for p in params:
            ledger.add("grads", p.grad)
        ledger.add("fp32_master", None)
        inner = optimizer.optimizer  # AcceleratedOptimizer -> torch optimizer
    for state in inner.state.values():
        for value in state.values():
            if torch.is_tensor(value):
                ledger.add("adam_moments", value)
    return ledger


def communication_setup(accelerator, model, deepspeed: bool) -> dict:
    """Which ZeRO communication pattern this run uses and the bytes per element it sends.

    Returns {"comm_kind": "ddp" | "zero2" | "zero2_allreduce" | "zero3", "grad_comm_bytes": element size of the
    gradient reduction, "param_comm_bytes": element size of the parameter all-gathers (None
    for DDP)}, read from the live run (DeepSpeed's communication dtype, FSDP's
    mixed-precision policy, DDP's gradient dtype).
    """
    if deepspeed:
        stage = accelerator.state.deepspeed_plugin.zero_stage
        kind = {0: "ddp", 1: "zero2", 2: "zero2", 3: "zero3"}[stage]
        if kind == "zero2" and getattr(model.optimizer, "use_multi_rank_bucket_allreduce", False):
            kind = "zero2_allreduce"  # DeepSpeed's default: the gradients are all-reduced, not reduce-scattered
        grad_bytes = model.communication_data_type.itemsize
        lp = next(model.module.parameters())
        param_bytes = getattr(lp, "ds_tensor", lp).element_size()
        return {"comm_kind": kind, "grad_comm_bytes": grad_bytes, "param_comm_bytes": param_bytes}
    if accelerator.distributed_type == DistributedType.FSDP:
        plugin = accelerator.state.fsdp_plugin
        reshard = plugin.reshard_after_forward
        name = (
            reshard.name
            if hasattr(reshard, "name")
            else ("FULL_SHARD" if reshard else "SHARD_GRAD_OP")
        )
        kind = {
            "FULL_SHARD": "zero3",
            "HYBRID_SHARD": "zero3",
            "SHARD_GRAD_OP": "zero2",
            "_HYBRID_SHARD_ZERO2": "zero2",
            "NO_SHARD": "ddp",
        }[name]
        fp32_bytes = next(model.parameters()).element_size()
        policy = plugin.mixed_precision_policy
        param_dtype = getattr(policy, "param_dtype", None)
        reduce_dtype = getattr(policy, "reduce_dtype", None)
        return {
            "comm_kind": kind,
            "grad_comm_bytes": reduce_dtype.itemsize if reduce_dtype else fp32_bytes,
            "param_comm_bytes": param_dtype.itemsize if param_dtype else fp32_bytes,
        }
    grad = next(p.grad for p in model.parameters() if p.grad is not None)
    return {"comm_kind": "ddp", "grad_comm_bytes": grad.element_size(), "param_comm_bytes": None}


def measure_shape(accelerator, args, overrides: str, tokenizer, train_set) -> dict | None:
    """Build, prepare and train the model with `overrides` two steps; the main process gets the result dict."""
    deepspeed = accelerator.distributed_type == DistributedType.DEEPSPEED
    if accelerator.distributed_type == DistributedType.FSDP and accelerator.mixed_precision != "no":
        # as recipes/llama.py does: bf16/fp16 compute, fp32 gradient reduction
        plugin = accelerator.state.fsdp_plugin
        plugin.mixed_precision_policy = replace(
            plugin.mixed_precision_policy, reduce_dtype=torch.float32
        )
    torch.manual_seed(args.seed)
    loader = torch.utils.data.DataLoader(
        train_set, batch_size=args.per_device_train_batch_size, shuffle=True, drop_last=True
    )
    config = models.llama_config(
        args.model_config,
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id,
    )
    kept = [
        kv for kv in overrides.split(",") if kv.strip() and not kv.strip().startswith("lora_r=")
    ]
    lora_r = next(
        (int(kv.split("=")[1]) for kv in overrides.split(",") if kv.strip().startswith("lora_r=")),
        None,
    )
    if kept:
        try:
            config = causal_lm.apply_overrides(config, ",".join(kept))
        except ValueError as err:
            sys.exit(f"error: {err}")
    model = LlamaForCausalLM(config)
    model.config.use_cache = False
    if (
        lora_r
    ):  # as recipes/sft.py --use_peft: the base frozen, adapters on every Linear but the head
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(
            model,
            LoraConfig(
                task_type="CAUSAL_LM",
                r=lora_r,
                lora_alpha=2 * lora_r,
                lora_dropout=0.05,
                target_modules="all-linear",
            ),
        )
    n_params = sum(p.numel() for p in model.parameters())
    n_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    optimizer = torch.optim.AdamW(
        models.param_groups(model, args.weight_decay), lr=args.learning_rate
    )
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    batches = iter(loader)
    for step in range(2):
        batch = next(batches)
        loss = model(**batch).loss
        if deepspeed:
            model.backward(loss)  # what accelerator.backward does, minus its engine.step()
        else:
            accelerator.backward(loss)
        if step == 1:  # gradients and optimizer state both exist now
            ledger = measure(model, optimizer, deepspeed)
            comm = communication_setup(accelerator, model, deepspeed)
        if deepspeed:
            model.step()
        else:
            optimizer.step()
            optimizer.zero_grad()

    categories = ["params", "grads", "fp32_master", "adam_moments"]
    # On accelerator.device: NCCL takes device tensors only (and Accelerate gathers onto the device).
    per_rank = accelerator.gather(
        torch.tensor(
            [ledger.bytes[c] for c in categories], dtype=torch.int64, device=accelerator.device
        )
    )
    per_rank = per_rank.view(
        accelerator.num_processes, len(categories)
    ).tolist()  # plain ints: no tensor outlives gloo
    result = None
    if accelerator.is_main_process:
        inner = model.optimizer.optimizer if deepspeed else optimizer.optimizer
        zero = model.optimizer if deepspeed else None
        result = {
            "distributed_type": str(accelerator.distributed_type).split(".")[-1],
            "world_size": accelerator.num_processes,
            "mixed_precision": accelerator.mixed_precision,
            "config_overrides": overrides,
            "n_params": n_params,
            "n_trainable": n_trainable,
            "lora_r": lora_r,
            "loss": loss.item(),
            **{f"{c}_bytes": [rank[i] for rank in per_rank] for i, c in enumerate(categories)},
            "devices": {c: sorted(d) for c, d in ledger.devices.items()},  # of rank 0
            "optimizer": type(inner).__name__,
            "offload_optimizer": bool(
                zero
                and (
                    getattr(zero, "offload_optimizer", False) or getattr(zero, "cpu_offload", False)
                )
            ),
            "offload_param": bool(zero and getattr(zero, "offload_param", False)),
            **comm,
        }
        print(json.dumps(result))
    # Tear down in order. Left to the garbage collector, the DDP reducer's gloo group was once
    # destroyed (joining its worker threads while holding the GIL) as a worker thread waited for
    # the GIL to free a finished all-gather: a hang at exit (torch 2.13; pytorch issue #56297).
    accelerator.wait_for_everyone()  # the last collective: a barrier, which holds no Python tensor
    accelerator.free_memory()  # drop the Accelerator's references to the wrapped model/optimizer ...
    del (
        model,
        optimizer,
        loader,
        batches,
        batch,
        loss,
    )  # ... and ours, while the group is still alive
    return result


def main():
    args = parse_flags((Args,), description=__doc__)[0][0]
    if not args.output_file:
        sys.exit("error: --output_file is required")
    shapes = args.config_overrides.split(";")
    results = []
    for i, overrides in enumerate(shapes):
        if i:  # a fresh Accelerator per shape (DeepSpeed takes one model per Accelerator); the process group stays
            AcceleratorState._reset_state()
        try:
            pg_kwargs = launch.process_group(args.ddp_timeout)[0]
        except ValueError as err:  # e.g. a GPU host whose GPUs torch cannot see
            sys.exit(f"error: {err}")
        accelerator = Accelerator(kwargs_handlers=[pg_kwargs])
        launch.check_distributed(accelerator)
        if i == 0:
            # per node, as the recipes: the recipe's cached tokenizer and packed blocks
            with accelerator.local_main_process_first():
                raw = data.load_text_dataset()
                tokenizer = data.get_tokenizer(None, raw, args.vocab_size, args.cache_dir)
                train_set = data.pack_dataset(raw, tokenizer, args.block_size, args.cache_dir)[
                    "train"
                ]
                train_set = train_set.with_format("torch")
        results.append(measure_shape(accelerator, args, overrides.strip(), tokenizer, train_set))
    if accelerator.is_main_process:
        os.makedirs(os.path.dirname(os.path.abspath(args.output_file)), exist_ok=True)
        with open(args.output_file, "w") as f:
            json.dump(results if len(shapes) > 1 else results[0], f, indent=1)
    accelerator.end_training()  # then destroy the process group


if __name__ == "__main__":
    errors.run(main)  # a bad flag: one error line
