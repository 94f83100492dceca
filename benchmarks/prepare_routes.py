"""How fast, and in how much memory, is a user's corpus made into training blocks? Three routes.

    python benchmarks/prepare_routes.py                 # ~45 minutes on 2 loaded cores, GBs of disk
    python benchmarks/prepare_routes.py --sizes 20 --output runs/prepare_routes.md

The corpora: JSONL files of --sizes MB (default 100 and 400), a row per paragraph of the bundled
Shakespeare corpus, cycled. The tokenizer: the bundled corpus' BPE (4,096 entries), block 256.
Each route runs as its own process tree, with empty caches (its own --cache_dir and
HF_DATASETS_CACHE: nothing is reused), on --num_proc processes:
  * prepare: `tools/prepare_shards.py --train_file X --num_proc N` to parquet shards;
  * llama.py: `recipes/llama.py --train_file X --preprocessing_num_workers N --max_steps 1`
    (one process, no launcher): its preparation, one step, a tiny eval;
  * datasets: run_clm's route, `load_dataset("json")`, `map(tokenize, num_proc=N)` and
    `map(group_texts, num_proc=N)` (the blocks, in `datasets`' cache).
Measured: wall time, and memory sampled every 0.1 s over the whole tree (the process and its
workers), as PSS (a page shared by n processes counts 1/n in each: forked workers share their
parent's): peak PSS (the pages it maps, file-backed ones included: Arrow files are
memory-mapped, and their pages are cache the kernel can drop) and peak anonymous PSS (the heap:
what cannot be dropped). Growth = the largest size's peak over the smallest's. Goals: prepare at least as fast
as `datasets`; peak memory growth under 10% from 100 MB to 400 MB.
Measurements that go in results files run under `flock /tmp/bench.lock` on a shared host.
"""

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from benchmarks.compare_strategies import describe_machine  # noqa: E402
from common import data, errors  # noqa: E402
from common.args import flag, parse_flags  # noqa: E402

BASELINE = """
import sys
from itertools import chain
import datasets
from transformers import AutoTokenizer
path, tokenizer_dir, num_proc, block = sys.argv[1], sys.argv[2], int(sys.argv[3]), 256
tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
raw = datasets.load_dataset("json", data_files={"train": path})
tokens = raw.map(lambda b: tokenizer(b["text"]), batched=True, num_proc=num_proc,
                 remove_columns=["text"])
def group_texts(examples):  # run_clm.py's
    concatenated = {k: list(chain(*examples[k])) for k in examples}
    total = len(concatenated["input_ids"]) // block * block
    result = {k: [t[i : i + block] for i in range(0, total, block)] for k, t in concatenated.items()}
    result["labels"] = result["input_ids"].copy()
    return result
blocks = tokens.map(group_texts, batched=True, num_proc=num_proc)
print("blocks", len(blocks["train"]))
"""


@dataclass
class Args:
    output: str = "benchmarks/results/prepare_routes_cpu2.md"
    work_dir: str = field(default="/tmp/prepare_routes", metadata={"help": "corpora and outputs"})
    sizes: str = flag("100,400", "corpus sizes in MB")
    routes: str = "prepare,datasets,llama"
    baseline_sizes: str = flag("100", "the sizes the datasets route runs at (time goal: 100 MB)")
    num_proc: int = flag(2, low=1)
    keep_corpora: bool = False


def make_corpus(path: Path, megabytes: int) -> None:
    """A JSONL of `megabytes` MB: paragraphs of the bundled corpus, a row each, cycled."""
    if path.exists():
        return
    texts = data.load_shakespeare()["text"]
    paragraphs = [p for t in texts for p in t.split("\n\n") if p.strip()]
    written, i = 0, 0
    with open(f"{path}.tmp", "w") as f:
        while written < megabytes * 10**6:
            line = json.dumps({"text": paragraphs[i % len(paragraphs)]}) + "\n"
            written, i = written + f.write(line), i + 1
    os.replace(f"{path}.tmp", path)


def measure(cmd: list[str], env: dict, log: Path) -> dict:
    """Run `cmd`; its wall time and the peaks of its process tree's PSS and anonymous PSS (a
    forked worker's pages shared with its parent count once, split between them)."""
    peak = {"pss": 0, "anon": 0}
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
        start, done = time.perf_counter(), threading.Event()

        def sample():
            root = psutil.Process(proc.pid)
            while not done.is_set():
                pss = anon = 0
                try:
                    for p in [root, *root.children(recursive=True)]:
                        with open(f"/proc/{p.pid}/smaps_rollup") as rollup:
                            fields = dict(line.split(":", 1) for line in list(rollup)[1:])
                        pss += int(fields["Pss"].split()[0]) * 1024
                        anon += int(fields["Pss_Anon"].split()[0]) * 1024
                except (OSError, KeyError, psutil.Error):
                    pass  # a worker that just exited
                peak["pss"], peak["anon"] = max(peak["pss"], pss), max(peak["anon"], anon)
                time.sleep(0.1)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        code = proc.wait()
        seconds = time.perf_counter() - start
        done.set()
        sampler.join()
    if code:
        sys.exit(f"error: {' '.join(map(str, cmd))} exited {code}; see {log}")
    return {"seconds": seconds, "peak_pss": peak["pss"], "peak_anon": peak["anon"]}


