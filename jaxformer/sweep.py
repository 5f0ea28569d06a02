"""Hyperparameter sweeps on Optuna: every trial is a normal training run in a sub-workdir of its own.

A sweep file (`experiments/sweeps/NAME.py`) defines `get_sweep() -> Sweep`:

    Sweep(
        base="copy_task",                                    # experiments/copy_task.py
        space={"train.learning_rate": Range(1e-4, 3e-3, log=True), "model.dropout_rate": Choice(0.0, 0.1)},
        fixed={"train.steps": 300},                          # the same in every trial
        strategy="tpe", trials=12, metric="loss",            # eval loss, minimised
    )

    jaxformer sweep experiments/sweeps/NAME.py --workdir sweeps/NAME [--workers N] [--storage URL]

Optuna's storage holds the sweep: by default a SQLite file, workdir/sweep.db (embedded,
nothing to start), shared by the `--workers` processes of one machine; with a database URL
(`postgresql://user:password@host/db`) the same command on many machines works on one sweep.
Each trial trains in workdir/trial-NNN and reports its evaluations, so the pruner (median rule)
stops hopeless trials early. Re-running the command continues the sweep: finished trials are
kept, and a trial whose worker died is retried with its parameters in its own workdir, which
resumes from the trial's last checkpoint (Optuna's heartbeat notices the dead worker).

Results: workdir/results.csv and a table (best first), workdir/objective.png (objective against
each parameter) and workdir/loss_curves.png (the trials' eval loss against step).
"""

from __future__ import annotations

import csv
import dataclasses
import math
import os
import pathlib
import subprocess
import sys
import time
import typing
import warnings
from typing import Any, Literal

from jaxformer.config import Config, ConfigError, call_file, field_hint, load_experiment, require, with_values

EVAL_METRICS = {"loss": "minimize", "nll": "minimize", "perplexity": "minimize", "accuracy": "maximize"}


@dataclasses.dataclass(frozen=True)
class Choice:
    """One of the given values (any type the field takes)."""

    values: tuple

    def __init__(self, *values):
        object.__setattr__(self, "values", tuple(values))


@dataclasses.dataclass(frozen=True)
class Range:
    """A number in [low, high], uniform or log-uniform; integers for an int field (`step` apart)."""

    low: float
    high: float
    log: bool = False
    step: int = 1


@dataclasses.dataclass(frozen=True)
class Sweep:
    base: str  # experiment name (experiments/NAME.py) or a path to one
    space: dict[str, Choice | Range]
    fixed: dict[str, Any] = dataclasses.field(default_factory=dict)
    strategy: Literal["grid", "random", "tpe"] = "tpe"
    trials: int = 10
    metric: str = "loss"  # an eval metric training reports: loss, nll, perplexity, accuracy
    direction: Literal["minimize", "maximize"] | None = None  # None: the metric's natural one
    prune: bool = True  # median pruner over the evaluations reported during training
    seed: int = 0
    heartbeat: int = 10  # seconds; a trial whose worker has been silent 3 heartbeats is retried

    @property
    def goal(self) -> str:
        return self.direction or EVAL_METRICS[self.metric]


def _numeric(hint) -> type | None:
    """int or float if the field holds a number (possibly Optional), else None."""
    args = [h for h in typing.get_args(hint) if h is not type(None)] or [hint]
    return next((h for h in args if h in (int, float)), None)


def check(sweep: Sweep, base: Config) -> None:
    """Every mistake a sweep file can make, named, before any trial starts."""
    require(sweep.space, "space", "is empty: name at least one field to search over")
    require(sweep.trials >= 1, "trials", f"must be >= 1, got {sweep.trials}")
    require(sweep.heartbeat >= 1, "heartbeat", f"must be >= 1 second, got {sweep.heartbeat}")
    require(sweep.strategy in ("grid", "random", "tpe"), "strategy", f"{sweep.strategy!r} is not grid, random or tpe")
    require(
        sweep.metric in EVAL_METRICS,
        "metric",
        f"{sweep.metric!r} is not reported by training's evaluation (it reports {', '.join(EVAL_METRICS)})",
    )
    fixed = with_values(base, sweep.fixed)
    for name, dist in sweep.space.items():
        hint = field_hint(name)  # unknown section or field: ConfigError naming it
        require(name not in sweep.fixed, name, "is both searched (space) and fixed")
        if isinstance(dist, Choice):
            require(len(dist.values) > 0, name, "Choice() of no values")
            for v in dist.values:
                with_values(fixed, {name: v})  # a value the field cannot hold: ConfigError naming it
        elif isinstance(dist, Range):
            number = _numeric(hint)
            require(number is not None, name, f"Range() over a non-numeric field (type {hint})")
            require(dist.low < dist.high, name, f"empty range: low={dist.low} is not below high={dist.high}")
            require(not dist.log or dist.low > 0, name, f"a log range needs low > 0, got {dist.low}")
            require(sweep.strategy != "grid", name, "grid search needs Choice() values for every field, not Range()")
            for v in (dist.low, dist.high):
                with_values(fixed, {name: number(v)})
        else:
            raise ConfigError(f"{name}: {dist!r} is neither Choice(...) nor Range(...)")


