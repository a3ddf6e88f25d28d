"""A runner spec typed once, at the edge: ``"roofline:model=gemma-3-27b,tp=2"`` -> `RunnerSpec`, the
runner's name and its frozen ``Params``, keeping the text it was written as (what ``str()``, run.json
and every other output write, unchanged).

A runner is one file of ``servelab.runners`` that registers its ``Params`` dataclass with
``@RUNNERS.register("name")``; ``params.build(**context)`` makes the runner, the replay's model, GPU,
TP... (the command line's or the config's) filling the fields left None (spec values win). Each value
is typed here against its field's annotation (``int``, ``float``, ``bool``, ``str``, ``Path``; with
``| None``, None means "not given", never a value written in a spec). A key that is not a field, or a
value not of its type, is a `ServelabError` naming the spec, the key and the type; ``Params``'s own
``__post_init__`` checks values without I/O (what needs a file or a preset table, a model name or a
fitted model's file, is read when the runner is built).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from servelab.common.coerce import coerce, type_name
from servelab.common.errors import ServelabError
from servelab.common.registry import did_you_mean
from servelab.replay.core.plugins import RUNNERS


def split_spec(text: str) -> tuple[str, dict[str, str]]:
    """Split ``"linear:base=1,prefill_token=0.25"`` into ``("linear", {"base": "1", ...})`` (strings).

    A value without ``=`` after the name is kept under the key ``""`` (``fitted:model.json``): the
    runner's ``Params.positional`` field."""
    name, _, rest = text.partition(":")
    params: dict[str, str] = {}
    for part in rest.split(",") if rest else ():
        if not part:
            continue
        key, eq, value = part.partition("=")
        if not eq:
            if "" in params:
                raise ServelabError(f"runner spec '{text}': more than one positional value")
            params[""] = key
        else:
            params[key.strip()] = value.strip()
    return name.strip(), params


@dataclass(frozen=True, slots=True)
class RunnerSpec:
    """A runner by name with its typed ``Params`` (None: their defaults). ``text``: the spec as written
    (made from the parameters when not given). Equal specs are the same runner: the text is not
    compared (``linear:base=1e-3`` equals ``linear:base=0.001``), so a pool whose spec is written
    another way shares the runner built once."""

    name: str
    params: Any = None
    text: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        cls = RUNNERS.get(self.name)
        if self.params is None:
            object.__setattr__(self, "params", cls())
        elif type(self.params) is not cls:
            raise TypeError(f"runner '{self.name}' takes its typed {cls.__name__}, got {type(self.params).__name__} "
                            "(a spec string is typed once, by RunnerSpec.parse)")
        if not self.text:
            object.__setattr__(self, "text", spec_text(self.name, self.params))

    def __str__(self) -> str:
        return self.text

    @classmethod
    def parse(cls, text: str) -> "RunnerSpec":
        """The spec ``text`` typed: its runner's ``Params`` made from the ``key=value`` strings."""
        name, raw = split_spec(text)
        return cls(name, typed_params(RUNNERS.get(name), raw, text), text)


def runner_spec(value: Any, where: str | None = None) -> RunnerSpec:
    """A runner spec, typed: a string is parsed (the edge: a TOML file, the command line, the API), a
    `RunnerSpec` is passed through as it is. ``where`` (a file's pool or instance type) goes in front of
    an error."""
    if isinstance(value, RunnerSpec):
        return value
    try:
        if isinstance(value, str):
            return RunnerSpec.parse(value)
        raise ServelabError(f"runner: expected a spec string (name:key=value,...), got {value!r}")
    except ServelabError as exc:
        if where is None:
            raise
        raise ServelabError(f"{where}: {exc}") from None


def typed_params(cls: type, raw: dict[str, str], text: str) -> Any:
    """The ``key=value`` strings of the spec ``text`` as the runner's ``Params`` ``cls``."""
    owner = f"runner '{text}'"
    known = {f.name: f for f in fields(cls)}
    positional = getattr(cls, "positional", None)
    values: dict[str, Any] = {}
    for key, value in raw.items():
        if key == "":
            if positional is None:
                raise ServelabError(f"{owner}: '{value}' needs a key (key=value; parameters: {', '.join(known)})")
            key = positional
        key = key.replace("-", "_")
        if key not in known:
            raise ServelabError(f"{owner}: unknown parameter '{key}'{did_you_mean(key, known)} "
                                f"(parameters: {', '.join(known)})")
        if key in values:
            raise ServelabError(f"{owner}: {key} given twice")
        values[key] = typed_value(value, known[key].type, f"{owner}: {key}")
    try:
        return cls(**values)
    except ServelabError as err:  # (a value the Params refuse: a negative weight, an unknown choice)
        raise ServelabError(f"{owner}: {err}") from None


def typed_value(text: str, annotation: Any, where: str) -> Any:
    """One spec value as its field's type (the type alone: ``none`` is a string here, not "not given")."""
    base = type_name(annotation)[0]
    if base == "Path":
        if not text:
            raise ServelabError(f"{where}: expected a path, got ''")
        return Path(text)
    return coerce(text, base, where)


def spec_text(name: str, params: Any) -> str:
    """The spec a typed ``params`` reads back from (``RunnerSpec.parse``): the fields set apart from their
    defaults, the positional one first and without its key."""
    positional = getattr(type(params), "positional", None)
    parts = []
    for f in sorted(fields(params), key=lambda f: f.name != positional):
        value = getattr(params, f.name)
        if value is None or value == f.default:
            continue
        written = "true" if value is True else "false" if value is False else repr(value) \
            if isinstance(value, float) else str(value)
        if "," in written or (f.name == positional and "=" in written):
            raise ServelabError(f"runner '{name}': {f.name} {written!r} cannot be written in a spec (name:key=value,...)")
        parts.append(written if f.name == positional else f"{f.name}={written}")
    return name + (":" + ",".join(parts) if parts else "")


__all__ = ["RunnerSpec", "runner_spec", "spec_text", "split_spec", "typed_params"]
