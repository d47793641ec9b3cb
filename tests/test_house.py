"""House rules checked statically: the import graph of `src/detrl` (every import, lazy ones inside functions
included, `if TYPE_CHECKING:` blocks left out) has no cycle."""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx
import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

# Cycles outside detrl.models, each a pair of modules that import each other; their owners remove them (delete
# the entry with the cycle). A cycle not listed here fails the test.
KNOWN_CYCLES = [
    {
        "detrl.config",
        "detrl.guards",
    },  # config's validation calls guards.check_values; guards reads TrainConfig
    {"detrl.plan", "detrl.trainer"},  # train() checks the plan; the plan reads trainer.context_length
]


def module_names(src: Path = SRC) -> dict[str, Path]:
    """Dotted module name -> file, for every module under src (a package is its __init__)."""
    names = {}
    for path in sorted(src.rglob("*.py")):
        parts = path.relative_to(src).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def _executed(tree: ast.AST):
    """The nodes of tree, less the bodies of `if TYPE_CHECKING:` blocks (annotations only: never imported)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            yield from (n for child in node.orelse for n in [child, *_executed(child)])
            continue
        yield node
        yield from _executed(node)


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of `modules` that `name` imports: `from a import b` counts as a.b where a.b is a module."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in _executed(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: up level - 1 packages from this module's package
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, *([base] if base else [])])
            subs = {f"{base}.{alias.name}" for alias in node.names} & modules.keys()
            found |= subs
            if len(subs) < len(node.names):
                found.add(base)
    return (found & modules.keys()) - {name}


def import_graph(src: Path = SRC) -> nx.DiGraph:
    modules = module_names(src)
    graph = nx.DiGraph()
    graph.add_nodes_from(modules)
    for name, path in modules.items():
        graph.add_edges_from((name, dep) for dep in imports_of(name, path, modules))
    return graph


def cycles(graph: nx.DiGraph) -> list[set[str]]:
    """The graph's strongly connected components of more than one module (each holds at least one cycle)."""
    return [c for c in nx.strongly_connected_components(graph) if len(c) > 1]


@pytest.fixture(scope="module")
def graph() -> nx.DiGraph:
    return import_graph()


def test_the_graph_sees_lazy_and_relative_imports(graph, tmp_path):
    """The checker itself: a lazy import inside a function and a relative import close a cycle; a
    TYPE_CHECKING import does not; `from pkg import module` names the module."""
    pkg = tmp_path / "p"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from p.b import g\n")
    (pkg / "b.py").write_text(
        "from . import a\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import p.c\n"
    )
    (pkg / "c.py").write_text("import p.b\n")
    g = import_graph(tmp_path)
    assert cycles(g) == [{"p.a", "p.b"}]
    assert set(g.successors("p.b")) == {"p.a"} and set(g.successors("p.c")) == {"p.b"}
    assert ("detrl.models.ops", "detrl.models.triton_ops") in graph.edges  # ops' lazy import of the kernels


def test_detrl_models_has_no_import_cycle(graph):
    models = graph.subgraph(n for n in graph if n.startswith("detrl.models"))
    assert not cycles(models), [nx.find_cycle(models.subgraph(c)) for c in cycles(models)]


def test_src_detrl_has_no_import_cycle_but_the_known_ones(graph):
    new = [c for c in cycles(graph) if not any(c <= known for known in KNOWN_CYCLES)]
    assert not new, [nx.find_cycle(graph.subgraph(c)) for c in new]
