"""A name -> factory registry filled by one decorator; unknown names list the known ones and
suggest the nearest (``did you mean``).

One idiom for every plug-in kind (policies, routers, runners, trace and run importers): a registry
names the package its plug-ins live in, and a plug-in is one new file there that registers itself
with ``@REGISTRY.register("name")`` when imported (a policy or router: its class, with its frozen
``Params``; a runner: its frozen ``Params``, whose ``build`` makes it). Nothing lists the files: a lookup imports the
module named after the name (``vllm-bench`` -> ``vllm_bench.py``) and, when that does not register
it, every module of the package, then what installed packages declare under the entry point group of
the package's name; a listing imports every module that registers something (a module whose source
never calls ``.register(`` is a helper, such as the torch model the torch runner builds lazily, and is
not imported). So a replay imports only the plug-ins it names (a
runner's numpy or torch stays out of one that does not use it)."""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Callable, Generic, Iterable, TypeVar

from servelab.common.errors import ServelabError

if TYPE_CHECKING:
    import pkgutil

T = TypeVar("T")


def did_you_mean(name: object, known: Iterable[str]) -> str:
    """``"; did you mean 'X'?"`` for the known name nearest ``name`` (a typo, a prefix, another case), or
    ``""`` when none is near: appended to an unknown-name error. Names that start with ``name`` come
    first, the first listed of several when ``name`` has three characters or more (``h100`` is ``h100-80gb``, not ``h200`` or the rarer ``h100-nvl``)."""
    known = list(known)
    text = str(name).strip()
    prefixed = [k for k in known if text and k.lower().startswith(text.lower())]
    if len(prefixed) == 1 or (prefixed and len(text) >= 3):  # (one letter prefixes too many names to mean one)
        return f"; did you mean '{prefixed[0]}'?"
    import difflib  # (an error's hint: not loaded by a run that makes none)

    lowered = {k.lower(): k for k in known}
    match = difflib.get_close_matches(text.lower(), list(lowered), n=1, cutoff=0.6)
    return f"; did you mean '{lowered[match[0]]}'?" if match else ""


class Registry(Generic[T]):
    """``kind``: what the names name (error messages); ``package``: the package whose modules register
    into it (None: only what was registered explicitly)."""

    def __init__(self, kind: str, package: str | None = None):
        self.kind = kind
        self.package = package
        self._items: dict[str, T] = {}
        self._aliases: dict[str, str] = {}  # another name -> the registered one (vllm-v1 -> sarathi)
        self._loaded = self._plugins_loaded = package is None

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

    # -- finding the plug-ins ------------------------------------------------------------------
    def _known(self, name: str) -> bool:
        return self._aliases.get(name, name) in self._items

    def _find(self, name: str) -> None:
        """Import what may register ``name``, cheapest first, until it is known."""
        if self._known(name) or self.package is None:
            return
        if not self._loaded:
            stem = str(name).replace("-", "_")
            if stem.isidentifier() and _exists(f"{self.package}.{stem}"):
                importlib.import_module(f"{self.package}.{stem}")
                if self._known(name):
                    return
            self.load()
            if self._known(name):
                return
        self.load(plugins=True)

    def load(self, plugins: bool = False) -> None:
        """Import every module of the package (once); with ``plugins``, also the entry points' (once).
        A module whose third-party dependency is not installed (torch) is left out: what it would
        register is then unknown, as in a build without it."""
        if not self._loaded:
            self._loaded = True
            import pkgutil  # (listing the package: a lookup by name mostly finds its module directly)

            package = importlib.import_module(self.package)
            for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda m: m.name):
                module = info.name
                if not _registers(info):  # a helper module (a model, a table of presets): not a plug-in
                    continue
                try:
                    importlib.import_module(f"{self.package}.{module}")
                except ModuleNotFoundError as err:
                    if err.name is None or err.name.split(".")[0] == self.package.split(".")[0]:
                        raise
        if plugins and not self._plugins_loaded:
            from importlib.metadata import entry_points

            self._plugins_loaded = True
            for entry in entry_points(group=self.package):
                entry.load()

    # -- lookups ---------------------------------------------------------------------------------
    def get(self, name: str) -> T:
        self._find(name)
        try:
            return self._items[self._aliases.get(name, name)]
        except KeyError:
            known = ", ".join(sorted(self._items))
            hint = did_you_mean(name, self._items)
            raise ServelabError(f"unknown {self.kind} '{name}'{hint} (known: {known})") from None

    def names(self) -> list[str]:
        if self.package is not None:
            self.load(plugins=True)
        return sorted(self._items)

    def __contains__(self, name: str) -> bool:
        self._find(name)
        return self._known(name)


def _exists(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


class ClassRegistry(Registry[type]):
    """A registry of classes (policies, routers): registering one also gives it its ``name``."""

    def register(self, name: str) -> Callable[[type], type]:
        add = super().register(name)

        def deco(cls: type) -> type:
            cls.name = name
            return add(cls)

        return deco


def _registers(info: pkgutil.ModuleInfo) -> bool:
    """Does the module's source call ``.register(`` (so importing it may add a plug-in)? A module
    whose source cannot be read (compiled only) is imported, to be safe."""
    spec = info.module_finder.find_spec(info.name) if hasattr(info.module_finder, "find_spec") else None
    origin = getattr(spec, "origin", None)
    if not origin or not origin.endswith(".py"):
        return True
    try:
        with open(origin, encoding="utf-8") as f:
            return ".register(" in f.read()
    except OSError:
        return True
