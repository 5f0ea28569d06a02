"""Every name of ours that the README and the docs mention is importable where they say it is.

Modules move as the library grows (a module becomes a package, a concern moves to its own room);
users' code and the guides keep `jaxformer.functional.apply_rope`, `from jaxformer.interop.hf import
load_hf` and `layers.MultiHeadAttention` working through re-exports. Read from the pages as written:
dotted paths (`jaxformer.a.b`), `from jaxformer... import ...` lines and `import ... as X` aliases in
code blocks (then each `X.name` of that block), and backticked `module.name` in prose, where a name
may also be a field of the config section of that name (`train.loss_chunk`)."""

import dataclasses
import importlib
import pathlib
import pkgutil
import re

import pytest

import jaxformer
from jaxformer import config as C

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
# The last part of each of our modules' dotted names: `ring` -> jaxformer.ring, `hf` -> jaxformer.interop.hf;
# where two share it, the shallower (`lora` is jaxformer.lora, not jaxformer.config.lora).
MODULES = {}
for _m in sorted(pkgutil.walk_packages(jaxformer.__path__, "jaxformer."), key=lambda m: -m.name.count(".")):
    MODULES[_m.name.rsplit(".", 1)[-1]] = _m.name


def _fields(cls) -> set[str]:
    """A config section's field names, its nested sections' included (`moe.every` is model.moe's)."""
    names = set()
    for f in dataclasses.fields(cls):
        names.add(f.name)
        t = getattr(C, f.type, None) if isinstance(f.type, str) else f.type
        if dataclasses.is_dataclass(t):
            names |= _fields(t)
    return names


FILE_ENDINGS = {"py", "json", "jsonl", "md", "txt", "yaml", "toml"}
SECTIONS = {f.name: _fields(getattr(C, f.type)) for f in dataclasses.fields(C.Config)}
SECTIONS["moe"] = _fields(C.MoEConfig)
SECTIONS["mla"] = _fields(C.MLAConfig)
SECTIONS["rope_scaling"] = _fields(C.RopeScalingConfig)


def resolve(dotted: str):
    """The object a dotted path names: the longest importable module prefix, then attributes."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(dotted)


def mentions() -> dict[str, str]:
    """Each dotted path the pages name -> the first page naming it."""
    found = {}

    def add(dotted, page):
        if dotted.rsplit(".", 1)[-1] not in FILE_ENDINGS:  # `jaxformer.config.json` names a file
            found.setdefault(dotted, page.relative_to(ROOT).as_posix())

    for page in PAGES:
        text = page.read_text()
        for m in re.finditer(r"\bjaxformer(?:\.[A-Za-z_]\w*)+", text):
            add(m.group(0).rstrip("."), page)
        for block in re.findall(r"```python\n(.*?)```", text, re.S):
            aliases = {}
            for m in re.finditer(r"^\s*from (jaxformer[\w.]*) import \(?([^)\n]+)\)?", block, re.M):
                for item in m.group(2).split(","):
                    name, _, alias = item.strip().partition(" as ")
                    if name:
                        add(f"{m.group(1)}.{name}", page)
                        aliases[alias or name] = f"{m.group(1)}.{name}"
            for m in re.finditer(r"^\s*import (jaxformer[\w.]*) as (\w+)", block, re.M):
                aliases[m.group(2)] = m.group(1)
            for alias, target in aliases.items():
                if target.rsplit(".", 1)[-1] in MODULES or target in MODULES.values():
                    for m in re.finditer(rf"(?<![\w.]){re.escape(alias)}\.([A-Za-z_]\w*)", block):
                        add(f"{target}.{m.group(1)}", page)
        for m in re.finditer(r"`(" + "|".join(MODULES) + r")\.([A-Za-z_]\w*)", text):
            module, name = m.groups()
            if name in SECTIONS.get(module, ()):
                continue  # a file name, or a config field (`lora.rank`)
            add(f"{MODULES[module]}.{name}", page)
    return found


MENTIONS = mentions()


def test_the_pages_mention_our_api():
    """The scan itself finds what it is for (a broken regex would make every other case vacuous)."""
    assert {
        "jaxformer.functional.apply_rope",
        "jaxformer.layers.MultiHeadAttention",
        "jaxformer.interop.hf.load_hf",
    } <= set(MENTIONS)
    assert len(MENTIONS) > 80


def test_a_name_that_is_not_there_does_not_resolve():
    with pytest.raises(AttributeError):
        resolve("jaxformer.functional.no_such_function")


@pytest.mark.parametrize("dotted", sorted(MENTIONS))
def test_a_name_the_docs_mention_is_importable(dotted):
    try:
        resolve(dotted)
    except (ImportError, AttributeError) as e:
        pytest.fail(f"{MENTIONS[dotted]} names {dotted}, which does not import: {e}")
