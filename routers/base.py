"""The routers' side of the seam: a base class and lookup by name (the registry, ``ROUTERS``, sits with the
engine's Protocols: replay/core/plugins.py).

The contract is the engine's (``servelab.replay.core.protocols.Router``): ``route(req, replicas)`` picks
the live replica an arriving request joins. A router is one file in this package with a class
registered by ``@ROUTERS.register("name")``; a lookup finds it by its file being in this package
(or under the ``servelab.routers`` entry point of another package: common/registry.py), so adding a
router edits no other file. Parameters are a frozen dataclass as ``Params`` (TOML
``router_params``, typed once when the config is made), as for policies. ``replay/`` never imports this package: ``servelab.api`` puts
the parts together.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from servelab.replay.core.plugins import ROUTERS, params_for

if TYPE_CHECKING:
    from servelab.replay.core.replica import Replica
    from servelab.replay.core.request import Request


@dataclass(frozen=True, slots=True)
class NoParams:
    """A router without settings."""


class RouterBase:
    """``name`` is set by the registry; ``seed`` is the replay's (routers that draw use it)."""

    name: ClassVar[str] = "?"
    Params: ClassVar[type] = NoParams
    # Whether ``route`` reads a replica's progress: its outstanding tokens (``reads_progress``) and its KV use,
    # ``kv.used`` (``reads_kv``). A decode stretch in flight updates both only at its end; the engine shows
    # them as one iteration at a time has them (replay/core/engine.py ``route_at``), at a cost per replica and
    # arrival (for ``reads_kv``, a walk of the stretch's requests): a router that reads neither says so.
    reads_progress: ClassVar[bool] = True
    reads_kv: ClassVar[bool] = False

    def __init__(self, params: Any = None, seed: int = 0):
        self.params = self.Params() if params is None else params
        self.seed = seed
        # (the class's flags as instance attributes: the engine reads reads_progress at every arrival, and
        # CPython 3.11 specialises that read on an instance attribute, not on a class default)
        self.reads_progress = type(self).reads_progress

    def route(self, req: Request, replicas: list[Replica]) -> Replica:
        raise NotImplementedError


def router_class(name: str) -> type[RouterBase]:
    return ROUTERS.get(name)


def router_names() -> list[str]:
    return ROUTERS.names()


def make_router(name: str, params: Any = None, seed: int = 0) -> RouterBase:
    """Router ``name`` with ``params`` its typed ``Params`` (None: the defaults); nothing is parsed here
    (a config's parameters were typed once, when it was made: ``ReplayConfig``)."""
    cls = router_class(name)
    return cls(params_for(cls, params), seed)


def least_outstanding(replicas: list[Replica]) -> Replica:
    """The replica with the fewest prompt + output tokens still to produce (ties: the first, the lowest id)."""
    return min(replicas, key=lambda r: r.outstanding_tokens)


__all__ = ["ROUTERS", "NoParams", "RouterBase", "least_outstanding", "make_router", "router_class", "router_names"]
