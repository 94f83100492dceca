"""The collective device guard (tests/device_guard/collective_guard.py), in this process.

Under NCCL every tensor handed to a collective must live on accelerator.device. On this CPU host
the host is the device, so the guard marks what project code leaves on the host and fails the
collective. tests/conftest.py's `launch` enables it in every launched rank; here it treats this
file as the project code, with a one-rank gloo group, where a torch.device("cpu") plays the
accelerator's device.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import accelerate
import accelerate.utils
import pytest
import torch
import torch.distributed as dist

from torch.utils._device import _device_constructors

from device_guard import collective_guard

REPO = Path(__file__).resolve().parent.parent
DEVICE = torch.device("cpu")  # as accelerator.device is on this host
HERE = os.path.basename(__file__)


@pytest.fixture
def guarded_world():
    """The guard, with this file as project code, and a one-rank default process group (gloo)."""
    _device_constructors.cache_clear()  # as in a fresh rank, where the guard installs before anything lists them
    uninstall = collective_guard.install(roots=[os.path.realpath(__file__)])
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
        uninstall()
    assert torch.tensor is torch._C._VariableFunctions.tensor and "to" not in torch.Tensor.__dict__


def line_of(text):
    """This file's line number of the first line containing `text`."""
    return next(
        i for i, line in enumerate(open(__file__), 1) if text in line and "line_of" not in line
    )


def test_host_tensors_handed_to_collectives_fail(guarded_world):
    host = torch.tensor([1.0, 2.0])  # host-made
    message = (
        f"tests/{HERE}:{line_of('# all_reduce host')} hands torch.distributed.all_reduce a tensor left on "
        f"the host at tests/{HERE}:{line_of('# host-made')} (torch.tensor without device=): under NCCL"
    )
    with pytest.raises(AssertionError, match=f"^{re.escape(message)}"):
        dist.all_reduce(host)  # all_reduce host
    with pytest.raises(
        AssertionError, match="accelerate.utils.gather"
    ):  # a view, nested in a dict of lists
        accelerate.utils.gather({"x": [1, host.view(2, 1)]})
    with pytest.raises(
        AssertionError, match="accelerator.gather_for_metrics"
    ):  # no Accelerator needed to fail
        accelerate.Accelerator.gather_for_metrics(None, (host,))
    with pytest.raises(
        AssertionError, match=r"at tests/\S+ \(torch.zeros without device=\)"
    ):  # an output too
        dist.all_gather([torch.zeros(2)], torch.ones(2, device=DEVICE))
    with pytest.raises(
        AssertionError, match="torch.distributed.all_reduce"
    ):  # a dtype change stays on the host
        dist.all_reduce(host.to(torch.float64))
    with pytest.raises(
        AssertionError, match="torch.distributed.broadcast"
    ):  # the default group: not a CPU one
        dist.broadcast(host, src=0, group=dist.group.WORLD)


def test_cpu_copies_fail_but_leave_the_device_tensor_alone(guarded_world):
    device_tensor = torch.arange(3.0, device=DEVICE)
    for host_copy, how in (
        (device_tensor.cpu(), r"\.cpu\(\)"),
        (device_tensor.to("cpu"), r"\.to\(cpu\)"),
    ):
        assert torch.equal(host_copy, device_tensor)
        with pytest.raises(
            AssertionError, match=rf"left on the host at tests/{HERE}:\d+ \({how}\)"
        ):
            accelerate.utils.reduce(host_copy)
    dist.all_reduce(
        device_tensor
    )  # on a CPU host .cpu() returns the tensor itself: the guard marked a view
    assert device_tensor.tolist() == [0.0, 1.0, 2.0]  # one rank: the sum is the tensor


