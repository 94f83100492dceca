"""torch.compile through Accelerate's dynamo settings (recipes/llama.py): the same numbers as eager,
an export that reloads, checkpoints that move between eager and compiled runs both ways, and a
one-line refusal where the compile would not happen (DeepSpeed under accelerate launch) or fails
(regional under FSDP1).

One compiled DDP launch (2 ranks, inductor, fp32) serves every assertion: it resumes the eager
checkpoint-20 of the session's `reference_run` (which the recovery and SLURM tests compare with
too) and trains to step 30, saving checkpoint-25 for an eager run to resume. The compile (a training
graph, and the evaluation's, which the logits probe reuses) dominates the launch, not its 10 steps.
"""

import json
import subprocess
import sys
import time

import pytest
import torch
import yaml
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from conftest import REPO, RUN30, corpus_args, launch, read_metrics, run_in_process

sys.path.insert(0, str(REPO))
from common import checks  # noqa: E402

# inductor reorders fp32 reductions: measured up to 4.2e-7 (grad norm, step 26; the compiled steps 21-30)
FP32_RTOL = 5e-6


def config_with_dynamo(tmp_path, base, **dynamo):
    """accelerate_configs/{base}.yaml plus `dynamo_config` (the config-file route to torch.compile)."""
    config = yaml.safe_load((REPO / "accelerate_configs" / f"{base}.yaml").read_text())
    config["dynamo_config"] = {"dynamo_backend": "INDUCTOR", **dynamo}
    path = tmp_path / f"{base}_compiled.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture(scope="module")
def compiled(tmp_path_factory, cache_dir, small_corpus, reference_run):
    """The RUN30 fp32 DDP run with `dynamo_config: {dynamo_backend: INDUCTOR}`, resumed from the eager
    run's checkpoint-20 and saving every 5th step: (output dir, launch seconds, stdout)."""
    root = tmp_path_factory.mktemp("compiled")
    out = root / "run"
    eager = reference_run("ddp", *corpus_args(small_corpus), *RUN30)
    t0 = time.perf_counter()
    proc = launch(
        config_with_dynamo(root, "ddp"),
        "recipes/llama.py",
        "--output_dir",
        out,
        *corpus_args(small_corpus),
        *RUN30,
        "--ddp_timeout",
        300,
        "--save_steps",
        5,
        "--save_logits_probe",
        "--resume_from_checkpoint",
        eager / "checkpoint-20",
        cache_dir=cache_dir,
        mixed_precision="no",
    )
    return out, time.perf_counter() - t0, proc.stdout


def test_compiled_ddp_matches_eager_and_exports(compiled, small_corpus, reference_run):
    out, seconds, stdout = compiled
    info = json.loads((out / "run_info.json").read_text())
    assert info["torch_compile"] == {"backend": "inductor", "mode": "default", "regional": False}
    assert info["distributed_type"] == "MULTI_CPU" and info["world_size"] == 2

    # An eager checkpoint resumed by a compiled model (its keys have no "_orig_mod." prefix), and then
    # fp32: every step's loss and grad norm within FP32_RTOL of the eager run, and the eval loss
    eager_dir = reference_run("ddp", *corpus_args(small_corpus), *RUN30)
    assert f"resumed from {eager_dir / 'checkpoint-20'} at step 20" in stdout
    eager, _ = read_metrics(eager_dir)
    eager = eager[20:]
    steps, summary = read_metrics(out)
    assert [r["step"] for r in steps] == [r["step"] for r in eager] == list(range(21, 31))
    for mine, ref in zip(steps, eager):
        for key in ("loss", "grad_norm"):
            assert mine[key] == pytest.approx(ref[key], rel=FP32_RTOL), (
                mine["step"],
                key,
                mine[key],
                ref[key],
            )
    assert steps[-1]["eval_loss"] == pytest.approx(eager[-1]["eval_loss"], rel=FP32_RTOL)
    assert (
        steps[-1]["loss"] < steps[0]["loss"] - 0.3
    )  # it trained: measured 5.86 -> 5.45 (steps 21-30)

    # The export: eager key names (no "_orig_mod."), reloaded by plain transformers to the live logits
    weights = load_file(out / "final" / "model.safetensors")
    assert not [k for k in weights if "_orig_mod" in k or k.startswith("module.")]
    model = AutoModelForCausalLM.from_pretrained(out / "final", dtype=torch.float32).eval()
    probe = load_file(out / "final_logits.safetensors")
    with torch.no_grad():
        logits = model(input_ids=probe["input_ids"]).logits
    torch.testing.assert_close(logits, probe["logits"], rtol=1e-4, atol=1e-4)
    print(f"compiled DDP launch: {seconds:.1f} s")


