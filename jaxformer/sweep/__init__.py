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

from jaxformer.sweep.commands import run, status
from jaxformer.sweep.report import plot, print_table, results
from jaxformer.sweep.spec import EVAL_METRICS, Choice, Range, Sweep, check, load
from jaxformer.sweep.study import _take_queued_trial as _take_queued_trial  # its own test takes trials
from jaxformer.sweep.study import open_study, planned_trials, storage_url
from jaxformer.sweep.worker import TPU_CHIP_BOUNDS, local_devices, pin, work

__all__ = [
    "EVAL_METRICS",
    "TPU_CHIP_BOUNDS",
    "Choice",
    "Range",
    "Sweep",
    "check",
    "load",
    "local_devices",
    "open_study",
    "pin",
    "planned_trials",
    "plot",
    "print_table",
    "results",
    "run",
    "status",
    "storage_url",
    "work",
]
