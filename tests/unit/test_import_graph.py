"""The import graph of kvproxy and kvlab: no cycles, the product never imports the tools.

Parses every module of both packages with :mod:`ast` (nothing is imported). A node of
the graph is a *unit*: a subpackage (``kvlab.sim``) or a top-level module
(``kvproxy.config``). Every import counts, including ones inside functions and under
``TYPE_CHECKING``: a deferred import hides a cycle from Python, not from a reader.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import kvlab
import kvproxy

# The shipped proxy (what ``kvproxy serve`` runs) and the tools around it.
PACKAGES = {"kvproxy": Path(kvproxy.__file__).parent, "kvlab": Path(kvlab.__file__).parent}
# The product's modules that may name kvlab: the command line's lazy dispatch (by name,
# through importlib) and the ``python -m kvproxy.workload`` shim (through the former).
REACHES_THE_TOOLS = {"kvproxy.cli", "kvproxy.workload.__main__"}
# Edges left out of the cycle check, each with the change that removes it.
KNOWN_EDGES: set[tuple[str, str]] = set()
# Subpackages left out of the per-module check, likewise (none at present).
KNOWN_MODULE_CYCLES: set[str] = set()
# Module edges left out of the per-module check (none at present).
KNOWN_MODULE_EDGES: set[tuple[str, str]] = set()


def _root(name: str) -> Path | None:
    return PACKAGES.get(name.partition(".")[0])


def _files() -> Iterator[Path]:
    for root in PACKAGES.values():
        yield from sorted(root.rglob("*.py"))


def _module_name(path: Path) -> str:
    root = next(r for r in PACKAGES.values() if r == path or r in path.parents)
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> Iterator[str]:
    """Absolute names of the modules ``path`` imports."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            yield prefix
            for alias in node.names:
                yield f"{prefix}.{alias.name}"


def _unit(name: str) -> str | None:
    """``kvlab.sim.scheduler`` -> ``kvlab.sim``; ``kvproxy.config`` -> ``kvproxy.config``."""
    parts = name.split(".")
    root = _root(name)
    if root is None or len(parts) < 2:
        return None
    if (root / parts[1]).is_dir() or (root / f"{parts[1]}.py").is_file():
        return f"{parts[0]}.{parts[1]}"
    return None


def _module_exists(name: str) -> bool:
    root = _root(name)
    if root is None:
        return False
    rel = Path(*name.split(".")[1:])
    return (root / rel).with_suffix(".py").is_file() or (root / rel / "__init__.py").is_file()


def unit_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in _files():
        src = _unit(_module_name(path))
        if src is None:
            continue
        deps = graph.setdefault(src, set())
        for name in _imports(path):
            dst = _unit(name)
            if dst is not None and dst != src and (src, dst) not in KNOWN_EDGES:
                deps.add(dst)
    return graph


def module_graph(unit: str) -> dict[str, set[str]]:
    """Imports between the modules of one subpackage (``kvlab.workload``)."""
    graph: dict[str, set[str]] = {}
    package, _, sub = unit.partition(".")
    for path in sorted((PACKAGES[package] / sub).rglob("*.py")):
        src = _module_name(path)
        deps = graph.setdefault(src, set())
        for name in _imports(path):
            if (
                name.startswith(f"{unit}.")
                and _module_exists(name)
                and name != src
                and (src, name) not in KNOWN_MODULE_EDGES
            ):
                deps.add(name)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a path (first node repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return [*stack[stack.index(dep) :], dep]
            if dep not in state and (found := visit(dep)) is not None:
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)) is not None:
            return found
    return None


def test_find_cycle_finds_a_cycle_and_accepts_a_dag() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_the_package_level_import_graph_is_acyclic() -> None:
    graph = unit_graph()
    assert {"kvproxy.proxy", "kvproxy.admission", "kvlab.sim", "kvlab.lab"} <= graph.keys()
    assert find_cycle(graph) is None


