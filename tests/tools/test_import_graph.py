"""The package-internal import graph: no cycles, io_engine stands alone, and imports point down the layers.

Every ``import`` and ``from ... import`` under ``tiered/`` and ``io_engine/`` counts, wherever it is: at module
level, inside a function (a lazy import is still a dependency), and inside ``if TYPE_CHECKING:`` (a type that
names a higher layer is the same coupling; a lower module should see a Protocol instead, as
tiered/checkpoint/plan.py does). Relative imports are resolved. ``from pkg import name`` points at the module
``pkg.name`` when there is one, else at ``pkg`` itself (its ``__init__``). Importing ``a.b.c`` also runs the
``__init__`` of ``a`` and ``a.b``; those implicit edges are not counted, or every module would depend on the
package façades that re-export it.

Only the source is read (``ast``): nothing is imported, so the test is fast and cannot be fooled by import order.
"""

from __future__ import annotations

import ast
import fnmatch
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]  # the repository
PACKAGES = ("io_engine", "tiered")

# The layers, lowest first: the folders of tiered/ are its layers. A module may import from its own layer or any
# lower one, never a higher one. Within a layer the cycle test still applies. Every module must match exactly one
# row: a module in a folder takes the folder's layer; a new module at the top level is placed here on purpose.
# The order (README.md, "How it works"; docs/internals.md):
#   io_engine < the shared top-level modules < tiered.layout < tiered.store < tiered.kv < tiered.checkpoint
#   < tiered.optim < tiered.offload < tiered.optimizer < tiered.integrations < tiered.cli, tiered.bench
# The KV cache stands on the store beside the optimizer and knows none of it; the checkpoint code sees the
# optimizer only through checkpoint.plan.ChunkedState, so it sits below the optimizer's parts.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("io_engine", ("io_engine", "io_engine.*")),
    (
        "shared: small modules any layer may use (argument checks, progress, Ctrl-C, counters, placement)",
        (
            "tiered._version",  # __version__, which any module may name
            "tiered.arguments",
            "tiered.progress",
            "tiered.interrupts",
            "tiered.telemetry",
            "tiered.calibration",  # the disk's calibrated bandwidth, the floor telemetry divides by
            "tiered.policy",  # pure placement logic: LRU, resident set, prefetch order
            "tiered.shares",  # the shares of a GPU budget the automatic choices use; torch-free, so the plan reads them
            "tiered.auto_budget",  # host_budget="auto", gpu_budget="auto": read off the machine and the CUDA cap
            "tiered.config",  # the optimizer's knobs, checked
        ),
    ),
    ("layout: chunks, record formats, split masters, 8-bit codes; pure, no I/O", ("tiered.layout", "tiered.layout.*")),
    (
        "store: the three tiers, records, the state folder, the chunk scan; knows no optimizer",
        ("tiered.store", "tiered.store.*"),
    ),  # fmt: skip
    ("kv cache: a client of the store", ("tiered.kv", "tiered.kv.*")),
    ("checkpoint", ("tiered.checkpoint", "tiered.checkpoint.*")),
    ("optim: what TieredOptimizer runs on", ("tiered.optim", "tiered.optim.*")),
    # offload_model: parameters and gradients off the GPU, by FSDP2's CPU offload (it wraps state as optim.shards);
    # the optimizer settles an offloaded model's gradient sums before it steps
    ("offload: parameters and gradients off the GPU", ("tiered.offload", "tiered.offload.*")),
    ("optimizer", ("tiered.optimizer",)),
    # HF Trainer / accelerate / Lightning checkpoint plumbing: on the optimizer, each importing its framework.
    ("framework integrations", ("tiered.integrations", "tiered.integrations.*")),
    # The package root holds __version__ and re-exports TieredOptimizer / TieredStore lazily: a façade, so
    # top layer; nothing inside the library should import from it.
    ("entry points", ("tiered", "tiered.cli", "tiered.bench", "tiered.bench.*")),
]


@dataclass(frozen=True)
class Edge:
    src: str
    dst: str
    where: str  # "path:line" of the import statement

    def __str__(self) -> str:
        return f"{self.src} -> {self.dst} ({self.where})"


def find_modules(root: Path = ROOT) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file of the packages (a package is its __init__.py)."""
    out = {}
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if "__pycache__" in parts:
                continue
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def _known(name: str, modules: dict[str, Path] | set[str]) -> str | None:
    """``name`` or its longest prefix that is a module of ours; None for anything outside the packages."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in modules:
            return candidate
        parts.pop()
    return None


