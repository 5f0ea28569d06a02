"""Docstrings complete where the API reference shows them: every public function, method and class of each
module with a page in docs/api/ has a docstring whose Args (Google style, as mkdocstrings renders it) name
every parameter of its signature, a Returns section when its return annotation is not None, a Raises
section when its body raises, and griffe (the reader the docs site uses, run here on the source, no JAX
imported) has nothing to warn about in it: the strict site build would fail on the same warnings.
*args and **kwargs may go undocumented; a dataclass's fields count as documented under Attributes.
"""

import logging
import pathlib
import re

import pytest

griffe = pytest.importorskip("griffe", reason='the docs extra is not installed: pip install -e ".[docs]"')

ROOT = pathlib.Path(__file__).resolve().parent.parent
API_MODULES = sorted(
    target
    for page in (ROOT / "docs" / "api").glob("*.md")
    for target in re.findall(r"^::: (\S+)$", page.read_text(), re.M)
)

# Objects whose parameters are documented elsewhere than in an Args section, each with the reason.
CONFIG_SECTION = (
    "a config section: each field's `# comment` is its meaning, shown in docs/config.md and by "
    "`jaxformer config` (tests/test_docs_site.py checks that every field has one)"
)
SECTIONS = {  # module of jaxformer.config -> the sections it defines
    "run": "Config",
    "architecture": "ModelConfig MoEConfig MLAConfig",
    "sections": "TrainConfig DataConfig CheckpointConfig DecodeConfig MeshConfig",
    "lora": "LoRAConfig",
    "preference": "PreferenceConfig",
    "rope": "RopeScalingConfig",
}
DOCUMENTED_ELSEWHERE = {
    f"jaxformer.config.{module}.{name}": CONFIG_SECTION for module, names in SECTIONS.items() for name in names.split()
}


@pytest.fixture(scope="module")
def package():
    return griffe.load("jaxformer", search_paths=[str(ROOT)], docstring_parser="google", allow_inspection=False)


def _public(obj):
    """The public functions and classes an object defines (not imported ones), methods of classes too, and
    `__call__` (a module's forward pass: the site shows it, mkdocs.yml's filters)."""
    for name, member in obj.members.items():
        if member.is_alias or (name.startswith("_") and name != "__call__"):
            continue
        if member.is_function or member.is_class:
            yield member
        if member.is_class:
            yield from _public(member)


def _documented(sections) -> set[str]:
    kinds = ("parameters", "other parameters", "attributes")  # attributes: a dataclass's fields
    return {item.name.lstrip("*") for s in sections if s.kind.value in kinds for item in s.value}


def test_api_pages_name_modules():
    assert "jaxformer.functional" in API_MODULES and "jaxformer.interop.hf" in API_MODULES, API_MODULES


@pytest.mark.parametrize("module", API_MODULES)
def test_public_names_have_complete_docstrings(package, module):
    warnings: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())
    logger = logging.getLogger("griffe")
    logger.addHandler(handler)
    problems = []
    try:
        for obj in _public(package[module.removeprefix("jaxformer.")]):
            if obj.path in DOCUMENTED_ELSEWHERE:
                continue
            if not obj.docstring:
                problems.append(f"{obj.path}: no docstring")
                continue
            sections = obj.docstring.parse("google")
            documented, kinds = _documented(sections), {s.kind.value for s in sections}
            parameters = obj.parameters if obj.is_function or obj.is_class else []
            missing = [
                p.name
                for p in parameters or []
                if p.name not in ("self", "cls")
                and p.kind.value not in ("variadic positional", "variadic keyword")  # *args, **kwargs
                and p.name not in documented
            ]
            if missing:
                problems.append(f"{obj.path}: Args does not document {', '.join(missing)}")
            if obj.is_function and "property" not in obj.labels:
                if str(obj.returns or "None") != "None" and "returns" not in kinds:
                    problems.append(f"{obj.path}: returns {obj.returns}, but its docstring has no Returns")
                if re.search(r"^\s+raise \w", "\n".join(obj.lines), re.M) and "raises" not in kinds:
                    problems.append(f"{obj.path}: raises, but its docstring has no Raises")
    finally:
        logger.removeHandler(handler)
    problems += [f"griffe: {w}" for w in warnings]
    assert not problems, "\n".join(problems)
