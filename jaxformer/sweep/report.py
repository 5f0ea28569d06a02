"""A sweep's results: one row per trial, best first, written to results.csv, printed as a table and drawn
to objective.png and loss_curves.png."""

from __future__ import annotations

import contextlib
import csv
import math
import os
import pathlib

from jaxformer.sweep.spec import Range, Sweep
from jaxformer.sweep.study import _values, open_study


def results(sweep: Sweep, name: str, url: str, root: pathlib.Path) -> list[dict]:
    """One row per trial, best first (complete by objective, then pruned, then failed); also
    written to root/results.csv and drawn to root/objective.png and root/loss_curves.png.

    Args:
        sweep: the sweep.
        name: the study's name.
        url: the storage URL.
        root: the sweep's directory.

    Returns:
        The rows.
    """
    study = open_study(sweep, name, url)
    rank = {"COMPLETE": 0, "PRUNED": 1, "RUNNING": 2, "WAITING": 2, "FAIL": 3}
    sign = 1 if sweep.goal == "minimize" else -1
    rows = []
    for t in study.get_trials(deepcopy=False):
        last = t.intermediate_values[max(t.intermediate_values)] if t.intermediate_values else None
        value = t.value if t.value is not None else last
        rows.append({
            "trial": t.number, "state": t.state.name, sweep.metric: value, **_values(sweep, t.params),
            "steps": max(t.intermediate_values, default=0), "workdir": t.user_attrs.get("workdir", ""),
            "seconds": round(t.duration.total_seconds()) if t.duration else None,
        })  # fmt: skip
    key = lambda r: (rank[r["state"]], sign * r[sweep.metric] if r[sweep.metric] is not None else math.inf)
    rows.sort(key=key)
    columns = ["trial", "state", sweep.metric, *sweep.space, "steps", "seconds", "workdir"]
    with _replacing(root / "results.csv") as tmp, tmp.open("w", newline="") as f:
        writer = csv.DictWriter(f, columns)
        writer.writeheader()
        writer.writerows(rows)
    plot(rows, sweep, root)
    return rows


@contextlib.contextmanager
def _replacing(path: pathlib.Path):
    """A temporary path that replaces `path` at once when the block ends: the commands of a sweep
    on several machines all write the results when it ends, and none may read a half-written file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def print_table(rows: list[dict], sweep: Sweep) -> None:
    """Print the results' rows as a table: trial, state, metric, the searched fields, steps, workdir.

    Args:
        rows: the rows of `results`.
        sweep: the sweep.
    """
    columns = ["trial", "state", sweep.metric, *sweep.space, "steps", "workdir"]
    fmt = lambda v: f"{v:.4g}" if isinstance(v, float) else str(v)
    cells = [[fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)))
    for row in cells:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)))


def plot(rows: list[dict], sweep: Sweep, root: pathlib.Path) -> None:
    """objective.png: the objective against each parameter (complete trials filled, pruned hollow);
    loss_curves.png: each trial's eval loss against step.

    Args:
        rows: the rows of `results`.
        sweep: the sweep.
        root: the directory to write the PNGs to.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from jaxformer.observe import curve, read_metrics

    names = list(sweep.space)
    fig, axes = plt.subplots(1, len(names), figsize=(4.5 * len(names), 3.8), squeeze=False)
    for ax, name in zip(axes[0], names, strict=True):
        for state, style in (("COMPLETE", {"color": "C0"}), ("PRUNED", {"facecolors": "none", "edgecolors": "C1"})):
            pts = [(r[name], r[sweep.metric]) for r in rows if r["state"] == state and r.get(name) is not None
                   and r[sweep.metric] is not None]  # fmt: skip
            if pts:
                xs = [x if isinstance(x, (int, float)) and not isinstance(x, bool) else str(x) for x, _ in pts]
                ax.scatter(xs, [y for _, y in pts], label=state.lower(), **style)
        dist = sweep.space[name]
        if isinstance(dist, Range) and dist.log:
            ax.set_xscale("log")
        ax.set(xlabel=name, ylabel=f"eval {sweep.metric}")
        if ax.collections:
            ax.legend()
    fig.tight_layout()
    with _replacing(root / "objective.png") as tmp:
        fig.savefig(tmp, dpi=100, format="png")
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in rows:
        path = root / r["workdir"]
        if r["workdir"] and (path / "metrics.jsonl").is_file():
            ax.plot(*curve(read_metrics(path), "eval", "loss"), marker=".", label=f"trial {r['trial']} ({r['state']})")
    ax.set(xlabel="step", ylabel="eval loss", yscale="log", title=f"{root.name}: eval loss of each trial")
    if ax.lines:
        ax.legend(fontsize="small")
    fig.tight_layout()
    with _replacing(root / "loss_curves.png") as tmp:
        fig.savefig(tmp, dpi=100, format="png")
    plt.close(fig)
