"""Faults a run must survive with an exact log: a kill during a save, damaged checkpoints and logs,
interrupts, unwritable directories, non-finite losses; and read-only commands that change nothing."""

import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import pytest

# Tiny and fast; log_every divides neither the checkpoint steps nor the evaluation steps, so a resume
# at a checkpoint is never at a logged step (the case where a resumed log used to gain a row).
OVERRIDES = [
    "train.steps=40",
    "train.batch_size=16",
    "checkpoint.every=10",
    "train.log_every=3",
    "train.eval_every=15",
    "train.num_samples=0",
]
TIMING = {"tokens_per_s", "mfu", "step_time"}  # differ from run to run


def train_command(workdir, *extra):
    sets = [x for o in [*OVERRIDES, *extra] for x in ("--set", o)]
    train = ["train", "--config", "experiments/copy_task.py", "--workdir", str(workdir), "--quiet"]
    return [sys.executable, "-m", "jaxformer.cli", *train, *sets]


def run(workdir, *extra):
    return subprocess.run(train_command(workdir, *extra), capture_output=True, text=True, timeout=600)


def metrics(workdir) -> list[dict]:
    """metrics.jsonl line by line, timings aside."""
    lines = (pathlib.Path(workdir) / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING} for line in lines]


def checkpoint_names(workdir) -> list[str]:
    d = pathlib.Path(workdir) / "checkpoints"
    return sorted(os.listdir(d)) if d.is_dir() else []


def saved_steps(workdir) -> list[int]:
    return sorted(int(n) for n in checkpoint_names(workdir) if n.isdigit())


def damage_state(checkpoint: pathlib.Path) -> None:
    """Cut the array data of a checkpoint short, as a full disk does."""
    files = [p for p in (checkpoint / "state").rglob("*") if p.is_file() and p.parent.name == "d"]
    assert files
    for path in files:
        with open(path, "r+b") as f:
            f.truncate(path.stat().st_size // 3)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("uninterrupted")
    result = run(workdir)
    assert result.returncode == 0, result.stderr[-3000:]
    return workdir


def test_uninterrupted_log_is_what_the_resume_tests_compare_against(uninterrupted):
    rows = [(r["step"], r["split"]) for r in metrics(uninterrupted)]
    assert [s for s, split in rows if split == "train"] == list(range(0, 40, 3))
    assert [s for s, split in rows if split == "eval"] == [15, 30, 40]


def test_sigkill_during_a_save_then_resume_logs_exactly_the_uninterrupted_run(tmp_path, uninterrupted):
    proc = subprocess.Popen(train_command(tmp_path), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 300
        # A save in progress after a complete one: orbax writes into "<step>.orbax-checkpoint-tmp".
        while not (saved_steps(tmp_path) and any("tmp" in n for n in checkpoint_names(tmp_path))):
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            assert time.time() < deadline, "no second save within 300 s"
            time.sleep(0.002)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert 10 <= saved_steps(tmp_path)[-1] < 40
    with open(tmp_path / "metrics.jsonl", "a") as f:  # and a crash in the middle of writing a record
        f.write('{"step": 99, "split": "tra')
    result = run(tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "dropped the partial last line" in result.stdout
    assert metrics(tmp_path) == metrics(uninterrupted)


def test_fallback_to_training_from_scratch_logs_exactly_the_uninterrupted_run(tmp_path, uninterrupted):
    workdir = tmp_path / "run"
    shutil.copytree(uninterrupted, workdir)
    for step in saved_steps(workdir):
        damage_state(workdir / "checkpoints" / str(step))
    result = run(workdir)
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(n for n in checkpoint_names(workdir) if n.startswith("corrupt-")) == [
        "corrupt-20",
        "corrupt-30",
        "corrupt-40",
    ]
    assert metrics(workdir) == metrics(uninterrupted)


def start_and_signal(workdir, sig) -> tuple[subprocess.Popen, str]:
    """Start training, wait for its first complete checkpoint, send `sig`; (process, its output)."""
    proc = subprocess.Popen(train_command(workdir), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 300
        while not saved_steps(workdir):
            assert proc.poll() is None, proc.stdout.read()[-3000:]
            assert time.time() < deadline, "no checkpoint within 300 s"
            time.sleep(0.01)
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc, out


def test_ctrl_c_saves_says_how_to_resume_and_resumes_exactly(tmp_path, uninterrupted):
    from jaxformer.checkpoint import EXIT_PREEMPTED

    proc, out = start_and_signal(tmp_path, signal.SIGINT)
    assert proc.returncode == EXIT_PREEMPTED, out[-3000:]
    assert "Traceback" not in out and "KeyboardInterrupt" not in out
    last = saved_steps(tmp_path)[-1]
    assert f"SIGINT: saved step {last} to {tmp_path / 'checkpoints'}; rerun the same command to resume" in out
    assert 10 <= last < 40
    result = run(tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert metrics(tmp_path) == metrics(uninterrupted)
