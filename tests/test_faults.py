"""Faults a run must survive: a kill during a save, SIGTERM and Ctrl-C, damaged checkpoints and logs,
unwritable directories, non-finite losses, a changed model. A resumed run ends bitwise-identical to an
uninterrupted one (parameters, optimizer state) with the same log; read-only commands change nothing.

One uninterrupted run (a subprocess, like every run a test kills) is the reference for the module."""

import json
import logging
import os
import pathlib
import re
import shlex
import shutil
import signal
import subprocess
import sys

import jax
import numpy as np
import pytest
from processes import communicate, cpu_env, wait_until
from processes import run as run_process

# Tiny and fast; log_every divides neither the checkpoint steps nor the evaluation steps, so a resume
# at a checkpoint is never at a logged step (the case where a resumed log used to gain a row).
OVERRIDES = [
    "train.steps=40",
    "train.batch_size=16",
    "checkpoint.every=10",
    "train.log_every=3",
    "train.eval_every=15",
    "train.num_samples=0",
    "train.peak_flops=1e13",  # MFU's denominator given: no matmul probe (~1 s of CPU) in each of the ~15 runs
    # One layer per stack: what a resume must restore is the same for one layer as for two, and each run
    # traces and lowers its programs anew (~40% of a run's CPU time goes with the second layers).
    "model.num_encoder_layers=1",
    "model.num_decoder_layers=1",
]
TIMING = {"tokens_per_s", "mfu", "step_time"}  # differ from run to run


def train_command(workdir, *extra, report=False):
    """The run's command; no held-out report at its end (decoding 512 sequences, about a quarter of a
    run's CPU) unless `report`: the uninterrupted run saves the one the tests read."""
    sets = [x for o in [*OVERRIDES, *extra] for x in ("--set", o)]
    train = ["train", "--config", "experiments/copy_task.py", "--workdir", str(workdir), "--quiet"]
    return [sys.executable, "-m", "jaxformer.cli", *train, *([] if report else ["--no-report"]), *sets]


def run(workdir, *extra, report=False):
    return run_process(train_command(workdir, *extra, report=report), env=cpu_env())


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
    result = run(workdir, report=True)
    assert result.returncode == 0, result.stderr[-3000:]
    return workdir


def final_state(workdir):
    from jaxformer.checkpoint import Checkpointer
    from jaxformer.config import from_dict
    from jaxformer.state import init_state

    cfg = from_dict(json.loads((pathlib.Path(workdir) / "config.json").read_text()))
    ckpt = Checkpointer(workdir, cfg)
    state = ckpt.restore_latest(init_state(cfg)[1])
    ckpt.close()
    return state


def assert_same_run(workdir, uninterrupted):
    """The resumed run's final state is bitwise the uninterrupted one's (on CPU), and so is its log."""
    resumed, state = final_state(workdir), final_state(uninterrupted)
    assert int(resumed.step) == int(state.step) == 40
    jax.tree.map(np.testing.assert_array_equal, resumed.params, state.params)
    jax.tree.map(np.testing.assert_array_equal, resumed.opt_state, state.opt_state)
    assert metrics(workdir) == metrics(uninterrupted)


def test_uninterrupted_log_is_what_the_resume_tests_compare_against(uninterrupted):
    rows = [(r["step"], r["split"]) for r in metrics(uninterrupted)]
    assert [s for s, split in rows if split == "train"] == list(range(0, 40, 3))
    assert [s for s, split in rows if split == "eval"] == [15, 30, 40]


def start(command, env=None) -> subprocess.Popen:
    env = cpu_env() if env is None else env
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def signal_when(proc: subprocess.Popen, ready, sig, what: str, poll: float = 0.01) -> str:
    """Send `sig` to a started run once `ready()` holds (it must not exit first); its output."""
    try:
        wait_until(ready, proc, f"the run's {what}", poll)
        proc.send_signal(sig)
        out, _ = communicate(proc, f"the run after {sig.name}")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return out


