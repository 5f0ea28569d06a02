"""The examples of the documentation site (docs/index.md, docs/guides/*.md) against the code.

Python blocks: each is run or says why not. The line before a ```python block is `<!-- run -->` (the
page's run blocks are executed in order, in one namespace, in an empty directory) or
`<!-- not run: REASON -->` (it needs a trained run, a download, minutes); an unmarked block fails, so
nothing goes silently unchecked.

Shell blocks (```bash, ```shell, ```sh and plain ``` blocks, `$ ` prompts included): every `jaxformer`
command line is read by the real parser (`cli.build_parser`), its `--config` file exists (placeholders
in capitals, `experiments/NAME.py`, excepted), and each `--set section.field=value` names a real field
with a value its type takes (`config.parse_overrides`), applied to that experiment and validated with
the others (`config.apply_overrides`). Broken links and anchors fail the strict build
(tests/test_docs_site.py).
"""

import pathlib
import re
import shlex

import pytest

from jaxformer import cli
from jaxformer.config import ConfigError, apply_overrides, load_experiment, parse_overrides

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = [ROOT / "docs" / "index.md", *sorted((ROOT / "docs" / "guides").glob("*.md"))]
FENCE = re.compile(r"^(?P<marker><!--.*?-->\n)?```(?P<lang>[a-z]*)\n(?P<body>.*?)^```$", re.M | re.S)
SHELL = {"bash", "shell", "sh", "console", ""}


def blocks(page: pathlib.Path, langs: set[str]) -> list[tuple[int, str, str]]:
    """(line, marker, body) of each fenced block of those languages."""
    text = page.read_text()
    return [
        (text.count("\n", 0, m.start("body")) + 1, (m["marker"] or "").strip(), m["body"])
        for m in FENCE.finditer(text)
        if m["lang"] in langs
    ]


def test_every_python_block_runs_or_says_why_not():
    unmarked = [
        f"{page.relative_to(ROOT)}:{line} {marker or '(no marker)'}"
        for page in PAGES
        for line, marker, _ in blocks(page, {"python"})
        if not re.fullmatch(r"<!-- run -->|<!-- not run: \S.* -->", marker)
    ]
    assert not unmarked, "mark each ```python block <!-- run --> or <!-- not run: REASON -->:\n" + "\n".join(unmarked)


RUN_PAGES = [p for p in PAGES if any(m == "<!-- run -->" for _, m, _ in blocks(p, {"python"}))]


@pytest.mark.parametrize("page", RUN_PAGES, ids=lambda p: p.name)
def test_python_examples_run(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "__docs__"}
    for line, marker, body in blocks(page, {"python"}):
        if marker == "<!-- run -->":
            exec(compile("\n" * (line - 1) + body, str(page), "exec"), namespace)


def command_lines(body: str) -> list[str]:
    """The `jaxformer ...` command lines of a shell block, continuation lines joined, prompts dropped."""
    joined = re.sub(r"\\\n\s*", "", body)
    out = []
    for line in joined.splitlines():
        line = re.sub(r" \[[^\]]*\]", "", line.strip().removeprefix("$ "))  # [optional ...] parts
        for prefix in (".venv/bin/jaxformer ", "jaxformer "):
            if line.startswith(prefix):
                out.append(line.removeprefix(prefix))
    return out


def _placeholder(path: str) -> bool:
    return bool(re.search(r"\b[A-Z]{1,}\b", path))


def check_command(args: str) -> list[str]:
    """What is wrong with one command line (empty if nothing)."""
    argv = shlex.split(args, comments=True)
    try:
        parsed = cli.build_parser().parse_args(argv)
    except SystemExit:
        return ["argparse refuses it"]
    problems, sets = [], getattr(parsed, "set", None) or []
    try:
        parse_overrides(sets)
    except ConfigError as e:
        problems.append(f"--set: {e}")
    path = getattr(parsed, "config", None)
    if path and not _placeholder(path):
        if not (ROOT / path).is_file():
            problems.append(f"--config {path}: no such file")
        elif not problems:
            try:
                apply_overrides(load_experiment(str(ROOT / path)), sets)
            except ConfigError as e:
                problems.append(f"--set on {path}: {e}")
    return problems


def test_every_jaxformer_command_parses_and_its_settings_validate():
    checked, wrong = 0, []
    for page in PAGES:
        for line, _, body in blocks(page, SHELL):
            for args in command_lines(body):
                checked += 1
                wrong += [f"{page.relative_to(ROOT)}:{line} jaxformer {args}\n  {p}" for p in check_command(args)]
    assert checked > 30, f"only {checked} commands found: is the block pattern still right?"
    assert not wrong, "\n".join(wrong)


def test_the_checker_catches_rot():
    """The checks above fail on what they are meant to catch (an independent look at each rule)."""
    assert check_command("train --config experiments/lm_shakespeare.py --workdir w") == []
    assert check_command("train --confg experiments/lm_shakespeare.py") == ["argparse refuses it"]
    assert "no such file" in check_command("train --config experiments/gone.py --workdir w")[0]
    assert "train.steps" in check_command("train --workdir w --set train.steps=many")[0]
    assert "train.stepz" in check_command("train --workdir w --set train.stepz=3")[0]
    assert command_lines("$ jaxformer eval \\\n   --workdir w  # held out\nls\n") == ["eval --workdir w  # held out"]
