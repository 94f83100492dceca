"""Test helper: with this folder on PYTHONPATH, every process of a launch runs `collective_guard.install()`.

tests/conftest.py's `launch` puts this folder first on PYTHONPATH, so every launched test fails
when project code hands a collective a tensor left on the host (see collective_guard.py).
With HOST_READS_DIR set it also logs every read of a tensor's value (host_reads.py); with
EXIT_STATUS_DIR set, each rank's exit status (the argument of its sys.exit).
Python imports only the first `sitecustomize` on the path, so this one then runs the next one
there too (e.g. tests/dropout_masks's, which runs tests/write_audit's). Those chain to the first
other `sitecustomize` on the path, which can be this one again: then it runs the first one whose
module code is not already running (found on the stack), and installs nothing twice.
"""

import atexit
import gc
import importlib.machinery
import importlib.util
import os
import sys

# Registered first, so it runs last at exit (the launcher's too): skip the final garbage collection
# over torch's objects, ~0.5 s per process, as common/launch.py does in the recipes' own processes.
atexit.register(gc.freeze)

if "collective_guard" not in sys.modules:
    # It imports torch and Accelerate before the recipe does: without garbage collection, frozen
    # after, as the recipes' own imports (common/launch.py's imports_done). Nothing to collect
    # first: this runs at interpreter start-up.
    gc.disable()
    try:
        import collective_guard
    finally:
        gc.freeze()
        gc.enable()

    collective_guard.install()
    if os.environ.get(
        "HOST_READS_DIR"
    ):  # log reads of tensor values (host_reads.py), for the sync tests
        import host_reads

        host_reads.install(os.environ["HOST_READS_DIR"])
    if os.environ.get("EXIT_STATUS_DIR") and "RANK" in os.environ:
        # a rank's exit status, which torchrun does not report when it stops its ranks on a signal: the
        # recipes leave through common/errors.run's sys.exit(status); written to {EXIT_STATUS_DIR}/rank{RANK}
        _sys_exit = sys.exit

        def _recorded_exit(status=None):
            with open(
                os.path.join(os.environ["EXIT_STATUS_DIR"], f"rank{os.environ['RANK']}"), "w"
            ) as f:
                f.write(str(status))
            _sys_exit(status)

        sys.exit = _recorded_exit

_running, _frame = set(), sys._getframe()
while _frame is not None:
    if os.path.basename(_frame.f_code.co_filename) == "sitecustomize.py":
        _running.add(os.path.realpath(os.path.dirname(_frame.f_code.co_filename)))
    _frame = _frame.f_back
_later = [p for p in sys.path if p and os.path.isdir(p) and os.path.realpath(p) not in _running]
if _spec := importlib.machinery.PathFinder.find_spec("sitecustomize", _later):
    _next = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_next)
