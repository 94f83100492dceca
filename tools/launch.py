"""Shorthand for `accelerate launch --config_file accelerate_configs/CONFIG.yaml RECIPE [ARGS]`.

    python tools/launch.py fsdp recipes/llama.py [ARGS]

Checks the config name first and lists the configs there are.
"""

import os
import sys
from pathlib import Path

if __name__ == "__main__":
    configs = Path(__file__).resolve().parent.parent / "accelerate_configs"
    names = ", ".join(sorted(p.stem for p in configs.glob("*.yaml")))
    usage = "usage: python tools/launch.py CONFIG RECIPE [ARGS...]"
    if sys.argv[1:2] in (["-h"], ["--help"]):
        print(
            f"{usage}\n\nRuns `accelerate launch --config_file accelerate_configs/CONFIG.yaml RECIPE "
            f"[ARGS...]` once the config exists. CONFIG: a .yaml path or one of {names}. The "
            "recipe's own flags: RECIPE --help."
        )
        sys.exit(0)
    if len(sys.argv) < 3:
        sys.exit(usage)
    name = sys.argv[1]
    path = Path(name) if name.endswith(".yaml") else configs / f"{name}.yaml"
    if not path.is_file():
        sys.exit(f"error: accelerate config {path} not found; available: {names}")
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(path)]
    os.execvp(sys.executable, [*launch, *sys.argv[2:]])