def route_command(route: str, corpus: Path, tokenizer: str, out: Path, args: Args) -> list:
    n = str(args.num_proc)
    if route == "prepare":
        return [sys.executable, "tools/prepare_shards.py", "--train_file", corpus, "--num_proc", n,
                "--tokenizer_name_or_path", tokenizer, "--output_dir", out, "--num_shards", "8",
                "--cache_dir", out.with_name(out.name + "_cache")]  # fmt: skip
    if route == "llama":
        return [sys.executable, "recipes/llama.py", "--train_file", corpus, "--max_steps", "1",
                "--preprocessing_num_workers", n, "--tokenizer_name_or_path", tokenizer,
                "--max_eval_samples", "8", "--report_to", "none", "--output_dir", out,
                "--cache_dir", out.with_name(out.name + "_cache")]  # fmt: skip
    return [sys.executable, "-c", BASELINE, corpus, tokenizer, n]


def main():
    args = parse_flags((Args,), description=__doc__)[0][0]
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    sizes = [int(s) for s in args.sizes.split(",")]
    # the bundled corpus' BPE, trained once, into the work folder
    tokenizer = data.get_tokenizer(None, data.load_text_dataset(), 4096, str(work / "tok_cache"))
    tokenizer_dir = str(work / "tokenizer")
    tokenizer.save_pretrained(tokenizer_dir)
    started = datetime.now(timezone.utc)
    results = {}
    for size in sizes:
        corpus = work / f"corpus_{size}mb.jsonl"
        make_corpus(corpus, size)
        for route in args.routes.split(","):
            if route == "datasets" and str(size) not in args.baseline_sizes.split(","):
                continue
            out = work / f"{route}_{size}mb"
            for old in (out, out.with_name(out.name + "_cache"), work / "hf_cache"):
                shutil.rmtree(old, ignore_errors=True)  # empty caches: nothing reused
            env = os.environ | {"HF_DATASETS_CACHE": str(work / "hf_cache")}
            cmd = route_command(route, corpus, tokenizer_dir, out, args)
            results[route, size] = measure([str(c) for c in cmd], env, out.with_suffix(".log"))
            print(route, size, results[route, size], flush=True)
            shutil.rmtree(work / "hf_cache", ignore_errors=True)
            for old in (out, out.with_name(out.name + "_cache")):
                shutil.rmtree(old, ignore_errors=True)  # GBs at 400 MB
            write_report(args, sizes, results, started)  # so far: a long run may be cut short
        if not args.keep_corpora:
            corpus.unlink()


def write_report(args: Args, sizes: list[int], results: dict, started) -> None:
    load = os.getloadavg()
    lines = [
        "# Preparing a user's JSONL: prepare_shards vs llama.py vs datasets (map + group_texts)",
        "",
        f"{started:%Y-%m-%d %H:%M} UTC, {describe_machine()}, --num_proc {args.num_proc} on "
        f"{len(os.sched_getaffinity(0))} cores; load average at the end {load[0]:.1f} (a shared "
        "host: other jobs ran beside it, so the times are upper bounds).",
        "`python benchmarks/prepare_routes.py` (its docstring says what is measured).",
        "",
        "| route | corpus | wall time | MB of text / s / core | peak PSS | peak anonymous PSS |",
        "|---|---|---|---|---|---|",
    ]
    for (route, size), r in results.items():
        rate = size / r["seconds"] / args.num_proc
        lines.append(
            f"| {route} | {size} MB | {r['seconds']:.1f} s | {rate:.2f} | "
            f"{r['peak_pss'] / 2**20:,.0f} MiB | {r['peak_anon'] / 2**20:,.0f} MiB |"
        )
    lines += ["", "Growth of the peaks from the smallest corpus to the largest:", ""]
    for route in args.routes.split(","):
        if (route, sizes[0]) not in results or (route, sizes[-1]) not in results:
            continue
        first, last = results[route, sizes[0]], results[route, sizes[-1]]
        lines.append(
            f"- {route}: PSS {last['peak_pss'] / first['peak_pss'] - 1:+.0%}, "
            f"anonymous {last['peak_anon'] / first['peak_anon'] - 1:+.0%}"
        )
    Path(args.output).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    errors.run(main)
