"""Launched by tests/test_data_order.py: records which sample each rank sees, step by step.

It builds the train and eval loaders exactly as recipes/llama.py does (seedable sampler,
shuffle + drop_last, accelerator.prepare, set_epoch per epoch, windows of
gradient_accumulation_steps micro batches) over a dataset of sample indices, and each rank
writes `{out}/rank{r}.json`: per epoch, per optimizer step, the indices it consumed; plus the
eval indices that `gather_for_metrics` returns.

    accelerate launch --config_file accelerate_configs/ddp.yaml tests/scripts/data_order.py OUT N BATCH ACCUM EPOCHS EVAL_N
"""

import json
import sys
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from common import launch  # noqa: E402

out, n, batch, accum, epochs, eval_n = sys.argv[1], *map(int, sys.argv[2:7])
accelerator = Accelerator(dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=42),
                          kwargs_handlers=[launch.cpu_process_group_kwargs(120)])
launch.check_distributed(accelerator)
train = torch.utils.data.DataLoader(torch.arange(n), batch_size=batch, shuffle=True, drop_last=True)
evalu = torch.utils.data.DataLoader(torch.arange(eval_n), batch_size=batch)
train, evalu = accelerator.prepare(train, evalu)
global_batch = batch * accum * accelerator.num_processes
updates_per_epoch = n // global_batch
record = {"epochs": [], "eval": []}
for epoch in range(epochs):
    train.set_epoch(epoch)
    batches = iter(train)
    steps = []
    for _ in range(updates_per_epoch):
        steps.append([i for _ in range(accum) for i in next(batches).tolist()])
    record["epochs"].append(steps)
for x in evalu:
    record["eval"] += accelerator.gather_for_metrics(x).tolist()
Path(out).mkdir(parents=True, exist_ok=True)
(Path(out) / f"rank{accelerator.process_index}.json").write_text(json.dumps(record))
accelerator.end_training()  # destroys the process group: gloo aborts at exit otherwise