def test_no_import_cycle_between_the_modules_of_a_subpackage() -> None:
    units = sorted(
        f"{package}.{p.name}"
        for package, root in PACKAGES.items()
        for p in root.iterdir()
        if (p / "__init__.py").is_file()
    )
    assert "kvlab.workload" in units
    for unit in units:
        if unit in KNOWN_MODULE_CYCLES:
            continue
        assert find_cycle(module_graph(unit)) is None, unit


def _names_kvlab(path: Path) -> bool:
    """Whether ``path`` imports kvlab or names one of its modules in a string (which
    ``importlib.import_module`` could load)."""
    if any(n.partition(".")[0] == "kvlab" for n in _imports(path)):
        return True
    tree = ast.parse(path.read_text(), str(path))
    return any(
        isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and (node.value == "kvlab" or node.value.startswith("kvlab."))
        for node in ast.walk(tree)
    )


def test_the_product_never_imports_the_tools() -> None:
    product = sorted(PACKAGES["kvproxy"].rglob("*.py"))
    naming = {_module_name(p) for p in product if _names_kvlab(p)}
    assert naming <= REACHES_THE_TOOLS, sorted(naming - REACHES_THE_TOOLS)
    # Nor through another module: what the product's units reach holds no kvlab unit.
    graph = unit_graph()
    reached: set[str] = set()
    todo = [u for u in graph if u.startswith("kvproxy.")]
    while todo:
        unit = todo.pop()
        if unit not in reached:
            reached.add(unit)
            todo.extend(graph.get(unit, ()))
    assert not {u for u in reached if u.startswith("kvlab.")}


def test_the_dispatch_names_the_tools_lazily() -> None:
    """The check above sees the command line's names of kvlab (it is not vacuous)."""
    assert _names_kvlab(PACKAGES["kvproxy"] / "cli.py")


def test_importing_the_proxy_loads_no_kvlab_module() -> None:
    code = (
        "import sys\n"
        "import kvproxy.app, kvproxy.serve, kvproxy.cli, kvproxy.doctor.cli\n"
        "print(sorted(m for m in sys.modules if m.partition('.')[0] == 'kvlab'))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip() == "[]"


# Modules described as pure: none of them may import aiohttp, directly or through others.
PURE_MODULES = [
    "kvproxy.vocab",
    "kvproxy.proxy.errors",
    "kvproxy.admin.auth",
    "kvproxy.admin.timeline",
    "kvproxy.sessions.identity",
    "kvproxy.sessions.table",
    "kvproxy.sessions.lifecycle_core",
    "kvproxy.sessions.lifecycle_metrics",
    "kvproxy.config",
    "kvproxy.dynamo.nvext",
    "kvproxy.dynamo.binding",
    "kvproxy.dynamo.streaming",
    "kvproxy.dynamo.prefill",
    "kvproxy.admission.classify",
    "kvproxy.admission.reservation",
    "kvproxy.admission.fleet.ledger",
    "kvlab.sim.histogram",
    "kvlab.sim.parse",
    "kvlab.sim.responses",
    "kvlab.workload.model",
    "kvlab.workload.draw",
    "kvlab.workload.spec",
    "kvlab.workload.plan",
    "kvlab.workload.trace",
    "kvlab.workload.report",
]


def _path_of(module: str) -> Path:
    root = _root(module)
    assert root is not None, module
    path = root.parent / Path(*module.split("."))
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def _own_imports_of(module: str) -> set[str]:
    names = {n for n in _imports(_path_of(module)) if _module_exists(n)}
    return {n for n in names if (module, n) not in KNOWN_MODULE_EDGES}


def _closure(module: str) -> set[str]:
    seen: set[str] = set()
    todo = [module]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        parts = name.split(".")
        todo.extend(".".join(parts[:i]) for i in range(2, len(parts)))  # parent packages
        todo.extend(_own_imports_of(name))
    return seen


def _third_party(module: str) -> set[str]:
    return {n.split(".")[0] for n in _imports(_path_of(module)) if _root(n) is None}


def test_the_pure_modules_do_not_import_aiohttp() -> None:
    for module in PURE_MODULES:
        reached = _closure(module)
        offenders = sorted(m for m in reached if "aiohttp" in _third_party(m))
        assert not offenders, (module, offenders)
