"""Data order: the same samples per optimizer step on any world size and accumulation split,
a new permutation every epoch, disjoint rank shards, and eval samples counted once."""

import json

from conftest import launch

N, EVAL_N, EPOCHS = 42, 13, 3  # neither divides evenly by world size x batch


def run(tmp_path, cache_dir, config, batch, accum):
    out = tmp_path / f"{config}-{batch}-{accum}"
    launch(config, "tests/scripts/data_order.py", out, N, batch, accum, EPOCHS, EVAL_N, cache_dir=cache_dir)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(1 if config == "single" else 2)]


def global_steps(ranks):
    """Per epoch, per optimizer step: the set of samples all ranks consumed together."""
    return [[sorted(i for r in ranks for i in r["epochs"][e][s]) for s in range(len(ranks[0]["epochs"][e]))]
            for e in range(EPOCHS)]


def test_data_order(tmp_path, cache_dir):
    one = run(tmp_path, cache_dir, "single", 4, 1)      # 1 process, batch 4
    two = run(tmp_path, cache_dir, "ddp", 2, 1)         # 2 processes, batch 2 each
    two_acc = run(tmp_path, cache_dir, "ddp", 1, 2)     # 2 processes, batch 1, 2 accumulation steps

    # 1. World-size invariance: optimizer step k sees the same sample set in all three.
    reference = global_steps(one)
    assert len(reference[0]) == N // 4  # drop_last: 10 full global batches, 2 samples left out
    assert global_steps(two) == reference
    assert global_steps(two_acc) == reference

    for ranks in (two, two_acc):
        for e in range(EPOCHS):
            # 2. Rank shards are disjoint, and their union is the epoch minus the dropped remainder.
            shards = [{i for step in r["epochs"][e] for i in step} for r in ranks]
            assert not shards[0] & shards[1]
            assert len(shards[0] | shards[1]) == N - N % 4
    # 3. Each epoch is a new permutation (the set_epoch anti-pattern), the same for every split.
    orders = [[i for step in epoch for i in step] for epoch in reference]
    assert orders[0] != orders[1] != orders[2] and orders[0] != orders[2]

    # 4. Eval: gather_for_metrics returns each of the 13 samples exactly once, on every rank,
    # although 13 does not divide by 2 ranks x batch 2 (Accelerate pads, then drops the padding).
    for ranks in (one, two):
        for r in ranks:
            assert sorted(r["eval"]) == list(range(EVAL_N))
