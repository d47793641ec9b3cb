"""House rules: the import graph of `src/detrl` (every import, lazy ones inside functions included,
`if TYPE_CHECKING:` blocks left out) has no cycle; no function over 80 lines (Triton kernels aside) nor file
over 450; only the runtime seam and the CUDA modules branch on the device type; scripts import detrl plainly;
benchmarks/gpu.py's sections."""

from __future__ import annotations

import ast
import fnmatch
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import networkx as nx  # installed with torch (one of its dependencies)
import pytest

SRC = Path(__file__).resolve().parents[1] / "src"


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


def test_src_detrl_has_no_import_cycle(graph):
    found = cycles(graph)
    assert not found, [nx.find_cycle(graph.subgraph(c)) for c in found]


ROOT = SRC.parent


def test_scripts_and_benchmarks_use_no_sys_path_hacks():
    """detrl is installed (editable): the scripts import it plainly, and run from the repo root as `python x.py`."""
    files = sorted([*ROOT.glob("benchmarks/*.py"), *ROOT.glob("scripts/*.py")])
    assert files
    assert [f.name for f in files if "sys.path" in f.read_text()] == []


@pytest.fixture(scope="module")
def gpu_bench():
    """benchmarks/gpu.py as a module (a script, not a package: loaded from its file)."""
    spec = importlib.util.spec_from_file_location("gpu_bench", ROOT / "benchmarks" / "gpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_gpu_benchmark_lists_its_sections():
    proc = subprocess.run(
        [sys.executable, "benchmarks/gpu.py", "--help"], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "{bench,profile,profile16,paged,kernels,tiles}" in proc.stdout


def test_each_gpu_section_parses_its_arguments(gpu_bench, capsys):
    parse = gpu_bench.parse
    assert parse(["profile16", "--batch", "8", "--modes", "on", "--no-profile"]).run is gpu_bench.profile16
    assert parse(["profile", "--model", "qwen3_moe_a3b_6l"]).model == "qwen3_moe_a3b_6l"
    assert parse(["tiles", "--out", "t.json"]).run is gpu_bench.tiles
    assert parse(["kernels"]).out is None
    paged = parse(["paged", "--batch", "8", "--json", "p.json"])
    assert paged.run is gpu_bench.paged and (paged.batch, paged.new, paged.modes) == (8, 64, "on,off")
    old = parse(["--sections", "targets,trl", "--grpo-steps", "3"])  # the bench section's own form
    assert old.run is gpu_bench.bench and old.sections == ["targets", "trl"] and old.grpo_steps == 3
    assert parse(["bench"]).sections == ["rollout", "grpo", "trl"]
    with pytest.raises(SystemExit):
        parse(["--sections", "targets,onof"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "unknown onof; choose from targets, vs_trl" in err, err


# Size limits and the device seam, over every module of src/detrl
MAX_FUNCTION_LINES, MAX_FILE_LINES = 80, 450
# the only modules that may branch on the device type: the runtime seam and the CUDA modules
CUDA_MODULES = ("detrl/runtime.py", "detrl/device.py", "detrl/rollout/cuda*.py", "detrl/models/triton_*.py")
CUDA_TEST = re.compile(r"\.type\s*[!=]=\s*[\"']cuda[\"']")


def _sources() -> list[tuple[str, str]]:
    files = sorted((SRC / "detrl").rglob("*.py"))
    assert len(files) > 50
    return [(f.relative_to(SRC).as_posix(), f.read_text()) for f in files]


def _is_triton_kernel(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    return any("jit" in ast.unparse(d) and "triton" in ast.unparse(d) for d in fn.decorator_list)


def long_functions(rel: str, text: str) -> list[str]:
    """`path:name (lines)` of every function over MAX_FUNCTION_LINES lines, Triton kernels left out."""
    return [
        f"{rel}:{fn.name} ({fn.end_lineno - fn.lineno + 1})"
        for fn in ast.walk(ast.parse(text))
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
        and fn.end_lineno - fn.lineno + 1 > MAX_FUNCTION_LINES
        and not _is_triton_kernel(fn)
    ]


def test_no_function_over_80_lines_and_no_file_over_450():
    sources = _sources()
    assert [f for rel, text in sources for f in long_functions(rel, text)] == []
    assert [(rel, n) for rel, text in sources if (n := len(text.splitlines())) > MAX_FILE_LINES] == []
    # the check sees what it must: a 81-line function counts, a Triton kernel does not
    body = "\n".join(["    x = 1"] * 80)
    assert long_functions("x.py", f"def f():\n{body}\n") == ["x.py:f (81)"]
    assert long_functions("x.py", f"@triton.jit\ndef k():\n{body}\n") == []


def test_only_the_runtime_seam_and_the_cuda_modules_branch_on_cuda():
    found = [
        f"{rel}:{i}"
        for rel, text in _sources()
        if not any(fnmatch.fnmatch(rel, pattern) for pattern in CUDA_MODULES)
        for i, line in enumerate(text.splitlines(), 1)
        if CUDA_TEST.search(line)
    ]
    assert found == []
    assert CUDA_TEST.search('if device.type == "cuda":') and CUDA_TEST.search("x.type != 'cuda'")
