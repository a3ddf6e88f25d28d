"""A click choice among a registry's names (trace formats, run import formats), listed from the registry
when first needed (help, checking a value), so that a new plug-in file is a new choice without an edit
here, and the command line does not import every plug-in to start."""

from __future__ import annotations

from typing import Any

import click


class RegistryChoice(click.Choice):
    def __init__(self, names: Any):
        """``names``: a callable returning the registered names (``REGISTRY.names``)."""
        self._names = names
        super().__init__(())

    @property
    def choices(self) -> tuple[str, ...]:
        return tuple(self._names())

    @choices.setter
    def choices(self, value) -> None:  # (click.Choice sets it; the registry is the source)
        pass


__all__ = ["RegistryChoice"]
