"""Does the data path keep up at any size? Both loaders of recipes/sharded_data.py, 10 MB vs 1 GB.

    python benchmarks/data_routes.py                     # ~8 minutes on 2 CPU cores, 0.6 GB of disk
    python benchmarks/data_routes.py --repeats 1 --routes datasets --output runs/data_routes.md

The corpora: `tools/prepare_shards.py --repeat K` repeats the bundled Shakespeare corpus
(5.06 MB of text) K times: K=2 is 10 MB, K=200 is 1,011 MB of text (549 MB of parquet in 8
shards of 632 row groups of 256 blocks x 256 tokens). Fast (20 s for 1 GB), and representative
for the loaders, which never look at a token's value: what they pay for is rows, row groups per
file and bytes per file, which match a real tokenized 1 GB corpus cut the same way (the repeats
are 5 MB apart, beyond any parquet page, so the compression ratio is the original text's too).
The corpora are written under --work_dir and deleted at the end (--keep_corpora keeps them).

Each (size, route) runs the recipe --repeats times as a real 2-rank `accelerate launch` (DDP,
bf16, batch 8 x 256, 2 loader workers per rank, --max_steps steps) and reads its metrics.jsonl
summary. Per rank, the recipe measures:
  * loader tokens/s: its DataLoader alone, nothing else running, for --loader_benchmark_batches
    batches after the first (start-up excluded), as training would iterate it;
  * step tokens/s: the tokens a training step consumes per second of the step's own time (the
    loop's wall time less the data waits);
  * data wait: time blocked on the loader in the training loop, as a share of the loop;
  * memory at the end, workers alive: the rank's RSS plus its workers' USS (pages only they hold;
    their RSS would count again the libraries they share with the rank).
The table gives the median over the repeats per rank, and growth = the 1 GB figure minus the
10 MB one. Goals: ratio >= 20, data wait < 2%, growth <= 50 MB per rank.
Measurements that go in results files run under `flock /tmp/bench.lock` on a shared host.
"""

import json
import shutil
import statistics
import subprocess
import sys
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path


REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from benchmarks.compare_strategies import accelerate_launch, describe_machine  # noqa: E402
from common import errors  # noqa: E402
from common.args import flag, parse_flags  # noqa: E402

SIZES = {"10 MB": 2, "1 GB": 200}  # --repeat of the bundled corpus
MB = 2**20
GOALS = {"ratio": 20, "data_wait": 0.02, "growth_mb": 50}


@dataclass
class Args:
    output: str = "benchmarks/results/data_routes_cpu2.md"
    work_dir: str = field(default="/tmp/data_routes", metadata={"help": "corpora and run folders"})
    routes: str = "parquet,datasets"
    repeats: int = flag(3, "launches per (size, route); the table gives medians", low=1)
    num_shards: int = flag(8, low=1)
    max_steps: int = flag(30, low=1)
    loader_benchmark_batches: int = flag(200, low=1)
    keep_corpora: bool = False
    num_processes: int = flag(2, low=1)
    mixed_precision: str = field(
        default="auto", metadata={"help": "auto (the config's, by the hardware), no, bf16, fp16"}
    )
    timeout: int = flag(900, "seconds allowed per launched run", low=1)


def prepare(out: Path, repeat: int, num_shards: int) -> dict:
    """Write (or reuse) the corpus repeated `repeat` times; returns its manifest."""
    if not (out / "manifest.json").exists():
        cmd = [
            sys.executable,
            str(REPO / "tools/prepare_shards.py"),
            "--output_dir",
            str(out),
            "--num_shards",
            str(num_shards),
            "--repeat",
            str(repeat),
            "--overwrite_output_dir",
        ]
        subprocess.run(cmd, cwd=REPO, check=True)
    return json.loads((out / "manifest.json").read_text())


def run(args: Args, data_dir: Path, route: str, out: Path) -> list[dict]:
    """One launch of the recipe; its per-rank summary (metrics.jsonl's last line)."""
    shutil.rmtree(out, ignore_errors=True)  # the recipe refuses a non-empty --output_dir
    accelerate_launch(
        "ddp",
        "recipes/sharded_data.py",
        [
            "--data_dir",
            data_dir,
            "--output_dir",
            out,
            "--loader",
            route,
            "--max_steps",
            args.max_steps,
            "--loader_benchmark_batches",
            args.loader_benchmark_batches,
            "--logging_steps",
            args.max_steps,
            "--verify_checksums",
            "false",
        ],
        args,
        out.with_suffix(".log"),
    )
    summary = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert summary.get("summary"), summary
    return summary["per_rank"]


def medians(runs: list[list[dict]]) -> list[dict]:
    """Per rank, the median of each figure over the repeats."""
    return [
        {k: statistics.median(r[rank][k] for r in runs) for k in runs[0][rank]}
        for rank in range(len(runs[0]))
    ]


