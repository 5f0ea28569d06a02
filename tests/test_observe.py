"""What a run leaves to look at: TensorBoard files TensorBoard itself reads, the environment, a
profiler trace of chosen steps, curves drawn to PNG; and an `on_eval` hook that stops a run."""

import json
import warnings

import pytest

from jaxformer import cli, tpu
from jaxformer.config import apply_overrides, load_experiment
from jaxformer.train import fit

STEPS, EVAL_EVERY, STOP_AT = 30, 10, 20


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The copy task, evaluated every 10 steps, stopped by its hook at step 20, steps 2-3 profiled."""
    workdir = tmp_path_factory.mktemp("observed")
    cfg = apply_overrides(
        load_experiment("experiments/copy_task.py"),
        [
            f"train.steps={STEPS}",
            f"train.eval_every={EVAL_EVERY}",
            "train.log_every=1",
            "train.num_samples=0",
            "train.peak_flops=1e13",
        ],
    )
    seen = []
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        result = fit(cfg, workdir, quiet=True, on_eval=lambda step, m: seen.append((step, m)) or step >= STOP_AT,
                     profile_steps=(2, 4))  # fmt: skip
    return workdir, result, seen, [str(w.message) for w in said]


def test_on_eval_stop_saves_and_ends_the_run_there(run):
    workdir, result, seen, _ = run
    assert result["stopped"] and [s for s, _ in seen] == [10, 20]
    assert int(result["state"].step) == STOP_AT
    assert sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())[-1] == STOP_AT
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert max(r["step"] for r in records) == STOP_AT
    assert seen[-1][1]["loss"] == pytest.approx(records[-1]["loss"]) and records[-1]["split"] == "eval"


def test_tensorboard_reads_back_what_the_jsonl_log_holds(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    workdir = run[0]
    events = EventAccumulator(str(workdir / "tensorboard"))
    events.Reload()
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    for split, metric in (("train", "loss"), ("train", "learning_rate"), ("eval", "accuracy")):
        logged = {r["step"]: r[metric] for r in records if r["split"] == split}
        read = {e.step: e.value for e in events.Scalars(f"{split}/{metric}")}
        assert read.keys() == logged.keys() and len(read) >= 2
        assert all(read[s] == pytest.approx(logged[s], rel=1e-6) for s in read)  # float32 in the event file


def test_environment_and_profile_are_written(run):
    import jax

    workdir = run[0]
    env = json.loads((workdir / "environment.json").read_text())
    assert env["jax"] == jax.__version__ and env["flax"] and env["optax"] and env["orbax-checkpoint"]
    assert env["devices"] == jax.device_count() and env["mesh"] == {"data": 1, "fsdp": 1, "tensor": 1}
    traces = list((workdir / "profile").rglob("*.xplane.pb"))
    if tpu.compile_only_loaded:  # this worker compiled for a TPU slice first (test_tpu): no profiler, said so
        assert traces == [] and any("no profile: this process compiled for a TPU slice" in w for w in run[3])
        return
    assert len(traces) == 1 and traces[0].stat().st_size > 1000


def test_plot_draws_the_curves(run, capsys):
    workdir = run[0]
    assert cli.main(["plot", "--workdir", str(workdir)]) == 0
    png = (workdir / "curves.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    assert cli.main(["plot", "--workdir", str(workdir / "nothing")]) == 2
    assert "metrics.jsonl does not exist" in capsys.readouterr().err


def test_bad_profile_steps_fail_before_training(tmp_path, capsys):
    args = ["train", "--config", "experiments/copy_task.py", "--workdir", str(tmp_path), "--profile-steps", "5:2"]
    assert cli.main(args) == 2
    assert "needs 0 <= A < B" in capsys.readouterr().err
    assert not (tmp_path / "config.json").exists()


def test_mfu_is_model_flops_over_the_configured_peak(run):
    """MFU / (tokens/s) is the model's FLOPs per target token over train.peak_flops (1e13 here), and
    tokens/s x step time is one batch's tokens at every logged step, those that end at an evaluation too."""
    from jaxformer.train import flops_per_example

    workdir = run[0]
    cfg = load_experiment("experiments/copy_task.py")
    L = cfg.data.synthetic_len  # copy task: every target position is a token
    per_token = flops_per_example(cfg.model, "seq2seq", L, L) / L
    rows = [r for r in map(json.loads, (workdir / "metrics.jsonl").read_text().splitlines()) if "mfu" in r]
    assert [r["step"] for r in rows] == list(range(1, STOP_AT))  # step 0 compiled: it has no rate
    for r in rows:
        assert r["mfu"] == pytest.approx(r["tokens_per_s"] * per_token / 1e13, rel=1e-4)
        assert r["tokens_per_s"] * r["step_time"] == pytest.approx(cfg.train.batch_size * L, rel=1e-6)
