"""The sweep in Optuna's storage: the storage that rides out a lost database, the study and its queue of
planned trials, taking a trial from the queue, and the trials counted by state."""

from __future__ import annotations

import contextlib
import functools
import itertools
import pathlib
import random
import threading
import time
import warnings

from jaxformer.config import ConfigError, field_hint
from jaxformer.sweep.spec import Choice, Sweep, _numeric


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
    """The Optuna storage URL: `storage` (checked: `check_storage`), else a SQLite file in the sweep's workdir.

    Args:
        workdir: the sweep's directory.
        storage: a storage URL, or None.

    Returns:
        The URL.

    Raises:
        ConfigError: a `storage` no retry can open.
    """
    if storage is None:
        return f"sqlite:///{workdir.resolve() / 'sweep.db'}"
    check_storage(storage)
    return storage


def check_storage(url: str) -> None:
    """Refuse, before anything is written or retried, a storage URL no retry can open: one SQLAlchemy
    cannot parse, a database it has no dialect for, or one whose driver is not installed.

    Args:
        url: the storage URL.

    Raises:
        ConfigError: naming --storage (the URL shown without its password) and why.
    """
    import sqlalchemy

    try:
        parsed = sqlalchemy.engine.make_url(url)
    except sqlalchemy.exc.ArgumentError:
        raise ConfigError("--storage: not a database URL (dialect://user:password@host/db, sqlite:///FILE)") from None
    try:
        parsed.get_dialect().import_dbapi()
    except (sqlalchemy.exc.NoSuchModuleError, ImportError) as e:
        raise ConfigError(
            f"--storage {_shown(url)}: SQLAlchemy cannot open it here ({type(e).__name__}: {e})"
        ) from None


def _shown(url: str) -> str:
    """The URL without its password, for messages."""
    import sqlalchemy

    return sqlalchemy.engine.make_url(url).render_as_string(hide_password=True)


def _lost_connection(error: BaseException | None) -> BaseException | None:
    """The database driver's error if `error` (or what caused it) means the database went away."""
    import sqlalchemy.exc

    while error is not None:
        if isinstance(error, (sqlalchemy.exc.OperationalError, sqlalchemy.exc.InterfaceError)) or getattr(
            error, "connection_invalidated", False
        ):
            return error
        error = error.__cause__ or error.__context__
    return None


def _patiently(call, url: str, patience: float, lost=_lost_connection, failed="did not answer"):
    """call(), retried while the database is away, for at most `patience` seconds; then a
    ConnectionError naming the database (the command line prints it as `error: ...`)."""
    deadline = None
    while True:
        try:
            result = call()
        except Exception as e:
            cause = lost(e)
            if cause is None:
                raise
            reason = str(getattr(cause, "orig", None) or cause).strip().splitlines()[0]
            if deadline is None:
                deadline = time.monotonic() + patience
                print(f"database {_shown(url)} {failed} ({reason}): retrying for up to {patience} s", flush=True)
            if time.monotonic() >= deadline:
                raise ConnectionError(
                    f"the database {_shown(url)} stayed away for {patience} s ({reason}); "
                    "this worker stops: rerun the command when it is back to continue the sweep"
                ) from e
            time.sleep(0.5)
        else:
            if deadline is not None:
                print(f"database {_shown(url)} is back", flush=True)
            return result


_outermost = threading.local()


def _retried(method):
    """A storage method retried by `_patiently` (only at the outermost call: the methods call each other)."""

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        if getattr(_outermost, "inside", False):
            return method(self, *args, **kwargs)
        _outermost.inside = True
        try:
            return _patiently(lambda: method(self, *args, **kwargs), self.url, self.patience)
        finally:
            _outermost.inside = False

    return call


