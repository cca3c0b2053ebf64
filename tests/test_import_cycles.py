"""No import circles among specplug's modules (issue 41), nor among its subpackages (issue 78): a
module's imports, at its top, inside its functions or under `if TYPE_CHECKING:`, never lead back to
it, and neither do a subpackage's (`specplug.heads`, `specplug.train`, ...: the graph with every
module collapsed to `specplug.<sub>`). An import under TYPE_CHECKING never runs, but it says the
module knows the other one all the same. Read from the source with `ast`, nothing is imported."""
from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_edges(package: str = "specplug", root: Path = ROOT) -> dict[tuple[str, str], list[int]]:
    """(module, a module of `package` it imports) -> the lines of those imports, wherever they sit
    (top, functions, TYPE_CHECKING). `from pkg import name` is an edge to the submodule pkg.name where
    there is one (a package importing its own submodules is no circle), else to pkg."""
    paths = {module_name(p, root): p for p in (root / package).rglob("*.py")}
    edges: dict[tuple[str, str], list[int]] = defaultdict(list)
    for mod, path in paths.items():
        here = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(here[:len(here) - node.level + 1] + ([base] if base else []))
                subs = [f"{base}.{a.name}" for a in node.names]
                names = [n for n in subs if n in paths] + ([base] if any(n not in paths for n in subs) else [])
            else:
                continue
            for name in names:
                while name and name not in paths:
                    name = name.rpartition(".")[0]
                if name and name != mod:
                    edges[(mod, name)].append(node.lineno)
    return edges


def import_graph(package: str = "specplug", root: Path = ROOT) -> dict[str, set[str]]:
    """module -> the modules of `package` it imports (see import_edges)."""
    graph: dict[str, set[str]] = {module_name(p, root): set() for p in (root / package).rglob("*.py")}
    for a, b in import_edges(package, root):
        graph[a].add(b)
    return graph


def subpackage(module: str) -> str:
    """`specplug.heads.eval` -> `specplug.heads`; a top-level module (`specplug.cli`) is its own."""
    return ".".join(module.split(".")[:2])


def collapse(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The graph of subpackages: an edge where any module of one imports any module of the other."""
    out: dict[str, set[str]] = defaultdict(set)
    for a, targets in graph.items():
        out[subpackage(a)].update(subpackage(b) for b in targets if subpackage(b) != subpackage(a))
    return dict(out)


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def explain(circle: list[str], edges: dict[tuple[str, str], list[int]], key=lambda m: m) -> str:
    """A circle and the imports that close it: each edge between its members (`key` maps a module to
    its member), the imports behind it as module:line, the edges with the fewest imports first (those
    are the ones to break)."""
    members = set(circle)
    behind: dict[tuple[str, str], list[str]] = defaultdict(list)
    for (a, b), lines in sorted(edges.items()):
        ka, kb = key(a), key(b)
        if ka != kb and ka in members and kb in members:
            behind[(ka, kb)] += [f"{a}:{n} -> {b}" for n in lines]
    parts = [f"{a} -> {b} ({len(imps)}: {', '.join(imps[:4])}{', ...' if len(imps) > 4 else ''})"
             for (a, b), imps in sorted(behind.items(), key=lambda kv: (len(kv[1]), kv[0]))]
    return " <-> ".join(circle) + " [" + "; ".join(parts) + "]"


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_the_finder_finds_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_the_finder_sees_imports_under_type_checking_and_in_functions(tmp_path):
    _write(tmp_path, {"pkg/__init__.py": "",
                      "pkg/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.b import B\n",
                      "pkg/b.py": "def f():\n    from pkg import a\n"})
    graph = import_graph("pkg", tmp_path)
    assert graph["pkg.a"] == {"pkg.b"} and graph["pkg.b"] == {"pkg.a"}
    assert circles(graph) == [["pkg.a", "pkg.b"]]
    assert "pkg.a:3 -> pkg.b" in explain(["pkg.a", "pkg.b"], import_edges("pkg", tmp_path))


def test_the_finder_finds_a_circle_between_subpackages(tmp_path):
    _write(tmp_path, {"pkg/__init__.py": "", "pkg/top.py": "import pkg.low.x\n",
                      "pkg/low/__init__.py": "", "pkg/low/x.py": "", "pkg/low/y.py": "from pkg.up import z\n",
                      "pkg/up/__init__.py": "", "pkg/up/z.py": "from pkg.low import x\n"})
    graph = import_graph("pkg", tmp_path)
    assert circles(graph) == []  # no module circle: low.y -> up.z -> low.x
    assert collapse(graph) == {"pkg": set(), "pkg.top": {"pkg.low"}, "pkg.low": {"pkg.up"}, "pkg.up": {"pkg.low"}}
    assert circles(collapse(graph)) == [["pkg.low", "pkg.up"]]
    why = explain(["pkg.low", "pkg.up"], import_edges("pkg", tmp_path), subpackage)
    assert why.index("pkg.low -> pkg.up (1: pkg.low.y:1 -> pkg.up.z)") < why.index("pkg.up -> pkg.low")


def test_specplug_has_no_import_circles():
    graph = import_graph()
    assert "specplug.cli_args" in graph["specplug.bench.cli"]  # the graph sees imports inside functions
    assert "specplug.record" in graph["specplug.server.worker"]  # and under TYPE_CHECKING
    found = circles(graph)
    edges = import_edges()
    assert not found, "import circles (break the thin edges with a module below both): " + \
        "; ".join(explain(c, edges) for c in found)


def test_specplug_subpackages_have_no_import_circles():
    found = circles(collapse(import_graph()))
    edges = import_edges()
    assert not found, "import circles between subpackages (move the pieces behind the thin edges below " \
        "both, or up to their users): " + "; ".join(explain(c, edges, subpackage) for c in found)


@pytest.mark.parametrize("low, high", [("specplug.cli_args", "specplug.cli"),
                                       ("specplug.train.generator", "specplug.train.ray_data")])
def test_shared_helpers_sit_below_their_users(low, high):
    graph = import_graph()
    assert low in graph[high] and not graph[low] & {high, "specplug.cli", "specplug.train.datagen"}
