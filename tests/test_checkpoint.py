"""Checkpointing: killed and preempted runs resume bitwise-identically; faults are reported, nothing is lost."""

import json
import pathlib
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from jaxformer import cli
from jaxformer.checkpoint import EXIT_PREEMPTED, Checkpointer, load_model
from jaxformer.config import ConfigError, apply_overrides, from_dict
from jaxformer.train import init_state

OVERRIDES = [
    "train.steps=80",
    "checkpoint.every=20",
    "train.log_every=1",  # every loss in the log, to compare them all
    "train.eval_every=40",
    "train.num_samples=0",
]


def train_command(workdir, *extra):
    sets = [x for o in [*OVERRIDES, *extra] for x in ("--set", o)]
    train = ["train", "--config", "experiments/copy_task.py", "--workdir", str(workdir), "--quiet"]
    return [sys.executable, "-m", "jaxformer.cli", *train, *sets]


def run(workdir, *extra):
    return subprocess.run(train_command(workdir, *extra), capture_output=True, text=True, timeout=600)


def saved_steps(workdir) -> list[int]:
    d = pathlib.Path(workdir) / "checkpoints"
    return sorted(int(p.name) for p in d.iterdir() if p.name.isdigit()) if d.is_dir() else []


def start_and_signal(workdir, sig) -> subprocess.Popen:
    """Start training, wait for its first complete checkpoint, then send `sig`."""
    proc = subprocess.Popen(train_command(workdir), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 300
        while not saved_steps(workdir):
            assert proc.poll() is None, proc.stdout.read()
            assert time.time() < deadline, "no checkpoint within 300 s"
            time.sleep(0.05)
        proc.send_signal(sig)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc


def final_state(workdir):
    cfg = from_dict(json.loads((pathlib.Path(workdir) / "config.json").read_text()))
    _, like, _ = init_state(cfg)
    ckpt = Checkpointer(workdir, cfg)
    state = ckpt.restore_latest(like)
    ckpt.close()
    return state


def train_log(workdir):
    lines = (pathlib.Path(workdir) / "metrics.jsonl").read_text().splitlines()
    return [(r["step"], r["split"], r["loss"]) for r in map(json.loads, lines)]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("uninterrupted")
    result = run(workdir)
    assert result.returncode == 0, result.stderr[-3000:]
    return workdir, final_state(workdir), train_log(workdir)


def assert_same_run(workdir, uninterrupted):
    _, state, log = uninterrupted
    resumed = final_state(workdir)
    assert int(resumed.step) == int(state.step) == 80
    jax.tree.map(np.testing.assert_array_equal, resumed.params, state.params)  # bitwise on CPU
    jax.tree.map(np.testing.assert_array_equal, resumed.opt_state, state.opt_state)
    assert train_log(workdir) == log  # same losses, each step logged exactly once


def test_sigkill_then_rerun_equals_uninterrupted(tmp_path, uninterrupted):
    proc = start_and_signal(tmp_path, signal.SIGKILL)
    assert proc.returncode == -signal.SIGKILL
    assert saved_steps(tmp_path)[-1] < 80, "killed before the end"
    result = run(tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert_same_run(tmp_path, uninterrupted)


def test_sigterm_saves_at_the_signal_and_exits_cleanly(tmp_path, uninterrupted):
    proc = start_and_signal(tmp_path, signal.SIGTERM)
    out = proc.stdout.read()
    assert proc.returncode == EXIT_PREEMPTED, out[-3000:]
    last = saved_steps(tmp_path)[-1]
    assert 20 <= last < 80
    logged = [s for s, split, _ in train_log(tmp_path) if split == "train"]
    assert logged == list(range(last)), "the log and the checkpoint agree on where the run stopped"
    result = run(tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert_same_run(tmp_path, uninterrupted)


def test_corrupt_latest_checkpoint_falls_back_and_is_kept(tmp_path, uninterrupted, capsys):
    source, _, _ = uninterrupted
    workdir = tmp_path / "run"
    subprocess.run(["cp", "-r", str(source), str(workdir)], check=True)
    latest = workdir / "checkpoints" / "80"
    data_files = [p for p in (latest / "state").rglob("*") if p.is_file() and p.parent.name == "d"]
    assert data_files
    for path in data_files:  # the array data cut short, as by a full disk
        with open(path, "r+b") as f:
            f.truncate(path.stat().st_size // 3)
    state = final_state(workdir)
    assert int(state.step) == 60, "fell back to the previous complete checkpoint"
    assert "checkpoints/80 cannot be restored" in capsys.readouterr().out
    assert (workdir / "checkpoints" / "corrupt-80").is_dir(), "set aside, not deleted"
    assert saved_steps(workdir) == [40, 60]


def test_resume_with_different_model_fails_naming_the_field(tmp_path, uninterrupted, capsys):
    source, _, _ = uninterrupted
    workdir = tmp_path / "run"
    subprocess.run(["cp", "-r", str(source), str(workdir)], check=True)
    before = {p: p.stat().st_mtime_ns for p in workdir.rglob("*")}
    args = ["train", "--config", "experiments/copy_task.py", "--workdir", str(workdir), "--quiet"]
    rc = cli.main([*args, "--set", "model.num_encoder_layers=3", "--set", "train.steps=200"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "model.num_encoder_layers: checkpoint 2, config 3" in err
    assert {p: p.stat().st_mtime_ns for p in workdir.rglob("*")} == before, "nothing was overwritten"


def test_unwritable_workdir_is_a_clear_error(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    rc = cli.main(["train", "--config", "experiments/copy_task.py", "--workdir", str(blocker / "run"), "--quiet"])
    assert rc == 2
    assert str(blocker) in capsys.readouterr().err


def test_export_and_load_model_give_identical_logits(tmp_path, uninterrupted):
    source, state, _ = uninterrupted
    assert cli.main(["export", "--workdir", str(source), "--out", str(tmp_path / "exported")]) == 0
    model = load_model(tmp_path / "exported")
    from flax import nnx

    cfg = from_dict(json.loads((source / "config.json").read_text()))
    graphdef, _, _ = init_state(cfg)
    original = nnx.merge(graphdef, state.params)
    src = np.random.default_rng(0).integers(2, 11, (4, 10)).astype(np.int32)
    tgt = np.concatenate([np.ones((4, 1), np.int32), src[:, :-1]], axis=1)
    np.testing.assert_array_equal(model(src, tgt), original(src, tgt))
    assert not list((tmp_path / "exported").rglob("*opt_state*"))


def test_config_overrides_reach_the_checkpoint_section():
    from jaxformer.config import load_experiment

    cfg = apply_overrides(load_experiment("experiments/copy_task.py"), ["checkpoint.keep=5"])
    assert from_dict(json.loads(json.dumps(cfg.to_dict()))).checkpoint.keep == 5
    with pytest.raises(ConfigError, match=r"checkpoint\.best_metric"):
        apply_overrides(cfg, ["checkpoint.best_metric=bleu"])
