"""One owner for a request's lifecycle (docs/engine.md "Layers and one owner"): across the package, a
request's status is written only by the Request type and by the engine's verbs (route, admit, preempt,
finish, end, interrupt, strand, truncate); the cluster and the platform ask them. And "stop the in-flight
step at a time" is written once (``Engine.truncate``)."""

from __future__ import annotations

import ast
from pathlib import Path

from helpers_package import package_files

ROOT = Path(__file__).resolve().parent.parent


OWNERS = {"replay/core/request.py", "replay/core/engine.py"}


def _mentions_status(node: ast.AST) -> bool:
    return any(isinstance(n, ast.Name) and n.id == "Status" for n in ast.walk(node))


def status_writes(root: Path = ROOT) -> dict[str, list[int]]:
    """File -> lines that assign a `Status` to an attribute named ``status`` (or setattr it). Under
    ``replay/`` every assignment to a ``status`` attribute counts, whatever its value (a local holding a
    `Status` is still a status write); outside it only one whose value names `Status` (the live client's
    records and the server's errors have string statuses of their own)."""
    out: dict[str, list[int]] = {}
    for rel, _, tree in package_files(root):
        in_replay = rel.startswith("replay/")
        for node in ast.walk(tree):
            hit = False
            if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                hit = any(isinstance(t, ast.Attribute) and t.attr == "status" for t in targets) \
                    and node.value is not None and (in_replay or _mentions_status(node.value))
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr":
                hit = len(node.args) == 3 and isinstance(node.args[1], ast.Constant) and node.args[1].value == "status"
            if hit:
                out.setdefault(rel, []).append(node.lineno)
    return out


def test_the_scan_sees_a_status_write(tmp_path) -> None:
    (tmp_path / "a.py").write_text("req.status = Status.DROPPED\nrecord.status = 'finished'\n")
    (tmp_path / "b.py").write_text("setattr(req, 'status', x)\n")
    (tmp_path / "replay").mkdir()
    (tmp_path / "replay" / "c.py").write_text("done = Status.UNFINISHED\nreq.status = done\n")
    assert status_writes(tmp_path) == {"a.py": [1], "b.py": [1], "replay/c.py": [2]}


def test_only_the_request_and_the_engine_write_a_status() -> None:
    writes = status_writes()
    assert set(writes) <= OWNERS, {f: lines for f, lines in writes.items() if f not in OWNERS}


def test_the_in_flight_step_is_truncated_in_one_place() -> None:
    """``iterations_done_by`` (how much of a step is done at a time) is called by ``Engine.truncate`` only."""
    calls = []
    for rel, _, tree in package_files(ROOT):
        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for node in ast.walk(fn):
                    if isinstance(node, ast.Attribute) and node.attr == "iterations_done_by" \
                            and isinstance(node.ctx, ast.Load) and fn.name != "iterations_done_by":
                        calls.append((rel, fn.name))
    assert calls == [("replay/core/engine.py", "truncate")]


def test_only_the_engine_sets_which_replicas_take_arrivals() -> None:
    """``Engine.live`` (the replicas arrivals are routed to) is assigned in replay/core/engine.py only: the
    autoscalers, fleets, the PD handoff and failures go through ``publish``/``fail``/``restore``."""
    writers = set()
    for rel, _, tree in package_files(ROOT):
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Attribute) and t.attr == "live"
                                                    for t in node.targets):
                writers.add(rel)
    assert writers == {"replay/core/engine.py"}


# Who may move a request in or out of a replica's queues: the engine's verbs; the replica (it makes
# them) and the batch builder (replay/core/batch.py swaps the running list for one that keeps its
# aggregate in step: replay/core/cohort.py's ``Running``, which only extends list's own methods).
QUEUE_OWNERS = {"replay/core/engine.py", "replay/core/replica.py", "replay/core/batch.py"}
MOVES = {"append", "appendleft", "extend", "insert", "remove", "pop", "popleft", "clear"}


def queue_moves(root: Path = ROOT) -> dict[str, list[int]]:
    """File -> lines that change a ``.waiting`` or ``.running`` queue (a mutating call or an assignment)."""
    out: dict[str, list[int]] = {}
    for rel, _, tree in package_files(root):
        for node in ast.walk(tree):
            hit = False
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MOVES:
                owner = node.func.value
                hit = isinstance(owner, ast.Attribute) and owner.attr in ("waiting", "running")
            elif isinstance(node, ast.Assign):
                hit = any(isinstance(t, ast.Attribute) and t.attr in ("waiting", "running") for t in node.targets)
            if hit:
                out.setdefault(rel, []).append(node.lineno)
    return {rel: sorted(lines) for rel, lines in out.items()}


