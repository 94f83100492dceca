r"""Host memory per rank while loading pretrained weights under FSDP, and what each rank got.

Launched under an FSDP accelerate config with a Llama directory saved by `save_pretrained`:

    accelerate launch --config_file accelerate_configs/fsdp.yaml --mixed_precision no \
        benchmarks/host_memory.py MODEL_DIR [--rank0_only]

Each rank builds the model as recipes/llama.py does (`from_pretrained(..., dtype=torch.float32)`
once the Accelerator exists); with `--rank0_only` and `fsdp_cpu_ram_efficient_loading: true`
the other ranks build it instead with uninitialised storage that nothing touches, and rely on
`accelerator.prepare` broadcasting rank 0's weights. Each rank then prints one JSON line: its
peak resident set (`VmHWM`, MiB) at the start, after loading and after prepare (the peak is
reset once the Accelerator exists, so imports are left out); whether transformers took its FSDP
loading path (`is_fsdp_enabled`); and, checked after the peaks are taken, the largest absolute
difference between its gathered fp32 weights and the checkpoint files, and between its rotary
`inv_freq` buffer and the default-RoPE value of the config. Linux only (/proc).
"""

import contextlib
import glob
import json
import sys

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType
from safetensors.torch import load_file
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.initialization import no_init_weights
from transformers.integrations import is_fsdp_enabled

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0])
from common import launch  # noqa: E402


def peak_rss_mib() -> float:
    """This process's peak resident set since it started or the last reset, in MiB (`VmHWM`)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 1024


def main(model_dir: str, rank0_only: bool) -> None:
    files = sorted(glob.glob(f"{model_dir}/*.safetensors"))
    if not files:
        sys.exit(f"error: no *.safetensors in {model_dir} (save the model with save_pretrained)")
    try:
        pg_kwargs = launch.process_group(120)[0]
    except ValueError as err:  # e.g. a GPU host whose GPUs torch cannot see
        sys.exit(f"error: {err}")
    accelerator = Accelerator(kwargs_handlers=[pg_kwargs])
    launch.check_distributed(accelerator)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident set
    base = peak_rss_mib()
    config = AutoConfig.from_pretrained(model_dir)
    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    if (
        rank0_only
        and plugin is not None
        and plugin.cpu_ram_efficient_loading
        and not accelerator.is_main_process
    ):
        with (
            no_init_weights()
        ):  # shapes only, storage never written: prepare broadcasts rank 0's weights
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.tie_weights()
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir, config=config, dtype=torch.float32)
    loaded = peak_rss_mib()
    optimizer = torch.optim.AdamW(model.parameters())  # FSDP2 prepares the model with its optimizer
    model, optimizer = accelerator.prepare(model, optimizer)
    prepared = peak_rss_mib()

    fsdp1 = accelerator.distributed_type == DistributedType.FSDP and not accelerator.is_fsdp2
    with FSDP.summon_full_params(model) if fsdp1 else contextlib.nullcontext():
        full = {
            k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in model.named_parameters()
        }
    disk = {k: v for f in files for k, v in load_file(f).items()}
    weight_gap = max((full[k] - v.float()).abs().max().item() for k, v in disk.items() if k in full)
    inv_freq = next(m.inv_freq for n, m in model.named_modules() if n.endswith("rotary_emb"))
    exponents = torch.arange(0, 2 * inv_freq.numel(), 2, dtype=torch.float64) / (
        2 * inv_freq.numel()
    )
    expected = 1.0 / config.rope_parameters["rope_theta"] ** exponents
    print(
        json.dumps(
            {
                "rank": accelerator.process_index,
                "n_params": sum(v.numel() for v in disk.values()),
                "base_mib": round(base),
                "peak_load_mib": round(loaded),
                "peak_prepare_mib": round(prepared),
                "transformers_fsdp_loading": is_fsdp_enabled(),
                "max_weight_gap": weight_gap,
                "max_inv_freq_gap": (inv_freq.cpu().double() - expected).abs().max().item(),
            }
        ),
        flush=True,
    )
    accelerator.end_training()


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("model_dir", help="a Llama directory written by save_pretrained")
    parser.add_argument(
        "--rank0_only",
        action="store_true",
        help="only rank 0 reads the weights; the others wait for prepare's broadcast",
    )
    cli = parser.parse_args()
    main(cli.model_dir, cli.rank0_only)
