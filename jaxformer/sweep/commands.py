"""The two commands of `jaxformer sweep`: `run` (check the sweep, start its workers, report the results)
and `status` (where a sweep stands, read from its storage)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import time

from jaxformer.config import ConfigError
from jaxformer.sweep.report import print_table, results
from jaxformer.sweep.spec import load
from jaxformer.sweep.study import _counts, _done, _shown, _values, open_study, storage_url
from jaxformer.sweep.worker import local_devices, pin, work


def run(
    path: str,
    workdir: str,
    workers: int | str = 1,
    storage: str | None = None,
    worker: int | None = None,
    overrides: list[str] = (),
    trials: int | None = None,
) -> list:
    """`jaxformer sweep`: check the sweep, run it with `workers` processes (`auto`: one per
    accelerator group), report the results. (`worker=i`: be worker i of a multi-process sweep:
    run trials, report nothing.) `overrides` and `trials` shrink or change it (see `load`).

    Args:
        path: the sweep file.
        workdir: the sweep's directory.
        workers: processes on this machine, or "auto".
        storage: a storage URL, or None (SQLite in the workdir).
        worker: be worker i of a multi-process sweep, or None.
        overrides: "section.field=value" strings fixed in every trial.
        trials: the number of trials, or None.

    Returns:
        The results' rows (see `results`).

    Raises:
        ConfigError: the sweep, the worker count or the storage URL is invalid.
        SystemExit: a worker process failed.
    """
    if workers != "auto" and workers < 1:
        raise ConfigError(f"--workers: must be >= 1 or auto, got {workers}")
    sweep, base = load(path, overrides, trials)
    root = pathlib.Path(workdir)
    url, name = storage_url(root, storage), pathlib.Path(path).stem  # checked before the workdir is made
    root.mkdir(parents=True, exist_ok=True)
    if worker is not None:
        work(sweep, base, root, url, name, worker, shared=True)
        return []
    envs = pin(*local_devices(), sweep.devices) if workers == "auto" else [{}] * workers
    open_study(sweep, name, url, create=True)  # created, and its trials queued, before workers race to them
    start = time.perf_counter()
    if envs == [{}]:
        work(sweep, base, root, url, name, shared=storage is not None)
    else:
        cmd = [sys.executable, "-m", "jaxformer.cli", "sweep", str(path), "--workdir", str(root), "--storage", url]
        cmd += [f"--set={item}" for item in overrides] + ([f"--trials={trials}"] if trials else [])
        for i, env in enumerate(envs, 1):
            if env:
                print(f"worker {i}: " + " ".join(f"{k}={v}" for k, v in env.items()))
        procs = [
            subprocess.Popen([*cmd, "--worker", str(i)], env={**os.environ, **env}) for i, env in enumerate(envs, 1)
        ]
        codes = [p.wait() for p in procs]
        if any(codes):
            raise SystemExit(f"error: sweep workers exited with {codes}; rerun the command to continue")
    rows = results(sweep, name, url, root)
    print(f"\n{len(rows)} trials in {root} ({time.perf_counter() - start:.0f} s this run), best first:")
    print_table(rows, sweep)
    print(f"results: {root / 'results.csv'}, plots: {root / 'objective.png'}, {root / 'loss_curves.png'}")
    return rows


def status(path: str, workdir: str, storage: str | None = None, overrides: list[str] = ()) -> dict:
    """`jaxformer sweep --status`: trials done / running / pruned / failed, the best so far and
    an ETA, read from the storage (starts nothing). Returns the counts printed.

    Args:
        path: the sweep file.
        workdir: the sweep's directory.
        storage: a storage URL, or None.
        overrides: as `run` takes them.

    Returns:
        The counts by state.

    Raises:
        ConfigError: no sweep in the workdir yet, or a storage URL that cannot be opened.
    """
    import datetime

    sweep, _ = load(path, overrides)
    url, name = storage_url(pathlib.Path(workdir), storage), pathlib.Path(path).stem
    if storage is None and not (pathlib.Path(workdir) / "sweep.db").is_file():
        raise ConfigError(f"{workdir}: no sweep here yet (no sweep.db): start it first")
    study = open_study(sweep, name, url)
    trials = study.get_trials(deepcopy=False)
    counts = _counts(study, sweep, trials)
    done = _done(counts)
    print(f"sweep {name} ({_shown(url)}): {counts['trials']} trials")
    print(
        f"  done {done} (complete {counts['complete']}, pruned {counts['pruned']}, failed {counts['failed']}), "
        f"running {counts['running']}, waiting {counts['waiting']}"
        + (f"; {counts['retried']} failed as dead and retried" if counts["retried"] else "")
    )
    if counts["complete"]:
        best = study.best_trial
        shown = ", ".join(f"{k}={v}" for k, v in _values(sweep, best.params).items())
        print(f"  best so far: trial {best.number}, {sweep.metric} {best.value:.4g} ({shown})")
    else:
        print("  best so far: none complete yet")
    left = counts["running"] + counts["waiting"]
    starts = [t.datetime_start for t in trials if t.datetime_start]
    if left == 0:
        print("  finished")
    elif done and starts:
        elapsed = (datetime.datetime.now() - min(starts)).total_seconds()
        eta = left * elapsed / done
        print(f"  ETA: {left} trial(s) left at {60 * done / elapsed:.2g} trials/min: ~{_duration(eta)}")
    else:
        print(f"  ETA: {left} trial(s) left; known once a trial is done")
    return counts


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.0f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"
