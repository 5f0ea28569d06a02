"""Hyperparameter sweeps on Optuna: every trial is a normal training run in a sub-workdir of its own.

A sweep file (`experiments/sweeps/NAME.py`) defines `get_sweep() -> Sweep`:

    Sweep(
        base="copy_task",                                    # experiments/copy_task.py
        space={"train.learning_rate": Range(1e-4, 3e-3, log=True), "model.dropout_rate": Choice(0.0, 0.1)},
        fixed={"train.steps": 300},                          # the same in every trial
        strategy="tpe", trials=12, metric="loss",            # eval loss, minimised
    )

    jaxformer sweep experiments/sweeps/NAME.py --workdir sweeps/NAME [--workers N|auto] [--storage URL]
    jaxformer sweep experiments/sweeps/NAME.py --workdir sweeps/NAME [--storage URL] --status

Optuna's storage holds the sweep: by default a SQLite file, workdir/sweep.db (embedded,
nothing to start), shared by the `--workers` processes of one machine; with a database URL
(`postgresql://user:password@host/db`) the same command on many machines works on one sweep.
`--workers auto` runs one worker per accelerator of the machine (`Sweep.devices` per trial),
each pinned to its own devices.

The sweep's `trials` are created once, as a queue, by whichever command creates the study:
grid points and random draws fixed up front from `Sweep.seed` (TPE's random start too; TPE's
later trials sample when they start). Workers take trials from the queue (one worker per trial,
atomically in the database) until it is empty and nothing runs, so any number of workers on
any number of machines run exactly the same trials as one worker would, and stop together.
Each trial trains in workdir/trial-NNN and reports its evaluations, so the pruner (median rule)
stops hopeless trials early. A trial whose worker died (Optuna's heartbeat: silent for
3 × `Sweep.heartbeat` seconds) is queued again with its parameters and workdir, so the worker
that takes it resumes from the trial's last checkpoint (the workdir must be shared by the
machines for that; otherwise the retry starts the trial afresh). Re-running the command
continues the sweep. A worker rides out a lost database connection for `Sweep.patience`
seconds, then stops with a message naming the database.

Results: workdir/results.csv and a table (best first), workdir/objective.png (objective against
each parameter) and workdir/loss_curves.png (the trials' eval loss against step).
"""

from __future__ import annotations

import contextlib
import csv
import math
import os
import pathlib
import subprocess
import sys
import threading
import time

from jaxformer.config import (
    Config,
    ConfigError,
    require,
    with_values,
)
from jaxformer.sweep.spec import EVAL_METRICS, Choice, Range, Sweep, check, load
from jaxformer.sweep.study import (
    _counts,
    _done,
    _shown,
    _storage,
    _suggest,
    _take_queued_trial,
    _values,
    open_study,
    planned_trials,
    storage_url,
)

__all__ = ["EVAL_METRICS", "Choice", "Range", "Sweep", "check", "load", "open_study", "planned_trials", "storage_url"]


