"""The examples of the documentation site (docs/index.md, docs/guides/*.md) against the code.

Python blocks: each is run or says why not. The line before a ```python block is `<!-- run -->` (the
page's run blocks are executed in order, in one namespace, in an empty directory) or
`<!-- not run: REASON -->` (it needs a trained run, a download, minutes); an unmarked block fails, so
nothing goes silently unchecked.

Shell blocks (```bash, ```shell, ```sh and plain ``` blocks, `$ ` prompts included): every `jaxformer`
command line is read by the real parser (`cli.build_parser`), its `--config` file exists (placeholders
in capitals, `experiments/NAME.py`, excepted), and each `--set section.field=value` names a real field
with a value its type takes (`config.parse_overrides`), applied to that experiment and validated with
the others (`config.apply_overrides`); every `python scripts/X.py` or `bash scripts/X.sh` names a
script that exists. Each shell block is marked as a Python block is: `<!-- run -->` (its commands,
`jaxformer` lines only, take seconds on a CPU: they are run, in an empty directory with
`experiments/` beside it, and must succeed) or `<!-- long: REASON -->` (minutes of training, an
accelerator, a download, a server, or a recorded output); an unmarked block fails. Broken links and
anchors fail the strict build (tests/test_docs_site.py).
"""

import contextlib
import io
import pathlib
import re
import shlex

import pytest

from jaxformer import cli
from jaxformer.config import ConfigError, apply_overrides, load_experiment, parse_overrides

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = [ROOT / "docs" / "index.md", *sorted((ROOT / "docs" / "guides").glob("*.md"))]
FENCE = re.compile(r"^(?P<marker><!--[^\n]*?-->\n)?```(?P<lang>[a-z]*)\n(?P<body>.*?)^```$", re.M | re.S)
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
    """The `jaxformer ...` command lines of a shell block, continuation lines joined, prompts and
    environment settings before them (`XLA_FLAGS=... jaxformer train ...`) dropped."""
    joined = re.sub(r"\\\n\s*", "", body)
    out = []
    for line in joined.splitlines():
        line = re.sub(r" \[[^\]]*\]", "", line.strip().removeprefix("$ "))  # [optional ...] parts
        line = re.sub(r"^([A-Z_]+=\S* )+", "", line)
        for prefix in (".venv/bin/jaxformer ", "jaxformer "):
            if line.startswith(prefix):
                out.append(line.removeprefix(prefix))
    return out


SHELL_MARKER = re.compile(r"<!-- run -->|<!-- long: \S.* -->")


def test_every_shell_block_runs_or_says_why_not():
    unmarked = [
        f"{page.relative_to(ROOT)}:{line} {marker or '(no marker)'}"
        for page in PAGES
        for line, marker, _ in blocks(page, SHELL)
        if not SHELL_MARKER.fullmatch(marker)
    ]
    assert not unmarked, "mark each shell block <!-- run --> or <!-- long: REASON -->:\n" + "\n".join(unmarked)


def _commands(body: str) -> list[str]:
    """The command lines of a shell block: continuation lines joined, comments and blank lines dropped."""
    joined = re.sub(r"\\\n\s*", "", body)
    return [s for line in joined.splitlines() if (s := line.strip().removeprefix("$ ")) and not s.startswith("#")]


RUN_BLOCKS = [
    pytest.param(body, id=f"{page.name}:{line}")
    for page in PAGES
    for line, marker, body in blocks(page, SHELL)
    if marker == "<!-- run -->"
]


@pytest.mark.parametrize("body", RUN_BLOCKS)
def test_shell_examples_run(body, tmp_path, monkeypatch):
    """Each command of a run block, through `cli.main` in this process (no second JAX start-up): it
    must succeed and print something; a `jaxformer config` line prints each value its --set gives."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "experiments").symlink_to(ROOT / "experiments")
    for command in _commands(body):
        assert command.startswith("jaxformer "), f"a run block holds jaxformer commands only: {command}"
        argv = shlex.split(command.removeprefix("jaxformer "), comments=True)
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            try:
                status = cli.main(argv)
            except SystemExit as e:  # --help
                status = e.code
        assert status in (0, None), f"{command}: exit status {status}"
        assert out.getvalue().strip(), f"{command}: printed nothing"
        if argv[0] == "config":
            for setting in cli.build_parser().parse_args(argv).set or []:
                field, value = setting.split("=", 1)
                assert re.search(rf"^{re.escape(field)} = {re.escape(value)} ", out.getvalue(), re.M), setting


def test_every_script_named_exists():
    """`python scripts/X.py` and `bash scripts/X.sh` in any shell block (run or not) name real files."""
    named, missing = 0, []
    for page in PAGES:
        for line, _, body in blocks(page, SHELL):
            for script in re.findall(r"(?:python|bash) (scripts/\S+)", body):
                named += 1
                if not (ROOT / script).is_file():
                    missing.append(f"{page.relative_to(ROOT)}:{line} {script}")
    assert named > 5, f"only {named} scripts named: is the pattern still right?"
    assert not missing, "\n".join(missing)


def _placeholder(path: str) -> bool:
    return bool(re.search(r"\b[A-Z]{1,}\b", path))


def check_command(args: str) -> list[str]:
    """What is wrong with one command line (empty if nothing)."""
    argv = shlex.split(args, comments=True)
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # --help prints, then exits 0
            parsed = cli.build_parser().parse_args(argv)
    except SystemExit as e:
        return [] if e.code == 0 and {"-h", "--help"} & set(argv) else ["argparse refuses it"]
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
    assert command_lines("XLA_FLAGS=--a=2 jaxformer eval --workdir w\n") == ["eval --workdir w"]
    assert check_command("train --help") == [] and check_command("--help") == []
    block = "$ jaxformer eval \\\n  --workdir w\n# a comment\n\nls -l\n"
    assert _commands(block) == ["jaxformer eval --workdir w", "ls -l"]
    assert SHELL_MARKER.fullmatch("<!-- long: trains for minutes -->") and not SHELL_MARKER.fullmatch("<!-- long: -->")


def _time_and_output(path: pathlib.Path) -> str:
    """An experiment's "Time and output:" paragraph, whitespace normalised."""
    import ast

    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    return " ".join(doc.split("Time and output:", 1)[-1].split("\n\n", 1)[0].split())


def test_training_guide_lists_every_experiment_with_its_steps_and_time():
    """The table of docs/guides/training.md against experiments/*.py: one row each, the mode and steps
    of its config, and a time that its docstring's "Time and output:" paragraph says word for word."""
    text = (ROOT / "docs" / "guides" / "training.md").read_text()
    header = "| experiment | mode | data | steps | time on 2 CPU cores |\n|---|---|---|---|---|\n"
    table = text.split(header, 1)[1].split("\n\n", 1)[0]
    rows = [[c.strip() for c in row.strip("|").split("|")] for row in table.splitlines()]
    files = {p.stem: p for p in (ROOT / "experiments").glob("*.py")}
    assert sorted(r[0].strip("`") for r in rows) == sorted(files), "one row per experiments/*.py"
    wrong = []
    for name, mode, _, steps, time in rows:
        path = files[name.strip("`")]
        cfg = load_experiment(str(path))
        if mode.replace("-", "_") != cfg.model.mode or int(steps) != cfg.train.steps:
            wrong.append(f"{name}: {mode}, {steps} steps; the file says {cfg.model.mode}, {cfg.train.steps}")
        if time not in _time_and_output(path):
            wrong.append(f"{name}: {time!r} is not in its docstring's 'Time and output:' paragraph")
    assert not wrong, "\n".join(wrong)
