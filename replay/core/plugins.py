"""The registries of the engine's three plug-in seams, policies, routers and runners, by name.

A policy or router is a class with a frozen ``Params`` dataclass, in one file of its package
(``servelab.policies``, ``servelab.routers``) that registers it here when imported; a runner registers
its frozen ``Params`` dataclass itself, whose ``build(**context)`` makes the runner (``servelab.runners``,
replay/core/runner_spec.py). A lookup imports the file named after the name (common/registry.py). The
registries sit beside the Protocols they serve (replay/core/protocols.py), not in those packages, so
that the replay's config (replay/config.py) can type a policy's or router's parameters and a runner
spec by name once, at the edge, without importing a policy: nothing in ``replay/`` imports a concrete
policy, router or runner, it asks a registry for one by name.
"""

from __future__ import annotations

from typing import Any

from servelab.common.registry import ClassRegistry, Registry

POLICIES: ClassRegistry = ClassRegistry("policy", package="servelab.policies")
ROUTERS: ClassRegistry = ClassRegistry("router", package="servelab.routers")
# a runner's name -> its typed ``Params`` class (with ``build(**context) -> Runner``); a replay imports only
# the runner module it names (the others bring numpy, pyarrow or torch's layout code)
RUNNERS: Registry = Registry("runner", package="servelab.runners")


def params_for(cls: type, params: Any) -> Any:
    """``params`` if it is the plug-in class ``cls``'s typed ``Params`` (None: its defaults). Nothing is
    parsed here: raw parameters are typed once, when a config is made (``ReplayConfig``), and anything
    else is the caller's mistake."""
    if params is None:
        return cls.Params()
    if type(params) is not cls.Params:
        raise TypeError(f"{cls.name} takes its typed {cls.Params.__name__}, got {type(params).__name__} "
                        "(raw parameters are typed once, by ReplayConfig)")
    return params


__all__ = ["POLICIES", "ROUTERS", "RUNNERS", "params_for"]
