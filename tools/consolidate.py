"""Turn a sharded FSDP or DeepSpeed ZeRO checkpoint into a Hugging Face model directory, offline.

    python tools/consolidate.py runs/llama/checkpoint-150 runs/llama/consolidated

No GPUs and no process group needed: it runs Accelerate's `merge_fsdp_weights` (the code behind
`accelerate merge-weights`) on FSDP's torch.distributed.checkpoint shards, or DeepSpeed's
`get_fp32_state_dict_from_zero_checkpoint` (the code behind the `zero_to_fp32.py` that DeepSpeed
drops in every checkpoint) on ZeRO partitions, then loads the fp32 weights into the model config
stored beside them (`hf/`) and writes `model.safetensors`, the config and the tokenizer.
DDP/single checkpoints already hold a full `model.safetensors`; they are converted the same way.
Note: DeepSpeed's loader unpickles its own files (`weights_only=False`): only consolidate
checkpoints that your own runs wrote.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common.checkpoint import verify_checkpoint  # noqa: E402
from common.causal_lm import weights_mismatch  # noqa: E402
from common.models import for_inference  # noqa: E402
from common.workarounds import safetensors_mode_from_umask  # noqa: E402


def consolidated_state_dict(checkpoint_dir: Path) -> dict:
    """Full fp32 state dict (name -> tensor) of any checkpoint that `save_checkpoint` wrote.

    Raises:
        FileNotFoundError / ValueError: an incomplete or damaged checkpoint, or an unknown layout.
    """
    ckpt = Path(checkpoint_dir)
    verify_checkpoint(ckpt)
    if (
        ckpt / "pytorch_model_fsdp_0"
    ).is_dir():  # FSDP SHARDED_STATE_DICT (torch.distributed.checkpoint)
        from accelerate.utils import merge_fsdp_weights

        with tempfile.TemporaryDirectory() as tmp:
            merge_fsdp_weights(str(ckpt / "pytorch_model_fsdp_0"), tmp, safe_serialization=True)
            return load_file(Path(tmp) / "model.safetensors")
    if (ckpt / "latest").is_file():  # DeepSpeed ZeRO partitions
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        return get_fp32_state_dict_from_zero_checkpoint(str(ckpt))
    if (ckpt / "model.safetensors").is_file():  # DDP / single process: already full
        return load_file(ckpt / "model.safetensors")
    raise ValueError(f"{ckpt}: no FSDP shards, DeepSpeed 'latest' file or model.safetensors found")


def consolidate(checkpoint_dir: str, output_dir: str) -> None:
    """Write `output_dir` as a Hugging Face model (safetensors + config + tokenizer).

    Other files in `output_dir` are left as they are.

    Raises:
        ValueError: `output_dir` holds a model already (its shards or index would mix with the new
            weights), or the weights do not fit the stored config (names the missing/unexpected keys).
    """
    earlier = sorted(
        p.name
        for glob in ("config.json", "model*.safetensors*")
        for p in Path(output_dir).glob(glob)
    )
    if earlier:
        raise ValueError(
            f"{output_dir} holds a model already ({', '.join(earlier)}): give a new folder or remove it"
        )
    ckpt = Path(checkpoint_dir)
    state_dict = consolidated_state_dict(ckpt)
    config = for_inference(AutoConfig.from_pretrained(ckpt / "hf"))  # the KV cache on
    model = AutoModelForCausalLM.from_config(config)
    missing, unexpected = model.load_state_dict(state_dict, strict=False)
    missing = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
    fix = f"its weights do not fit {ckpt / 'hf' / 'config.json'} (a damaged or foreign checkpoint)"
    if problem := weights_mismatch(missing, unexpected, fix):
        raise ValueError(f"{ckpt}: {problem}")
    model.tie_weights()
    model.save_pretrained(output_dir)
    AutoTokenizer.from_pretrained(ckpt / "hf").save_pretrained(output_dir)
    index = Path(output_dir) / "model.safetensors.index.json"
    shards = (
        set(json.loads(index.read_text())["weight_map"].values())
        if index.exists()
        else {"model.safetensors"}
    )
    for (
        name
    ) in shards:  # the files just written, not others in the folder (safetensors writes 0600)
        safetensors_mode_from_umask(Path(output_dir) / name)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("checkpoint_dir")
    parser.add_argument("output_dir")
    cli = parser.parse_args()
    try:
        consolidate(cli.checkpoint_dir, cli.output_dir)
    except (FileNotFoundError, ValueError) as err:
        sys.exit(f"error: {err}")
    print(f"wrote {cli.output_dir}")