@contextlib.contextmanager
def _heartbeat(storage, trial_id: int, interval: float):
    """Record the trial's heartbeat every `interval` seconds while the block runs."""
    stop = threading.Event()

    def beat():
        while True:
            try:
                storage.record_heartbeat(trial_id)
            except ConnectionError:
                return  # the trial's next report meets the lost database too, and stops the worker
            if stop.wait(interval):
                return

    thread = threading.Thread(target=beat, name=f"heartbeat-{trial_id}", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def work(sweep: Sweep, base: Config, workdir: pathlib.Path, url: str, name: str, worker: int = 0, shared=False):
    """Take trials from the sweep's queue and train them until the queue is empty and no trial
    runs anywhere (a dead worker's trial comes back to the queue). `worker` numbers this machine's
    processes; a `shared` storage may have workers on other machines too.

    Args:
        sweep: the sweep.
        base: its base config.
        workdir: the sweep's directory.
        url: the storage URL.
        name: the study's name.
        worker: this worker's number on this machine.
        shared (bool): the storage is shared with other machines.

    Raises:
        SystemExit: code 0 when a trial was preempted (SIGTERM) after saving: the worker stops and
            another resumes the trial.
    """
    import optuna

    from jaxformer.observe import curve, read_metrics
    from jaxformer.train import fit, parameters_line

    storage = _storage(url, sweep)
    study = open_study(sweep, name, url, worker=(worker, os.getpid()) if shared else (worker,), storage=storage)
    study_id = storage.get_study_id_from_name(name)
    tag = f"[worker {worker}] " if worker else ""
    RUNNING = optuna.trial.TrialState.RUNNING

    def train(trial) -> tuple[optuna.trial.TrialState | None, float | None]:
        values = {k: _suggest(trial, k, d) for k, d in sweep.space.items()}
        # A retried trial inherits the user attributes, so it trains on in the dead trial's workdir.
        trial_dir = workdir / trial.user_attrs.get("workdir", f"trial-{trial.number:03d}")
        trial.set_user_attr("workdir", trial_dir.name)
        shown = ", ".join(f"{k}={v}" for k, v in values.items())
        c = _counts(study, sweep, study.get_trials(deepcopy=False))
        print(f"{tag}trial {trial.number} ({trial_dir.name}): {shown}   [{_done(c)} of {c['trials']} done]", flush=True)
        given_up = []

        def on_eval(step: int, metrics: dict) -> bool:
            try:
                trial.report(metrics[sweep.metric], step)
            except optuna.exceptions.UpdateFinishedTrialError:
                given_up.append(step)  # failed as dead while the database was away: its retry trains it
                return True
            return trial.should_prune()

        try:
            result = fit(with_values(base, values), trial_dir, quiet=True, on_eval=on_eval)
        except FloatingPointError as e:
            print(f"{tag}trial {trial.number}: failed ({e})", flush=True)
            return optuna.trial.TrialState.FAIL, None
        if given_up:
            print(f"{tag}trial {trial.number}: failed as dead while the database was away; its retry goes on")
            return None, None
        if result.get("preempted"):  # SIGTERM: saved; left running, so the heartbeat hands it on
            print(f"{tag}trial {trial.number}: preempted after saving; a worker resumes it from its checkpoint")
            raise SystemExit(0)
        value = result["eval"].get(sweep.metric)
        if value is None:  # its worker died after the last step: the log holds the last evaluation
            value = curve(read_metrics(trial_dir), "eval", sweep.metric)[1][-1]
        if result["stopped"]:
            print(f"{tag}trial {trial.number}: pruned ({sweep.metric} {value:.4g})", flush=True)
            return optuna.trial.TrialState.PRUNED, None
        # Training's own "parameters:" line, which a quiet trial does not print: a LoRA rank tells here.
        counted = f"; {parameters_line(result['state'])}" if result.get("state") is not None else ""
        print(f"{tag}trial {trial.number}: {sweep.metric} {value:.4g}{counted}", flush=True)
        return optuna.trial.TrialState.COMPLETE, value

    waiting_said = False
    while True:
        optuna.storages.fail_stale_trials(study)  # a dead worker's trial: failed, and queued again
        trial_id = _take_queued_trial(storage, study_id, url)
        if trial_id is None:
            running = study.get_trials(deepcopy=False, states=(RUNNING,))
            if not running:
                return
            if not waiting_said:
                print(f"{tag}{len(running)} trial(s) running: waiting for them (a dead worker's trial "
                      f"is retried within {3 * sweep.heartbeat} s)", flush=True)  # fmt: skip
                waiting_said = True
            time.sleep(min(sweep.heartbeat, 5))
            continue
        waiting_said = False
        trial = optuna.Trial(study, trial_id)
        with _heartbeat(storage, trial_id, sweep.heartbeat):
            try:
                state, value = train(trial)
            except SystemExit:
                raise
            except BaseException:
                study.tell(trial, state=optuna.trial.TrialState.FAIL, skip_if_finished=True)
                raise
        if state is not None:
            study.tell(trial, value, state=state, skip_if_finished=True)


def local_devices() -> tuple[str, list[str]]:
    """This machine's accelerator platform and device (GPU) or chip (TPU) ids as the pinning
    variables name them, asked of JAX in a child process (so this one holds no accelerator).

    Returns:
        (platform, ids).
    """
    probe = (
        "import jax; ds = jax.local_devices(); chips = {tuple(getattr(d, 'coords', None) or (d.id,)) for d in ds}; "
        "print(ds[0].platform, len(chips) if ds[0].platform == 'tpu' else len(ds))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.split()
    platform, n = out[-2], int(out[-1])
    visible = {"gpu": "CUDA_VISIBLE_DEVICES", "tpu": "TPU_VISIBLE_CHIPS"}.get(platform)
    already = os.environ.get(visible or "", "")  # already narrowed: pin within what this process may use
    ids = already.split(",")[:n] if already else [str(i) for i in range(n)]
    return platform, ids


TPU_CHIP_BOUNDS = {1: "1,1,1", 2: "1,2,1", 4: "2,2,1"}  # chips of one worker, as a TPU host lays them out


def pin(platform: str, ids: list[str], per_trial: int) -> list[dict[str, str]]:
    """The environment of each worker of one machine: one worker per `per_trial` devices, each
    seeing only its own (devices left over are idle). CPU: one worker, nothing pinned.

    Args:
        platform: "cpu", "gpu" or "tpu".
        ids: the device ids.
        per_trial: devices per trial.

    Returns:
        One environment (variable -> value) per worker.

    Raises:
        ConfigError: more devices per trial than the machine has, or a platform with no pinning.
    """
    if platform == "cpu":
        return [{}]
    require(
        per_trial <= len(ids), "devices", f"a trial asks for {per_trial}, this machine has {len(ids)} {platform}(s)"
    )
    groups = [ids[i : i + per_trial] for i in range(0, len(ids) - per_trial + 1, per_trial)]
    if platform == "gpu":
        return [{"CUDA_VISIBLE_DEVICES": ",".join(g)} for g in groups]
    if platform == "tpu":
        if len(groups) == 1 and per_trial == len(ids):
            return [{}]  # the whole host: nothing to narrow
        require(per_trial in TPU_CHIP_BOUNDS, "devices", f"{per_trial} TPU chips per trial: use 1, 2, 4 or all")
        envs = []
        for i, g in enumerate(groups):  # a TPU runtime per worker, each with its own port
            port = str(8476 + i)
            envs.append({
                "TPU_VISIBLE_CHIPS": ",".join(g), "TPU_VISIBLE_DEVICES": ",".join(g),
                "TPU_CHIPS_PER_PROCESS_BOUNDS": TPU_CHIP_BOUNDS[per_trial], "TPU_PROCESS_BOUNDS": "1,1,1",
                "TPU_PROCESS_PORT": port, "TPU_PROCESS_ADDRESSES": f"localhost:{port}",
                "TPU_MESH_CONTROLLER_ADDRESS": f"localhost:{port}", "TPU_MESH_CONTROLLER_PORT": port,
            })  # fmt: skip
        return envs
    raise ConfigError(f"--workers auto: no pinning known for platform {platform!r}")


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
        ConfigError: the sweep or the worker count is invalid.
        SystemExit: a worker process failed.
    """
    if workers != "auto" and workers < 1:
        raise ConfigError(f"--workers: must be >= 1 or auto, got {workers}")
    sweep, base = load(path, overrides, trials)
    root = pathlib.Path(workdir)
    root.mkdir(parents=True, exist_ok=True)
    url, name = storage_url(root, storage), pathlib.Path(path).stem
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
        ConfigError: no sweep in the workdir yet.
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