def test_sigkill_during_a_save_then_resume_logs_exactly_the_uninterrupted_run(tmp_path, uninterrupted):
    proc = start(train_command(tmp_path))
    # A save in progress after a complete one: orbax writes into "<step>.orbax-checkpoint-tmp".
    saving = lambda: saved_steps(tmp_path) and any("tmp" in n for n in checkpoint_names(tmp_path))
    signal_when(proc, saving, signal.SIGKILL, "second save", poll=0.002)
    assert proc.returncode == -signal.SIGKILL
    assert 10 <= saved_steps(tmp_path)[-1] < 40
    with open(tmp_path / "metrics.jsonl", "a") as f:  # and a crash in the middle of writing a record
        f.write('{"step": 99, "split": "tra')
    result = run(tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "dropped the partial last line" in result.stdout
    assert f"held-out report skipped (--no-report): jaxformer eval --workdir {tmp_path} makes it" in result.stdout
    assert not list(tmp_path.glob("eval-*.json")), "--no-report: no report saved"
    assert_same_run(tmp_path, uninterrupted)


def test_fallback_to_training_from_scratch_logs_exactly_the_uninterrupted_run(tmp_path, uninterrupted):
    workdir = tmp_path / "run"
    shutil.copytree(uninterrupted, workdir)
    for step in saved_steps(workdir):
        damage_state(workdir / "checkpoints" / str(step))
    result = run(workdir)
    assert result.returncode == 0, result.stderr[-3000:]
    # tensorstore finishing the reads orbax abandoned: nothing lost, nothing to print
    assert "Event loop is closed" not in result.stderr and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert sorted(n for n in checkpoint_names(workdir) if n.startswith("corrupt-")) == [
        "corrupt-20",
        "corrupt-30",
        "corrupt-40",
    ]
    assert metrics(workdir) == metrics(uninterrupted)


def unshare_mount(probe: pathlib.Path) -> list[str] | None:
    """A command prefix that runs in a mount namespace of its own (root: a plain one; anyone else: as
    root of a user namespace); None where neither may mount a tmpfs here."""
    if shutil.which("unshare") is None:
        return None
    probe.mkdir()
    for prefix in (["unshare", "--mount"], ["unshare", "--user", "--map-root-user", "--mount"]):
        mount = [*prefix, "mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(probe)]
        if subprocess.run(mount, capture_output=True).returncode == 0:
            return prefix
    return None


def files_of(directory: pathlib.Path) -> dict:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def test_a_full_disk_during_a_save_is_one_line_keeps_the_last_checkpoint_and_a_rerun_with_room_resumes(
    tmp_path, uninterrupted
):
    """A real full filesystem (a tmpfs the size of one and a half checkpoints, in a mount namespace of
    the test's own): the periodic save of step 45 cannot be written, and the save of step 50 reports it."""
    prefix = unshare_mount(tmp_path / "probe")
    if prefix is None:
        pytest.skip("cannot mount a small filesystem here (no mount namespace)")
    workdir = copy_of(uninterrupted, tmp_path)
    checkpoints, last = workdir / "checkpoints", uninterrupted / "checkpoints" / "40"
    shutil.rmtree(checkpoints)
    checkpoints.mkdir()
    size_kib = sum(p.stat().st_size for p in last.rglob("*") if p.is_file()) * 3 // 2 // 1024
    train = " ".join(shlex.quote(a) for a in train_command(workdir, "train.steps=50", "checkpoint.every=5"))
    out = tmp_path / "out"
    script = f"""
        mount -t tmpfs -o size={size_kib}k tmpfs {checkpoints} && cp -a {last} {checkpoints}/ || exit 99
        {train} > {out}.full 2> {out}.full.err; echo $? > {out}.full.rc
        cp -a {checkpoints} {out}.after-failure
        mount -o remount,size=64m {checkpoints}
        {train} > {out}.room 2> {out}.room.err; echo $? > {out}.room.rc
        cp -a {checkpoints} {out}.after-rerun
    """
    done = run_process([*prefix, "sh", "-c", script], env=cpu_env())
    assert done.returncode == 0, done.stderr[-3000:]
    shutil.rmtree(checkpoints)  # the mount point, empty once its namespace is gone
    shutil.copytree(f"{out}.after-rerun", checkpoints)

    err = pathlib.Path(f"{out}.full.err").read_text()
    assert pathlib.Path(f"{out}.full.rc").read_text().strip() == "2", err[-3000:]
    assert err.splitlines() == [
        f"error: cannot save the checkpoint of step 45 to {checkpoints}: the disk is full (No space left on device); "
        f"step 40 ({checkpoints / '40'}) is the last complete checkpoint and is intact; "
        "free space and rerun the same command to resume from it"
    ], err[-3000:]
    after = sorted(os.listdir(f"{out}.after-failure"))
    assert after[0] == "40" and after[1:] and all(n.startswith("45.orbax-checkpoint-tmp") for n in after[1:]), after
    assert files_of(pathlib.Path(f"{out}.after-failure") / "40") == files_of(last), "bitwise what it was"

    err = pathlib.Path(f"{out}.room.err").read_text()
    assert pathlib.Path(f"{out}.room.rc").read_text().strip() == "0", err[-3000:]
    assert "Traceback" not in err and "Event loop is closed" not in err, err[-3000:]
    assert checkpoint_names(workdir) == ["40", "45", "50"], "resumed from 40; the partial save of 45 removed"
    assert int(final_state(workdir).step) == 50
    assert [r["step"] for r in metrics(workdir) if r["split"] == "train"] == list(range(0, 50, 3))


def start_and_signal(workdir, sig) -> tuple[subprocess.Popen, str]:
    """Start training, wait for its first complete checkpoint, send `sig`; (process, its output)."""
    proc = start(train_command(workdir))
    return proc, signal_when(proc, lambda: saved_steps(workdir), sig, "checkpoint")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "Ctrl-C"])