def test_an_eager_run_resumes_a_compiled_checkpoint(
    compiled, tmp_path, cache_dir, small_corpus, reference_run
):
    """Checkpoints keep eager key names: an uncompiled run resumes the compiled run's step 25 and
    continues as the eager run did (without it: missing/unexpected '_orig_mod.' keys, a traceback)."""
    out, _, _ = compiled
    ckpt = out / "checkpoint-25"
    weights = load_file(ckpt / "model.safetensors")
    assert weights and not [k for k in weights if "_orig_mod" in k]
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    launch(
        "ddp",
        "recipes/llama.py",
        "--output_dir",
        resumed,
        *corpus_args(small_corpus),
        *RUN30,
        "--resume_from_checkpoint",
        ckpt,
        cache_dir=cache_dir,
        mixed_precision="no",
    )
    eager = {
        r["step"]: r
        for r in read_metrics(reference_run("ddp", *corpus_args(small_corpus), *RUN30))[0]
    }
    steps, _ = read_metrics(resumed)
    assert [r["step"] for r in steps] == list(range(26, 31))
    for r in steps:
        assert r["loss"] == pytest.approx(eager[r["step"]]["loss"], rel=FP32_RTOL), r["step"]


def test_deepspeed_with_a_dynamo_backend_is_one_error_line(tmp_path, cache_dir):
    """accelerate launch does not pass --dynamo_backend to DeepSpeed's ranks: they would train
    uncompiled, silently. The recipe reads the launcher's command line and refuses in one line."""
    proc = launch(
        "deepspeed_zero2",
        "recipes/llama.py",
        "--output_dir",
        tmp_path / "out",
        "--max_steps",
        1,
        "--report_to",
        "none",
        launcher_args=["--dynamo_backend", "inductor"],
        cache_dir=cache_dir,
        env={"ACCELERATE_DYNAMO_BACKEND": None},
        device_guard=False,
        check=False,
        timeout=300,
    )
    assert proc.returncode != 0
    errors = sorted({line for line in proc.stderr.splitlines() if line.startswith("error:")})
    assert len(errors) == 1, proc.stderr[-3000:]
    assert "dynamo backend inductor" in errors[0] and "DeepSpeed" in errors[0]
    assert "ACCELERATE_DYNAMO_BACKEND=INDUCTOR" in errors[0]
    assert not [
        line
        for line in proc.stderr.splitlines()
        if line.startswith("[rank") and "Traceback" in line
    ]