@functools.cache
def _patient_storage():
    """Optuna's RDBStorage whose every database call rides out a lost connection for `patience` seconds."""
    import inspect

    import optuna

    class PatientStorage(optuna.storages.RDBStorage):
        patience: float = 0.0

    for name, method in vars(optuna.storages.RDBStorage).items():
        if inspect.isfunction(method) and not name.startswith("__"):
            setattr(PatientStorage, name, _retried(method))
    return PatientStorage


def _storage(url: str, sweep: Sweep):
    import optuna
    import sqlalchemy.exc

    kwargs = {"connect_args": {"timeout": 60}} if url.startswith("sqlite") else {"pool_pre_ping": True}

    def connect():
        storage = _patient_storage()(
            url,
            engine_kwargs=kwargs,
            heartbeat_interval=sweep.heartbeat,
            grace_period=3 * sweep.heartbeat,
            heartbeat_stale_trial_callback=optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry=3),
        )
        storage.patience = sweep.patience
        return storage

    # Any database error while connecting is retried: workers starting together on an empty
    # database race to create Optuna's tables, and all but one see the others' half-made schema.
    any_error = lambda e: e if isinstance(e, sqlalchemy.exc.SQLAlchemyError) else _lost_connection(e)
    return _patiently(connect, url, sweep.patience, lost=any_error, failed="could not be set up")


def _startup(sweep: Sweep) -> int:
    """TPE's random trials before it models the results."""
    return min(sweep.trials, max(2, min(10, sweep.trials // 3)))


def planned_trials(sweep: Sweep) -> list[dict]:
    """The sweep's trials as Optuna stores their parameters (choices by index), fixed up front
    from `sweep.seed`: the grid's points in a shuffled order, or random draws; TPE's trials after
    its random start are `{}`, sampled when they start, from the results then known.

    Args:
        sweep: the sweep.

    Returns:
        One parameter dict per trial.
    """
    import optuna

    if sweep.strategy == "grid":
        points = list(itertools.product(*(range(len(d.values)) for d in sweep.space.values())))
        random.Random(sweep.seed).shuffle(points)
        return [dict(zip(sweep.space, p, strict=True)) for p in points[: sweep.trials]]
    drawn = sweep.trials if sweep.strategy == "random" else _startup(sweep)
    scratch = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=sweep.seed))
    plan = []
    for _ in range(drawn):
        trial = scratch.ask()
        for name, dist in sweep.space.items():
            _suggest(trial, name, dist)
        plan.append(trial.params)
    return plan + [{}] * (sweep.trials - drawn)


def open_study(sweep: Sweep, name: str, url: str, create: bool = False, worker: tuple = (), storage=None):
    """The sweep's Optuna study (in `storage`, else one opened on `url`). With `create`, a new one is
    made with its planned trials queued (the one command that wins the race to create it queues
    them; the others wait for the queue).
    TPE samples with a seed drawn from (sweep.seed, trials so far, `worker`): workers started
    together, or a sweep started again, would otherwise propose the same parameters.

    Args:
        sweep: the sweep.
        name: the study's name.
        url: the storage URL.
        create: create the study (and queue its planned trials).
        worker: what makes this worker's TPE seed its own.
        storage (optuna.storages.BaseStorage | None): an open storage, or None (open `url`).

    Returns:
        study (optuna.Study): the study.

    Raises:
        ConfigError: no such study yet, or one with another definition.
    """
    import numpy as np
    import optuna

    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)  # the heartbeat
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = storage or _storage(url, sweep)
    pruner = optuna.pruners.MedianPruner(n_startup_trials=2) if sweep.prune else optuna.pruners.NopPruner()
    described = repr({k: sweep.space[k] for k in sorted(sweep.space)}) + repr(sorted(sweep.fixed.items()))
    described += repr((sweep.strategy, sweep.trials, sweep.seed))
    study = None
    if create:
        try:  # the database's unique study name elects one creator among commands started together
            study = optuna.create_study(storage=storage, study_name=name, pruner=pruner, direction=sweep.goal)
        except optuna.exceptions.DuplicatedStudyError:
            pass
        else:
            study.set_user_attr("definition", described)
            for params in planned_trials(sweep):
                study.enqueue_trial(params)
            study.set_user_attr("trials", sweep.trials)  # the queue is complete
    if study is None:
        try:
            study = optuna.load_study(study_name=name, storage=storage, pruner=pruner)
        except KeyError:
            raise ConfigError(f"{_shown(url)} holds no sweep {name!r} yet: start it first") from None
        deadline = time.monotonic() + 60
        while "trials" not in study.user_attrs:  # its creator is still queuing the trials
            if time.monotonic() > deadline:
                raise ConfigError(f"{_shown(url)}: sweep {name!r} has no trial queue: use a new --workdir")
            time.sleep(0.5)
        if create and study.user_attrs.get("definition") != described:
            raise ConfigError(f"{_shown(url)} holds sweep {name!r} with another definition: use a new --workdir")
    so_far = len(study.get_trials(deepcopy=False))
    seed = int(np.random.SeedSequence([sweep.seed, so_far, *worker]).generate_state(1)[0])
    if sweep.strategy == "tpe":  # constant liar: trials running elsewhere count, so workers spread out
        study.sampler = optuna.samplers.TPESampler(seed=seed, n_startup_trials=_startup(sweep), constant_liar=True)
    else:  # every parameter is fixed in the queue
        study.sampler = optuna.samplers.RandomSampler(seed=seed)
    return study