def test_a_signal_saves_says_how_to_resume_and_resumes_exactly(tmp_path, uninterrupted, sig):
    """Preemption (SIGTERM) and Ctrl-C (SIGINT): the step finishes, a checkpoint is saved, exit 3. One
    handler takes both, so the resume from where the signal stopped is checked once, after SIGTERM."""
    from jaxformer.checkpoint import EXIT_PREEMPTED

    proc, out = start_and_signal(tmp_path, sig)
    assert proc.returncode == EXIT_PREEMPTED, out[-3000:]
    assert "Traceback" not in out and "KeyboardInterrupt" not in out
    last = saved_steps(tmp_path)[-1]
    assert f"{sig.name}: saved step {last} to {tmp_path / 'checkpoints'}; rerun the same command to resume" in out
    assert 10 <= last < 40
    logged = [r["step"] for r in metrics(tmp_path) if r["split"] == "train"]
    assert logged == list(range(0, last, 3)), "the log and the checkpoint agree on where the run stopped"
    if sig == signal.SIGINT:
        return
    result = run(tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert_same_run(tmp_path, uninterrupted)


def copy_of(uninterrupted, tmp_path) -> pathlib.Path:
    workdir = tmp_path / "run"
    shutil.copytree(uninterrupted, workdir)
    return workdir


def write_meta(workdir, step: int, meta) -> None:
    (pathlib.Path(workdir) / "checkpoints" / str(step) / "meta" / "metadata").write_text(json.dumps(meta))


def good_meta(workdir, step: int) -> dict:
    return json.loads((pathlib.Path(workdir) / "checkpoints" / str(step) / "meta" / "metadata").read_text())


def wrong_type(meta: dict) -> dict:
    meta["config"]["model"]["d_model"] = "64"
    return meta


def wrong_step(meta: dict) -> dict:
    meta["data"]["step"] = "forty"
    return meta


@pytest.mark.parametrize(
    "damage",
    [lambda m: {}, lambda m: [], lambda m: {"config": None, "data": m["data"]}, wrong_type, wrong_step],
    ids=["empty", "list", "no_config", "field_of_wrong_type", "data_step_of_wrong_type"],
)
def test_metadata_that_parses_but_is_wrong_falls_back_to_the_previous_checkpoint(
    tmp_path, uninterrupted, capsys, damage
):
    from jaxformer.checkpoint import Checkpointer
    from jaxformer.config import from_dict
    from jaxformer.state import init_state

    workdir = copy_of(uninterrupted, tmp_path)
    write_meta(workdir, 40, damage(good_meta(workdir, 40)))
    cfg = from_dict(json.loads((workdir / "config.json").read_text()))
    ckpt = Checkpointer(workdir, cfg)
    state = ckpt.restore_latest(init_state(cfg)[1])
    ckpt.close()
    assert int(state.step) == 30, "fell back to the previous checkpoint, as for damaged state files"
    out = capsys.readouterr().out
    assert f"checkpoint {workdir / 'checkpoints' / '40'} cannot be restored (ValueError: its metadata" in out
    assert checkpoint_names(workdir) == ["20", "30", "corrupt-40"], "set aside, not deleted"


def test_a_damaged_latest_checkpoint_falls_back_to_the_previous_and_is_kept(tmp_path, uninterrupted, capsys):
    workdir = copy_of(uninterrupted, tmp_path)
    damage_state(workdir / "checkpoints" / "40")
    assert int(final_state(workdir).step) == 30, "fell back to the previous complete checkpoint"
    assert "checkpoints/40 cannot be restored" in capsys.readouterr().out
    assert checkpoint_names(workdir) == ["20", "30", "corrupt-40"], "set aside, not deleted"


def test_only_the_messages_of_io_orbax_abandoned_are_dropped(monkeypatch):
    """tensorstore finishing the reads of a failed restore or the writes of a failed save calls back
    into orbax's closed event loop, and the write coroutines orbax abandoned fail to import at
    interpreter shutdown: exactly those messages are dropped, every other one still reported."""
    from jaxformer.checkpoint import _quiet_abandoned_io

    seen = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: seen.append(u.exc_value))
    monkeypatch.setattr(sys, "is_finalizing", lambda: True)  # as at interpreter shutdown

    class RaisesWhenCollected:
        def __init__(self, error):
            self.error = error

        def __del__(self):
            raise self.error

    class FailsInOrbax:  # its __del__ runs code of a file of orbax's
        exec(compile("def __del__(self): raise ImportError('sys.meta_path is None')", "/orbax/x.py", "exec"))

    _quiet_abandoned_io()
    _quiet_abandoned_io()  # once only: a second Checkpointer does not wrap it again
    RaisesWhenCollected(RuntimeError("Event loop is closed"))
    FailsInOrbax()
    RaisesWhenCollected(RuntimeError("something else"))
    RaisesWhenCollected(ValueError("Event loop is closed"))
    RaisesWhenCollected(ImportError("sys.meta_path is None"))  # at shutdown, but not from orbax
    assert [f"{type(e).__name__}: {e}" for e in seen] == [
        "RuntimeError: something else",
        "ValueError: Event loop is closed",
        "ImportError: sys.meta_path is None",
    ]


