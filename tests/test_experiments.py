"""End to end through the command line: the copy task is learnt, and eval reproduces train's figures."""

import pathlib
import re

import pytest

from jaxformer import cli


def figures(text: str) -> dict[str, float]:
    return {k: float(v) for k, v in re.findall(r"^  (\w+)\s+(-?[\d.]+)$", text, re.M)}


@pytest.fixture(scope="module")
def copy_run(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("copy")
    return workdir


def test_copy_task_is_learnt_and_eval_agrees(copy_run, capsys):
    """Acceptance: greedy decoding copies >= 99% of held-out sequences exactly (Annotated Transformer task)."""
    assert cli.main(["train", "--config", "experiments/copy_task.py", "--workdir", str(copy_run)]) == 0
    trained = figures(capsys.readouterr().out)
    assert trained["sequence_accuracy"] >= 0.99, trained
    assert (copy_run / "config.json").is_file() and (copy_run / "metrics.jsonl").is_file()
    assert any((copy_run / "tensorboard").iterdir())
    assert cli.main(["eval", "--workdir", str(copy_run)]) == 0
    evaluated = figures(capsys.readouterr().out)
    assert evaluated["sequence_accuracy"] == trained["sequence_accuracy"]
    assert evaluated["test_loss"] == pytest.approx(trained["test_loss"], rel=1e-6)


def test_bad_override_fails_before_training(tmp_path, capsys):
    rc = cli.main(
        ["train", "--config", "experiments/copy_task.py", "--workdir", str(tmp_path), "--set", "model.num_heads=3"]
    )
    assert rc == 2
    assert "model.num_heads: num_heads=3 does not divide d_model=64" in capsys.readouterr().err
    assert not (tmp_path / "config.json").exists()


@pytest.mark.parametrize(
    "name", ["lm_shakespeare", "translate_en_de", "classify_lohelp", "mlm_shakespeare", "paper_base_en_de", "gpt2_1p3b"]
)
def test_every_experiment_validates_and_documents_its_command(name):
    import ast

    from jaxformer.config import Config, load_experiment

    path = f"experiments/{name}.py"
    assert isinstance(load_experiment(path), Config)  # all sections validated on construction
    doc = ast.get_docstring(ast.parse(pathlib.Path(path).read_text()))
    assert f"jaxformer train --config {path} --workdir runs/{name}" in doc
