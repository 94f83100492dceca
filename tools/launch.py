"""Shorthand for `accelerate launch --config_file accelerate_configs/CONFIG.yaml RECIPE [ARGS]`.

    python tools/launch.py fsdp recipes/llama.py [ARGS]

Checks the config name first and lists the configs there are.
"""

import argparse
import os
import sys
from pathlib import Path

if __name__ == "__main__":
    configs = Path(__file__).resolve().parent.parent / "accelerate_configs"
    names = ", ".join(sorted(p.stem for p in configs.glob("*.yaml")))
    parser = argparse.ArgumentParser(
        prog="python tools/launch.py",
        description="Runs `accelerate launch --config_file accelerate_configs/CONFIG.yaml RECIPE "
        "[ARGS...]` once the config exists. The recipe's own flags: RECIPE --help.",
    )
    parser.add_argument("config", metavar="CONFIG", help=f"a .yaml path or one of {names}")
    parser.add_argument("recipe", metavar="RECIPE [ARGS...]", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    if not args.recipe:
        sys.exit("error: give a RECIPE after CONFIG (python tools/launch.py ddp recipes/llama.py)")
    path = Path(args.config) if args.config.endswith(".yaml") else configs / f"{args.config}.yaml"
    if not path.is_file():
        sys.exit(f"error: accelerate config {path} not found; available: {names}")
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(path)]
    os.execvp(sys.executable, [*launch, *args.recipe])