def test_dynamo_checks(tmp_path):
    """The same checks from a YAML (the planner's route) and from a launcher's command line."""
    ds = yaml.safe_load(config_with_dynamo(tmp_path, "deepspeed_zero2").read_text())
    assert [p.severity for p in checks.config_problems(ds, where="ds.yaml", compiles=True)] == [
        "error"
    ]
    fsdp1 = yaml.safe_load(
        config_with_dynamo(tmp_path, "fsdp1", dynamo_use_regional_compilation=True).read_text()
    )
    [problem] = checks.config_problems(fsdp1, compiles=True)
    assert problem.severity == "error" and "FSDP1" in problem.text
    for allowed in ("fsdp1", "fsdp", "ddp", "single"):  # whole-model compile works under each
        assert not checks.config_problems(
            yaml.safe_load(config_with_dynamo(tmp_path, allowed).read_text()), compiles=True
        )
    fsdp2 = yaml.safe_load(
        config_with_dynamo(tmp_path, "fsdp", dynamo_use_regional_compilation=True).read_text()
    )
    assert not checks.config_problems(fsdp2, compiles=True)
    # a recipe that does not keep eager key names (every one but llama.py) refuses any backend
    [problem] = checks.config_problems(
        yaml.safe_load(config_with_dynamo(tmp_path, "ddp").read_text())
    )
    assert problem.severity == "error" and "does not support torch.compile" in problem.text

    # _launcher_dynamo_backend: the flag, else the config file's dynamo_config; nothing after the script
    def parent(*argv):
        proc = subprocess.Popen(
            ["accelerate", "-c", "import time; time.sleep(30)", *map(str, argv)],
            executable=sys.executable,
        )
        time.sleep(0.3)
        try:
            return checks._launcher_dynamo_backend(proc.pid)
        finally:
            proc.kill()
            proc.wait()

    assert parent("--dynamo_backend", "inductor", "train.py") == "INDUCTOR"
    assert parent("--dynamo_backend=eager", "train.py") == "EAGER"
    assert (
        parent("--config_file", tmp_path / "deepspeed_zero2_compiled.yaml", "train.py")
        == "INDUCTOR"
    )
    assert parent("--dynamo_backend", "no", "train.py") is None
    assert parent("train.py", "--dynamo_backend", "inductor") is None


def test_other_recipes_refuse_a_dynamo_backend(tmp_path, monkeypatch):
    """Compiled, mixed_precision.py's checkpoints and export would carry '_orig_mod.' keys: one error
    line, before the Accelerator. In this process, with the variables that `accelerate launch
    --dynamo_backend inductor` gives DDP ranks (the compiled fixture launches that route for real)."""
    for key, value in {
        "ACCELERATE_DYNAMO_BACKEND": "INDUCTOR",
        "WORLD_SIZE": "2",
        "LOCAL_WORLD_SIZE": "2",
    }.items():
        monkeypatch.setenv(key, value)
    message = run_in_process(
        monkeypatch,
        "recipes/mixed_precision.py",
        "--output_dir",
        tmp_path / "out",
        "--max_steps",
        1,
    )
    assert message.startswith("error:") and len(message.splitlines()) == 1, message
    assert "dynamo backend inductor" in message and "does not support torch.compile" in message, (
        message
    )


def test_documents_packing_compiles_once(cache_dir):
    """--packing documents under torch.compile: position ids that restart at other places each step,
    and a target count that changes with them (a tensor, as the recipe passes it), reuse the first
    graph. transformers builds the block-diagonal mask from the position ids without a data-dependent
    branch while tracing. In-process, dynamo with the eager backend (its guards decide recompiles
    whatever the backend), the debug Llama at 64 tokens: 5 steps, each with another document layout."""
    import torch._dynamo
    from transformers import LlamaForCausalLM

    from common import models

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = LlamaForCausalLM(models.llama_config("debug", vocab_size=512, use_cache=False))
    compiled = torch.compile(model, backend="eager")
    counts, graphs = [], []
    with torch._dynamo.config.patch(error_on_recompile=True):  # a recompile raises
        for step in range(5):
            cuts = sorted(
                torch.randperm(63, generator=torch.Generator().manual_seed(step))[: step + 1] + 1
            )
            positions = torch.cat([torch.arange(b - a) for a, b in zip([0, *cuts], [*cuts, 64])])[
                None
            ].repeat(2, 1)
            ids = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(step))
            labels = ids.masked_fill(positions == 0, -100)
            num_items = (labels[:, 1:] != -100).sum()
            counts.append(num_items.item())
            loss = compiled(
                input_ids=ids, labels=labels, position_ids=positions, num_items_in_batch=num_items
            ).loss
            loss.backward()
            model.zero_grad()
            graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    assert len(set(counts)) == 5  # every step another layout and target count
    assert graphs[0] >= 1 and len(set(graphs)) == 1, graphs  # all compiled at the first step
    torch._dynamo.reset()