def test_resuming_with_another_model_fails_naming_the_field_and_overwrites_nothing(tmp_path, uninterrupted, capsys):
    from jaxformer import cli

    workdir = copy_of(uninterrupted, tmp_path)
    before = tree(workdir)
    args = ["train", "--config", "experiments/copy_task.py", "--workdir", str(workdir), "--quiet"]
    sets = [x for o in [*OVERRIDES, "model.num_encoder_layers=3", "train.steps=200"] for x in ("--set", o)]
    assert cli.main([*args, *sets]) == 2
    assert "model.num_encoder_layers: checkpoint 1, config 3" in capsys.readouterr().err
    assert tree(workdir) == before, "nothing was overwritten"


def test_export_and_load_model_give_identical_logits(tmp_path, uninterrupted, capsys):
    from flax import nnx

    from jaxformer import cli
    from jaxformer.checkpoint import load_model
    from jaxformer.config import from_dict
    from jaxformer.state import init_state

    assert cli.main(["export", "--workdir", str(uninterrupted), "--out", str(tmp_path / "exported")]) == 0
    model = load_model(tmp_path / "exported")
    graphdef = init_state(from_dict(json.loads((uninterrupted / "config.json").read_text())))[0]
    original = nnx.merge(graphdef, final_state(uninterrupted).params)
    src = np.random.default_rng(0).integers(2, 11, (4, 10)).astype(np.int32)
    tgt = np.concatenate([np.ones((4, 1), np.int32), src[:, :-1]], axis=1)
    np.testing.assert_array_equal(model(src, tgt), original(src, tgt))
    assert not list((tmp_path / "exported").rglob("*opt_state*"))
    capsys.readouterr()
    for source in (["--exported", str(tmp_path / "exported")], ["--workdir", str(uninterrupted)]):
        assert cli.main(["translate", *source, "--src", "2 3 4 5 6"]) == 0
    from_export, from_workdir = capsys.readouterr().out.split("2 3 4 5 6\n=> ")[1:]
    assert from_export.strip() == from_workdir.strip() != "", "the exported model translates as the run's"


