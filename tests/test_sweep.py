"""Sweeps on Optuna: two worker processes on one SQLite storage, resumption after a killed worker,
results that agree with the trials' own logs, and bad sweep files rejected before any trial."""

import csv
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from jaxformer import cli
from jaxformer.config import ConfigError
from jaxformer.sweep import load

REPO = pathlib.Path(__file__).resolve().parent.parent
# The copy task at its smallest (one layer per stack): a trial is 20-30 steps and 2-3 evaluations.
SWEEP = """
from jaxformer.sweep import Choice, Range, Sweep

def get_sweep():
    return Sweep(
        base={base!r},
        space={{"train.learning_rate": Range(1e-3, 1e-2, log=True), "train.warmup_steps": Choice(5, 10)}},
        fixed={{"train.steps": {steps}, "train.eval_every": 10, "train.log_every": 10, "train.batch_size": 16,
               "train.num_samples": 0, "train.eval_batches": 2, "model.d_model": 32, "model.num_encoder_layers": 1,
               "model.num_decoder_layers": 1, "checkpoint.every": 10, "train.peak_flops": 1e11}},
        strategy="random", trials={trials}, metric="loss", prune=False, heartbeat=1,
    )
"""


def sweep_file(directory: pathlib.Path, name: str, trials: int, steps: int = 20) -> pathlib.Path:
    path = directory / f"{name}.py"
    path.write_text(SWEEP.format(base=str(REPO / "experiments/copy_task.py"), trials=trials, steps=steps))
    return path


def rows(workdir: pathlib.Path) -> list[dict]:
    with (workdir / "results.csv").open() as f:
        return list(csv.DictReader(f))