def load(path: str | pathlib.Path) -> tuple[Sweep, Config]:
    """The sweep of a sweep file and its (fixed-overridden) base config, checked."""
    sweep = call_file(path, "get_sweep", "sweep")
    require(isinstance(sweep, Sweep), "get_sweep()", f"returned {type(sweep).__name__}, not jaxformer.sweep.Sweep")
    base_path = pathlib.Path(sweep.base)
    if not base_path.suffix:  # a name: the experiments/ directory next to experiments/sweeps/
        base_path = pathlib.Path(path).resolve().parent.parent / f"{sweep.base}.py"
    base = load_experiment(str(base_path))
    check(sweep, base)
    return sweep, with_values(base, sweep.fixed)


def _suggest(trial, name: str, dist):
    if isinstance(dist, Choice):
        index = trial.suggest_categorical(name, list(range(len(dist.values))))
        return dist.values[index]  # by index: Optuna stores only None/bool/int/float/str choices
    if _numeric(field_hint(name)) is int:
        return trial.suggest_int(name, int(dist.low), int(dist.high), step=dist.step, log=dist.log)
    return trial.suggest_float(name, dist.low, dist.high, log=dist.log)


def _values(sweep: Sweep, params: dict) -> dict:
    """Optuna's stored params -> config values (choices are stored by index)."""
    return {k: sweep.space[k].values[v] if isinstance(sweep.space[k], Choice) else v for k, v in params.items()}


def storage_url(workdir: pathlib.Path, storage: str | None) -> str:
    return storage or f"sqlite:///{workdir.resolve() / 'sweep.db'}"


