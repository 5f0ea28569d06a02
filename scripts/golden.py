"""What the golden-file scripts share (`make_moe_golden.py`, `make_peft_golden.py`): a PyTorch model's
float32 logits on fixed inputs, those logits against the ones jaxformer saved beside a checkpoint it
wrote, and the command line (`SCRIPT [NAMES...]` makes the golden files, `SCRIPT export OUT` writes
jaxformer's checkpoints, `SCRIPT check OUT` has the reference library read them back).
"""

from __future__ import annotations

import pathlib
import sys
from collections.abc import Callable

import numpy as np

TOLERANCE = 1e-4  # |logits - jaxformer's| max that a `check` accepts: float32 on both sides


def torch_logits(model, inputs: dict) -> np.ndarray:
    """A transformers (or peft) model's float32 logits on numpy ids, without gradients."""
    import torch

    with torch.no_grad():
        return model(**{k: torch.from_numpy(v).long() for k, v in inputs.items()}).logits.float().numpy()


def against_saved(model, ref) -> tuple[np.ndarray, float]:
    """The model's logits on the inputs `ref` (a `logits.npz` that `export` wrote) holds, and their
    largest difference from the logits jaxformer saved there."""
    logits = torch_logits(model, {k: ref[k] for k in ref.files if k != "logits"})
    return logits, float(np.abs(logits - ref["logits"]).max())


def main(make: Callable[[list[str]], None], export: Callable[[pathlib.Path], None],
         check: Callable[[pathlib.Path], None]) -> None:  # fmt: skip
    """`export OUT` and `check OUT` go to `export` and `check`; any other arguments (names) to `make`."""
    args = sys.argv[1:]
    if args[:1] == ["export"]:
        export(pathlib.Path(args[1]))
    elif args[:1] == ["check"]:
        check(pathlib.Path(args[1]))
    else:
        make(args)
