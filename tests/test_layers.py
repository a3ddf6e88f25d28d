"""The package's layers (docs/engine.md "Layers and one owner"): no import circles, and no file imports a layer above its own.

The import graph is read from the source with ``ast`` (every import anywhere in a file counts: module
level, under TYPE_CHECKING or inside a function, since each is a design tie whether or not it bites at
import time), the same reading as the project's tools/import_cycles.py, kept here so the test needs
nothing outside the checkout.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from helpers_package import package_files

ROOT = Path(__file__).resolve().parent.parent
PKG = "servelab"

# Packages, bottom first: a module may import its own package and those listed before it.
PACKAGES = ["common", "traces", "replay", "policies", "routers", "runners", "assembly", "scoring", "fidelity", "live",
            "serve", "search", "api", "cli", "__main__"]
# policies, routers and runners implement replay's protocols side by side and never import each other
SIDE_BY_SIDE = {"policies", "routers", "runners"}

# replay/'s own layers are its folders, bottom first: the core (replay/core/: event loop, request, KV,
# batch, step, the protocols), then the cluster (replay/cluster/: pools, PD handoff, autoscaling,
# instance types) and the platform (replay/platform/: front door, pausing, failures) beside each other,
# then the assembly of a whole replay's config and results (the files directly in replay/). A module's
# layer is the first folder below replay/; a new folder must be given a rank here.
REPLAY_RANK = {"core": 0, "cluster": 1, "platform": 1, "assembly": 2}

# Upward imports that remain, each with its reason; the list only shrinks (every entry must still exist).
KNOWN_UPWARD = {
    # a runner compared with a reference by replaying both: a tool above the assembly, kept at its
    # documented path (docs/runners.md: servelab.runners.validation.validate)
    ("runners.validation", "assembly"),
}


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Module (dotted, without the package name) -> the project modules it imports."""
    mods: dict[str, Path] = {}
    trees: dict[str, ast.Module] = {}
    for rel, p, tree in package_files(root):
        name = rel[: -len(".py")].replace("/", ".")
        if name.endswith("__init__"):
            name = name[: -len("__init__")].rstrip(".")
        mods[name], trees[name] = p, tree

    def target(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name if name in mods else None

    graph: dict[str, set[str]] = {m: set() for m in mods}
    for m, p in mods.items():
        is_pkg = p.name == "__init__.py"
        for node in ast.walk(trees[m]):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = [PKG, *m.split(".")] if m else [PKG]
                    up = parts[: len(parts) - node.level + (1 if is_pkg else 0)]
                    base = ".".join(up + ([base] if base else []))
                names = [f"{base}.{a.name}" for a in node.names] + [base]
            for n in names:
                if n != PKG and not n.startswith(PKG + "."):
                    continue
                t = target(n[len(PKG) + 1:])
                if t is not None and t != m and not (is_pkg and t.startswith(m + ".")):
                    graph[m].add(t)
    return graph


def circles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """Strongly connected components of more than one module (Tarjan's, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[frozenset[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = set()
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.add(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(frozenset(comp))
    return out


def package_of(module: str) -> str:
    return module.split(".")[0] if module else ""


def replay_layer(module: str) -> str:
    """A replay module's layer: its first folder below replay/, or the assembly for a file in replay/ itself."""
    parts = module.split(".")[1:] if module.startswith("replay.") else []
    layer = parts[0] if len(parts) > 1 or (parts and (ROOT / "replay" / parts[0]).is_dir()) else "assembly"
    if layer not in REPLAY_RANK:
        raise AssertionError(f"replay/{layer}/ is no layer of REPLAY_RANK: give it a rank")
    return layer


def upward_imports(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    """(importer, imported) pairs where a module imports a layer above its own."""
    rank = {p: i for i, p in enumerate(PACKAGES)}
    out = set()
    for m, targets in graph.items():
        pm = package_of(m)
        if pm not in rank:
            continue
        for t in targets:
            pt = package_of(t)
            if pt not in rank:
                continue
            if pm == "replay" and pt == "replay":
                lm, lt = replay_layer(m), replay_layer(t)
                if REPLAY_RANK[lt] > REPLAY_RANK[lm] or (REPLAY_RANK[lt] == REPLAY_RANK[lm] and lt != lm):
                    out.add((m, t))
            elif pm != pt and (rank[pt] > rank[pm] or (pm in SIDE_BY_SIDE and pt in SIDE_BY_SIDE)):
                out.add((m, t))
    return out


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph()


def test_the_reader_sees_a_known_circle() -> None:
    """The checker itself: a circle of three is found, and a module-level and a TYPE_CHECKING import are both read."""
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(g) == [frozenset({"a", "b", "c"})]
    graph = import_graph()
    assert "replay.core.request" in graph["replay.core.engine"]
    assert "replay.core.engine" in graph["replay.platform.hooks"]  # a TYPE_CHECKING import and a module-level one


def test_replay_has_no_import_circle(graph) -> None:
    found = [c for c in circles(graph) if any(m.startswith("replay") for m in c)]
    assert not found, f"import circles in replay/: {[sorted(c) for c in found]}"


def test_no_import_circle_anywhere(graph) -> None:
    found = circles(graph)
    assert not found, f"import circles: {[sorted(c) for c in found]}"


def test_every_replay_file_has_a_layer(graph) -> None:
    for m in graph:
        if package_of(m) == "replay":
            replay_layer(m)


def test_replay_folders_are_the_layers() -> None:
    """The folders below replay/ are exactly the ranked layers (the assembly: the files in replay/ itself)."""
    folders = {p.name for p in (ROOT / "replay").iterdir() if p.is_dir() and (p / "__init__.py").is_file()}
    assert folders == set(REPLAY_RANK) - {"assembly"}
    assert replay_layer("replay.core.engine") == replay_layer("replay.core.kv.manager") == "core"
    assert replay_layer("replay.platform") == "platform" and replay_layer("replay.config") == "assembly"
    assert replay_layer("replay") == "assembly"


def test_no_module_imports_a_layer_above_its_own(graph) -> None:
    found = upward_imports(graph)
    assert found <= KNOWN_UPWARD, f"imports of a higher layer: {sorted(found - KNOWN_UPWARD)}"
    assert KNOWN_UPWARD <= found, f"gone (drop them from KNOWN_UPWARD): {sorted(KNOWN_UPWARD - found)}"


def test_the_layer_rule_catches_the_core_reaching_up() -> None:
    """What the rule exists for: the engine importing the platform (as it did) is refused."""
    g = {"replay.core.engine": {"replay.platform.hooks"}, "replay.platform.hooks": {"replay.core.engine"},
         "runners.base": {"api"}, "api": set()}
    assert upward_imports(g) == {("replay.core.engine", "replay.platform.hooks"), ("runners.base", "api")}
    # by folder: the KV manager reaching the cluster, the cluster the platform, the platform the assembly
    g = {"replay.core.kv.manager": {"replay.cluster.fleet"}, "replay.cluster.disagg": {"replay.platform.admission"},
         "replay.platform.abort": {"replay.results"}, "replay.cluster.fleet": set(), "replay.platform.admission": set(),
         "replay.results": {"replay.core.engine"}, "replay.core.engine": set()}
    assert upward_imports(g) == {("replay.core.kv.manager", "replay.cluster.fleet"),
                                 ("replay.cluster.disagg", "replay.platform.admission"),
                                 ("replay.platform.abort", "replay.results")}
