"""What a run leaves behind to be looked at: metrics (JSONL + TensorBoard), the environment it ran
in, profiler traces of chosen steps, and plots of its curves.

    workdir/metrics.jsonl      one record per logged step: {"step", "split": "train" | "eval", metric: value}
    workdir/tensorboard/       the same scalars as TensorBoard event files ("train/loss", "eval/accuracy", ...)
    workdir/environment.json   versions, devices, mesh and host of the (latest) run
    workdir/profile/           `jax.profiler` trace of the steps of `--profile-steps A:B` (TensorBoard / XProf)
    workdir/curves.png         `jaxformer plot --workdir ...`

Only process 0 writes (the caller passes a NullWriter elsewhere).
"""

from __future__ import annotations

import importlib.metadata
import json
import math
import pathlib
import platform
import warnings

import jax

PACKAGES = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "numpy")


class MetricWriter:
    """Metrics to a JSONL file and TensorBoard event files in the workdir.

    A run starting at step N (N = 0 for a fresh start, including a fallback to training from
    scratch) first drops the records the checkpoint does not contain (train steps >= N,
    evaluations after N), so the log of a resumed run equals that of an uninterrupted one.

    Args:
        workdir: the run's directory (metrics.jsonl, tensorboard/).
        resume_step: N, the step the run starts from.
    """

    def __init__(self, workdir: pathlib.Path, resume_step: int = 0):
        from tensorboardX import SummaryWriter

        path = workdir / "metrics.jsonl"
        existed = path.is_file()
        if existed:
            kept = [
                line
                for line, r in _records(path)
                if r["step"] < resume_step or (r["split"] == "eval" and r["step"] == resume_step)
            ]
            path.write_text("".join(line + "\n" for line in kept))
        self.jsonl = path.open("a")
        self.tb = SummaryWriter(str(workdir / "tensorboard"), purge_step=resume_step if existed else None)

    def write(self, step: int, split: str, metrics: dict) -> None:
        """One record: a JSONL line and a TensorBoard scalar per metric (`split/name`).

        Args:
            step: the training step.
            split: "train" or "eval".
            metrics: name -> number.
        """
        values = {k: float(v) for k, v in metrics.items()}
        self.jsonl.write(json.dumps({"step": step, "split": split, **values}) + "\n")
        self.jsonl.flush()
        for k, v in values.items():
            self.tb.add_scalar(f"{split}/{k}", v, step)

    def close(self) -> None:
        """Closes both files."""
        self.jsonl.close()
        self.tb.close()


class NullWriter:
    """What processes other than 0 write to."""

    def write(self, *args) -> None:
        """Nothing."""

    def close(self) -> None:
        """Nothing."""


def _percent(x: float) -> str:
    """Three significant digits: 42.1% on a TPU, 2.00%, 0.0123% on a CPU against a GPU's peak."""
    p = 100 * x
    digits = 2 - math.floor(math.log10(abs(p))) if p and math.isfinite(p) else 1
    return f"{p:.{max(digits, 0)}f}%"


# One name and format per metric for everything a command prints (train logs, held-out reports,
# plan's table): fractions as percentages, rates with thousands separators. metrics.jsonl and the
# saved reports keep the raw keys and values (fractions).
METRICS = {
    "loss": ("loss", "{:.4f}".format),
    "nll": ("cross-entropy", "{:.4f}".format),  # unsmoothed: a classifier's log loss; log(perplexity) for tokens
    "perplexity": ("perplexity", "{:.3f}".format),
    "accuracy": ("accuracy", "{:.2%}".format),
    "sequence_accuracy": ("sequence accuracy", "{:.2%}".format),
    "bleu": ("BLEU", "{:.2f}".format),
    "tokens_per_s": ("tokens/s", "{:,.0f}".format),
    "mfu": ("MFU", _percent),
    "flops": ("FLOPs", "{:.4g}".format),
    # mixture of experts (means over the MoE layers; the share of token-expert pairs past capacity)
    "router_z_loss": ("router z-loss", "{:.4f}".format),
    "load_balance_loss": ("load-balancing loss", "{:.4f}".format),
    "dropped_fraction": ("dropped tokens", "{:.2%}".format),
    "router_entropy": ("router entropy", "{:.4f}".format),  # nats per token: log E when uniform
    # expert_load/<l>/<e>: the share of MoE layer l's tokens that chose expert e (a layer's sum to k)
    "expert_load": ("expert load", "{:.2%}".format),
    # preference pairs (TRL's names): the share whose chosen reward is the larger, the mean reward margin
    "rewards/accuracies": ("reward accuracy", "{:.2%}".format),
    "rewards/margins": ("reward margin", "{:.4f}".format),
}


# A model with MoE layers: the router figures its training log line adds (all are in metrics.jsonl)
ROUTER_SHOWN = ("load_balance_loss", "dropped_fraction")

# The held-out report's baselines (evaluate.py), each beside the figure it is a baseline for.
BASELINES = {
    "perplexity": ("unigram_perplexity", "unigram model"),
    "accuracy": ("majority_accuracy", "majority class"),
    "bleu": ("copy_source_bleu", "copying the source"),
}


