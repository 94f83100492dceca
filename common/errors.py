"""Every recipe's one way out: `errors.run(main)` runs `def main() -> int`.

- `raise Stop("one line")` anywhere: the rank prints `error: one line` (in one write, so that two
  ranks do not splice their lines) and exits 1; every rank checks the same facts, so none waits;
- `warn("one line")`: `warning: one line` on stderr, once per job (global rank 0);
- any other exception is a bug: its traceback prints as usual.
A `Stop` or an exception also goes to torchrun's `TORCHELASTIC_ERROR_FILE`, which the launcher's
failure summary then names.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Callable, NoReturn


class Stop(ValueError):
    """A one-line reason to stop; further lines are further `error: ...` lines."""


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
