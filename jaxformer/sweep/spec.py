"""What a sweep file says (`Sweep`, `Choice`, `Range`), read (`load`) and checked (`check`) before any
trial starts."""

from __future__ import annotations

import dataclasses
import pathlib
import typing
from typing import Any, Literal

from jaxformer.config import (
    Config,
    ConfigError,
    call_file,
    field_hint,
    load_experiment,
    parse_overrides,
    require,
    with_values,
)
from jaxformer.config.base import require_seed

EVAL_METRICS = {"loss": "minimize", "nll": "minimize", "perplexity": "minimize", "accuracy": "maximize"}


@dataclasses.dataclass(frozen=True)
class Choice:
    """One of the given values (any type the field takes).

    Args:
        *values (object): the values.
    """

    values: tuple

    def __init__(self, *values):
        object.__setattr__(self, "values", tuple(values))


@dataclasses.dataclass(frozen=True)
class Range:
    """A number in [low, high], uniform or log-uniform; integers for an int field (`step` apart).

    Attributes:
        low: the lowest value.
        high: the highest value.
        log: log-uniform.
        step: the spacing of an int field's values.
    """

    low: float
    high: float
    log: bool = False
    step: int = 1


@dataclasses.dataclass(frozen=True)
class Sweep:
    """A hyperparameter search over an experiment: what `get_sweep()` of a sweep file returns.

    Attributes:
        base: experiment name (experiments/NAME.py) or a path to one.
        space: "section.field" -> `Choice` or `Range`, the fields searched.
        fixed: "section.field" -> value, the same in every trial.
        strategy: "grid", "random" or "tpe".
        trials: the number of trials.
        metric: an eval metric training reports: loss, nll, perplexity, accuracy, or TASK/METRIC of an
            lm-eval task the base config's train.evals runs (`shakespeare_cloze/acc`).
        direction: "minimize" or "maximize"; None: the metric's natural one (a task's: maximize).
        prune: median pruner over the evaluations reported during training.
        seed: the seed of the planned trials and of TPE.
        heartbeat: seconds; a trial whose worker has been silent 3 heartbeats is retried.
        patience: seconds a worker waits for a lost database to come back before it stops.
        devices: accelerators per trial: `--workers auto` runs one worker per `devices` of them.
    """

    base: str  # experiment name (experiments/NAME.py) or a path to one
    space: dict[str, Choice | Range]
    fixed: dict[str, Any] = dataclasses.field(default_factory=dict)
    strategy: Literal["grid", "random", "tpe"] = "tpe"
    trials: int = 10
    metric: str = "loss"  # an eval metric training reports: loss, nll, perplexity, accuracy, or TASK/METRIC
    direction: Literal["minimize", "maximize"] | None = None  # None: the metric's natural one
    prune: bool = True  # median pruner over the evaluations reported during training
    seed: int = 0
    heartbeat: int = 10  # seconds; a trial whose worker has been silent 3 heartbeats is retried
    patience: int = 120  # seconds a worker waits for a lost database to come back before it stops
    devices: int = 1  # accelerators per trial: `--workers auto` runs one worker per `devices` of them

    @property
    def goal(self) -> str:
        return self.direction or EVAL_METRICS.get(self.metric, "maximize")  # a task's: accuracy, exact match, BLEU


def _numeric(hint) -> type | None:
    """int or float if the field holds a number (possibly Optional), else None."""
    args = [h for h in typing.get_args(hint) if h is not type(None)] or [hint]
    return next((h for h in args if h in (int, float)), None)


def check(sweep: Sweep, base: Config) -> None:
    """Every mistake a sweep file can make, named, before any trial starts.

    Args:
        sweep: the sweep.
        base: its base config.

    Raises:
        ConfigError: an empty or invalid space, a field both searched and fixed, a bad setting, named.
    """
    require(sweep.space, "space", "is empty: name at least one field to search over")
    require(sweep.trials >= 1, "trials", f"must be >= 1, got {sweep.trials}")
    require(sweep.heartbeat >= 1, "heartbeat", f"must be >= 1 second, got {sweep.heartbeat}")
    require(sweep.patience >= 0, "patience", f"must be >= 0 seconds, got {sweep.patience}")
    require(sweep.devices >= 1, "devices", f"must be >= 1 per trial, got {sweep.devices}")
    require_seed(sweep.seed, "seed")
    require(sweep.strategy in ("grid", "random", "tpe"), "strategy", f"{sweep.strategy!r} is not grid, random or tpe")
    fixed = with_values(base, sweep.fixed)
    task = sweep.metric.split("/")[0] if "/" in sweep.metric else None
    require(
        sweep.metric in EVAL_METRICS or (task is not None and task in fixed.train.evals),
        "metric",
        f"{sweep.metric!r} is not reported by training's evaluation (it reports {', '.join(EVAL_METRICS)}, and "
        f"TASK/METRIC of the lm-eval tasks of train.evals: {', '.join(fixed.train.evals) or 'none'})",
    )
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


def load(path: str | pathlib.Path, overrides: list[str] = (), trials: int | None = None) -> tuple[Sweep, Config]:
    """The sweep of a sweep file and its (fixed-overridden) base config, checked. `overrides`
    (`section.field=value`, the command line's --set) join the sweep's fixed values and `trials`
    replaces its count: a sweep shrunk to try it (a few short trials) without editing its file.

    Args:
        path: the sweep file.
        overrides: "section.field=value" strings fixed in every trial.
        trials: the number of trials, or None (the file's).

    Returns:
        (sweep, base config).

    Raises:
        ConfigError: the file, an override or the sweep is invalid, named.
    """
    sweep = call_file(path, "get_sweep", "sweep")
    require(isinstance(sweep, Sweep), "get_sweep()", f"returned {type(sweep).__name__}, not jaxformer.sweep.Sweep")
    given = parse_overrides(list(overrides))
    for name in given:
        require(name not in sweep.space, f"--set {name}", "is searched by the sweep (its space): it cannot be fixed")
    require(trials is None or trials >= 1, "--trials", f"must be >= 1, got {trials}")
    sweep = dataclasses.replace(sweep, fixed={**sweep.fixed, **given}, trials=trials or sweep.trials)
    base_path = pathlib.Path(sweep.base)
    if not base_path.suffix:  # a name: the experiments/ directory next to experiments/sweeps/
        base_path = pathlib.Path(path).resolve().parent.parent / f"{sweep.base}.py"
    base = load_experiment(str(base_path))
    check(sweep, base)
    return sweep, with_values(base, sweep.fixed)