def value(metric: str, x: float) -> str:
    """`x` in `metric`'s format: 0.1234 accuracy -> "12.34%", mfu -> "12.3%", 12345.6 tokens_per_s -> "12,346".

    Args:
        metric: a name in `METRICS`.
        x: its value.

    Returns:
        The formatted value.
    """
    return METRICS[metric][1](x)


def show(metric: str, x: float) -> str:
    """A metric as every command prints it: "loss 2.3456", "accuracy 87.50%", "MFU 14.0%".

    Args:
        metric: a name in `METRICS`.
        x: its value.

    Returns:
        The metric's label and formatted value.
    """
    return f"{METRICS[metric][0]} {value(metric, x)}"


def shown(objective: str) -> tuple[str, ...]:
    """The metrics an evaluation of `objective` prints: perplexity says nothing of a classifier's labels.

    Args:
        objective: the train section's objective.

    Returns:
        The metric names.
    """
    if objective == "preference":  # TRL's names: the share of pairs whose chosen reward is the larger, the margin
        return ("loss", "rewards/accuracies", "rewards/margins")
    return ("loss", "nll", "accuracy") if objective == "classify" else ("loss", "perplexity", "accuracy")


def line(metrics: dict, keys) -> str:
    """ "loss 2.3456, tokens/s 12,345, MFU 14.0%": the `keys` that `metrics` holds, in order.

    Args:
        metrics: name -> value.
        keys (Iterable[str]): the names to show, in order.

    Returns:
        One line.
    """
    return ", ".join(show(k, metrics[k]) for k in keys if k in metrics)


def report_lines(objective: str, report: dict) -> list[str]:
    """The held-out report as `train` and `eval` print it: `objective`'s figures on the test split
    (report keys `test_<metric>`), each beside its baseline, then the translation figures.

    Args:
        objective: the train section's objective.
        report: the held-out report (`evaluate`).

    Returns:
        The lines to print.
    """
    figures = [(m, f"test_{m}") for m in shown(objective)] + [(m, m) for m in ("bleu", "sequence_accuracy")]
    lines = []
    for m, key in figures:
        if key not in report:
            continue
        text = f"  {METRICS[m][0]:18s} {value(m, report[key]):>9s}"
        if (base := BASELINES.get(m)) and base[0] in report:
            text += f"   {base[1]}: {value(m, report[base[0]])}"
        lines.append(text)
    for ex in report.get("examples", []):
        lines.append(f"  src: {ex['src']}\n  ref: {ex['ref']}\n  hyp: {ex['hyp']}\n")
    return lines


def environment(mesh: jax.sharding.Mesh) -> dict:
    """Versions, devices, processes and mesh of this run.

    Args:
        mesh: the run's device mesh.

    Returns:
        name -> value, as written to the workdir.
    """
    from jaxformer import sharding

    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return {
        "python": platform.python_version(),
        **versions,
        "backend": jax.default_backend(),
        "device_kind": jax.devices()[0].device_kind,
        "devices": jax.device_count(),
        "local_devices": jax.local_device_count(),
        "processes": jax.process_count(),
        "mesh": sharding.axis_sizes(mesh),
        "host": platform.node(),
    }


def parse_steps(text: str | None) -> tuple[int, int] | None:
    """'A:B' -> (A, B): steps A..B-1 (the `--profile-steps` form); None passes through.

    Args:
        text: "A:B", or None.

    Returns:
        (A, B), or None.

    Raises:
        ValueError: not two integers 0 <= A < B.
    """
    if text is None:
        return None
    try:
        a, b = (int(x) for x in text.split(":"))
    except ValueError:
        raise ValueError(f"--profile-steps takes A:B (e.g. 10:15), got {text!r}") from None
    if not 0 <= a < b:
        raise ValueError(f"--profile-steps {text}: needs 0 <= A < B")
    return a, b


class Profiler:
    """A `jax.profiler` trace of steps [A, B) into workdir/profile (a no-op without steps).

    `before(step)` is called before dispatching a step, `after(step, outputs)` once it is
    dispatched; the trace stops when step B-1 has finished running, not just been dispatched.

    Args:
        workdir: the run's directory (the trace goes to workdir/profile).
        steps: (A, B), or None for no trace.
    """

    def __init__(self, workdir: pathlib.Path, steps: tuple[int, int] | None):
        self.directory = workdir / "profile"
        self.steps = steps
        self.active = False

    def before(self, step: int) -> None:
        """Starts the trace at step A (not in a process that compiled for a TPU it lacks).

        Args:
            step: the step about to be dispatched.
        """
        if self.steps and step == self.steps[0]:
            from jaxformer import tpu

            if tpu.compile_only_loaded:
                warnings.warn(
                    "no profile: this process compiled for a TPU slice it does not have (jaxformer plan --target "
                    "tpu-...), and JAX's profiler crashes once libtpu is loaded that way; profile in a fresh process",
                    stacklevel=2,
                )
                self.steps = None
                return
            jax.profiler.start_trace(str(self.directory))
            self.active = True

    def after(self, step: int, outputs) -> None:
        """Stops the trace once step B-1 has run.

        Args:
            step: the step just dispatched.
            outputs (Any): its outputs, waited for at step B-1.
        """
        if self.active and step == self.steps[1] - 1:
            jax.block_until_ready(outputs)
            self.stop()

    def stop(self) -> None:
        """Stops a running trace (a run that ends before step B)."""
        if self.active:
            jax.profiler.stop_trace()
            self.active = False


