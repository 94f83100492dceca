"""Test helper: record, per rank, which elements the first training-mode dropout zeroed.

With this directory on PYTHONPATH, Python imports this module at start-up in every process of a
launch. If DROPOUT_MASK_DIR is set, `torch.nn.Dropout.forward` is wrapped: its first call in
training mode with p > 0 writes {DROPOUT_MASK_DIR}/rank{RANK}.json with a SHA-256 of the mask
(`output == 0`, as bytes), its shape and the share of zeros. Ranks that draw dropout from one RNG
stream write the same hash; ranks with streams of their own write different ones.

Python imports only the first `sitecustomize` on the path, so this one then runs the next one
there too (e.g. tests/write_audit's): the two audits can share one launch.
"""

import hashlib
import importlib.machinery
import importlib.util
import json
import os
import sys

_DIR = os.environ.get("DROPOUT_MASK_DIR")

if _DIR:
    import torch

    _original = torch.nn.Dropout.forward
    _done = []

    def _forward(self, input):
        output = _original(self, input)
        if self.training and self.p > 0 and not _done:
            _done.append(True)
            mask = (output.detach() == 0).cpu().contiguous()
            record = {
                "rank": os.environ.get("RANK"),
                "shape": list(mask.shape),
                "zero_share": mask.float().mean().item(),
                "hash": hashlib.sha256(mask.numpy().tobytes()).hexdigest(),
            }
            os.makedirs(_DIR, exist_ok=True)
            with open(os.path.join(_DIR, f"rank{os.environ.get('RANK')}.json"), "w") as f:
                json.dump(record, f)
        return output

    torch.nn.Dropout.forward = _forward

_here = os.path.dirname(os.path.abspath(__file__))
_later = [p for p in sys.path if p and os.path.isdir(p) and not os.path.samefile(p, _here)]
if _spec := importlib.machinery.PathFinder.find_spec("sitecustomize", _later):
    _next = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_next)