def tree(workdir) -> dict:
    """Every path under a workdir with its size and modification time."""
    return {str(p.relative_to(workdir)): (p.stat().st_size, p.stat().st_mtime_ns) for p in workdir.rglob("*")}


def test_read_only_commands_change_nothing_in_the_workdir(tmp_path, uninterrupted, capsys, caplog):
    from jaxformer import cli

    caplog.set_level(logging.WARNING)

    workdir = copy_of(uninterrupted, tmp_path)
    (workdir / "eval-40.json").unlink()
    write_meta(workdir, 40, {})  # damaged: a trainer would set it aside, a reader must only skip it
    before = tree(workdir)
    w = str(workdir)
    commands = [
        ["eval", "--workdir", w],
        ["translate", "--workdir", w, "--src", "2 3 4 5"],
        ["export", "--workdir", w, "--out", str(tmp_path / "exported")],
        ["plot", "--workdir", w, "--out", str(tmp_path / "curves.png")],
    ]
    for command in commands:
        assert cli.main(command) == 0, command
        out = capsys.readouterr().out
        if command[0] != "plot":
            assert f"checkpoint {workdir / 'checkpoints' / '40'} cannot be restored" in out, command
            assert "skipped, trying the previous one" in out
    after = tree(workdir)
    assert set(after) - set(before) == {"eval-30.json"}, "eval writes its results and nothing else"
    del after["eval-30.json"]
    assert after == before
    report = json.loads((workdir / "eval-30.json").read_text())
    assert report["step"] == 30 and 0 <= report["report"]["sequence_accuracy"] <= 1
    orbax_noise = ("Given directory is read only", "CheckpointManagerOptions.read_only")
    assert not [r for r in caplog.records if r.getMessage().startswith(orbax_noise)], (
        "orbax's warning about the read-only managers readers open on purpose is not shown"
    )


def test_generate_in_a_workdir_that_is_not_one_advises_train_and_creates_nothing(tmp_path, capsys):
    from jaxformer import cli

    empty = tmp_path / "empty"
    empty.mkdir()
    assert cli.main(["generate", "--workdir", str(empty), "--prompt", "To be"]) == 2
    message = capsys.readouterr().err
    assert "is not a training workdir" in message and "jaxformer train --config" in message
    assert "pass --config" not in message, "generate has no --config option"
    assert list(empty.iterdir()) == []


def test_training_saves_held_out_results_and_a_rerun_says_already_complete(tmp_path, uninterrupted, capsys):
    from jaxformer import cli, observe

    saved = json.loads((uninterrupted / "eval-40.json").read_text())
    assert saved["step"] == 40 and {"test_loss", "bleu", "sequence_accuracy"} <= saved["report"].keys()
    workdir = copy_of(uninterrupted, tmp_path)
    before = tree(workdir)
    args = ["train", "--config", "experiments/copy_task.py", "--workdir", str(workdir), "--quiet"]
    assert cli.main([*args, *[x for o in OVERRIDES for x in ("--set", o)]]) == 0
    out = capsys.readouterr().out
    assert f"{workdir} is already complete at step 40 (train.steps=40): nothing to train" in out
    shown = observe.report_lines("seq2seq", saved["report"])
    assert any("BLEU" in line for line in shown) and "\n".join(shown) in out, "the saved report, not a new one"
    assert tree(workdir) == before, "nothing trained, logged or saved again"