def _take_queued_trial(storage, study_id: int, url: str) -> int | None:
    """A waiting trial of the study, now RUNNING and this worker's, or None if none waits.

    Said with the storage's public API: Optuna's own `Study.ask` takes a waiting trial too, but
    creates a new one when none waits, where a sweep's fixed queue must stop. Taking one is a
    guarded WAITING -> RUNNING update; PostgreSQL guards it with a row lock, SQLite ignores that
    (two workers once both read WAITING and both trained trial 0 in one workdir), so on SQLite
    the workers of the machine take trials one at a time under a file lock beside the database."""
    import optuna

    WAITING, RUNNING = optuna.trial.TrialState.WAITING, optuna.trial.TrialState.RUNNING
    database = url.removeprefix("sqlite:///") if url.startswith("sqlite:///") else None
    with _file_lock(f"{database}.take-lock") if database else contextlib.nullcontext():
        for trial in storage.get_all_trials(study_id, deepcopy=False, states=(WAITING,)):
            trial_id = storage.get_trial_id_from_study_id_trial_number(study_id, trial.number)
            try:
                if storage.set_trial_state_values(trial_id, state=RUNNING):
                    return trial_id
            except optuna.exceptions.UpdateFinishedTrialError:
                continue  # finished meanwhile by another worker
    return None


@contextlib.contextmanager
def _file_lock(path: str):
    """An exclusive lock on `path` (created if need be) held while the block runs."""
    import fcntl

    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _counts(study, sweep: Sweep, trials) -> dict:
    """The sweep's trials by state; a trial that failed as dead and was retried is not "failed"."""
    import optuna

    S = optuna.trial.TrialState
    by = {s: [t for t in trials if t.state == s] for s in S}
    retried = {t.system_attrs.get("failed_trial") for t in trials} - {None}
    failed = [t for t in by[S.FAIL] if t.number not in retried]  # given up for good
    return {
        "trials": int(study.user_attrs.get("trials", sweep.trials)), "complete": len(by[S.COMPLETE]),
        "pruned": len(by[S.PRUNED]), "running": len(by[S.RUNNING]), "waiting": len(by[S.WAITING]),
        "failed": len(failed), "retried": len(by[S.FAIL]) - len(failed),
    }  # fmt: skip


def _done(counts: dict) -> int:
    return counts["complete"] + counts["pruned"] + counts["failed"]  # a retried failure is not done