def module_imports(name: str, source: str, is_package: bool, modules: set[str], path: str = "") -> list[Edge]:
    """The package-internal imports of module ``name`` (its ``source``), anywhere in the file."""
    package = name if is_package else name.rpartition(".")[0]
    edges = []
    for node in ast.walk(ast.parse(source, filename=path or name)):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                if node.level - 1 > len(parts) - 1:
                    raise ValueError(f"{path}:{node.lineno}: relative import beyond the top-level package")
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join(parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                targets.append(sub if alias.name != "*" and sub in modules else base)
        for target in targets:
            dst = _known(target, modules)
            if dst is not None and dst != name:
                edges.append(Edge(name, dst, f"{path or name}:{node.lineno}"))
    return edges


def build_graph(root: Path = ROOT) -> tuple[dict[str, Path], list[Edge]]:
    modules = find_modules(root)
    names = set(modules)
    edges = []
    for name, path in modules.items():
        rel = str(path.relative_to(root))
        edges += module_imports(name, path.read_text(), path.name == "__init__.py", names, rel)
    return modules, edges


def find_cycles(nodes: list[str], edges: list[Edge]) -> list[list[Edge]]:
    """Every import that lies on a cycle, each shown in a shortest cycle through it (as the cycle's edges).

    The strongly connected components (Tarjan) say which imports lie on cycles; for each such import
    ``u -> v`` the cycle is it plus a shortest path back from ``v`` to ``u``. Cycles found twice are listed once.
    """
    out_edges: dict[str, list[Edge]] = {n: [] for n in nodes}
    for e in edges:
        out_edges[e.src].append(e)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    component: dict[str, int] = {}

    def strongconnect(v: str) -> None:  # recursion depth is bounded by the module count (~100)
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for e in out_edges[v]:
            if e.dst not in index:
                strongconnect(e.dst)
                low[v] = min(low[v], low[e.dst])
            elif e.dst in on_stack:
                low[v] = min(low[v], index[e.dst])
        if low[v] == index[v]:
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component[w] = index[v]
                if w == v:
                    break

    for n in sorted(nodes):
        if n not in index:
            strongconnect(n)

    def path_back(start: str, goal: str) -> list[Edge]:
        """A shortest path start -> goal within start's component (breadth first)."""
        prev: dict[str, Edge] = {}
        frontier, seen = [start], {start}
        while goal not in seen:
            nxt = []
            for v in frontier:
                for e in out_edges[v]:
                    if component[e.dst] == component[start] and e.dst not in seen:
                        seen.add(e.dst)
                        prev[e.dst] = e
                        nxt.append(e.dst)
            assert nxt, "within a strongly connected component every member reaches every other"
            frontier = nxt
        path: list[Edge] = []
        while goal != start:
            path.insert(0, prev[goal])
            goal = path[0].src
        return path

    cycles, seen_cycles = [], set()
    for e in sorted(edges, key=lambda e: (e.src, e.dst, e.where)):
        if component[e.src] != component[e.dst]:
            continue
        cycle = [e, *path_back(e.dst, e.src)]
        first = min(range(len(cycle)), key=lambda i: cycle[i].src)  # the same cycle, whichever edge found it
        cycle = cycle[first:] + cycle[:first]
        key = tuple((c.src, c.dst) for c in cycle)
        if key not in seen_cycles:
            seen_cycles.add(key)
            cycles.append(cycle)
    return cycles


def layer_of(name: str) -> list[int]:
    return [i for i, (_, patterns) in enumerate(LAYERS) if any(fnmatch.fnmatchcase(name, p) for p in patterns)]


@pytest.fixture(scope="module")
def graph() -> tuple[dict[str, Path], list[Edge]]:
    return build_graph()


# ------------------------------------------------------------------------------------------- the analyzer
def test_analyzer_finds_every_kind_of_import():
    source = (
        "from typing import TYPE_CHECKING\n"
        "import io_engine.errors\n"
        "from . import b\n"
        "from .b import thing\n"
        "from .. import y\n"
        "from ..z import *\n"
        "if TYPE_CHECKING:\n"
        "    from tiered.q import Q\n"
        "def f():\n"
        "    from .c import other\n"
        "    import tiered.pkg.c\n"
        "import torch\n"
    )
    modules = {"io_engine", "io_engine.errors", "tiered", "tiered.y", "tiered.z", "tiered.q"}
    modules |= {"tiered.pkg", "tiered.pkg.a", "tiered.pkg.b", "tiered.pkg.c"}
    edges = module_imports("tiered.pkg.a", source, False, modules)
    got = sorted((e.dst, int(e.where.rpartition(":")[2])) for e in edges)
    assert got == [
        ("io_engine.errors", 2),
        ("tiered.pkg.b", 3),
        ("tiered.pkg.b", 4),
        ("tiered.pkg.c", 10),
        ("tiered.pkg.c", 11),
        ("tiered.q", 8),
        ("tiered.y", 5),
        ("tiered.z", 6),
    ]
    # In a package's __init__, "." is the package itself.
    init = module_imports("tiered.pkg", "from .a import x\nfrom . import b\n", True, modules)
    assert sorted(e.dst for e in init) == ["tiered.pkg.a", "tiered.pkg.b"]


def test_analyzer_reports_a_cycle_by_its_edges():
    edges = [Edge("a", "b", "a.py:1"), Edge("b", "c", "b.py:2"), Edge("c", "a", "c.py:3"), Edge("c", "d", "c.py:4")]
    (cycle,) = find_cycles(["a", "b", "c", "d"], edges)
    assert [str(e) for e in cycle] == ["a -> b (a.py:1)", "b -> c (b.py:2)", "c -> a (c.py:3)"]
    assert find_cycles(["a", "b"], [Edge("a", "b", "a.py:1")]) == []
    # Two cycles through one module: both are reported, each by its own edges.
    edges.append(Edge("b", "a", "b.py:5"))
    cycles = [[str(e) for e in c] for c in find_cycles(["a", "b", "c", "d"], edges)]
    assert cycles == [["a -> b (a.py:1)", "b -> a (b.py:5)"], ["a -> b (a.py:1)", "b -> c (b.py:2)", "c -> a (c.py:3)"]]


def test_graph_sees_the_real_tree(graph):
    modules, edges = graph
    assert {"io_engine", "tiered.optimizer", "tiered.checkpoint.save", "tiered.store.scan"} <= set(modules)
    pairs = {(e.src, e.dst) for e in edges}
    assert ("tiered.optim.assembly", "tiered.store") in pairs
    assert ("tiered.checkpoint.save", "tiered.store.scan") in pairs  # save reads ahead by tiered.store.scan's rule


# ----------------------------------------------------------------------------------------------- the rules
def test_every_module_has_exactly_one_layer(graph):
    modules, _ = graph
    bad = {m: [LAYERS[i][0] for i in layer_of(m)] for m in modules if len(layer_of(m)) != 1}
    assert not bad, f"place each module in exactly one row of LAYERS (tests/tools/test_import_graph.py): {bad}"


def test_no_import_cycles(graph):
    modules, edges = graph
    cycles = find_cycles(list(modules), edges)
    report = "\n".join("  " + " ; ".join(str(e) for e in cycle) for cycle in cycles)
    assert not cycles, f"{len(cycles)} import cycle(s), each shown by its edges:\n{report}"


def test_io_engine_imports_nothing_from_tiered(graph):
    _, edges = graph
    bad = [str(e) for e in edges if e.src.split(".")[0] == "io_engine" and e.dst.split(".")[0] == "tiered"]
    assert not bad, "io_engine is a library on its own and must not import tiered:\n  " + "\n  ".join(bad)


def test_checkpoint_never_imports_the_optimizer(graph):
    _, edges = graph
    bad = [str(e) for e in edges if fnmatch.fnmatchcase(e.src, "tiered.checkpoint*") and e.dst == "tiered.optimizer"]
    assert not bad, "tiered.checkpoint sees the optimizer as plan.ChunkedState only:\n  " + "\n  ".join(bad)


def test_imports_point_down_the_layers(graph):
    modules, edges = graph
    up = []
    for e in edges:
        src, dst = layer_of(e.src), layer_of(e.dst)
        if len(src) == 1 and len(dst) == 1 and dst[0] > src[0]:
            up.append(f"{e}: from layer '{LAYERS[src[0]][0]}' up to '{LAYERS[dst[0]][0]}'")
    assert not up, f"{len(up)} import(s) point up the layers (LAYERS in this file):\n  " + "\n  ".join(up)
