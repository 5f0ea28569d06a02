"""The figures of docs/guides/figures.md, drawn by the code from committed records.

    python scripts/make_figures.py

docs/figures/lm_shakespeare.metrics.jsonl is the metrics log of a recorded run of the demo experiment
(the date, machine and command are on the figures page); `jaxformer plot`'s own function
(`observe.plot_run`) draws it to docs/figures/lm_shakespeare_curves.png, as it draws any run's
`curves.png`. Rerun this after changing the plot or recording a new run, and commit both files.
"""

import os
import pathlib
import shutil
import tempfile

from jaxformer import observe

ROOT = pathlib.Path(__file__).resolve().parent.parent
FIGURES = ROOT / "docs" / "figures"


def demo_curves() -> pathlib.Path:
    """The demo run's loss, accuracy and learning rate against step."""
    out = FIGURES / "lm_shakespeare_curves.png"
    with tempfile.TemporaryDirectory() as tmp:
        workdir = pathlib.Path(tmp) / "runs" / "lm_shakespeare"  # the plot's title: the demo's workdir
        workdir.mkdir(parents=True)
        shutil.copy(FIGURES / "lm_shakespeare.metrics.jsonl", workdir / "metrics.jsonl")
        cwd = os.getcwd()
        os.chdir(tmp)
        try:
            observe.plot_run(pathlib.Path("runs") / "lm_shakespeare", out)
        finally:
            os.chdir(cwd)
    return out


if __name__ == "__main__":
    for path in (demo_curves(),):
        print(f"{path.relative_to(ROOT)}: {path.stat().st_size / 1024:.0f} KB")