def test_a_non_finite_loss_stops_naming_the_step_and_causes_and_keeps_the_last_good_checkpoint(tmp_path, capsys):
    from jaxformer import cli
    from jaxformer.checkpoint import Checkpointer
    from jaxformer.config import from_dict
    from jaxformer.state import init_state

    # A learning rate of 1e30 after warmup's first step: finite parameters of ~1e29, then overflow.
    sets = [*OVERRIDES, "checkpoint.every=2", "train.learning_rate=1e30", "train.warmup_steps=10"]
    args = ["train", "--config", "experiments/copy_task.py", "--workdir", str(tmp_path), "--quiet"]
    assert cli.main([*args, *[x for o in sets for x in ("--set", o)]]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith("error: training stopped at step ")
    step = int(err.removeprefix("error: training stopped at step ").split(":")[0])
    assert "train.learning_rate too high" in err and "train.on_nonfinite=skip" in err
    kept = saved_steps(tmp_path)
    assert kept and kept[-1] <= step, "no checkpoint holds the non-finite step's update"
    assert err.endswith(f"{tmp_path / 'checkpoints' / str(kept[-1])} is the last good checkpoint")
    cfg = from_dict(json.loads((tmp_path / "config.json").read_text()))
    ckpt = Checkpointer(tmp_path, cfg, read_only=True)
    state = ckpt.restore_latest(init_state(cfg)[1])
    ckpt.close()
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(state.params))


def make_unwritable(directory: pathlib.Path) -> bool:
    """Make a directory unwritable (chmod, or for root the immutable flag); False if neither works here."""
    directory.chmod(0o555)
    probe = directory / "probe"
    try:
        probe.touch()
    except PermissionError:
        return True
    probe.unlink()  # root ignores modes
    return subprocess.run(["chattr", "+i", str(directory)], capture_output=True).returncode == 0


def test_a_run_that_cannot_write_its_checkpoints_fails_before_its_first_step(tmp_path, capsys):
    from jaxformer import cli

    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir()
    if not make_unwritable(checkpoints):
        pytest.skip("cannot make a directory unwritable here (root without chattr)")
    try:
        args = ["train", "--config", "experiments/copy_task.py", "--workdir", str(tmp_path), "--quiet"]
        assert cli.main([*args, *[x for o in OVERRIDES for x in ("--set", o)]]) == 2
    finally:
        subprocess.run(["chattr", "-i", str(checkpoints)], capture_output=True)
        checkpoints.chmod(0o755)
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: cannot write checkpoints to {checkpoints}: ") and len(err.splitlines()) == 1, err
    assert not (tmp_path / "metrics.jsonl").exists(), "no step ran"
    assert list(checkpoints.iterdir()) == []


@pytest.mark.parametrize(
    "name, value, field",
    [
        ("on_nonfinite", "skip", "train.on_nonfinite: checkpoint 'stop', config 'skip'"),
        ("optimizer", "adam", "train.optimizer: checkpoint 'adamw', config 'adam'"),
        ("clip_norm", 0.0, "train.clip_norm > 0: checkpoint True, config False"),
    ],
)
def test_resuming_with_another_optimizer_layout_is_refused_not_set_aside(tmp_path, uninterrupted, name, value, field):
    import dataclasses

    from jaxformer.checkpoint import Checkpointer
    from jaxformer.config import ConfigError, from_dict
    from jaxformer.state import init_state

    workdir = copy_of(uninterrupted, tmp_path)
    cfg = from_dict(json.loads((workdir / "config.json").read_text()))
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, **{name: value}))
    ckpt = Checkpointer(workdir, cfg)
    with pytest.raises(ConfigError, match=re.escape(field)):
        ckpt.restore_latest(init_state(cfg)[1])
    ckpt.close()
    assert checkpoint_names(workdir) == ["20", "30", "40"], "nothing set aside"


