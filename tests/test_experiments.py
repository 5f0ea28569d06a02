"""End to end through the command line: the copy task is learnt, eval reproduces train's figures, and
eval and translate with the sequence split over a context axis reproduce one device's."""

import contextlib
import io
import pathlib
import re
import shutil
import sys

import processes
import pytest

from jaxformer import cli


def figures(text: str) -> dict[str, float]:
    """The held-out report's lines, "  sequence accuracy    100.00%" -> {"sequence accuracy": 100.0}."""
    return {k: float(v) for k, v in re.findall(r"^  (\w+(?: \w+)*) {2,}(-?[\d.]+)%?", text, re.M)}


@pytest.fixture(scope="module")
def copy_run(tmp_path_factory) -> tuple[pathlib.Path, dict[str, float]]:
    """The copy task trained once for the module: its workdir and the held-out figures train printed.

    300 steps, not the experiment's 400: runs of 200, 250 and 300 steps (the cosine schedule decaying to
    each) copied 85.7%, 99.4% and 100% of the held-out sequences exactly, so 300 learns it with margin.
    MFU's peak given: no matmul probe, MFU is no figure this test reads. One evaluation, at the end, and
    no sample translations (the experiment's evaluation at step 200 and its samples at each: ~2 s of
    CPU, read by no test); training is the same to the bit, its log's train rows and the report equal."""
    workdir = tmp_path_factory.mktemp("copy")
    out = io.StringIO()
    settings = ["train.steps=300", "train.peak_flops=1e13", "train.eval_every=300", "train.num_samples=0"]
    sets = [a for s in settings for a in ("--set", s)]
    with contextlib.redirect_stdout(out):
        assert cli.main(["train", "--config", "experiments/copy_task.py", "--workdir", str(workdir), *sets]) == 0
    return workdir, figures(out.getvalue())


def test_copy_task_is_learnt_and_eval_agrees(copy_run, capsys):
    """Acceptance: greedy decoding copies >= 99% of held-out sequences exactly (Annotated Transformer task)."""
    copy_run, trained = copy_run
    assert trained["sequence accuracy"] >= 99, trained
    assert (copy_run / "config.json").is_file() and (copy_run / "metrics.jsonl").is_file()
    assert any((copy_run / "tensorboard").iterdir())
    assert cli.main(["eval", "--workdir", str(copy_run)]) == 0
    evaluated = figures(capsys.readouterr().out)
    assert evaluated["sequence accuracy"] == trained["sequence accuracy"]
    assert evaluated["loss"] == pytest.approx(trained["loss"], rel=1e-6)


SOURCES = ["2 3 4 5 6", "7 8 9 3 2 4 5 6 7"]
ON_A_CONTEXT_AXIS = """
import json, pathlib, sys
import jax
from jaxformer import cli
w = pathlib.Path(sys.argv[1])
print(jax.device_count(), "devices")
assert cli.main(["eval", "--workdir", str(w), "--set", "mesh.context=2"]) == 0
saved = json.loads((w / "config.json").read_text())  # translate takes the workdir's mesh (--set: decode only)
(w / "config.json").write_text(json.dumps(saved | {"mesh": saved["mesh"] | {"context": 2}}))
args = [a for src in sys.argv[2:] for a in ("--src", src)]
assert cli.main(["translate", "--workdir", str(w), *args]) == 0
"""


def test_eval_and_translate_over_a_context_axis_equal_one_device(copy_run, tmp_path, capsys):
    """`eval --set mesh.context=2` and `translate` from a workdir whose config has mesh.context=2, on 2
    devices (the CLI's own mesh: sequences and the KV cache split by position, ring attention): the
    held-out figures train printed, and one device's translations."""
    workdir, trained = copy_run
    assert cli.main(["translate", "--workdir", str(workdir), *(a for s in SOURCES for a in ("--src", s))]) == 0
    one_device = capsys.readouterr().out
    split = tmp_path / "copy"
    shutil.copytree(workdir, split)  # eval saves its report in the workdir; translate reads its config
    env = processes.cpu_env(XLA_FLAGS="--xla_force_host_platform_device_count=2")  # compiled as `train` was here
    proc = processes.run([sys.executable, "-c", ON_A_CONTEXT_AXIS, str(split), *SOURCES], env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.startswith("2 devices")
    evaluated = figures(proc.stdout)
    assert evaluated["sequence accuracy"] == trained["sequence accuracy"]
    assert evaluated["loss"] == pytest.approx(trained["loss"], rel=1e-5)
    translations = proc.stdout[proc.stdout.index(SOURCES[0] + "\n=>") :]
    assert translations.strip() == one_device.strip() != ""


@pytest.mark.parametrize(
    "name",
    [
        "lm_shakespeare",
        "moe_shakespeare",
        "moe_mlm_shakespeare",
        "switch_translate",
        "translate_en_de",
        "classify_lohelp",
        "mlm_shakespeare",
        "paper_base_en_de",
        "gpt2_1p3b",
        "instruct_tiny",
        "llama_7b_lora",
        "llama_70b",
        "dpo_tiny",
        "qwen3_8b_lora",
        "gemma3_12b",
        "deepseek_v3",
    ],
)
def test_every_experiment_validates_and_documents_its_command(name):
    import ast

    from jaxformer.config import Config, load_experiment

    path = f"experiments/{name}.py"
    assert isinstance(load_experiment(path), Config)  # all sections validated on construction
    doc = ast.get_docstring(ast.parse(pathlib.Path(path).read_text()))
    assert f"jaxformer train --config {path} --workdir runs/{name}" in doc
    # How long it takes on 2 CPU cores and when its output is worth reading: a time (minutes, or seconds a
    # step), "time not measured" with its reason in brackets, or, for a model of an accelerator's size,
    # "not a CPU run" first and what a CPU does with it.
    assert "Time and output:" in doc and "2 CPU cores" in doc, f"{path}: say how long it takes and when to read it"
    said = " ".join(doc.split("Time and output:", 1)[1].split())
    assert re.search(r"\d (min|minutes|s a step)\b|^not a CPU run: |time not measured \(", said), said


def test_check_names_the_devices_and_runs_each_mode(capsys):
    import jax

    import jaxformer as jf

    assert cli.main(["check"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"jax {jax.__version__}: 1 x cpu (cpu)"
    for line, mode in zip(lines[1:], ("encoder_only", "decoder_only", "encoder_decoder"), strict=True):
        params = jf.count_params(jf.build_model(jf.tiny(mode, vocab_size=100, d_model=64, num_heads=4, d_ff=256)))
        assert line.split() == [mode, f"{params:,d}", "params", "logits", "(2,", "16,", "100)"], line
