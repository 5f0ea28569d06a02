"""The package's imports run one way: no module imports, directly or through others, one that imports it.

Read from the source with `ast` (nothing is imported), counting imports inside functions too: a deferred
import hides a circle from Python's loader, not from a reader, and the next feature built on either side
of one inherits it.
"""

import ast
import pathlib

import jaxformer

ROOT = pathlib.Path(jaxformer.__file__).parent


def module_name(path: pathlib.Path, root: pathlib.Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: pathlib.Path) -> dict[str, set[str]]:
    """module -> the package's modules it imports (a package's own `__init__` only where it is named:
    `from jaxformer.data import sources` imports the submodule, not the package's re-exports)."""
    files = {module_name(p, root): p for p in root.rglob("*.py")}
    graph = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                edges |= {a.name for a in node.names if a.name in files}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from . import x, from .y import z
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, *([node.module] if node.module else [])])
                for alias in node.names:
                    if f"{base}.{alias.name}" in files:
                        edges.add(f"{base}.{alias.name}")
                    elif base in files:
                        edges.add(base)
        graph[name] = edges - {name}
    return graph


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    reach, stack = {start}, [start]
    while stack:
        for nxt in graph[stack.pop()] - reach:
            reach.add(nxt)
            stack.append(nxt)
    return reach


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One closed path through each group of modules that import one another (directly or not)."""
    found, seen = [], set()
    for start in sorted(graph):
        group = {m for m in reachable(graph, start) if start in reachable(graph, m)}
        if len(group) > 1 and start not in seen:
            seen |= group
            found.append(_loop(graph, start, group))
    return found


def _loop(graph, start, group) -> list[str]:
    """A shortest path start -> ... -> start inside `group` (breadth first)."""
    paths = [[start]]
    while paths:
        path = paths.pop(0)
        for nxt in sorted(graph[path[-1]] & group):
            if nxt == start:
                return [*path, start]
            if nxt not in path:
                paths.append([*path, nxt])
    raise AssertionError("unreachable: the group is strongly connected")


def test_the_package_has_no_import_cycle():
    found = cycles(import_graph(ROOT))
    assert not found, "import cycles: " + "; ".join(" -> ".join(c) for c in found)


def test_the_cycle_finder_finds_a_deferred_import_circle(tmp_path):
    """The check above can fail: a circle closed by an import inside a function is found and named."""
    package = tmp_path / "jaxformer"
    (package / "data").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "data" / "__init__.py").write_text("from jaxformer.data.a import f\n")
    (package / "data" / "a.py").write_text("from jaxformer.data import b\n\ndef f():\n    return b\n")
    (package / "data" / "b.py").write_text("def g():\n    from jaxformer.data.a import f\n    return f\n")
    (package / "c.py").write_text("from . import d\n")
    (package / "d.py").write_text("from .c import x\n")
    found = cycles(import_graph(package))
    assert sorted(found) == [
        ["jaxformer.c", "jaxformer.d", "jaxformer.c"],
        ["jaxformer.data.a", "jaxformer.data.b", "jaxformer.data.a"],
    ]


# The maths apart from the modules (STYLE.md habit 1): these import no Flax, directly or through the package's
# modules they import; only `jaxformer.attention.layer` of the attention package holds parameters.
PURE = [
    "jaxformer.functional",
    "jaxformer.ring",
    *(f"jaxformer.attention.{m}" for m in ("masks", "kernels", "cache", "ring", "ring_kernels")),
]


def imports_flax(path: pathlib.Path) -> bool:
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
        names += [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
        if any(n == "flax" or n.startswith("flax.") for n in names):
            return True
    return False


def test_the_pure_maths_imports_no_flax():
    graph = import_graph(ROOT)
    files = {module_name(p, ROOT): p for p in ROOT.rglob("*.py")}
    assert imports_flax(files["jaxformer.attention.layer"])  # the check sees an import of Flax where there is one
    for name in PURE:
        with_flax = sorted(m for m in reachable(graph, name) if imports_flax(files[m]))
        assert not with_flax, f"{name} imports Flax through {with_flax}"