# Two pipeline stages of a layer each over 2 CPU devices, 2 micro-batches (GPipe): the kill and the resume
# of a pipelined run, its state saved and restored with the layers split over `stage`.
PIPELINED = ["model.num_decoder_layers=2", "model.scan_layers=true", "mesh.stage=2", "train.grad_accum=2"]


def corpus_command(workdir, corpus, pack, pipelined=False):
    """A tiny LM on a user's JSONL corpus: 24 steps of 8 windows, an epoch is longer. Packed, its
    feed-forward is a mixture of experts with a capacity and router noise (drawn per step: a resumed
    run must draw the same), so its exact resume covers MoE training too; pipelined, 2 stages."""
    sets = [
        "data.source=files", f"data.files={corpus}", f"data.pack={pack}", "data.max_examples=0", "data.max_len=32",
        "model.max_len=32", "model.d_model=32", "model.num_heads=2", "model.d_ff=64", "model.num_decoder_layers=1",
        "train.steps=24", "train.batch_size=8", "checkpoint.every=8", "train.log_every=1", "train.eval_every=24",
        "train.eval_batches=2", "train.num_samples=0", "train.warmup_steps=2", "train.peak_flops=1e13",
    ]  # fmt: skip
    if pack:
        sets += ["model.moe.num_experts=4", "model.moe.capacity_factor=1.25", "model.moe.router_noise=0.1",
                 "model.moe.aux_loss_weight=0.01", "model.moe.z_loss_weight=0.001"]  # fmt: skip
    sets += PIPELINED if pipelined else []
    args = ["train", "--config", "experiments/lm_shakespeare.py", "--workdir", str(workdir), "--quiet", "--no-report"]
    return [sys.executable, "-m", "jaxformer.cli", *args, *(x for s in sets for x in ("--set", s))]


@pytest.mark.parametrize("pack, pipelined", [(False, False), (True, False), (False, True)],
                         ids=["unpacked", "packed", "pipelined"])  # fmt: skip
def test_sigkill_mid_epoch_on_a_user_corpus_resumes_to_the_same_batches_and_state(tmp_path, pack, pipelined):
    corpus = tmp_path / "corpus.jsonl"
    rng = np.random.default_rng(0)
    words = ["to", "be", "or", "not", "that", "is", "the", "question"]
    corpus.write_text(
        "".join(json.dumps({"text": " ".join(rng.choice(words, n))}) + "\n" for n in rng.integers(2, 12, 800))
    )
    env = cpu_env(XLA_FLAGS="--xla_force_host_platform_device_count=2") if pipelined else cpu_env()
    command = corpus_command(tmp_path / "whole", corpus, pack, pipelined)
    whole = run_process(command, env=env)
    assert whole.returncode == 0, whole.stderr[-3000:]
    workdir = tmp_path / "killed"
    proc = start(corpus_command(workdir, corpus, pack, pipelined), env)
    # A checkpoint, and training on past it: killed mid-epoch.
    signal_when(proc, lambda: saved_steps(workdir), signal.SIGKILL, "checkpoint")
    assert saved_steps(workdir)[-1] < 24
    resumed = run_process(corpus_command(workdir, corpus, pack, pipelined), env=env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    train = lambda w: [r for r in metrics(w) if r["split"] == "train"]
    assert [r["step"] for r in train(workdir)] == list(range(24))
    assert train(workdir) == train(tmp_path / "whole")  # same batches: same losses, real_fraction, bitwise
    a, b = final_state(workdir), final_state(tmp_path / "whole")
    jax.tree.map(np.testing.assert_array_equal, a.params, b.params)
    epoch = build_dataset_len(tmp_path / "whole")
    assert epoch > 24, "the kill and the resume are inside the first epoch"


def build_dataset_len(workdir) -> int:
    from jaxformer.config import from_dict
    from jaxformer.data import build_dataset

    cfg = from_dict(json.loads((pathlib.Path(workdir) / "config.json").read_text()))
    return len(build_dataset(cfg, workdir).train)
