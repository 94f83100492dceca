"""recipes/gradient_checkpointing.py under real 2-rank launches (DDP and FSDP2), in fp32, and its flags."""

import json

import pytest

from conftest import launch, run_in_process

RECIPE = "recipes/gradient_checkpointing.py"
BATCH, BLOCK, HIDDEN = (
    2,
    128,
    256,
)  # per-device batch, tokens per sequence, the debug preset's width
VOCAB, FFN = 4096, 688  # the recipe's vocabulary and the debug preset's MLP width (tied embedding)
DEPTHS = (1, 2, 4)


@pytest.mark.parametrize(
    "flag, value, why",
    [
        ("save_steps", 2, "it saves no checkpoints"),
        ("resume_from_checkpoint", "latest", "it saves no checkpoints"),
        ("warmup_steps", 2, "it trains at a constant --learning_rate"),
        ("lr_scheduler_type", "cosine", "it trains at a constant --learning_rate"),
        ("dataloader_num_workers", 2, "it reads its few batches once"),
        ("run_name", "x", "its figures go to results.json"),
        ("num_train_epochs", 2, "it runs --max_steps steps per variant and depth"),
        ("report_to", "tensorboard", "its figures go to results.json"),
    ],
)
def test_a_core_flag_it_cannot_honour_is_refused(flag, value, why, tmp_path, monkeypatch):
    message = run_in_process(
        monkeypatch, RECIPE, "--output_dir", tmp_path / "out", f"--{flag}", value
    )
    assert message.startswith(f"error: gradient_checkpointing.py does not take --{flag}: {why}"), (
        message
    )
    assert "\n" not in message and not (tmp_path / "out").exists()


def test_a_non_empty_output_dir_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    (tmp_path / "table.md").write_text("an earlier table\n")
    message = run_in_process(monkeypatch, RECIPE, "--output_dir", tmp_path, "--max_steps", 3)
    assert message.startswith(f"error: --output_dir {tmp_path} already holds files (table.md)"), (
        message
    )
    assert [p.name for p in tmp_path.iterdir()] == ["table.md"]


def test_on_cpu_a_step_is_left_for_timing_after_the_metered_one(tmp_path, monkeypatch):
    """Step 1 is untimed (Adam's state), step 2 metered for memory (the profiler slows it): on CPU
    --max_steps 2 would leave no step to time."""
    message = run_in_process(
        monkeypatch, RECIPE, "--output_dir", tmp_path / "out", "--max_steps", 2
    )
    assert (
        message
        == "error: --max_steps 2: on CPU step 2 is metered for memory, not timed; need at least 3"
    ), message