def test_the_logits_probe_reuses_the_evaluation_graph(tmp_path):
    """--save_logits_probe after the evaluation, on a compiled model: the probe calls the model with
    evaluate()'s keywords, so dynamo compiles no graph for it (under inductor, one compile less per
    rank). In-process, dynamo with the eager backend, the debug Llama at 64 tokens, 2 blocks."""
    from types import SimpleNamespace

    import datasets
    import torch._dynamo
    from transformers import LlamaForCausalLM

    from common import causal_lm, models
    from recipes.llama import evaluate

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = LlamaForCausalLM(models.llama_config("debug", vocab_size=512, use_cache=False))
    compiled = torch.compile(model, backend="eager")
    ids = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(0))
    one_process = SimpleNamespace(
        device=torch.device("cpu"),
        gather_for_metrics=lambda t: t,
        wait_for_everyone=lambda: None,
        is_main_process=True,
    )
    evaluate(compiled, [{"input_ids": ids, "labels": ids}], one_process)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    eval_set = datasets.Dataset.from_dict({"input_ids": ids.tolist()}).with_format("torch")
    with torch._dynamo.config.patch(error_on_recompile=True):  # a recompile raises
        causal_lm.save_logits_probe(one_process, compiled, eval_set, str(tmp_path))
    assert graphs >= 1 and torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
    with torch.no_grad():
        torch.testing.assert_close(
            load_file(tmp_path / "final_logits.safetensors")["logits"],
            model.eval()(input_ids=ids).logits,
        )
    torch._dynamo.reset()


def test_a_cpu_capability_override_gets_its_own_kernel_cache(monkeypatch):
    """Kernels cached by a native run and read under ATEN_CPU_CAPABILITY=avx2 failed a compiled run
    (common/workarounds.inductor_cache_per_cpu_capability): every recipe's process_group gives the
    override a cache directory of its own, and leaves a directory the user chose alone."""
    import os

    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    from common import launch as launch_module

    monkeypatch.setenv(
        "TORCHINDUCTOR_CACHE_DIR", "x"
    )  # so that teardown restores the variable as it was
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    launch_module.process_group(60)
    assert "TORCHINDUCTOR_CACHE_DIR" not in os.environ  # torch's default
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "AVX2")
    launch_module.process_group(60)
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == f"{default_cache_dir()}_avx2"
    # torch's default, as an import that loads inductor writes it (transformers' LlamaForCausalLM)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())
    launch_module.process_group(60)
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == f"{default_cache_dir()}_avx2"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/data/kernels")
    launch_module.process_group(60)
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == "/data/kernels"


def test_the_suite_launches_with_its_own_kernel_cache(cache_dir, monkeypatch):
    """Importing transformers' LlamaForCausalLM makes torch write its shared default cache directory
    into this process's environment (the test modules import it while pytest collects them). Every
    launch still gets the suite's own directory (`conftest.launch_env`), never kernels another run
    or another CPU capability left in /tmp (a compiled DDP run read those and failed at its first step)."""
    import os

    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    import conftest

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())
    capability = os.environ.get("ATEN_CPU_CAPABILITY", "native").lower()
    expected = conftest.CALLER_INDUCTOR_CACHE or os.path.join(cache_dir, f"inductor_{capability}")
    assert conftest.launch_env(cache_dir)["TORCHINDUCTOR_CACHE_DIR"] == expected
    assert conftest.CALLER_INDUCTOR_CACHE or expected != default_cache_dir()