def test_device_tensors_gloo_groups_and_library_calls_pass(guarded_world):
    moved = torch.tensor([5.0]).to(DEVICE)  # made on the host, then moved to the device
    dist.all_reduce(moved)
    dist.all_reduce(torch.full((2,), 7, device=DEVICE))
    out = [torch.empty(1, device=DEVICE)]
    dist.all_gather(out, moved)
    assert out[0].item() == 5.0
    cpu_group = dist.new_group(
        backend="gloo"
    )  # a CPU group on purpose (common/checkpoint.py's stop_on_signal)
    flag = torch.tensor([3], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=cpu_group)
    assert flag.item() == 3
    library = {
        "torch": torch,
        "dist": dist,
    }  # code outside the project makes and reduces host tensors unchecked
    exec(
        compile("t = torch.tensor([1.0]); dist.all_reduce(t)", "/site-packages/lib.py", "exec"),
        library,
    )
    dist.all_reduce(library["t"])  # and its tensors are not marked


def test_device_contexts_still_place_factories(guarded_world):
    # `with torch.device(...)` finds the factories by identity; transformers builds and re-initialises
    # models under it (with the wrappers listed instead, its rotary buffers stayed uninitialised memory).
    with torch.device("meta"):
        made = [
            torch.arange(4),
            torch.tensor([1.0]),
            torch.zeros(2),
            torch.empty(3),
            torch.full((2,), 1.0),
        ]
    assert [t.device.type for t in made] == ["meta"] * 5


def test_the_guard_leaves_compiled_graphs_whole():
    """Inside a region dynamo traces, the guard does no bookkeeping, so that tests/test_compile.py
    checks the program users run: a 2-layer Llama's forward and loss trace to one graph with the
    guard as without it (with the bookkeeping traced: 10 graphs, 9 breaks)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    def graphs():
        torch._dynamo.reset()
        model = LlamaForCausalLM(
            LlamaConfig(
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=2,
                num_attention_heads=2,
                num_key_value_heads=2,
                vocab_size=128,
            )
        )
        x = torch.randint(0, 128, (2, 16))
        explained = torch._dynamo.explain(model)(input_ids=x, labels=x)
        return explained.graph_count, explained.graph_break_count

    plain = graphs()
    uninstall = collective_guard.install()  # the project's own roots, as in a launched rank
    try:
        guarded = graphs()
    finally:
        uninstall()
        torch._dynamo.reset()
    assert plain == guarded == (1, 0)


# Each idiom that reads a tensor's value on the host (a GPU sync), run as project code: the
# host-read logger (tests/device_guard/host_reads.py) must log each exactly once, by its name.
IDIOMS = r"""
import json, os, sys
sys.path.insert(0, os.path.join(sys.argv[1], "tests", "device_guard"))
import collective_guard, host_reads
collective_guard.install(roots=[os.path.realpath(__file__)])
host_reads.install(sys.argv[2])
import torch
t = torch.arange(3.0, device=torch.device("cpu"))[1]  # 0-dim, on "the device": not left on the host on purpose
idioms = {"item": lambda: t.item(), "tolist": lambda: t.tolist(), "__float__": lambda: float(t),
          "__int__": lambda: int(t), "__bool__": lambda: bool(t), "__format__": lambda: f"{t:.3}",
          "cpu": lambda: t.cpu(), "to(cpu)": lambda: t.to("cpu").tolist(), "__repr__ (str)": lambda: str(t),
          "__repr__ (print)": lambda: print(t, file=open(os.devnull, "w"))}
seen = {}
for idiom, read in idioms.items():
    before = len(host_reads._reads)
    read()
    seen[idiom] = [(origin, name) for origin, name, *_ in host_reads._reads[before:]]
print("SEEN " + json.dumps(seen))
"""


def test_the_host_read_logger_sees_every_idiom(tmp_path):
    script = tmp_path / "idioms.py"
    script.write_text(IDIOMS)
    env = {
        **os.environ,
        "PYTHONPATH": "",
    }  # not the suite's sitecustomize: this script installs the logger itself
    proc = subprocess.run(
        [sys.executable, str(script), str(REPO), str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.split("SEEN ", 1)[1])
    for idiom, reads in seen.items():
        assert reads == [["project", idiom.split(" ")[0]]], (idiom, reads)