def main():
    args = parse_flags((Args,), description=__doc__)[0][0]
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    if (free := shutil.disk_usage(work).free) < 2 * 600e6:
        sys.exit(
            f"error: {work} has {free / 1e9:.1f} GB free; the 1 GB corpus needs 0.6 GB (and room to spare)"
        )
    routes = args.routes.split(",")
    started = datetime.now(timezone.utc)
    corpora = {size: work / f"corpus_x{repeat}" for size, repeat in SIZES.items()}
    manifests = {
        size: prepare(path, SIZES[size], args.num_shards) for size, path in corpora.items()
    }
    results = {}
    try:
        for i in range(
            args.repeats
        ):  # interleaved: a slow spell of the shared host hits every config alike
            for size in SIZES:
                for route in routes:
                    per_rank = run(
                        args, corpora[size], route, work / f"run_{route}_{SIZES[size]}_{i}"
                    )
                    results.setdefault((size, route), []).append(per_rank)
                    r0 = per_rank[0]
                    print(
                        f"{size} {route} #{i}: ratio {r0['loader_to_step_ratio']:.0f}, "
                        f"wait {r0['data_wait_share']:.1%}, "
                        f"RSS+USS {(r0['rss_bytes'] + r0['workers_uss_bytes']) / MB:.0f} MiB",
                        flush=True,
                    )
    finally:
        if not args.keep_corpora:
            for path in corpora.values():
                shutil.rmtree(path, ignore_errors=True)

    lines = [
        "# Data routes of recipes/sharded_data.py: 10 MB vs 1 GB\n",
        f"Measured {started:%Y-%m-%d %H:%M} UTC on {describe_machine()}.",
        f"`python benchmarks/data_routes.py --repeats {args.repeats} --max_steps {args.max_steps} "
        f"--loader_benchmark_batches {args.loader_benchmark_batches}` under `flock /tmp/bench.lock`: DDP, "
        f"{args.num_processes} ranks, {args.mixed_precision}, batch 8 x 256, 2 loader workers per rank, "
        f"{args.num_shards} shards (4 per rank). Medians over {args.repeats} launches, per rank (rank 0 / 1). "
        "Memory: the rank's RSS plus its workers' USS (MiB), at the end of the run; growth: 1 GB minus 10 MB. "
        f"Goals: loader/step >= {GOALS['ratio']}, data wait < {GOALS['data_wait']:.0%}, "
        f"growth <= {GOALS['growth_mb']} MB.\n",
        "| corpus (text) | route | loader tokens/s | step tokens/s | loader/step | data wait "
        "| rank RSS + workers USS MiB "
        "| workers USS MiB | growth MiB | goals met |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    table = {key: medians(runs) for key, runs in results.items()}

    def total(r: dict) -> float:  # MiB
        return (r["rss_bytes"] + r["workers_uss_bytes"]) / MB

    def col(rows: list[dict], value, spec: str) -> str:  # "rank 0 / rank 1"
        return " / ".join(format(value(r), spec) for r in rows)

    for route in routes:
        for size in SIZES:
            rows, base = table[(size, route)], table[("10 MB", route)]
            growth = [total(r) - total(b) for r, b in zip(rows, base)]
            met = all(
                r["loader_to_step_ratio"] >= GOALS["ratio"]
                and r["data_wait_share"] < GOALS["data_wait"]
                for r in rows
            ) and all(g <= GOALS["growth_mb"] for g in growth)
            lines.append(
                " | ".join(
                    [
                        f"| {manifests[size]['text_bytes'] / 1e6:,.0f} MB",
                        route,
                        col(rows, lambda r: r["loader_tokens_per_second"], ",.0f"),
                        col(rows, lambda r: r["step_tokens_per_second"], ",.0f"),
                        col(rows, lambda r: r["loader_to_step_ratio"], ".0f"),
                        col(rows, lambda r: r["data_wait_share"], ".1%"),
                        col(rows, total, ".0f"),
                        col(rows, lambda r: r["workers_uss_bytes"] / MB, ".0f"),
                        " / ".join(f"{g:+.0f}" for g in growth) if size != "10 MB" else "-",
                        ("yes" if met else "NO") + " |",
                    ]
                )
            )
    lines.append(
        "\nEvery launch (rank 0 / 1: loader tokens/s; data wait; RSS + workers USS MiB):\n"
    )
    for (size, route), runs in results.items():
        lines.append(
            f"- {size} {route}: "
            + "; ".join(
                f"[{col(pr, lambda r: r['loader_tokens_per_second'], ',.0f')}; "
                f"{col(pr, lambda r: r['data_wait_share'], '.1%')}; {col(pr, total, '.0f')}]"
                for pr in runs
            )
        )
    text = "\n".join(lines) + "\n"
    print(text)
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(text)


if __name__ == "__main__":
    errors.run(main)  # a bad flag: one error line
