"""Every recipe's one way out: a refusal raises `Stop`, and `run(main)` turns it into an exit.

A recipe is `def main() -> int`, started as `errors.run(main)`:
- `raise Stop("one line")` anywhere (recipe or `common/`): printed as `error: one line` by the rank
  that raises it, exit status 1. The recipes check the same facts on every rank, so every rank
  prints its own line and none waits for a peer that has left;
- `return 0`, or `checkpoint.PREEMPTED_EXIT_CODE` after a preemption checkpoint;
- any other exception is a bug: its traceback prints as usual.

`warn("one line")` is the one way to warn: `warning: one line` on stderr, printed by the job's
global rank 0 only (the recipes check the same facts on every rank).

Under torchrun (`accelerate launch`) a `Stop` or an uncaught exception is also written to the
rank's `TORCHELASTIC_ERROR_FILE`, in the format torch's `ProcessFailure` reads, so the failure
summary that ends the launcher's output names the error instead of a link to the docs (torch's
`@record` does the same for exceptions only). The `error:` line reaches stderr in one write: two
ranks stopping at once would otherwise splice their lines.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Callable, NoReturn


class Stop(ValueError):
    """A one-line reason to stop: a bad flag, file or config at start-up, or a fatal step. Lines after
    the first, if any, are further `error: ...` lines."""


def _report(message: str) -> None:
    """Write `message` to torchrun's error file for this rank, if there is one."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    try:
        with open(path, "w") as f:
            json.dump({"message": message, "timestamp": int(time.time())}, f)
    except OSError:
        pass  # the summary then says less; the rank's own output still has the error


def warn(message: str) -> None:
    """Print `warning: message` on stderr once per job: on global rank 0 (`RANK`, or no launcher)."""
    if os.environ.get("RANK", "0") == "0":
        sys.stderr.write(f"warning: {message}\n")
        sys.stderr.flush()


def run(main: Callable[[], int | None]) -> NoReturn:
    """Call `main()` and exit with its status; a `Stop` exits 1 with its `error:` line."""
    try:
        status = main()
    except Stop as err:
        message = f"error: {err}"
        _report(message)
        sys.stdout.flush()
        sys.stderr.flush()
        os.write(2, f"{message}\n".encode())
        status = 1
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as err:
        _report(f"{type(err).__name__}: {err}")  # the traceback itself goes to stderr, as always
        raise
    sys.exit(status or 0)