def _records(path: pathlib.Path) -> list[tuple[str, dict]]:
    """(line, record) of each line of a metrics.jsonl. A partial last line (a crash mid-write) is
    dropped with a notice; an unreadable line elsewhere is an error naming it."""
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    out = []
    for i, line in enumerate(lines):
        try:
            record = json.loads(line)
            if not isinstance(record, dict) or not {"step", "split"} <= record.keys():
                raise ValueError("not a metrics record")
        except ValueError as e:
            if i < len(lines) - 1:
                raise OSError(f"{path}, line {i + 1}: {e}; fix or remove that line") from None
            print(f"warning: dropped the partial last line of {path} (a run stopped while writing it)")
            continue
        out.append((line, record))
    return out


def read_metrics(workdir: str | pathlib.Path) -> list[dict]:
    """The records of a run's metrics.jsonl (a partial last line dropped with a notice).

    Args:
        workdir: the run's directory.

    Returns:
        One dict per record: step, split and the metrics.

    Raises:
        FileNotFoundError: the workdir has no metrics.jsonl.
        OSError: a line other than the last is not a record.
    """
    path = pathlib.Path(workdir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: is {workdir} a training workdir?")
    return [r for _, r in _records(path)]


def curve(records: list[dict], split: str, metric: str) -> tuple[list[int], list[float]]:
    """One metric of one split against step.

    Args:
        records: `read_metrics`'s records.
        split: "train" or "eval".
        metric: the metric's name.

    Returns:
        (steps, values).
    """
    rows = [(r["step"], r[metric]) for r in records if r["split"] == split and metric in r]
    return [s for s, _ in rows], [v for _, v in rows]


def expert_loads(records: list[dict]) -> dict[int, list[int]]:
    """{MoE layer: its experts} named by the run's `expert_load/<layer>/<expert>` metrics (empty: no MoE).

    Args:
        records: `read_metrics`'s records.

    Returns:
        {layer: sorted expert indices}.
    """
    layers: dict[int, set] = {}
    for r in records:
        for key in r:
            if key.startswith("expert_load/"):
                layer, expert = key.split("/")[1:]
                layers.setdefault(int(layer), set()).add(int(expert))
    return {layer: sorted(experts) for layer, experts in sorted(layers.items())}


def plot_run(workdir: str | pathlib.Path, out: str | pathlib.Path | None = None) -> pathlib.Path:
    """Loss (train and eval), eval accuracy and learning rate against step, to a PNG. A run with
    MoE layers gets a second row: each MoE layer's expert load (the share of its tokens that chose
    each expert, one line per expert) over training.

    Args:
        workdir: the run's directory.
        out: the image's path (a PNG without a suffix; another suffix matplotlib knows, such as .svg or
            .pdf, in that format), or a directory to write curves.png in; None: workdir/curves.png.

    Returns:
        The path of the image written.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(workdir)
    loads = expert_loads(records)
    fig = plt.figure(figsize=(15, 8 if loads else 4), layout="constrained")
    top, bottom = fig.subfigures(2, 1) if loads else (fig, None)
    axes = top.subplots(1, 3)
    for split in ("train", "eval"):
        axes[0].plot(*curve(records, split, "loss"), label=f"{split} loss", marker="o" if split == "eval" else None)
    axes[0].set(xlabel="step", ylabel="loss", yscale="log", title="loss")
    axes[0].legend()
    axes[1].plot(*curve(records, "eval", "accuracy"), marker="o")
    axes[1].set(xlabel="step", ylabel="token accuracy", title="eval accuracy")
    axes[2].plot(*curve(records, "train", "learning_rate"))
    axes[2].set(xlabel="step", ylabel="learning rate", title="learning rate")
    if loads:
        panels = bottom.subplots(1, len(loads), squeeze=False)[0]
        for ax, (layer, experts) in zip(panels, loads.items(), strict=True):
            for e in experts:
                ax.plot(*curve(records, "train", f"expert_load/{layer}/{e}"), label=f"expert {e}")
            ax.set(xlabel="step", ylabel="share of tokens", title=f"expert load, MoE layer {layer}")
        panels[-1].legend(fontsize="small")
    fig.suptitle(str(workdir))
    out = pathlib.Path(out if out else workdir)
    if out.is_dir():
        out = out / "curves.png"
    elif not out.suffix:  # matplotlib would write OUT.png and the path returned would not be the file's
        out = out.with_suffix(".png")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
