"""tools/prepare_shards.py on a user's JSONL, in this process: 1 and 2 tokenizing processes give the same
shards (and llama.py's preparation the same blocks and resume fingerprint); an interrupted run leaves no
manifest, and running it again ends with a complete one that every shard's checksum verifies."""

import hashlib
import json
import runpy
import shutil
import subprocess
import sys
import time

import datasets
import numpy as np
import pyarrow.parquet as pq
import pytest

from common import data
from common.errors import Stop
from conftest import REPO

# 4 shards of 16-row groups of 64-token blocks, from the paragraphs of 2 works (~170 KB of text)
TINY = ["--num_shards", 4, "--block_size", 64, "--rows_per_row_group", 16]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A JSONL of the first 2 bundled works, a row per paragraph, with the text in `body`."""
    path = tmp_path_factory.mktemp("corpus") / "corpus.jsonl"
    works = data.load_shakespeare()["text"][:2]
    rows = [p for t in works for p in t.split("\n\n") if p.strip()]
    path.write_text("".join(json.dumps({"body": p, "n": i}) + "\n" for i, p in enumerate(rows)))
    return path


@pytest.fixture(scope="module")
def no_reuse():
    """`datasets` recomputes every map (no fingerprint cache): each run tokenizes for itself."""
    datasets.disable_caching()
    yield
    datasets.enable_caching()


def tool():
    return runpy.run_path(str(REPO / "tools/prepare_shards.py"), run_name="prepare_shards_in_tests")


def prepare(out, corpus, cache_dir, *flags, module=None):
    """tools/prepare_shards.py on `corpus`, in this process; its manifest."""
    module = module or tool()
    argv = ["--output_dir", out, "--train_file", corpus, "--dataset_text_field", "body"]
    argv += ["--cache_dir", cache_dir, *TINY, *flags]
    module["prepare"](module["parse_flags"]((module["Args"],), list(map(str, argv)))[0][0])
    return json.loads((out / "manifest.json").read_text())


@pytest.fixture(scope="module")
def by_procs(corpus, no_reuse, tmp_path_factory):
    """{num_proc: (output dir, manifest, cache dir)}, --packing documents, each with its own cache."""
    made = {}
    for n in (1, 2):
        base = tmp_path_factory.mktemp(f"procs{n}")
        manifest = prepare(base / "out", corpus, base / "cache", "--packing", "documents",
                           "--num_proc", n)  # fmt: skip
        made[n] = base / "out", manifest, base / "cache"
    return made


def test_one_and_two_processes_write_the_same_shards(by_procs, corpus):
    (out, one, cache), two = by_procs[1], by_procs[2][1]
    assert [s["sha256"] for s in one["shards"]] == [s["sha256"] for s in two["shards"]]
    assert one["validation"]["sha256"] == two["validation"]["sha256"]
    assert one["packed_digest"] == two["packed_digest"]
    # the blocks are llama.py's: block b of shard b % 4 is its packed block b, positions included
    raw = data.load_text_dataset(train_file=str(corpus), columns=(("body",),))
    raw = raw.select_columns("body").rename_column("body", "text")
    tokenizer = data.get_tokenizer(None, raw, 4096, str(cache))
    packed = data.pack_dataset(raw, tokenizer, 64, str(cache), "documents")["train"]
    assert one["total_blocks"] == len(packed) // 4 * 4 == 1228  # of 1230
    table = pq.read_table(out / "shard_0001.parquet")
    assert table.column("block_id").to_pylist()[:3] == [1, 5, 9]
    assert table.column("input_ids")[1].as_py() == packed[5]["input_ids"]
    positions = np.array(table.column("position_ids").to_pylist())
    assert positions.tolist()[1] == packed[5]["position_ids"]
    assert (positions[:, 0] == 0).all() and (positions[:, 1:] == 0).sum() > 10  # documents start


def test_llama_preparation_on_two_workers_makes_the_blocks_of_one(by_procs):
    """pack_dataset(num_proc=2) is llama.py --preprocessing_num_workers 2: the same cache key (one
    directory name) and the same digests, which are llama.py's resume fingerprint."""
    dirs = [{p.name for p in by_procs[n][2].glob("documents-64-*")} for n in (1, 2)]
    assert dirs[0] == dirs[1] and len(dirs[0]) == 1
    stats = [json.loads((by_procs[n][2] / next(iter(dirs[0])) / "stats.json").read_text()) for n in (1, 2)]  # fmt: skip
    assert stats[0] == stats[1]
    assert stats[0]["train"]["blocks"] == 1230 and stats[0]["train"]["rows"] > 300


