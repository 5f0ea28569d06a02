"""The documentation site (mkdocs.yml, docs/): the generated pages match the code, every config field
has a meaning, and the site builds in strict mode with every public name of each API page in it.

The build needs the `docs` extra (`pip install -e ".[docs]"`, as `make docs` and CI do); without it
that test is skipped, the others still run.
"""

import dataclasses
import importlib
import importlib.util
import inspect
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("make_reference_pages", ROOT / "scripts" / "make_reference_pages.py")
pages = importlib.util.module_from_spec(spec)
spec.loader.exec_module(pages)

REGENERATE = "stale: run `python scripts/make_reference_pages.py` (or `make docs`) and commit the result"


@pytest.mark.parametrize("rel", sorted(pages.PAGES))
def test_generated_page_is_current(rel):
    assert (ROOT / rel).read_text() == pages.PAGES[rel](), f"{rel} {REGENERATE}"


def test_cli_page_lists_every_command_and_option():
    """Against argparse's own help: each subcommand's every visible option is in the page."""
    from jaxformer import cli

    text = (ROOT / "docs" / "cli.md").read_text()
    parser = cli.build_parser()
    (sub,) = [a for a in parser._actions if a.dest == "command"]
    for name, subparser in sub.choices.items():
        section = text.split(f"## `jaxformer {name}`\n", 1)[1].split("\n## ", 1)[0]
        shown = re.findall(r"(--[a-z][a-z-]*)", subparser.format_help().split("options:", 1)[-1])
        for option in set(shown) - {"--help"}:
            assert f"`{option}" in section, f"jaxformer {name} {option} is missing from docs/cli.md"


def test_every_config_field_has_a_meaning():
    from jaxformer.config_reference import field_docs

    for section, cls in pages.config_sections():
        docs = field_docs(cls)
        missing = [f.name for f in dataclasses.fields(cls) if not docs[f.name][1]]
        assert not missing, f"{section}.{missing}: say what each field means in a `# comment` beside it"


def test_config_page_has_a_table_per_section_nested_ones_too():
    """Every field of every section, nested ones (`model.moe`) under their own dotted heading, walked
    here from the Config's fields, not from the script's list of sections."""
    from jaxformer import config

    text = (ROOT / "docs" / "config.md").read_text()
    found = []

    def walk(name: str, obj) -> None:
        found.append(name)
        heading = f"## `{name}`: `{type(obj).__name__}`\n"
        assert heading in text, f"docs/config.md has no table for {name}"
        table = text.split(heading, 1)[1].split("\n## ", 1)[0]
        for f in dataclasses.fields(obj):
            assert f"| `{f.name}` |" in table, f"docs/config.md: {name}.{f.name} is missing from its table"
            if dataclasses.is_dataclass(getattr(obj, f.name)):
                walk(f"{name}.{f.name}", getattr(obj, f.name))

    for f in dataclasses.fields(config.Config):  # each section's defaults (a default Config is no valid run)
        walk(f.name, f.default_factory())
    assert "model.moe" in found and len(found) > len(config.SECTIONS), found


def _public_names(module) -> list[str]:
    """Functions and classes a module defines itself, not starting with '_'."""
    return [
        name
        for name, obj in vars(module).items()
        if not name.startswith("_")
        and (inspect.isfunction(obj) or inspect.isclass(obj))
        and getattr(obj, "__module__", None) == module.__name__
    ]


def test_site_builds_strict(tmp_path):
    for package in ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python"):
        pytest.importorskip(package, reason='the docs extra is not installed: pip install -e ".[docs]"')
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")  # Material's end-of-life banner (see mkdocs.yml)
    out = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=ROOT, env=env, capture_output=True, text=True,
    )  # fmt: skip
    assert out.returncode == 0, f"mkdocs build --strict failed:\n{out.stderr[-4000:]}"
    # Each API page documents every public function and class of its module (an anchor per name).
    for page in sorted((ROOT / "docs" / "api").glob("*.md")):
        (target,) = re.findall(r"^::: (\S+)$", page.read_text(), re.M)
        html = (tmp_path / "api" / f"{page.stem}.html").read_text()
        module = importlib.import_module(target)
        missing = [n for n in _public_names(module) if f'id="{target}.{n}"' not in html]
        assert not missing, f"{page.name}: no entry for {missing}"


def _paragraphs(text: str) -> list[str]:
    """The prose paragraphs and code lines of a Markdown text, whitespace normalised, 60+ characters."""
    text = re.sub(r"<!--.*?-->", "", text, flags=re.S)
    pieces = re.split(r"\n\s*\n|^```.*$", text, flags=re.M)
    return [p for p in (" ".join(piece.split()) for piece in pieces) if len(p) >= 60]


def test_no_readme_text_is_copied_into_the_site():
    """The README is the first screen; the site's landing page includes its introduction and two commands
    (pymdownx.snippets) rather than holding a copy, and no page repeats a paragraph of it."""
    readme = _paragraphs((ROOT / "README.md").read_text())
    assert len(readme) > 5, readme
    copied = [
        f"{page.relative_to(ROOT)}: {paragraph[:80]}..."
        for page in sorted((ROOT / "docs").rglob("*.md"))
        for paragraph in readme
        if paragraph in " ".join(page.read_text().split())
    ]
    assert not copied, "say it once (include the README's section, or link to it):\n" + "\n".join(copied)
    index = (ROOT / "docs" / "index.md").read_text()
    assert '--8<-- "README.md:intro"' in index and '--8<-- "README.md:commands"' in index
