"""What a run leaves to look at: TensorBoard files TensorBoard itself reads, the environment, a
profiler trace of chosen steps, curves drawn to PNG; an `on_eval` hook that stops a run; and one
vocabulary for metrics in train logs, held-out reports and plan's table."""

import contextlib
import io
import json
import re
import types
import warnings

import numpy as np
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
    seen, logged = [], io.StringIO()
    with warnings.catch_warnings(record=True) as said, contextlib.redirect_stdout(logged):
        warnings.simplefilter("always")
        result = fit(cfg, workdir, on_eval=lambda step, m: seen.append((step, m)) or step >= STOP_AT,
                     profile_steps=(2, 4))  # fmt: skip
    return workdir, result, seen, [str(w.message) for w in said], logged.getvalue()


def test_on_eval_stop_saves_and_ends_the_run_there(run):
    workdir, result, seen, *_ = run
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


def test_plot_writes_where_it_says_it_does(run, tmp_path, capsys):
    """`--out` without a suffix is a PNG at OUT.png, a directory gets curves.png, another suffix its own
    format, a missing parent is made; each time the line printed names the file written."""
    workdir = run[0]
    cases = {
        tmp_path / "curves": tmp_path / "curves.png",
        tmp_path: tmp_path / "curves.png",
        tmp_path / "new" / "dir" / "run.svg": tmp_path / "new" / "dir" / "run.svg",
    }
    for out, written in cases.items():
        written.unlink(missing_ok=True)
        assert cli.main(["plot", "--workdir", str(workdir), "--out", str(out)]) == 0
        assert capsys.readouterr().out.strip() == f"wrote {written}"
        data = written.read_bytes()
        assert data.startswith(b"\x89PNG") if written.suffix == ".png" else b"<svg" in data[:2000]


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


def test_train_logs_and_plan_print_mfu_and_tokens_per_second_alike(run):
    """MFU is a percentage and tokens/s a count with separators, said the same way by a training
    run's log and by plan's roofline; an evaluation line names its metrics without the token count."""
    from jaxformer import observe
    from jaxformer.plan import Plan

    workdir, logged = run[0], run[4].splitlines()
    records = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
    records = {r["step"]: r for r in records if r["split"] == "train"}
    steps = [x for x in logged if re.match(r"step \d+: loss", x)]
    assert steps and all(
        re.fullmatch(r"step \d+: loss \d+\.\d{4}, tokens/s [\d,]+, MFU [\d.]+%, ETA \d+s", x) for x in steps
    )
    for x in steps:  # the figures of metrics.jsonl, as observe says them
        record = records[int(x.split(":")[0].split()[1])]
        assert x.startswith(f"step {record['step']}: {observe.line(record, ('loss', 'tokens_per_s', 'mfu'))}, ETA")
    evals = [x for x in logged if re.match(r"step \d+: eval", x)]
    t = load_experiment("experiments/copy_task.py").train
    on = rf"the validation split \({t.eval_batches * t.batch_size:,} sequences\)"  # generated: every batch full
    assert evals and all(
        re.fullmatch(rf"step \d+: eval on {on}: loss [\d.]+, perplexity [\d.]+, accuracy [\d.]+%", x) for x in evals
    )
    sizes = dict(parameters=0, optimizer_state=0, gradients=0, activations=0, arguments=0, outputs=0, aliased=0)
    planned = Plan(
        devices=4, mesh={"data": 4}, batch_size=8, **sizes, temporaries=0, code=0, peak=0, flops_per_device=2e12,
        model_flops=6e12, bytes_accessed=1e9, compute_seconds=0.01, memory_seconds=0.002, step_seconds=0.01,
        tokens_per_second=123456.0, mfu_ceiling=0.0949,
    )  # fmt: skip
    table = planned.table()
    assert "ceilings: tokens/s 123,456, MFU 9.49%" in table
    assert observe.show("mfu", 0.0949) == "MFU 9.49%" and observe.show("tokens_per_s", 123456.0) == "tokens/s 123,456"
    assert "FLOPs per step: XLA's 2e+12 per device, 8e+12 in all; the model's 1.5e+12 per device, 6e+12 in all" in table