def test_the_scan_sees_a_queue_move(tmp_path) -> None:
    (tmp_path / "a.py").write_text("replica.waiting.remove(req)\nreplica.running = []\nheld.remove(req)\n"
                                   "len(replica.running)\n")
    assert queue_moves(tmp_path) == {"a.py": [1, 2]}


def test_only_the_engine_moves_requests_between_queues() -> None:
    """Pausing a tier, a client's abort, the PD handoff and a replica lost go through engine verbs
    (``take_off``, ``let_go``, ``hand_off``, ``land``, ``set_aside``, ``resume``, ``empty``)."""
    moves = queue_moves()
    assert set(moves) <= QUEUE_OWNERS, {f: lines for f, lines in moves.items() if f not in QUEUE_OWNERS}


# The engine's private attributes are its own; the client timeouts and the platform ask the engine for
# nothing but its event queue (``push``) and to apply their intents (``enact``): every other method of
# ``Engine`` is a lifecycle or membership verb, applied for them by ``enact``.
INTENT_SOURCES = ("replay/platform/abort.py", "replay/platform/hooks.py", "replay/core/depends.py")
NOT_VERBS = {"push", "enact"}


def _names_engine(node: ast.AST) -> bool:
    """``engine``, ``Engine`` or ``<anything>.engine``: an expression naming the engine (or its class)."""
    return (isinstance(node, ast.Name) and node.id in ("engine", "Engine")) or \
        (isinstance(node, ast.Attribute) and node.attr == "engine")


def _private(name) -> bool:
    return isinstance(name, str) and name.startswith("_") and not name.startswith("__")


def private_engine_uses(root: Path = ROOT) -> dict[str, list[int]]:
    """File -> lines outside replay/core/engine.py that read or write a private attribute of the engine
    (``engine._x``, ``self.engine._x``, ``Engine._x``, or by name through getattr/setattr/hasattr)."""
    out: dict[str, list[int]] = {}
    for rel, _, tree in package_files(root):
        if rel == "replay/core/engine.py":
            continue
        for node in ast.walk(tree):
            hit = isinstance(node, ast.Attribute) and _private(node.attr) and _names_engine(node.value)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                    and node.func.id in ("getattr", "setattr", "hasattr", "delattr") and len(node.args) >= 2:
                name = node.args[1]
                hit = _names_engine(node.args[0]) and isinstance(name, ast.Constant) and _private(name.value)
            if hit:
                out.setdefault(rel, []).append(node.lineno)
    return {rel: sorted(lines) for rel, lines in out.items()}


def engine_verbs(root: Path = ROOT) -> set[str]:
    """The methods ``class Engine`` defines in replay/core/engine.py, but ``push`` and ``enact``."""
    tree = ast.parse((root / "replay/core/engine.py").read_text())
    engine = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Engine")
    return {n.name for n in engine.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))} - NOT_VERBS


def _through_engine(target: ast.AST) -> bool:
    """Does an assignment target reach into the engine (``engine.x = ``, ``engine.ledger.refused_s[i] = ``)?"""
    while isinstance(target, (ast.Attribute, ast.Subscript)):
        if _names_engine(target.value):
            return True
        target = target.value
    return False


def verbs_called(root: Path = ROOT, files=INTENT_SOURCES) -> dict[str, list[tuple[int, str]]]:
    """File -> (line, what) for each engine verb ``files`` call themselves (``engine.end(...)``,
    ``self.engine.take_off(...)``), and each write into the engine's state (``engine.ledger.x[i] = ...``)."""
    verbs = engine_verbs(root)
    out: dict[str, list[tuple[int, str]]] = {}
    for rel in files:
        for node in ast.walk(ast.parse((root / rel).read_text(), rel)):
            found = None
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and node.func.attr in verbs and _names_engine(node.func.value):
                found = node.func.attr
            elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(_through_engine(t) for t in targets):
                    found = "assignment"
            if found is not None:
                out.setdefault(rel, []).append((node.lineno, found))
    return {rel: sorted(hits) for rel, hits in out.items()}


def test_the_scans_see_a_private_use_and_a_verb(tmp_path) -> None:
    for folder in ("core", "platform"):
        (tmp_path / "replay" / folder).mkdir(parents=True)
    (tmp_path / "replay" / "core" / "engine.py").write_text(
        "class Engine:\n    def push(self): pass\n    def enact(self): pass\n    def end(self): pass\n"
        "    def _cut(self): pass\n    def _x(self): self._cut()\n")
    (tmp_path / "replay" / "platform" / "abort.py").write_text(
        "engine._cut(r)\nself.engine.end(req)\nself.engine.push(1)\nengine.enact([])\n"
        "engine.ledger.refused_s[i] = 1\nplatform.end(req)\nengine.__class__\n")
    (tmp_path / "replay" / "platform" / "hooks.py").write_text("getattr(self.engine, '_cut')\nself.ledger.x[i] = 1\n")
    (tmp_path / "replay" / "core" / "depends.py").write_text("x = 1\nself.engine.end(req)\n")
    assert engine_verbs(tmp_path) == {"end", "_cut", "_x"}
    assert private_engine_uses(tmp_path) == {"replay/platform/abort.py": [1], "replay/platform/hooks.py": [1]}
    assert verbs_called(tmp_path) == {"replay/platform/abort.py": [(1, "_cut"), (2, "end"), (5, "assignment")],
                                      "replay/core/depends.py": [(2, "end")]}


