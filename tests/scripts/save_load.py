"""Launched by tests/test_checkpoint.py: a save followed at once by a load, in the same job.

Saves with common.checkpoint.save_checkpoint, perturbs the weights, loads the checkpoint back
straight away and checks every rank got its own shard back bit for bit; rank 0 writes `ok`
(the number of ranks that passed) into OUT.

    accelerate launch --config_file accelerate_configs/fsdp.yaml tests/scripts/save_load.py OUT
"""

import sys
from pathlib import Path

import torch
from accelerate import Accelerator

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from common import checkpoint, launch, models  # noqa: E402
from transformers import LlamaForCausalLM  # noqa: E402

out = Path(sys.argv[1])
accelerator = Accelerator(kwargs_handlers=[launch.process_group(60)[0]])
launch.check_distributed(accelerator)
torch.manual_seed(0)
model = LlamaForCausalLM(models.llama_config("debug", 512, num_hidden_layers=2))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
loader = torch.utils.data.DataLoader(torch.randint(0, 512, (8, 32)), batch_size=2)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
batch = next(iter(loader))
accelerator.backward(model(input_ids=batch, labels=batch).loss)
optimizer.step()
optimizer.zero_grad()


def local_weights(model):
    return [
        (p.ds_tensor if hasattr(p, "ds_tensor") else getattr(p, "to_local", lambda: p)())
        .detach()
        .clone()
        for p in model.parameters()
    ]


before = local_weights(model)
path = checkpoint.save_checkpoint(
    accelerator, str(out), step=1, run_state={"world_size": accelerator.num_processes}
)
with torch.no_grad():
    for p in model.parameters():
        (p.ds_tensor if hasattr(p, "ds_tensor") else p).add_(1.0)
accelerator.load_state(str(path))  # straight after the save: the save's barriers make this safe
same = torch.tensor(
    [all(torch.equal(a, b) for a, b in zip(before, local_weights(model)))], dtype=torch.int64
)
passed = accelerator.reduce(same, reduction="sum").item()
if accelerator.is_main_process:
    (out / "ok").write_text(str(passed))
model = optimizer = None
launch.teardown(accelerator)  # in order: the model before the process group
