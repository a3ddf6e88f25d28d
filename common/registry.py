"""A name -> factory registry filled by one decorator; unknown names list the known ones and
suggest the nearest (``did you mean``)."""

from __future__ import annotations

import difflib
import importlib
import pkgutil
from typing import Callable, Generic, Iterable, TypeVar

from servelab.common.errors import ServelabError

T = TypeVar("T")


def did_you_mean(name: object, known: Iterable[str]) -> str:
    """``"; did you mean 'X'?"`` for the known name nearest ``name`` (a typo, a unique prefix, another
    case), or ``""`` when none is near: appended to an unknown-name error."""
    known = list(known)
    text = str(name).strip()
    prefixed = [k for k in known if text and k.lower().startswith(text.lower())]
    if len(prefixed) == 1:
        return f"; did you mean '{prefixed[0]}'?"
    lowered = {k.lower(): k for k in known}
    match = difflib.get_close_matches(text.lower(), list(lowered), n=1, cutoff=0.6)
    return f"; did you mean '{lowered[match[0]]}'?" if match else ""


class Registry(Generic[T]):
    def __init__(self, kind: str):
        self.kind = kind
        self._items: dict[str, T] = {}
        self._aliases: dict[str, str] = {}  # another name -> the registered one (vllm-v1 -> sarathi)

    def register(self, name: str) -> Callable[[T], T]:
        def deco(obj: T) -> T:
            if name in self._items:
                raise ValueError(f"{self.kind} '{name}' registered twice")
            self._items[name] = obj
            return obj

        return deco

    def alias(self, name: str, target: str) -> None:
        """``name`` is another name for the registered ``target`` (not listed by ``names``)."""
        if name in self._items or name in self._aliases:
            raise ValueError(f"{self.kind} '{name}' registered twice")
        self._aliases[name] = target

    def aliases_of(self, target: str) -> list[str]:
        return sorted(a for a, t in self._aliases.items() if t == target)

    def get(self, name: str) -> T:
        try:
            return self._items[self._aliases.get(name, name)]
        except KeyError:
            known = ", ".join(sorted(self._items))
            hint = did_you_mean(name, self._items)
            raise ServelabError(f"unknown {self.kind} '{name}'{hint} (known: {known})") from None

    def names(self) -> list[str]:
        return sorted(self._items)

    def __contains__(self, name: str) -> bool:
        return self._aliases.get(name, name) in self._items


class ClassRegistry(Registry[type]):
    """A registry of classes (policies, routers): registering one also gives it its ``name``.

    ``package``: the package whose modules register their classes by being imported. The first
    lookup imports every module of it; what other packages declare under the entry point group of
    the same name is loaded when a name is not among those, or when the names are listed: adding
    a class edits no other file, and a replay of built-in names does not scan the installed
    packages' entry points (importlib.metadata: ~20 ms of a replay's start-up)."""

    def __init__(self, kind: str, package: str | None = None):
        super().__init__(kind)
        self.package = package
        self._loaded = self._plugins_loaded = package is None

    def load(self, plugins: bool = False) -> None:
        """Import the package's modules (once); with ``plugins``, also the entry points' (once)."""
        if not self._loaded:
            self._loaded = True
            package = importlib.import_module(self.package)
            for module in sorted(m.name for m in pkgutil.iter_modules(package.__path__)):
                importlib.import_module(f"{self.package}.{module}")
        if plugins and not self._plugins_loaded:
            from importlib.metadata import entry_points

            self._plugins_loaded = True
            for entry in entry_points(group=self.package):
                entry.load()

    def get(self, name: str) -> type:
        self.load()
        if self._aliases.get(name, name) not in self._items:
            self.load(plugins=True)
        return super().get(name)

    def names(self) -> list[str]:
        self.load(plugins=True)
        return super().names()

    def __contains__(self, name: str) -> bool:
        self.load()
        if self._aliases.get(name, name) not in self._items:
            self.load(plugins=True)
        return super().__contains__(name)

    def register(self, name: str) -> Callable[[type], type]:
        add = super().register(name)

        def deco(cls: type) -> type:
            cls.name = name
            return add(cls)

        return deco
