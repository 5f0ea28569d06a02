"""Sweeps on Optuna: two worker processes on one SQLite storage, four commands (as on four machines)
on one PostgreSQL that run exactly what one worker runs, a worker killed mid-trial whose trial another
worker resumes, a database that goes away and comes back (or not), one worker per accelerator,
results that agree with the trials' own logs, and bad sweep files rejected before any trial.

PostgreSQL is a real server started for the session (tests/conftest.py: `postgres`)."""

import csv
import json
import pathlib
import re
import signal
import socket
import subprocess
import sys
import time

import jax
import processes
import pytest

from jaxformer import cli
from jaxformer.config import ConfigError
from jaxformer.sweep import load, pin

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
        strategy="random", trials={trials}, metric="loss", prune=False, heartbeat={heartbeat}, patience={patience},
    )
"""


def sweep_file(
    directory: pathlib.Path, name: str, trials: int, steps: int = 20, heartbeat: int = 1, patience: int = 120
) -> pathlib.Path:
    path = directory / f"{name}.py"
    base = str(REPO / "experiments/copy_task.py")
    path.write_text(SWEEP.format(base=base, trials=trials, steps=steps, heartbeat=heartbeat, patience=patience))
    return path


@pytest.fixture(autouse=True)
def workers_compile_as_the_session_does(monkeypatch, compilation_cache):
    """The worker processes a sweep starts (`--workers 2`) compile with the elemental emitters, as this
    process and the sweep commands started below do; restored after each test.

    XLA_FLAGS then names the emitters this process compiles with, so its programs' cache keys are those
    of the processes it starts: it shares their compilation cache for the test, and a trial trained in
    one (the one-worker reference of the four commands, the killed sweep's first trials) is loaded in
    the other instead of compiled again."""
    from jax.experimental.compilation_cache import compilation_cache as cache

    monkeypatch.setenv("XLA_FLAGS", processes.cpu_env()["XLA_FLAGS"])
    own = jax.config.jax_compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", compilation_cache)
    cache.reset_cache()
    yield
    jax.config.update("jax_compilation_cache_dir", own)
    cache.reset_cache()


def command(file: pathlib.Path, workdir: pathlib.Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "jaxformer.cli", "sweep", str(file), "--workdir", str(workdir), *args]


def start(cmd: list[str], log: pathlib.Path) -> subprocess.Popen:
    """A sweep command in its own process, its output to `log` (read while it runs)."""
    with log.open("w") as out:
        return subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=processes.cpu_env())


def wait_for(condition, procs, logs, what: str) -> None:
    """Poll `condition()` while every process runs (their output goes to `logs`), under the hang guard."""
    deadline = time.monotonic() + processes.HANG_GUARD_S
    output = lambda: "\n".join(log.read_text() for log in logs)
    while not condition():
        assert all(p.poll() is None for p in procs), ([p.returncode for p in procs], output()[-3000:])
        if time.monotonic() > deadline:
            for p in procs:
                p.kill()
            processes.hung(f"waiting for {what}", output())
        time.sleep(0.2)


def eval_steps(trial_dir: pathlib.Path) -> list[int]:
    records = [json.loads(line) for line in (trial_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["step"] for r in records if r["split"] == "eval"]


def trial_table(table: list[dict]) -> list[tuple]:
    """What two runs of one sweep must agree on: each trial's number, state, parameters and loss."""
    return sorted((int(r["trial"]), r["state"], r["train.learning_rate"], r["train.warmup_steps"], float(r["loss"]))
                  for r in table)  # fmt: skip


def rows(workdir: pathlib.Path) -> list[dict]:
    with (workdir / "results.csv").open() as f:
        return list(csv.DictReader(f))


def last_eval_loss(trial_dir: pathlib.Path) -> float:
    records = [json.loads(line) for line in (trial_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r["split"] == "eval"][-1]["loss"]


def test_two_workers_share_one_sqlite_sweep_and_a_rerun_adds_nothing(tmp_path, capfd):
    """Shrunk from the command line (--trials, --set), which each worker process is given too. To the 30
    steps of the module's other sweeps: their trials are planned alike (the sweep's seed), so each trial's
    programs, compiled here, are loaded from the compilation cache by the tests after this one."""
    file, workdir = sweep_file(tmp_path, "two", trials=9, steps=60), tmp_path / "sweep"
    shrink = ["--trials", "4", "--set", "train.steps=30"]
    assert cli.main(["sweep", str(file), "--workdir", str(workdir), "--workers", "2", *shrink]) == 0
    out = capfd.readouterr().out
    assert "[worker 1] trial" in out and "[worker 2] trial" in out  # both processes ran trials
    progress = re.findall(r"trial \d+ .*\[(\d+) of (\d+) done\]", out)  # each trial says where the sweep is
    assert len(progress) == 4 and {total for _, total in progress} == {"4"} and min(int(d) for d, _ in progress) == 0
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

    for r in table:  # the --set value, not the file's 60 steps
        assert json.loads((workdir / r["workdir"] / "config.json").read_text())["train"]["steps"] == 30
        assert eval_steps(workdir / r["workdir"])[-1] == 30

    mtimes = {p: p.stat().st_mtime for p in workdir.glob("trial-*/metrics.jsonl")}
    assert cli.main(["sweep", str(file), "--workdir", str(workdir), *shrink]) == 0
    assert "trial 4" not in capfd.readouterr().out
    assert len(rows(workdir)) == 4 and {p: p.stat().st_mtime for p in mtimes} == mtimes
    assert cli.main(["sweep", str(file), "--workdir", str(workdir), "--trials", "5"]) == 2  # another sweep
    assert "with another definition: use a new --workdir" in capfd.readouterr().err


def test_a_killed_sweep_continues_and_retries_the_dead_trial_in_its_workdir(tmp_path, capfd):
    import optuna

    # 60 steps, a checkpoint every 10: trial 1 runs the programs trial 0 compiled, and the kill must come
    # between its first checkpoint and its end (at 30 steps, polled every 0.5 s, a fast run once ended first).
    file, workdir = sweep_file(tmp_path, "killed", trials=3, steps=60), tmp_path / "sweep"
    cmd = [sys.executable, "-m", "jaxformer.cli", "sweep", str(file), "--workdir", str(workdir)]
    proc = subprocess.Popen(cmd, cwd=REPO, env=processes.cpu_env())
    url = f"sqlite:///{workdir / 'sweep.db'}"
    try:  # kill the worker once trial 0 is complete and trial 1 has saved a checkpoint
        trial1_saved = lambda: (workdir / "trial-001" / "checkpoints" / "10").is_dir()
        processes.wait_until(trial1_saved, proc, "trial 1's first checkpoint", poll=0.05)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()
    study = optuna.load_study(study_name="killed", storage=url)
    before = {t.number: t.state.name for t in study.trials}
    assert before == {0: "COMPLETE", 1: "RUNNING", 2: "WAITING"}, before  # trial 2: planned, queued
    trial0 = last_eval_loss(workdir / "trial-000")

    assert cli.main(["sweep", str(file), "--workdir", str(workdir)]) == 0
    capfd.readouterr()
    table = {int(r["trial"]): r for r in rows(workdir)}
    assert table[0]["state"] == "COMPLETE" and float(table[0]["loss"]) == pytest.approx(trial0, rel=1e-6)
    assert table[1]["state"] == "FAIL"
    retries = [r for n, r in table.items() if n > 1 and r["workdir"] == "trial-001"]
    assert len(retries) == 1 and retries[0]["state"] == "COMPLETE"
    assert retries[0]["train.learning_rate"] == table[1]["train.learning_rate"]
    assert sum(r["state"] == "COMPLETE" for r in table.values()) == 3
    assert len({table[n]["train.learning_rate"] for n in (0, 1, 2)}) == 3  # the planned trials differ
    # The retry resumed from trial 1's checkpoint (a fresh start would append a second step 0).
    steps = [json.loads(line)["step"] for line in (workdir / "trial-001" / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(steps) and steps[-1] == 60


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


@pytest.mark.parametrize("seed", [-1, 2**32])
def test_a_seed_outside_32_bits_fails_before_any_trial(tmp_path, seed):
    """The planned trials' draws and TPE's seeds take 32 bits: Optuna's sampler and numpy's SeedSequence refuse
    a negative seed with a traceback."""
    file = tmp_path / "bad.py"
    file.write_text(
        "from jaxformer.sweep import Range, Sweep\n"
        f"def get_sweep():\n    return Sweep(base={str(REPO / 'experiments/copy_task.py')!r}, "
        f"space={{'train.learning_rate': Range(1e-3, 1e-2)}}, seed={seed})\n"
    )
    with pytest.raises(ConfigError, match=rf"seed: must be in \[0, 2\*\*32\) \(a 32-bit seed\), got {seed}"):
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


def test_an_lm_eval_metric_is_an_objective_when_training_runs_its_task(tmp_path):
    """`TASK/METRIC` of train.evals (lm-evaluation-harness tasks logged beside the loss): maximised by default."""
    file = tmp_path / "cloze.py"
    fixed = "{'train.evals': ('shakespeare_cloze',), 'train.evals_limit': 8}"
    for extra, ok in ((f", fixed={fixed}", True), ("", False)):
        file.write_text(
            "from jaxformer.sweep import Range, Sweep\n"
            f"def get_sweep():\n    return Sweep(base={str(REPO / 'experiments/lm_shakespeare.py')!r}, "
            f"space={{'train.learning_rate': Range(1e-3, 1e-2)}}, metric='shakespeare_cloze/acc'{extra})\n"
        )
        if ok:
            assert load(file)[0].goal == "maximize"
        else:
            with pytest.raises(ConfigError, match=r"TASK/METRIC of the lm-eval tasks of train\.evals: none\)"):
                load(file)


def test_shipped_sweeps_validate():
    for path in sorted((REPO / "experiments/sweeps").glob("*.py")):
        sweep, base = load(path)
        assert base.train.steps == sweep.fixed["train.steps"], path
        shrunk, small = load(path, ["train.steps=7", "train.batch_size=4"], trials=2)
        assert (shrunk.trials, small.train.steps, small.train.batch_size) == (2, 7, 4)
        assert shrunk.space == sweep.space


@pytest.mark.parametrize(
    "overrides, trials, message",
    [
        (["train.learning_rate=0.1"], None, "--set train.learning_rate: is searched by the sweep"),
        (["train.stepz=3"], None, "train.stepz: unknown field"),
        (["train.steps=many"], None, "train.steps"),
        ([], 0, "--trials: must be >= 1, got 0"),
    ],
)
def test_a_sweep_shrunk_from_the_command_line_is_checked(tmp_path, overrides, trials, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load(sweep_file(tmp_path, "s", trials=3), overrides, trials)


@pytest.mark.parametrize("storage, workers", [("sqlite", 1), ("postgresql", "auto")])
def test_the_median_pruner_stops_trials_behind_the_median_at_their_first_evaluation(
    tmp_path, monkeypatch, capsys, request, storage, workers
):
    """Training is replaced by a stand-in that reports eval loss 1.0 (trials 0 and 1) or 5.0 (later
    trials) at steps 10, 20 and 30 and stops when `on_eval` says so, as `fit` does (tested in
    test_observe). After the pruner's two startup trials, each later one is pruned at step 10.
    On PostgreSQL with `--workers auto`: on this CPU machine auto is one worker in this process, as
    `--workers 1` (the stand-in would not reach a worker process)."""
    from jaxformer import sweep, train

    url = request.getfixturevalue("postgres_url") if storage == "postgresql" else None

    def stand_in(cfg, workdir, *, quiet, on_eval):
        loss = 1.0 if pathlib.Path(workdir).name in ("trial-000", "trial-001") else 5.0
        for step in (10, 20, 30):
            if on_eval(step, {"loss": loss}):
                return {"eval": {"loss": loss}, "stopped": True}
        return {"eval": {"loss": loss}, "stopped": False}

    monkeypatch.setattr(train, "fit", stand_in)
    path = sweep_file(tmp_path, "pruned", trials=4, steps=30)
    path.write_text(path.read_text().replace("prune=False", "prune=True"))
    table = sweep.run(str(path), str(tmp_path / "w"), workers=workers, storage=url)
    assert [(r["trial"], r["state"], r["steps"]) for r in table] == [
        (0, "COMPLETE", 30), (1, "COMPLETE", 30), (2, "PRUNED", 10), (3, "PRUNED", 10)
    ]  # fmt: skip
    assert "trial 2: pruned (loss 5)" in capsys.readouterr().out


def test_four_commands_on_one_postgres_run_the_trials_one_worker_runs_even_when_one_dies(
    tmp_path, postgres_url, capsys
):
    """Four `jaxformer sweep --storage postgresql://...` commands started together, as on four
    machines, against one worker on SQLite with the same sweep file; one of the four is SIGKILLed
    once its trial has saved a checkpoint. The trials are planned from the sweep's seed when the
    study is created, so "the same" can mean the same table: each trial's number, parameters and
    loss (training and resuming are deterministic on CPU). The dead trial is taken over by another
    worker after its heartbeat lapses and resumed from its checkpoint (its eval log never goes
    back to step 10); no trial ran twice otherwise, and the three others stop at the budget."""
    import optuna

    file = sweep_file(tmp_path, "four", trials=4, steps=30)
    assert cli.main(["sweep", str(file), "--workdir", str(tmp_path / "one")]) == 0
    one = trial_table(rows(tmp_path / "one"))

    workdir = tmp_path / "four"
    logs = [tmp_path / f"machine-{i}.log" for i in range(4)]
    procs = [start(command(file, workdir, "--storage", postgres_url), log) for log in logs]
    victim = []

    def a_trial_has_a_checkpoint():  # and which command runs it
        for i, log in enumerate(logs):
            started = [line.split()[1] for line in log.read_text().splitlines() if line.startswith("trial ")]
            if started and (workdir / f"trial-{int(started[-1]):03d}" / "checkpoints" / "10").is_dir():
                victim.append((i, int(started[-1])))
                return True
        return False

    try:
        wait_for(a_trial_has_a_checkpoint, procs, logs, "a trial's checkpoint")
        killed, dead = victim[0]
        procs[killed].send_signal(signal.SIGKILL)
        codes = [processes.wait(p, f"sweep worker {i}", logs[i]) for i, p in enumerate(procs)]
    finally:
        for p in procs:
            p.kill()
    outputs = [log.read_text() for log in logs]
    assert codes == [-signal.SIGKILL if i == killed else 0 for i in range(4)], "\n".join(outputs)

    trials = optuna.load_study(study_name="four", storage=postgres_url).trials
    assert [t.state.name for t in trials] == ["FAIL" if n == dead else "COMPLETE" for n in range(4)] + ["COMPLETE"]
    retry = trials[4]
    assert retry.params == trials[dead].params and retry.user_attrs["workdir"] == f"trial-{dead:03d}"
    # The planned trials' outcomes, whichever attempt finished them, are one worker's.
    finished = {int(t.user_attrs["workdir"][-3:]): t for t in trials if t.state.name == "COMPLETE"}
    four = [(n, "COMPLETE", *next(r for r in one if r[0] == n)[2:4], finished[n].value) for n in range(4)]
    for a, b in zip(four, one, strict=True):
        assert a[:4] == b[:4] and a[4] == pytest.approx(b[4], rel=1e-5), (a, b)
    for n in range(4):
        attempts = sum(out.count(f"(trial-{n:03d}): ") for out in outputs)
        assert attempts == (2 if n == dead else 1), n  # started once, anywhere (the dead one twice)
        steps = eval_steps(workdir / f"trial-{n:03d}")
        assert steps.count(10) == 1 and sorted(set(steps)) == [10, 20, 30], (n, steps)
    assert all("5 trials in" in out for i, out in enumerate(outputs) if i != killed)  # the same end, together

    capsys.readouterr()
    assert cli.main(["sweep", str(file), "--workdir", str(workdir), "--storage", postgres_url, "--status"]) == 0
    status = capsys.readouterr().out
    best = min(four, key=lambda r: r[4])
    assert "done 4 (complete 4, pruned 0, failed 0), running 0, waiting 0; 1 failed as dead and retried" in status
    assert f"best so far: trial {best[0] if best[0] != dead else 4}, loss {best[4]:.4g}" in status
    assert "finished" in status


def test_a_sweep_rides_out_a_brief_database_outage(tmp_path, postgres, postgres_url):
    """The PostgreSQL server is stopped for 3 s while a trial trains and started again: the worker
    says so, retries, and the sweep finishes with every trial complete and none retried."""
    file, workdir = sweep_file(tmp_path, "outage", trials=2, steps=30, heartbeat=2), tmp_path / "sweep"
    log = tmp_path / "worker.log"
    proc = start(command(file, workdir, "--storage", postgres_url), log)
    try:
        wait_for(lambda: (workdir / "trial-000" / "checkpoints" / "10").is_dir(), [proc], [log], "trial 0's checkpoint")
        postgres.stop()
        time.sleep(3)
        postgres.start()
        assert processes.wait(proc, "the sweep worker", log) == 0, log.read_text()
    finally:
        proc.kill()
    out = log.read_text()
    assert f"database {postgres_url} did not answer" in out and f"database {postgres_url} is back" in out
    assert [(r["trial"], r["state"]) for r in sorted(rows(workdir), key=lambda r: r["trial"])] == [
        ("0", "COMPLETE"), ("1", "COMPLETE")
    ]  # fmt: skip
    assert eval_steps(workdir / "trial-000") == [10, 20, 30]


def test_a_database_that_stays_away_stops_the_sweep_with_a_clear_message(tmp_path, capsys, monkeypatch):
    """The worker waits out its patience (1 s) and no longer. Its clock is the retries' own: each sleep
    between tries moves it on, so the wait is counted in the worker's sleeps, not in a busy machine's
    seconds (a wall-clock bound of 30 s here failed under load saying nothing about the code)."""
    pytest.importorskip("psycopg")
    from jaxformer.sweep import study

    clock = [0.0]
    monkeypatch.setattr(study, "time", type(time)("clock"))  # this module's clock alone, not the process's
    study.time.monotonic, study.time.sleep = lambda: clock[0], lambda s: clock.__setitem__(0, clock[0] + s)
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"postgresql://jax:secret@127.0.0.1:{port}/sweeps"
    file = sweep_file(tmp_path, "away", trials=1, patience=1)
    assert cli.main(["sweep", str(file), "--workdir", str(tmp_path / "w"), "--storage", url]) == 2
    err = capsys.readouterr().err
    shown = f"postgresql://jax:***@127.0.0.1:{port}/sweeps"
    assert (
        f"error: the database {shown} stayed away for 1 s (connection failed: " in err and "Connection refused" in err
    )
    assert "this worker stops: rerun the command when it is back to continue the sweep" in err
    assert "secret" not in err
    assert 1.0 <= clock[0] <= 1.5  # slept through its patience, then stopped at the next try


def test_workers_are_pinned_one_per_accelerator_group():
    """`--workers auto`: the environment each worker gets, for fake device lists."""
    gpus = [str(i) for i in range(8)]
    assert pin("gpu", gpus, 1) == [{"CUDA_VISIBLE_DEVICES": g} for g in gpus]
    assert pin("gpu", gpus, 2) == [{"CUDA_VISIBLE_DEVICES": g} for g in ("0,1", "2,3", "4,5", "6,7")]
    assert pin("gpu", gpus[:3], 2) == [{"CUDA_VISIBLE_DEVICES": "0,1"}]  # the third GPU idles
    assert pin("gpu", ["2", "5"], 1) == [{"CUDA_VISIBLE_DEVICES": "2"}, {"CUDA_VISIBLE_DEVICES": "5"}]
    assert pin("cpu", ["0"], 1) == [{}]  # as `--workers 1`
    with pytest.raises(ConfigError, match=r"devices: a trial asks for 4, this machine has 2 gpu\(s\)"):
        pin("gpu", gpus[:2], 4)

    tpu = pin("tpu", ["0", "1", "2", "3"], 1)
    assert [e["TPU_VISIBLE_CHIPS"] for e in tpu] == ["0", "1", "2", "3"]
    assert {e["TPU_CHIPS_PER_PROCESS_BOUNDS"] for e in tpu} == {"1,1,1"} and {e["TPU_PROCESS_BOUNDS"] for e in tpu} == {
        "1,1,1"
    }
    assert len({e["TPU_PROCESS_PORT"] for e in tpu}) == 4  # a TPU runtime each, on its own port
    assert [e["TPU_VISIBLE_CHIPS"] for e in pin("tpu", ["0", "1", "2", "3"], 2)] == ["0,1", "2,3"]
    assert pin("tpu", ["0", "1", "2", "3"], 4) == [{}]  # the whole host: nothing to narrow
    with pytest.raises(ConfigError, match="3 TPU chips per trial: use 1, 2, 4 or all"):
        pin("tpu", [str(i) for i in range(8)], 3)


def test_workers_auto_starts_one_pinned_worker_per_gpu(tmp_path, monkeypatch):
    """`run(workers="auto")` on a machine that says it has two GPUs: two worker processes, each
    started with its own CUDA_VISIBLE_DEVICES (the processes are recorded, not run)."""
    from jaxformer import sweep
    from jaxformer.sweep import commands

    started = []

    class Recorded:
        def __init__(self, cmd, env):
            started.append((cmd[cmd.index("--worker") + 1], env["CUDA_VISIBLE_DEVICES"]))

        def wait(self):
            return 0

    assert sweep.local_devices()[0] == jax.local_devices()[0].platform  # this machine, asked for real
    monkeypatch.setattr(commands, "local_devices", lambda: ("gpu", ["0", "1"]))  # where `run` reads it
    monkeypatch.setattr(commands.subprocess, "Popen", Recorded)
    table = sweep.run(str(sweep_file(tmp_path, "gpus", trials=2)), str(tmp_path / "w"), workers="auto")
    assert started == [("1", "0"), ("2", "1")]
    assert [r["state"] for r in table] == ["WAITING", "WAITING"]  # queued for the (recorded) workers


def test_workers_sharing_a_sqlite_sweep_never_take_the_same_trial(tmp_path):
    """SQLite ignores the row lock Optuna's WAITING -> RUNNING update relies on: four takers of one
    queue of 60 took 78 trials (12 twice) without the sweep's file lock, and two workers once
    trained trial 0 in one workdir. With it, each trial is taken exactly once."""
    import threading

    import optuna

    from jaxformer.sweep import _take_queued_trial

    url = f"sqlite:///{tmp_path / 'sweep.db'}"
    study = optuna.create_study(storage=url, study_name="queue")
    for i in range(60):
        study.enqueue_trial({"x": i})
    taken = []

    def worker():
        storage = optuna.storages.RDBStorage(url, engine_kwargs={"connect_args": {"timeout": 60}})
        study_id = storage.get_study_id_from_name("queue")
        while (trial_id := _take_queued_trial(storage, study_id, url)) is not None:
            taken.append(trial_id)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(taken) == len(set(taken)) == 60
    assert {t.state for t in study.get_trials(deepcopy=False)} == {optuna.trial.TrialState.RUNNING}


LORA_SWEEP = """
from jaxformer.sweep import Choice, Range, Sweep

def get_sweep():
    return Sweep(
        base={base!r},
        space={space},
        fixed={{"lora.targets": ("q", "k", "v", "o"), "train.steps": 10, "train.eval_every": 10,
               "train.log_every": 10, "train.batch_size": 16, "train.num_samples": 0, "train.eval_batches": 1,
               "model.d_model": 32, "model.num_encoder_layers": 1, "model.num_decoder_layers": 1,
               "checkpoint.every": 10, "train.peak_flops": 1e11}},
        strategy={strategy!r}, trials=2, metric="loss", prune=False,
    )
"""


def test_a_sweep_over_the_lora_rank_runs_each_trial_with_its_own_adapters(tmp_path, capsys):
    """LoRA is config like any other: its rank is searched (with a learning rate), each trial trains
    adapters of its rank alone and says how many parameters it trains."""
    from jaxformer.sweep import Choice, Range

    base_file = str(REPO / "experiments/copy_task.py")
    searched = '{"lora.rank": Choice(2, 4), "train.learning_rate": Range(1e-3, 1e-2, log=True)}'
    file = tmp_path / "lora_and_lr.py"
    file.write_text(LORA_SWEEP.format(base=base_file, space=searched, strategy="tpe"))
    sweep, base = load(file)
    assert sweep.space == {"lora.rank": Choice(2, 4), "train.learning_rate": Range(1e-3, 1e-2, log=True)}
    assert base.lora.targets == ("q", "k", "v", "o")

    file = tmp_path / "lora.py"  # each rank once: a grid
    file.write_text(LORA_SWEEP.format(base=base_file, space='{"lora.rank": Choice(2, 4)}', strategy="grid"))

    assert cli.main(["sweep", str(file), "--workdir", str(tmp_path / "sweep"), "--trials", "2"]) == 0
    out = capsys.readouterr().out
    table = rows(tmp_path / "sweep")
    assert sorted(int(r["lora.rank"]) for r in table) == [2, 4] and {r["state"] for r in table} == {"COMPLETE"}
    trained = {}
    for r in table:
        line = re.search(rf"trial {r['trial']}: loss \S+; parameters: ([\d,]+) trained of ([\d,]+) ", out)
        assert line, out
        trained[int(r["lora.rank"])], total = (int(n.replace(",", "")) for n in line.groups())
        assert trained[int(r["lora.rank"])] < total / 2
        config = json.loads((tmp_path / "sweep" / r["workdir"] / "config.json").read_text())
        assert config["lora"]["rank"] == int(r["lora.rank"])
    assert trained[4] == 2 * trained[2]  # adapters' size is linear in the rank
