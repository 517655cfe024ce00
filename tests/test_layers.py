"""The layer map of docs/design.md, enforced over every module under src/ by reading its imports with `ast`.

Every `import` and `from ... import` counts, at module level or inside a function: a lazy import is still an arrow.
The checks: no import cycle between modules, no arrow from a layer to a higher one, and the three process packages
(inference, orchestrator, trainer) never import one another.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

# Lowest first. A module may import its own layer and the layers below it. A module belongs to the layer of the
# longest prefix listed here; every module under src/ must belong to one.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    (
        "base",
        (
            "primerl",  # the package itself: the version
            "primerl.cache",
            "primerl.digests",
            "primerl.models",
            "primerl.storage",
            "primerl.cpu",
            "primerl.ports",
            "primerl.imports",
            "primerl.multicast",
            "primerl.waiting",
        ),
    ),
    ("transport", ("primerl.transport",)),
    ("config", ("primerl.config",)),
    ("shared services", ("primerl.monitor", "primerl.wandb_run", "primerl.recipes")),
    ("process", ("primerl.inference", "primerl.orchestrator", "primerl.trainer")),
    ("launch", ("primerl.launch", "primerl_chat")),
    ("checklist", ("primerl.checklist",)),
    ("entry", ("primerl.commands", "primerl.cli", "primerl.eval", "primerl.demo")),
]
PROCESS_PACKAGES = ("primerl.inference", "primerl.orchestrator", "primerl.trainer")


def module_files(src: Path = SRC) -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (file, is a package's __init__)."""
    modules = {}
    for path in sorted(src.rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts = parts[:-1]
        modules[".".join(parts)] = (path, is_package)
    return modules


def _imported_names(tree: ast.AST, package: str) -> Iterator[tuple[str, int]]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            yield module, node.lineno
            for alias in node.names:  # `from pkg import submodule`
                yield f"{module}.{alias.name}", node.lineno


def import_graph(src: Path = SRC) -> dict[str, dict[str, int]]:
    """Module -> {imported module under src: first line of the import}."""
    modules = module_files(src)

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, dict[str, int]] = {}
    for name, (path, is_package) in modules.items():
        package = name if is_package else name.rpartition(".")[0]
        edges: dict[str, int] = {}
        for imported, line in _imported_names(ast.parse(path.read_text(), str(path)), package):
            target = resolve(imported)
            if target and target != name:
                edges.setdefault(target, line)
        graph[name] = edges
    return graph


def layer_of(module: str) -> tuple[int, str]:
    """(rank, the longest matching prefix)."""
    best: tuple[int, str] | None = None
    for rank, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and (best is None or len(prefix) > len(best[1])):
                best = (rank, prefix)
    if best is None:
        raise KeyError(module)
    return best


def find_cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each as one cycle through them."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, {}):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(_cycle_through(sorted(component), graph))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def _cycle_through(component: list[str], graph: dict[str, dict[str, int]]) -> list[str]:
    """One closed path inside a strongly connected component, from its first member back to it (breadth first)."""
    members = set(component)
    start = component[0]
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for node in frontier:
            for target in sorted(graph[node]):
                if target == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if target in members and target not in previous:
                    previous[target] = node
                    nxt.append(target)
        frontier = nxt
    return component


def violations(graph: dict[str, dict[str, int]]) -> tuple[list[str], list[str]]:
    """(upward arrows, arrows between process packages), one line each."""
    upward, across = [], []
    for module, edges in sorted(graph.items()):
        rank, _ = layer_of(module)
        for target, line in sorted(edges.items()):
            target_rank, _ = layer_of(target)
            arrow = f"{module}:{line} -> {target} ({LAYERS[rank][0]} -> {LAYERS[target_rank][0]})"
            if target_rank > rank:
                upward.append(arrow)
            own = next((p for p in PROCESS_PACKAGES if module == p or module.startswith(p + ".")), None)
            other = next((p for p in PROCESS_PACKAGES if target == p or target.startswith(p + ".")), None)
            if own and other and own != other:
                across.append(arrow)
    return upward, across


@pytest.fixture(scope="module")
def graph() -> dict[str, dict[str, int]]:
    return import_graph()


def test_every_module_has_a_layer(graph):
    assert len(graph) > 50
    unplaced = []
    for module in graph:
        try:
            layer_of(module)
        except KeyError:
            unplaced.append(module)
    assert not unplaced, f"modules in no layer of tests/test_layers.py (and docs/design.md): {unplaced}"


def test_no_import_cycles(graph):
    cycles = find_cycles(graph)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(cycle) for cycle in cycles)


def test_no_upward_arrows(graph):
    upward, _ = violations(graph)
    assert not upward, "imports from a lower layer to a higher one:\n" + "\n".join(upward)


def test_process_packages_never_import_each_other(graph):
    _, across = violations(graph)
    assert not across, "process packages importing one another:\n" + "\n".join(across)


def test_the_checks_see_what_they_must(tmp_path):
    """The checker itself: a function-level import, a relative import, a cycle and an upward arrow are all found."""
    package = tmp_path / "primerl"
    (package / "config").mkdir(parents=True)
    (package / "trainer").mkdir()
    (package / "orchestrator").mkdir()
    (package / "__init__.py").write_text("")
    (package / "config" / "__init__.py").write_text("")
    (package / "trainer" / "__init__.py").write_text("")
    (package / "orchestrator" / "__init__.py").write_text("")
    (package / "config" / "a.py").write_text("def f():\n    from primerl.trainer import b\n")
    (package / "trainer" / "b.py").write_text("from ..config import a\nfrom . import c\n")
    (package / "trainer" / "c.py").write_text("import primerl.orchestrator.d\n")
    (package / "orchestrator" / "d.py").write_text("")
    small = import_graph(tmp_path)
    assert small["primerl.config.a"] == {"primerl.trainer": 2, "primerl.trainer.b": 2}
    assert find_cycles(small) == [["primerl.config.a", "primerl.trainer.b", "primerl.config.a"]]
    upward, across = violations(small)
    assert [arrow.split(" ")[0] for arrow in upward] == ["primerl.config.a:2", "primerl.config.a:2"]
    assert across == ["primerl.trainer.c:1 -> primerl.orchestrator.d (process -> process)"]
