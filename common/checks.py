"""Start-up checks of the launch config against the recipe's flags: one line per problem.

A DeepSpeed JSON can hold explicit values that silently win over the flags: Accelerate adopts a
JSON `gradient_accumulation_steps` over `--gradient_accumulation_steps` (with a warning in the
log), the engine clips by `gradient_clipping` whatever `--max_grad_norm` says, and an explicit
`bf16`/`fp16` block ignores `accelerate launch --mixed_precision`. A run whose steps, schedule
or precision are not the ones its flags and logs say is wrong silently, so each disagreement
stops the run before any work, naming the file, the key and both values.
"""

from __future__ import annotations

import json
import os

from accelerate.utils import DistributedType

from common import grad_norm

# DeepSpeed batch keys and the flag each must equal (train_batch_size is the product).
BATCH_KEYS = {"train_micro_batch_size_per_gpu": "--per_device_train_batch_size",
              "gradient_accumulation_steps": "--gradient_accumulation_steps"}


def deepspeed_json_path(accelerator) -> str | None:
    """The DeepSpeed JSON the accelerate config points to, or None (not DeepSpeed, or keys in the YAML)."""
    if accelerator.distributed_type != DistributedType.DEEPSPEED:
        return None
    path = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
    return path if path and path.lower() != "none" else None


def deepspeed_config_errors(accelerator, micro_batch: int, accumulation: int, max_grad_norm: float,
                            requested_precision: str | None = None) -> list[str]:
    """Where the DeepSpeed JSON contradicts the flags. Call on every rank after building the Accelerator.

    Args:
        accelerator: the `Accelerator` (not yet prepared).
        micro_batch: `--per_device_train_batch_size`, samples per rank per micro step.
        accumulation: `--gradient_accumulation_steps`.
        max_grad_norm: `--max_grad_norm`.
        requested_precision: the precision the run asks for; default the launch's
            (`ACCELERATE_MIXED_PRECISION`: the config's `mixed_precision` or `--mixed_precision`).

    Returns:
        One message per problem (empty when none, and always empty off DeepSpeed):
        - an explicit `train_micro_batch_size_per_gpu`, `gradient_accumulation_steps` or
          `train_batch_size` (= micro batch x accumulation x world size) that differs from the flags
          (`"auto"` or a missing key agrees: Accelerate fills it in from the flags);
        - `gradient_clipping` that differs from `--max_grad_norm` (`grad_norm.clip_threshold_error`);
        - a precision other than the one requested: the JSON's `bf16`/`fp16` `enabled: true`
          wins over it in Accelerate.
    """
    if accelerator.distributed_type != DistributedType.DEEPSPEED:
        return []
    path = deepspeed_json_path(accelerator)
    where = f"the DeepSpeed JSON {path}" if path else "the DeepSpeed config"
    config = json.load(open(path)) if path else accelerator.state.deepspeed_plugin.deepspeed_config
    errors = []
    wanted = {"train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": accumulation,
              "train_batch_size": micro_batch * accumulation * accelerator.num_processes}
    flags = {**BATCH_KEYS, "train_batch_size": f"the global batch ({micro_batch} per device x {accumulation} "
                                                f"accumulation x {accelerator.num_processes} ranks)"}
    for key, value in wanted.items():
        explicit = config.get(key, "auto")
        if explicit != "auto" and int(explicit) != value:
            errors.append(f"{where} sets {key}: {explicit}, but {flags[key]} is {value}; set the key to \"auto\" "
                          "(it then follows the flags) or make them equal")
    if error := grad_norm.clip_threshold_error(accelerator, max_grad_norm):
        errors.append(f"{error} ({where})")
    requested = requested_precision or os.environ.get("ACCELERATE_MIXED_PRECISION")
    if requested and requested != accelerator.mixed_precision:
        errors.append(f"the launch asks for mixed precision {requested}, but {where} enables "
                      f"{accelerator.mixed_precision}: its bf16/fp16 \"enabled\" keys win; set them to \"auto\" so "
                      "the config's mixed_precision (or --mixed_precision) decides")
    return errors


def rank_mismatch(accelerator, what: str, value: str) -> str | None:
    """A message if `value` is not the same on every rank, else None. A collective: call on every rank.

    For what each node reads from its own disk (the training data, a tokenizer): a node-local
    copy that differs from rank 0's would train on other samples, silently (measured on two
    loopback "machines" with another text of the same block count: 1.0% off in loss after 4 steps).

    Args:
        what: what `value` identifies, for the message (e.g. "training data").
        value: a short fingerprint (a digest) of it on this rank.
    """
    from accelerate.utils import gather_object

    values = gather_object([value])
    if len(set(values)) == 1:
        return None
    differ = [r for r, v in enumerate(values) if v != values[0]]
    return (f"the {what} differs between ranks: rank(s) {', '.join(map(str, differ))} read another one than rank 0 "
            f"({values[differ[0]]} vs {values[0]}); every node must see the same files (a shared or identical path)")
