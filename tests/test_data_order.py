"""Data order of recipes/llama.py itself (--record_sample_ids): the same blocks per optimizer step on
any world size, strategy and accumulation split, a new permutation every epoch, disjoint rank shards.

The runs are the session's 16-step fp32 runs of tests/test_checkpoint.py (global batch 8: 4 x 2
accumulation on one process, 2 x 2 accumulation x 2 ranks under every strategy), which the resume,
parity and multi-node tests share: no launch of its own when those ran. (Eval blocks counted once
by `gather_for_metrics`: the parity tests' eval loss, 13 blocks on 2 ranks x 4, equals one process's.)
"""

import json

import pytest

from conftest import CONFIGS, read_metrics
from test_checkpoint import STEPS, args, batch_args


def global_steps(out):
    """Per epoch, per optimizer step: the sorted block ids all ranks trained on together."""
    ranks = [json.loads(p.read_text()) for p in sorted((out / "sample_ids").glob("rank*.json"))]
    info = json.loads((out / "run_info.json").read_text())
    assert len(ranks) == info["world_size"] == ranks[0]["world_size"]
    per_step = (
        info["args"]["per_device_train_batch_size"] * info["args"]["gradient_accumulation_steps"]
    )  # per rank
    epochs = []
    for e in range(len(ranks[0]["epochs"])):
        ids = [r["epochs"][e] for r in ranks]
        assert len({len(i) for i in ids}) == 1 and len(ids[0]) % per_step == 0
        epochs.append(
            [
                sorted(i for r in ids for i in r[k * per_step : (k + 1) * per_step])
                for k in range(len(ids[0]) // per_step)
            ]
        )
    return epochs, ranks, info


@pytest.fixture(scope="module")
def runs(small_corpus, reference_run):
    return {
        config: reference_run(config, *args(None, small_corpus, *batch_args(config))[2:])
        for config in CONFIGS
    }


def test_the_same_blocks_per_step_on_every_strategy_and_split(runs):
    reference, _, info = global_steps(runs["single"])
    per_epoch, blocks = info["updates_per_epoch"], info["data"]["train"]["blocks"]
    assert per_epoch == blocks // 8  # drop_last: a remainder of blocks % 8 stays out of every epoch
    # 16 steps: two whole epochs (7 steps each: 56 blocks), then the start of the third
    assert [len(e) for e in reference] == [per_epoch, per_epoch, STEPS - 2 * per_epoch]
    assert sum(len(e) for e in reference) == len(read_metrics(runs["single"])[0]) == STEPS
    for config in CONFIGS[1:]:
        steps, ranks, _ = global_steps(runs[config])
        assert steps == reference, (
            config
        )  # step k trains blocks 8k .. 8k+7 of the epoch's permutation
        for e in range(2):  # whole epochs: disjoint rank shards that together hold the epoch
            shards = [set(r["epochs"][e]) for r in ranks]
            assert not shards[0] & shards[1], (config, e)
            assert len(shards[0] | shards[1]) == 8 * per_epoch, (config, e)


def test_each_epoch_is_a_new_permutation(runs):
    epochs, _, _ = global_steps(runs["single"])
    orders = [[i for step in epoch for i in step] for epoch in epochs]
    assert orders[0] != orders[1] and orders[1] != orders[2][: len(orders[1])]
    # a replayed epoch would give the identical order; a fresh one shares ~1/N positions
    same = sum(a == b for a, b in zip(orders[0], orders[1]))
    assert same < 0.2 * len(orders[0]), same