def last_eval_loss(trial_dir: pathlib.Path) -> float:
    records = [json.loads(line) for line in (trial_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r["split"] == "eval"][-1]["loss"]


def test_two_workers_share_one_sqlite_sweep_and_a_rerun_adds_nothing(tmp_path, capfd):
    file, workdir = sweep_file(tmp_path, "two", trials=4), tmp_path / "sweep"
    assert cli.main(["sweep", str(file), "--workdir", str(workdir), "--workers", "2"]) == 0
    out = capfd.readouterr().out
    assert "[worker 1] trial" in out and "[worker 2] trial" in out  # both processes ran trials
    table = rows(workdir)
    assert [r["state"] for r in table] == ["COMPLETE"] * 4
    assert sorted(int(r["trial"]) for r in table) == [0, 1, 2, 3]
    assert len({r["train.learning_rate"] for r in table}) == 4
    losses = [float(r["loss"]) for r in table]
    assert losses == sorted(losses)  # best first
    for r in table:  # the objective is the trial's own last evaluation
        assert float(r["loss"]) == pytest.approx(last_eval_loss(workdir / r["workdir"]), rel=1e-6)
    assert (workdir / "sweep.db").is_file() and (workdir / "objective.png").is_file()
    assert (workdir / "loss_curves.png").is_file()

    mtimes = {p: p.stat().st_mtime for p in workdir.glob("trial-*/metrics.jsonl")}
    assert cli.main(["sweep", str(file), "--workdir", str(workdir)]) == 0
    assert "trial 4" not in capfd.readouterr().out
    assert len(rows(workdir)) == 4 and {p: p.stat().st_mtime for p in mtimes} == mtimes


def test_a_killed_sweep_continues_and_retries_the_dead_trial_in_its_workdir(tmp_path, capfd):
    import optuna

    file, workdir = sweep_file(tmp_path, "killed", trials=3, steps=30), tmp_path / "sweep"
    cmd = [sys.executable, "-m", "jaxformer.cli", "sweep", str(file), "--workdir", str(workdir)]
    proc = subprocess.Popen(cmd, cwd=REPO, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    url = f"sqlite:///{workdir / 'sweep.db'}"
    try:  # kill the worker once trial 0 is complete and trial 1 has saved a checkpoint
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.5)
            if (workdir / "trial-001" / "checkpoints" / "10").is_dir():
                break
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()
    study = optuna.load_study(study_name="killed", storage=url)
    before = {t.number: t.state.name for t in study.trials}
    assert before == {0: "COMPLETE", 1: "RUNNING"}, before
    trial0 = last_eval_loss(workdir / "trial-000")

    assert cli.main(["sweep", str(file), "--workdir", str(workdir)]) == 0
    out = capfd.readouterr().out
    assert "waiting up to 3 s to retry dead ones" in out
    table = {int(r["trial"]): r for r in rows(workdir)}
    assert table[0]["state"] == "COMPLETE" and float(table[0]["loss"]) == pytest.approx(trial0, rel=1e-6)
    assert table[1]["state"] == "FAIL"
    retries = [r for n, r in table.items() if n > 1 and r["workdir"] == "trial-001"]
    assert len(retries) == 1 and retries[0]["state"] == "COMPLETE"
    assert retries[0]["train.learning_rate"] == table[1]["train.learning_rate"]
    assert sum(r["state"] == "COMPLETE" for r in table.values()) == 3
    assert table[3]["train.learning_rate"] != table[0]["train.learning_rate"]  # a resumed sweep samples anew
    # The retry resumed from trial 1's checkpoint (a fresh start would append a second step 0).
    steps = [json.loads(line)["step"] for line in (workdir / "trial-001" / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(steps) and steps[-1] == 30


@pytest.mark.parametrize(
    "change, message",
    [
        ('"train.learning_rat": Range(1e-3, 1e-2)', "train.learning_rat: unknown field"),
        ('"train.learning_rate": Range(1e-2, 1e-3)', "train.learning_rate: empty range: low=0.01"),
        ('"model.activation": Range(0, 1)', "model.activation: Range() over a non-numeric field"),
        ('"model.num_heads": Choice(4, 3)', "model.num_heads: num_heads=3 does not divide d_model=64"),
        ('"train.learning_rate": Range(0.0, 1e-2, log=True)', "a log range needs low > 0"),
    ],
)
def test_bad_search_spaces_fail_before_any_trial(tmp_path, change, message):
    file = tmp_path / "bad.py"
    file.write_text(
        "from jaxformer.sweep import Choice, Range, Sweep\n"
        f"def get_sweep():\n    return Sweep(base={str(REPO / 'experiments/copy_task.py')!r}, space={{{change}}})\n"
    )
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load(file)


def test_an_objective_training_never_reports_is_rejected(tmp_path, capsys):
    file = tmp_path / "bleu.py"
    file.write_text(
        "from jaxformer.sweep import Range, Sweep\n"
        f"def get_sweep():\n    return Sweep(base={str(REPO / 'experiments/copy_task.py')!r}, "
        "space={'train.learning_rate': Range(1e-3, 1e-2)}, metric='bleu')\n"
    )
    assert cli.main(["sweep", str(file), "--workdir", str(tmp_path / "w")]) == 2
    assert "metric: 'bleu' is not reported by training's evaluation" in capsys.readouterr().err
    assert not (tmp_path / "w").exists()


def test_shipped_sweeps_validate():
    for path in sorted((REPO / "experiments/sweeps").glob("*.py")):
        sweep, base = load(path)
        assert base.train.steps == sweep.fixed["train.steps"], path


def test_the_median_pruner_stops_trials_behind_the_median_at_their_first_evaluation(tmp_path, monkeypatch, capsys):
    """Training is replaced by a stand-in that reports eval loss 1.0 (trials 0 and 1) or 5.0 (later
    trials) at steps 10, 20 and 30 and stops when `on_eval` says so, as `fit` does (tested in
    test_observe). After the pruner's two startup trials, each later one is pruned at step 10."""
    from jaxformer import sweep, train

    def stand_in(cfg, workdir, *, quiet, on_eval):
        loss = 1.0 if pathlib.Path(workdir).name in ("trial-000", "trial-001") else 5.0
        for step in (10, 20, 30):
            if on_eval(step, {"loss": loss}):
                return {"eval": {"loss": loss}, "stopped": True}
        return {"eval": {"loss": loss}, "stopped": False}

    monkeypatch.setattr(train, "fit", stand_in)
    path = sweep_file(tmp_path, "pruned", trials=4, steps=30)
    path.write_text(path.read_text().replace("prune=False", "prune=True"))
    table = sweep.run(str(path), str(tmp_path / "w"))
    assert [(r["trial"], r["state"], r["steps"]) for r in table] == [
        (0, "COMPLETE", 30), (1, "COMPLETE", 30), (2, "PRUNED", 10), (3, "PRUNED", 10)
    ]  # fmt: skip
    assert "trial 2: pruned (loss 5)" in capsys.readouterr().out
