"""What each config field means, read from the `# comment`s beside the fields in jaxformer/config/.

One source for both readers of it: `jaxformer config EXPERIMENT` (every field with its value, type and
meaning) and the site's config reference, docs/config.md (scripts/make_reference_pages.py).
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import io
import pathlib
import sys
import tokenize

from jaxformer import config


def _comments(source: str) -> dict[int, str]:
    """Line number -> the text of the `#` comment on that line (formatter pragmas dropped)."""
    out = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            text = tok.string.lstrip("#").strip()
            if not text.startswith(("fmt:", "noqa", "type:")):
                out[tok.start[0]] = text
    return out


@functools.cache
def _source(path: str) -> tuple[str, dict[int, str], ast.Module]:
    source = pathlib.Path(path).read_text()
    return source, _comments(source), ast.parse(source)


def field_docs(cls: type) -> dict[str, tuple[str, str]]:
    """The fields of a config dataclass of jaxformer/config/, as written in the module that defines it.

    Args:
        cls: a dataclass defined in a module of jaxformer/config/ (`ModelConfig`, `MoEConfig`, ...).

    Returns:
        field name -> (its annotation as written, its meaning): the meaning joins the comment lines
        right above the field and the comment on its own lines ("" if it has none).

    Raises:
        ValueError: `cls` is not a class defined in jaxformer/config/.
    """
    path = getattr(sys.modules.get(cls.__module__), "__file__", None)
    found = []
    if path and pathlib.Path(path).parent == pathlib.Path(config.__file__).parent:
        source, comments, tree = _source(path)
        lines = source.splitlines()
        found = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls.__name__]
    if not found:
        raise ValueError(f"{cls.__name__} is not a class of jaxformer/config/")
    out = {}
    for node in found[0].body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        above, n = [], node.lineno - 1
        while n >= 1 and lines[n - 1].lstrip().startswith("#"):
            above.insert(0, comments.get(n, ""))
            n -= 1
        trailing = [comments[i] for i in range(node.lineno, node.end_lineno + 1) if i in comments]
        meaning = " ".join(t for t in above + trailing if t)
        out[node.target.id] = (ast.get_source_segment(source, node.annotation), meaning)
    return out


def fields(cfg: config.Config) -> list[tuple[str, object, str, str]]:
    """Every field of a run's config, nested sections (`model.moe`) flattened into dotted names.

    Args:
        cfg: the config of a run (an experiment's `get_config()`, with any overrides applied).

    Returns:
        (dotted name, value, annotation as written in jaxformer/config/, meaning) for each field, in the
        order of `config.SECTIONS` and of each section's fields.
    """
    out = []

    def walk(prefix: str, section) -> None:
        docs = field_docs(type(section))
        for f in dataclasses.fields(section):
            value = getattr(section, f.name)
            if dataclasses.is_dataclass(value):
                walk(f"{prefix}.{f.name}", value)
            else:
                annotation, meaning = docs[f.name]
                out.append((f"{prefix}.{f.name}", value, annotation, meaning))

    for name in config.SECTIONS:
        walk(name, getattr(cfg, name))
    return out


def describe(cfg: config.Config) -> str:
    """The text `jaxformer config` prints: per section, one line per field.

    Args:
        cfg: the config to describe.

    Returns:
        Lines `section.field = value  # type: meaning`, a heading with each section's summary above
        its fields, values as `--set` would take them back (tuples comma-separated, `None` as none).
    """
    rows = fields(cfg)
    width = max(len(f"{name} = {_shown(value)}") for name, value, _, _ in rows)
    lines, section = [], None
    for name, value, annotation, meaning in rows:
        if name.split(".")[0] != section:
            section = name.split(".")[0]
            cls = config.SECTIONS[section]
            summary = " ".join((cls.__doc__ or "").split("\n\n")[0].split())
            lines += ["" if lines else None, f"[{section}] {cls.__name__}: {summary}"]
        lines.append(f"{f'{name} = {_shown(value)}':<{width}}  # {annotation}: {meaning}".rstrip(": "))
    return "\n".join(line for line in lines if line is not None).rstrip()


def _shown(value) -> str:
    """A field's value as `--set` takes it."""
    if value is None:
        return "none"
    if isinstance(value, tuple) and all(isinstance(v, str) for v in value):
        return ",".join(value) if value else '""'
    return str(value)