def test_no_file_but_the_engine_uses_its_private_attributes() -> None:
    assert private_engine_uses() == {}


def test_client_timeouts_and_the_platform_call_no_engine_verb_they_return_intents() -> None:
    """replay/platform/abort.py and replay/platform/hooks.py end, take off, let go, preempt, set aside, resume, strand
    and move requests, and replay/core/depends.py sends and skips dependent requests, by returning intents
    (replay/core/intents.py) that ``Engine.enact`` applies."""
    assert {"end", "take_off", "let_go", "preempt", "set_aside", "resume", "truncate", "empty", "interrupt",
            "route_all", "strand", "_cut_stretch", "_request_schedule", "evict"} <= engine_verbs()
    assert verbs_called() == {}


def test_online_mode_drives_the_engine_and_changes_no_lifecycle_itself() -> None:
    """replay/platform/online.py (a server feeding the engine) calls two engine methods that are no lifecycle
    or membership verb: ``send_at`` (a request arrives at a time: an ARRIVAL event, status still pending)
    and ``advance`` (the clock); a client that goes away is aborted through ``enact`` (``Aborts.fire``'s
    intents). Its writes into the engine are its wiring, once, when it is made: per-iteration pricing,
    the client timeouts without timeouts, and a hook on ``ended`` that reports a request's end."""
    hits = verbs_called(files=("replay/platform/online.py",))["replay/platform/online.py"]
    assert {what for _, what in hits} == {"send_at", "advance", "assignment"}
    tree = ast.parse((ROOT / "replay/platform/online.py").read_text())
    init = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    wiring = {n.lineno for n in ast.walk(init) if hasattr(n, "lineno")}
    assert all(line in wiring for line, what in hits if what == "assignment")


# The decode cohort (replay/core/cohort.py) is the batch builder's device (issue #27 item 4): batch.py
# makes it and is the only module that imports it; what the engine does with a replica's aggregate is
# drive it through an iteration (``start``, ``apply``, ``after``). Everyone else asks batch.py
# (``no_aggregate``, ``make_current``, ``in_batch``, ``blocks_to_grow``, ``settle``).
AGGREGATE_USERS = {"replay/core/batch.py", "replay/core/cohort.py", "replay/core/engine.py"}
ENGINE_DRIVES = {"start", "apply", "after"}


def aggregate_uses(root: Path = ROOT) -> dict[str, set[str]]:
    """File -> what it does with a ``.aggregate`` (the attribute called on it, or "read") and whether it
    imports the cohort module ("import")."""
    out: dict[str, set[str]] = {}
    for rel, _, tree in package_files(root):
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").endswith("replay.core.cohort"):
                out.setdefault(rel, set()).add("import")
            elif isinstance(node, ast.Attribute) and node.attr == "aggregate" and isinstance(node.ctx, ast.Load):
                parent = parents.get(node)
                use = parent.attr if isinstance(parent, ast.Attribute) else "read"
                out.setdefault(rel, set()).add(use)
    return out


def test_only_the_batch_builder_knows_the_decode_cohort() -> None:
    uses = aggregate_uses()
    assert {f for f, what in uses.items() if "import" in what} == {"replay/core/batch.py"}
    outside = {f: what for f, what in uses.items() if f not in AGGREGATE_USERS}
    assert outside == {}, f"reach into a replica's aggregate outside the builder: {outside}"
    engine = uses["replay/core/engine.py"] - {"read"}
    assert engine <= ENGINE_DRIVES, engine


def test_no_code_outside_the_builder_names_the_cohort() -> None:
    """The KV manager's share of it is ``aggregate_held``, a request's ``aggregate_mark``, the token log's
    ``timeline``: no identifier (name, attribute, argument, function, class) outside batch.py and cohort.py
    says "cohort"."""
    named: dict[str, set[str]] = {}
    for rel, _, tree in package_files(ROOT):
        if rel in ("replay/core/batch.py", "replay/core/cohort.py"):
            continue
        for node in ast.walk(tree):
            name = (node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute)
                    else node.arg if isinstance(node, ast.arg)
                    else node.name if isinstance(node, (ast.FunctionDef, ast.ClassDef)) else "")
            if "cohort" in name.lower():
                named.setdefault(rel, set()).add(name)
    assert named == {}
