"""tools/prepare_shards.py on several machines: a SLURM job array tokenizes, one task writes the shards.

    python slurm/prepare_shards.py --tasks 16 --partition cpu --output_dir shards \
        --train_file corpus.jsonl --num_shards 64 --num_proc 8
    python slurm/prepare_shards.py --local --tasks 2 --output_dir shards --train_file corpus.jsonl

Run from the repository on a machine that can call sbatch, with the flags of
tools/prepare_shards.py. datatrove's SlurmPipelineExecutor submits two jobs: an array of --tasks
tasks, task r tokenizing the r-th contiguous part of the training rows on --num_proc cores
(common/data.py's tokenize_rows) into <output_dir>/.parts/, then, once all have succeeded, one
task that packs the parts in order and writes the shards and manifest.json as
tools/prepare_shards.py does: byte for byte the shards one process writes. The output folder must
be on a filesystem every node sees. datatrove records finished tasks in <output_dir>/.datatrove/:
the same command after a failure runs only the unfinished ones. --local runs the same tasks here, one after another.
"""

import sys
from dataclasses import dataclass
from functools import partial
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run from anywhere, no install
from common import errors  # noqa: E402
from common.args import flag, make_output_dir, parse_flags  # noqa: E402
from common.errors import Stop  # noqa: E402
from tools.prepare_shards import Args, merge_parts, text_and_tokenizer, tokenize_part  # noqa: E402


@dataclass
class Cluster:
    tasks: int = flag(2, "SLURM tasks that tokenize, a part of the rows each", low=1)
    partition: str = flag(None, "SLURM partition")
    time: str = flag("24:00:00", "SLURM time limit of each task")
    mem_per_cpu: str = flag("2G", "SLURM --mem-per-cpu of each task")
    local: bool = flag(False, "run the tasks on this machine (datatrove's LocalPipelineExecutor)")


def main() -> int:
    from datatrove.executor import LocalPipelineExecutor, SlurmPipelineExecutor

    class Slurm(SlurmPipelineExecutor):
        def launch_merge_stats(self):
            """No job that merges datatrove's own statistics (unused here): it asks for 1 GB per
            CPU whatever --mem_per_cpu says, which a cluster that declares no memory refuses."""

    (args, cluster), _ = parse_flags((Args, Cluster), sys.argv[1:], description=__doc__)
    if not args.output_dir or not (cluster.local or cluster.partition):
        raise Stop("slurm/prepare_shards.py needs --output_dir and --partition (or --local)")
    out = Path(args.output_dir).resolve()
    if (out / "manifest.json").exists() and not args.overwrite_output_dir:
        raise Stop(f"{out / 'manifest.json'} exists; pass --overwrite_output_dir to replace it")
    make_output_dir(str(out / ".parts"))
    args.output_dir = str(out)
    if not args.tokenizer_name_or_path:  # one BPE, trained here, for every task
        tokenizer_dir = out / ".parts" / "tokenizer"
        text_and_tokenizer(args)[1].save_pretrained(tokenizer_dir)
        args.tokenizer_name_or_path = str(tokenizer_dir)
    tokenize, merge = [partial(tokenize_part, args)], [partial(merge_parts, args, cluster.tasks)]
    logs = out / ".datatrove"
    if cluster.local:
        first = LocalPipelineExecutor(
            tokenize, cluster.tasks, workers=1, logging_dir=str(logs / "tokenize")
        )
        LocalPipelineExecutor(merge, 1, logging_dir=str(logs / "merge"), depends=first).run()
        return 0
    settings = {
        "time": cluster.time,
        "partition": cluster.partition,
        "cpus_per_task": args.num_proc,
        "sbatch_args": {"mem-per-cpu": cluster.mem_per_cpu},
        "qos": None,  # (datatrove's default asks for a QOS "normal" a site may not have)
        # this Python's environment on every node: its venv's bin first, the repository importable
        "env_command": f"cd {REPO} && export PATH={Path(sys.executable).parent}:$PATH "
        f"PYTHONPATH={REPO}",
        "slurm_logs_folder": str(logs / "slurm"),
    }
    first = Slurm(
        tokenize,
        cluster.tasks,
        job_name="prepare-tokenize",
        logging_dir=str(logs / "tokenize"),
        **settings,
    )
    Slurm(
        merge,
        1,
        job_name="prepare-merge",
        depends=first,
        logging_dir=str(logs / "merge"),
        **settings,
    ).run()
    return 0


if __name__ == "__main__":
    errors.run(main)