@pytest.mark.parametrize("config", ["ddp", "fsdp"])
def test_checkpointing_changes_memory_not_gradients(config, tmp_path, cache_dir):
    out = tmp_path / "gc"
    # DDP with find_unused_parameters=True is where reentrant checkpointing fails with "Expected to
    # mark a variable ready only once" (checked by hand, see the recipe's docstring); the
    # non-reentrant variants must run there.
    ddp_args = ["--ddp_find_unused_parameters", "True"] if config == "ddp" else []
    # FSDP2: each step accumulates 2 micro batches (no_sync via Accelerate's accumulate); step 1's
    # first micro batch is the one measured, so every byte count below is the same as without.
    accumulation = 2 if config == "fsdp" else 1
    proc = launch(
        config,
        RECIPE,
        "--num_layers",
        ",".join(map(str, DEPTHS)),
        "--max_steps",
        3,
        "--timing_rounds",
        1,
        "--per_device_train_batch_size",
        BATCH,
        "--gradient_accumulation_steps",
        accumulation,
        "--block_size",
        BLOCK,
        "--output_dir",
        out,
        "--ddp_timeout",
        120,
        *ddp_args,
        cache_dir=cache_dir,
        mixed_precision="no",
    )
    for message in ("mark a variable ready only once", "marked as ready twice"):
        assert message not in proc.stdout + proc.stderr

    info = json.loads(
        (out / "results.json").read_text(),  # standard JSON: no NaN/Infinity literals
        parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"),
    )
    assert (
        info["args"]["gradient_accumulation_steps"] == accumulation
        and info["args"]["weight_decay"] == 0.01
    )
    assert info["world_size"] == 2 and info["mixed_precision"] == "no"
    assert (
        info["precision"]["requested"] == "no" and info["precision"]["used"] == "no"
    )  # the launch's, recorded
    assert info["distributed_type"] == {"ddp": "MULTI_CPU", "fsdp": "FSDP"}[config]
    variants = ["none", "hf", "manual"] + (["fsdp"] if config == "fsdp" else [])
    rows = {(r["num_layers"], r["variant"]): r for r in info["results"]}
    assert set(rows) == {(depth, v) for depth in DEPTHS for v in variants}
    for depth in DEPTHS:
        assert f"| {depth} | {variants[-1]} |" in proc.stdout  # the printed table

    for (depth, variant), r in rows.items():
        none = rows[(depth, "none")]
        # The same gradients (step 1, this rank's full gradient or FSDP shard, max over ranks) as
        # allclose(rtol=1e-5, atol=1e-7) in fp32, and the same loss at every step.
        assert r["max_abs_grad_diff"] <= 1e-7 + 1e-5 * r["max_abs_grad"], r
        assert len(r["losses"]) == 3 and r["max_abs_loss_diff"] <= 1e-6, r
        assert r["losses"][-1] < r["losses"][0]  # it trains
        # The forward+backward peak (CPU: the profiler's allocator events, step 2): everything
        # saved for backward is alive at the end of the forward.
        assert r["saved_bytes"] <= r["peak_bytes"], r
        if (
            config == "ddp"
        ):  # each rank holds whole gradients, and Adam's state is two gradient-sizes more
            # No optimizer step in it (Adam's state, its foreach temporaries): below the saved bytes,
            # the gradients and one more gradient-size of temporaries.
            grad_bytes = 4 * (
                VOCAB * HIDDEN
                + depth * (4 * HIDDEN * HIDDEN + 3 * HIDDEN * FFN + 2 * HIDDEN)
                + HIDDEN
            )
            assert r["peak_bytes"] < r["saved_bytes"] + 2 * grad_bytes, (r, grad_bytes)
        if variant == "none":
            continue
        if (
            depth > 1
        ):  # checkpointing lowers the peak too (at depth 1 by ~3 MiB, near FSDP2's run-to-run 1.5 MiB)
            assert r["peak_bytes"] < none["peak_bytes"], (r, none)
        # A checkpointed block keeps exactly its input: batch x block x hidden fp32 values.
        assert r["saved_block_bytes"] == depth * BATCH * BLOCK * HIDDEN * 4, r
        assert r["saved_rest_bytes"] == none["saved_rest_bytes"]  # embedding, norm, head: untouched
        assert r["saved_bytes"] < none["saved_bytes"] / 2
    # Without checkpointing every block saves the same, so the blocks' bytes are linear in depth
    # (plus a constant: the rotary cos/sin, made once and first saved inside block 0).
    blocks = {depth: rows[(depth, "none")]["saved_block_bytes"] for depth in DEPTHS}
    assert blocks[4] - blocks[2] == 2 * (blocks[2] - blocks[1]) > 0


def test_a_nan_loss_stops_the_measurement(tmp_path, cache_dir):
    """fp32, --learning_rate 1e10: step 2's loss is NaN; the first variant stops with one line naming it
    and no table is written (a measurement of NaN training compares nothing)."""
    out = tmp_path / "gc"
    proc = launch(
        "ddp",
        RECIPE,
        "--num_layers",
        1,
        "--max_steps",
        3,
        "--timing_rounds",
        1,
        "--learning_rate",
        1e10,
        "--per_device_train_batch_size",
        BATCH,
        "--block_size",
        64,
        "--output_dir",
        out,
        "--ddp_timeout",
        120,
        cache_dir=cache_dir,
        mixed_precision="no",
        check=False,
    )
    assert proc.returncode != 0
    errors = {line[line.index("error:") :] for line in proc.stderr.splitlines() if "error:" in line}
    # each rank's line, and torchrun's failure summary, which repeats it cut short
    assert errors and all(
        e.startswith(
            "error: L=1 none round 0: step 2: the training loss is nan and the gradient norm nan in fp32"
        )
        for e in errors
    ), proc.stderr[-3000:]
    assert not (out / "results.json").exists()