def open_study(sweep: Sweep, name: str, url: str, create: bool = False, worker: tuple = ()):
    """The sweep's Optuna study, created if new. Each worker and each resumption samples with its
    own seed, drawn from (sweep.seed, trials so far, `worker`): workers started together, or a
    sweep started again, would otherwise propose the same parameters."""
    import numpy as np
    import optuna

    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)  # the heartbeat
    storage = optuna.storages.RDBStorage(
        url,
        engine_kwargs={"connect_args": {"timeout": 60}} if url.startswith("sqlite") else None,
        heartbeat_interval=sweep.heartbeat,
        grace_period=3 * sweep.heartbeat,
        heartbeat_stale_trial_callback=optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry=3),
    )
    pruner = optuna.pruners.MedianPruner(n_startup_trials=2) if sweep.prune else optuna.pruners.NopPruner()
    study = optuna.create_study(
        storage=storage, study_name=name, pruner=pruner, direction=sweep.goal, load_if_exists=True
    )
    so_far = len(study.get_trials(deepcopy=False))
    seed = int(np.random.SeedSequence([sweep.seed, so_far, *worker]).generate_state(1)[0])
    if sweep.strategy == "grid":
        grid = {k: list(range(len(d.values))) for k, d in sweep.space.items()}
        study.sampler = optuna.samplers.GridSampler(grid, seed=seed)
    elif sweep.strategy == "random":
        study.sampler = optuna.samplers.RandomSampler(seed=seed)
    else:
        startup = max(2, min(10, sweep.trials // 3))  # random trials before TPE models the results
        study.sampler = optuna.samplers.TPESampler(seed=seed, n_startup_trials=startup)
    described = repr({k: sweep.space[k] for k in sorted(sweep.space)}) + repr(sorted(sweep.fixed.items()))
    if create:
        if study.user_attrs.get("definition", described) != described:
            raise ConfigError(f"{url} holds sweep {name!r} with another space or fixed values: use a new --workdir")
        study.set_user_attr("definition", described)
    return study


def work(sweep: Sweep, base: Config, workdir: pathlib.Path, url: str, name: str, worker: int = 0, shared=False):
    """Run trials until the sweep has its `trials` finished (complete or pruned) ones. `worker`
    numbers this machine's processes; a `shared` storage may have workers on other machines too."""
    import optuna

    from jaxformer.observe import curve, read_metrics
    from jaxformer.train import fit

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = open_study(sweep, name, url, worker=(worker, os.getpid()) if shared else (worker,))
    tag = f"[worker {worker}] " if worker else ""
    finished = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)

    def objective(trial) -> float:
        values = {k: _suggest(trial, k, d) for k, d in sweep.space.items()}
        # A retried trial inherits the user attributes, so it trains on in the dead trial's workdir.
        trial_dir = workdir / trial.user_attrs.get("workdir", f"trial-{trial.number:03d}")
        trial.set_user_attr("workdir", trial_dir.name)
        shown = ", ".join(f"{k}={v}" for k, v in values.items())
        print(f"{tag}trial {trial.number} ({trial_dir.name}): {shown}", flush=True)

        def on_eval(step: int, metrics: dict) -> bool:
            trial.report(metrics[sweep.metric], step)
            return trial.should_prune()

        result = fit(with_values(base, values), trial_dir, quiet=True, on_eval=on_eval)
        value = result["eval"].get(sweep.metric)
        if value is None:  # its worker died after the last step: the log holds the last evaluation
            value = curve(read_metrics(trial_dir), "eval", sweep.metric)[1][-1]
        if result["stopped"]:
            print(f"{tag}trial {trial.number}: pruned ({sweep.metric} {value:.4g})", flush=True)
            raise optuna.TrialPruned()
        print(f"{tag}trial {trial.number}: {sweep.metric} {value:.4g}", flush=True)
        return value

    def enough(study, _trial) -> None:  # finished plus running elsewhere: no new trial past the budget
        states = (*finished, optuna.trial.TrialState.RUNNING)
        if len(study.get_trials(deepcopy=False, states=states)) >= sweep.trials:
            study.stop()

    if len(study.get_trials(deepcopy=False, states=finished)) < sweep.trials:
        study.optimize(objective, n_trials=sweep.trials, callbacks=[enough], catch=(FloatingPointError,))


def run(path: str, workdir: str, workers: int = 1, storage: str | None = None, worker: int | None = None) -> list:
    """`jaxformer sweep`: check the sweep, run it with `workers` processes, report the results.
    (`worker=i`: be worker i of a multi-process sweep: run trials, report nothing.)"""
    if workers < 1:
        raise ConfigError(f"--workers: must be >= 1, got {workers}")
    sweep, base = load(path)
    root = pathlib.Path(workdir)
    root.mkdir(parents=True, exist_ok=True)
    url, name = storage_url(root, storage), pathlib.Path(path).stem
    if worker is not None:
        work(sweep, base, root, url, name, worker, shared=True)
        return []
    study = open_study(sweep, name, url, create=True)  # created once, before workers race to
    retry_dead_trials(study, sweep)
    start = time.perf_counter()
    if workers == 1:
        work(sweep, base, root, url, name, shared=storage is not None)
    else:
        cmd = [sys.executable, "-m", "jaxformer.cli", "sweep", str(path), "--workdir", str(root), "--storage", url]
        procs = [subprocess.Popen([*cmd, "--worker", str(i)]) for i in range(1, workers + 1)]
        codes = [p.wait() for p in procs]
        if any(codes):
            raise SystemExit(f"error: sweep workers exited with {codes}; rerun the command to continue")
    rows = results(sweep, name, url, root)
    print(f"\n{len(rows)} trials in {root} ({time.perf_counter() - start:.0f} s this run), best first:")
    print_table(rows, sweep)
    print(f"results: {root / 'results.csv'}, plots: {root / 'objective.png'}, {root / 'loss_curves.png'}")
    return rows


def retry_dead_trials(study, sweep: Sweep) -> None:
    """Trials left running by an interrupted sweep: wait (at most the grace period) until Optuna's
    heartbeat tells dead ones, whose workers stopped beating, from live ones on other machines;
    the dead ones are failed and queued again with their parameters (and their workdirs)."""
    import optuna

    running = lambda: study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,))
    if not running():
        return
    print(f"{len(running())} trial(s) marked running: waiting up to {3 * sweep.heartbeat} s to retry dead ones")
    deadline = time.monotonic() + 3 * sweep.heartbeat + 2
    while running() and time.monotonic() < deadline:
        time.sleep(1)
        optuna.storages.fail_stale_trials(study)


def results(sweep: Sweep, name: str, url: str, root: pathlib.Path) -> list[dict]:
    """One row per trial, best first (complete by objective, then pruned, then failed); also
    written to root/results.csv and drawn to root/objective.png and root/loss_curves.png."""
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
    with (root / "results.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, columns)
        writer.writeheader()
        writer.writerows(rows)
    plot(rows, sweep, root)
    return rows


def print_table(rows: list[dict], sweep: Sweep) -> None:
    columns = ["trial", "state", sweep.metric, *sweep.space, "steps", "workdir"]
    fmt = lambda v: f"{v:.4g}" if isinstance(v, float) else str(v)
    cells = [[fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)))
    for row in cells:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)))


def plot(rows: list[dict], sweep: Sweep, root: pathlib.Path) -> None:
    """objective.png: the objective against each parameter (complete trials filled, pruned hollow);
    loss_curves.png: each trial's eval loss against step."""
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
        ax.legend()
    fig.tight_layout()
    fig.savefig(root / "objective.png", dpi=100)
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
    fig.savefig(root / "loss_curves.png", dpi=100)
    plt.close(fig)
