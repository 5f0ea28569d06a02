"""End to end through the command line: the copy task is learnt, and eval reproduces train's figures."""

import pathlib
import re

import pytest

from jaxformer import cli


def figures(text: str) -> dict[str, float]:
    """The held-out report's lines, "  sequence accuracy    100.00%" -> {"sequence accuracy": 100.0}."""
    return {k: float(v) for k, v in re.findall(r"^  (\w+(?: \w+)*) {2,}(-?[\d.]+)%?", text, re.M)}


@pytest.fixture(scope="module")
def copy_run(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("copy")
    return workdir


def test_copy_task_is_learnt_and_eval_agrees(copy_run, capsys):
    """Acceptance: greedy decoding copies >= 99% of held-out sequences exactly (Annotated Transformer task)."""
    assert cli.main(["train", "--config", "experiments/copy_task.py", "--workdir", str(copy_run)]) == 0
    trained = figures(capsys.readouterr().out)
    assert trained["sequence accuracy"] >= 99, trained
    assert (copy_run / "config.json").is_file() and (copy_run / "metrics.jsonl").is_file()
    assert any((copy_run / "tensorboard").iterdir())
    assert cli.main(["eval", "--workdir", str(copy_run)]) == 0
    evaluated = figures(capsys.readouterr().out)
    assert evaluated["sequence accuracy"] == trained["sequence accuracy"]
    assert evaluated["loss"] == pytest.approx(trained["loss"], rel=1e-6)


@pytest.mark.parametrize(
    "name",
    [
        "lm_shakespeare",
        "moe_shakespeare",
        "switch_translate",
        "translate_en_de",
        "classify_lohelp",
        "mlm_shakespeare",
        "paper_base_en_de",
        "gpt2_1p3b",
        "instruct_tiny",
        "llama_7b_lora",
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
