"""Compare the per-step metrics of runs of recipes/llama.py with a reference run.

    python tests/scripts/compare_runs.py [--rtol R] REFERENCE_DIR RUN_DIR [RUN_DIR ...]

Prints, per run, the worst relative gap over the shared logged steps of `loss`, `grad_norm` and
`eval_loss` (|run - ref| / |ref|), and the worst absolute gap of `lr`. Exits 1 when a run has a
relative gap above R (default 5e-6, the fp32 bound; 2.5e-2 for bf16 runs), an LR off by more than
1e-9, or cannot be read. tests/test_parity.py uses `worst_gaps` for its assertions; the README's
"check it by hand" commands use this printout.
"""

import json
import sys
from pathlib import Path

KEYS = ("loss", "grad_norm", "eval_loss")
FP32_RTOL, LR_ATOL = (
    5e-6,
    1e-9,
)  # one bound for every key; tests/test_parity.py asserts tighter ones per key


def read_steps(output_dir):
    """Per-step records of `{output_dir}/metrics.jsonl`, keyed by step (the summary line left out).

    Raises:
        FileNotFoundError: no metrics.jsonl in `output_dir`.
    """
    path = Path(output_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no metrics.jsonl (did the run finish?)")
    records = (json.loads(line) for line in path.open())
    return {r["step"]: r for r in records if not r.get("summary")}


def worst_gaps(run_dir, ref_dir):
    """Worst gaps of a run against the reference over the steps both logged.

    Returns:
        dict: `loss`, `grad_norm`, `eval_loss` (relative, dimensionless; None if never logged by
        both), `lr` (absolute), `steps` (how many steps were compared).

    Raises:
        ValueError: the two runs share no logged step.
    """
    run, ref = read_steps(run_dir), read_steps(ref_dir)
    steps = sorted(run.keys() & ref.keys())
    if not steps:
        raise ValueError(f"{run_dir} and {ref_dir} have no logged step in common")
    gaps = {"steps": len(steps), "lr": max(abs(run[s]["lr"] - ref[s]["lr"]) for s in steps)}
    for key in KEYS:
        pairs = [
            (run[s][key], ref[s][key])
            for s in steps
            if run[s].get(key) is not None and ref[s].get(key)
        ]
        gaps[key] = max((abs(a - b) / abs(b) for a, b in pairs), default=None)
    return gaps


if __name__ == "__main__":
    argv, rtol = sys.argv[1:], FP32_RTOL
    if argv[:1] == ["--rtol"] and len(argv) > 1:
        try:
            rtol = float(argv[1])
        except ValueError:
            sys.exit(f"error: --rtol takes a number, got {argv[1]!r}")
        argv = argv[2:]
    if len(argv) < 2:
        sys.exit(__doc__.split("\n\n")[1])
    reference, *runs = argv
    print(
        f"worst gap vs {reference} over the logged steps (bound: {rtol:.0e} relative, LR {LR_ATOL:.0e})"
    )
    print(f"{'run':<32} {'steps':>5} {'loss':>9} {'grad_norm':>9} {'eval_loss':>9} {'lr (abs)':>9}")
    fmt = lambda x: "-" if x is None else f"{x:.1e}"  # noqa: E731
    failed = False
    for run_dir in runs:
        try:
            g = worst_gaps(run_dir, reference)
        except (FileNotFoundError, ValueError) as err:  # report it, and go on with the other runs
            print(f"{run_dir:<32} error: {err}")
            failed = True
            continue
        over = [k for k in KEYS if g[k] is not None and g[k] > rtol] + ["lr"] * (g["lr"] > LR_ATOL)
        print(
            f"{run_dir:<32} {g['steps']:>5} {fmt(g['loss']):>9} {fmt(g['grad_norm']):>9} "
            f"{fmt(g['eval_loss']):>9} {fmt(g['lr']):>9}"
            + (f"  OVER: {', '.join(over)}" if over else "")
        )
        failed |= bool(over)
    sys.exit(1 if failed else 0)