class _Rows:
    """One held-out batch, as `data.Batches` gives it."""

    padded = False  # a full batch

    def __init__(self, batch):
        self.batch = batch

    def __len__(self):
        return 1

    def sequences(self, num_batches):
        return num_batches * len(next(iter(self.batch.values())))

    def get(self, i, rows=None):
        return self.batch


def _held_out(objective: str, batch: dict, sums: dict) -> tuple[dict, str]:
    """`evaluate_model`'s report for an eval step that returns `sums`, and the report as printed."""
    from jaxformer.evaluate import evaluate_model
    from jaxformer.observe import report_lines

    experiment = {"classify": "classify_lohelp", "lm": "lm_shakespeare"}[objective]
    cfg = load_experiment(f"experiments/{experiment}.py")
    data = types.SimpleNamespace(train=_Rows(batch), test=_Rows(batch))
    eval_step = lambda state, b: {k: np.float32(v) for k, v in sums.items()}
    report = evaluate_model(cfg, None, None, data, eval_step, None, num_batches=1)
    return report, "\n".join(report_lines(objective, report))


def test_a_classifier_reports_accuracy_and_cross_entropy_not_perplexity():
    labels = np.array([1, 1, 1, 0], np.int32)  # the majority class, 1, is right 3 times in 4
    batch = {"src": np.ones((4, 8), np.int32), "src_lengths": np.full(4, 8, np.int32), "label": labels}
    report, printed = _held_out("classify", batch, {"loss": 2.4, "nll": 2.0, "correct": 2.0, "count": 4.0})
    assert "test_perplexity" not in report and "perplexity" not in printed and "tokens" not in printed
    assert re.search(r"accuracy +50\.00% +majority class: 75\.00%", printed)
    assert re.search(r"loss +0\.6000", printed) and re.search(r"cross-entropy +0\.5000", printed)


def test_a_language_model_reports_perplexity_beside_the_unigram_model():
    ids = np.array([[3, 4, 5, 3]], np.int32)
    batch = {"inputs": ids, "targets": ids, "weights": np.ones((1, 4), np.float32)}
    report, printed = _held_out("lm", batch, {"loss": 8.0, "nll": 8.0, "correct": 1.0, "count": 4.0})
    assert report["test_perplexity"] == pytest.approx(np.exp(2.0)) and "unigram_perplexity" in report
    assert re.search(r"perplexity +7\.389 +unigram model: [\d.]+", printed) and "accuracy     " in printed
    assert "cross-entropy" not in printed and "majority" not in printed


def test_a_moe_models_log_line_shows_its_router(tmp_path):
    """With MoE layers the terminal's step line adds the load-balancing loss and the dropped share, the
    figures metrics.jsonl holds for that step."""
    from jaxformer import observe

    cfg = apply_overrides(
        load_experiment("experiments/copy_task.py"),
        ["model.moe.num_experts=4", "model.moe.capacity_factor=1.0", "model.num_encoder_layers=1",
         "model.num_decoder_layers=1", "train.steps=3", "train.log_every=1", "train.eval_every=3",
         "train.num_samples=0"],
    )  # fmt: skip
    logged = io.StringIO()
    with contextlib.redirect_stdout(logged):
        fit(cfg, tmp_path)
    records = {r["step"]: r for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())
               if r["split"] == "train"}  # fmt: skip
    steps = [x for x in logged.getvalue().splitlines() if re.match(r"step \d+: loss", x)]
    assert steps
    for x in steps:
        record = records[int(x.split(":")[0].split()[1])]
        router = f"{observe.show('load_balance_loss', record['load_balance_loss'])}, "
        router += observe.show("dropped_fraction", record["dropped_fraction"])
        assert re.fullmatch(r"step \d+: loss [\d.]+, tokens/s [\d,]+, MFU [\d.]+%, (.*), ETA \d+s", x)[1] == router