def test_an_interrupted_run_leaves_no_manifest_and_a_rerun_completes(by_procs, corpus, tmp_path):
    module, done = tool(), by_procs[1][1]
    out, cache = by_procs[1][0], by_procs[1][2]
    real_write, calls = module["ShardWriter"].write, []

    def dies_on_the_fifth(self, columns):
        calls.append(self.path.name)
        if len(calls) == 5:
            raise KeyboardInterrupt  # Ctrl-C, or a kill: the files stay as they are
        real_write(self, columns)

    with pytest.MonkeyPatch.context() as mp, pytest.raises(KeyboardInterrupt):
        mp.setattr(module["ShardWriter"], "write", dies_on_the_fifth)
        prepare(out, corpus, cache, "--packing", "documents", "--overwrite_output_dir",
                module=module)  # fmt: skip
    assert not (out / "manifest.json").exists()  # the old one went first
    assert not list(out.glob("shard_*.parquet"))  # only temporary names
    assert len(list(out.glob(".shard_*.parquet.tmp"))) == 4
    again = prepare(out, corpus, cache, "--packing", "documents")  # no --overwrite_output_dir
    assert again == done and not list(out.glob(".*tmp"))
    for entry in [*again["shards"], again["validation"]]:
        path = out / entry["name"]
        assert hashlib.sha256(path.read_bytes()).hexdigest() == entry["sha256"]
        assert pq.read_metadata(path).num_rows == entry["rows"]


def test_sharded_data_refuses_documents_blocks(by_procs):
    """recipes/sharded_data.py counts every position of a block a target: it refuses the shards of
    --packing documents (their position_ids) at start-up, before any rank reads a row."""
    own_shards = runpy.run_path(str(REPO / "recipes/sharded_data.py"), run_name="x")["own_shards"]
    with pytest.raises(Stop, match="--packing documents blocks; prepare stream ones"):
        own_shards(str(by_procs[1][0]), 1, 0, verify=False)


def test_datatrove_tasks_write_the_shards_of_one_process(by_procs, corpus, tmp_path, monkeypatch):
    """slurm/prepare_shards.py --local: 2 datatrove tasks tokenize a part of the rows each, a third
    packs them: the shards of one process, byte for byte; the parts are gone, the tasks recorded."""
    out = tmp_path / "out"
    argv = ["--local", "--tasks", 2, "--output_dir", out, "--train_file", corpus, *TINY]
    argv += ["--dataset_text_field", "body", "--packing", "documents", "--num_proc", 1]
    argv += ["--cache_dir", tmp_path / "cache"]
    monkeypatch.setattr(sys, "argv", ["slurm/prepare_shards.py", *map(str, argv)])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(str(REPO / "slurm/prepare_shards.py"), run_name="__main__")
    assert exit_info.value.code == 0
    made, one = json.loads((out / "manifest.json").read_text()), by_procs[1][1]
    assert [s["sha256"] for s in made["shards"]] == [s["sha256"] for s in one["shards"]]
    assert made["validation"]["sha256"] == one["validation"]["sha256"]
    assert sorted(p.name for p in (out / ".parts").iterdir()) == ["tokenizer"]
    assert len(list((out / ".datatrove" / "tokenize" / "completions").iterdir())) == 2


@pytest.mark.skipif(shutil.which("sbatch") is None, reason="no sbatch: bash slurm/local_cluster.sh")
def test_two_slurm_machines_write_the_shards_of_one_process(by_procs, corpus, tmp_path):
    """slurm/prepare_shards.py on the local 2-node SLURM: a 2-task job array tokenizes (a node each),
    then one job writes the shards: those of one process, byte for byte."""
    out = tmp_path / "out"
    argv = ["--tasks", 2, "--partition", "debug", "--mem_per_cpu", "1M", "--output_dir", out]
    argv += ["--train_file", corpus, *TINY, "--dataset_text_field", "body", "--packing"]
    argv += ["documents", "--num_proc", 1, "--cache_dir", tmp_path / "cache"]
    cmd = [sys.executable, "slurm/prepare_shards.py", *map(str, argv)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    deadline, logs = time.monotonic() + 300, ""  # both jobs, start-up included (about 40 s here)
    while logs.count("Processing done for rank=") < 3 and time.monotonic() < deadline:
        time.sleep(2)  # 2 tokenizing tasks, then 1 writing
        logs = "".join(p.read_text() for p in out.glob(".datatrove/slurm/*.out"))
    assert (out / "manifest.json").exists(), logs[-3000:]
    made, one = json.loads((out / "manifest.json").read_text()), by_procs[1][1]
    assert [s["sha256"] for s in made["shards"]] == [s["sha256"] for s in one["shards"]]
    assert made["validation"]["sha256"] == one["validation"]["sha256"]
    assert not list(out.glob(".parts/0*"))  # the parts, once packed, are gone
