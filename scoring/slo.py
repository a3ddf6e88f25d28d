"""Service-level objectives: a global/tier/tenant table parsed from the CLI or TOML, turned into SQL rows.

Precedence for each field separately: the request's own override (trace column ``ttft_slo_s`` /
``tpot_slo_s``) > its tenant's entry > its tier's entry > the global entry. A field given nowhere is
"not specified" and does not take part in that request's joint attainment.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, fields, replace
from typing import Any, Mapping

import pyarrow as pa

from servelab.common.errors import InputError, ServelabError
from servelab.common.registry import did_you_mean

# CLI/TOML key -> Slo field. Short names on the command line, unit-suffixed names in TOML both work.
_KEYS = {
    "ttft": "ttft_s",
    "ttft_s": "ttft_s",
    "tpot": "tpot_s",
    "tpot_s": "tpot_s",
    "e2e": "e2e_s",
    "e2e_s": "e2e_s",
    "max_stall": "max_stall_s",
    "max_stall_s": "max_stall_s",
    "stall": "max_stall_s",
    "task": "task_s",
    "task_s": "task_s",
}
SCOPES = ("global", "tier", "tenant")


@dataclass(frozen=True, slots=True)
class Slo:
    """Latency targets in seconds; None = not specified at this level."""

    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None
    max_stall_s: float | None = None
    task_s: float | None = None  # a task's deadline: its completion time (first arrival to last finish)

    def is_empty(self) -> bool:
        return all(getattr(self, f.name) is None for f in fields(self))

    def merged(self, other: "Slo", where: str) -> "Slo":
        """Combine two partial entries for the same scope; giving one field twice is an error."""
        values = {}
        for f in fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            if a is not None and b is not None:
                raise ServelabError(f"SLO {where}: '{f.name}' given twice")
            values[f.name] = a if a is not None else b
        return Slo(**values)

    def overridden_by(self, other: "Slo") -> "Slo":
        """Fields set in ``other`` replace ours (CLI over file)."""
        return replace(self, **{f.name: getattr(other, f.name) for f in fields(other) if getattr(other, f.name) is not None})


@dataclass(frozen=True, slots=True)
class SloTable:
    """A global entry plus per-tier and per-tenant entries (name-sorted tuples, so the table is hashable)."""

    global_: Slo = Slo()
    tiers: tuple[tuple[str, Slo], ...] = ()
    tenants: tuple[tuple[str, Slo], ...] = ()

    @property
    def is_empty(self) -> bool:
        return self.global_.is_empty() and not self.tiers and not self.tenants

    def specified_fields(self) -> tuple[str, ...]:
        """Fields some entry sets (a per-request override can add ttft_s/tpot_s on top)."""
        entries = [self.global_, *(s for _, s in self.tiers), *(s for _, s in self.tenants)]
        return tuple(f.name for f in fields(Slo) if any(getattr(e, f.name) is not None for e in entries))

    @classmethod
    def parse_cli(cls, specs: list[str] | tuple[str, ...]) -> "SloTable":
        """Parse ``ttft=0.5,tpot=0.05``, ``tier=priority:ttft=0.2``, ``tenant=acme:ttft=1`` (repeatable)."""
        table = cls()
        for spec in specs:
            table = table.combined(_parse_one(spec))
        return table

    @classmethod
    def from_toml(cls, data: Mapping[str, Any], path: str = "<slo toml>") -> "SloTable":
        """Read ``{ttft_s=.., tier={name={..}}, tenant={name={..}}}``, optionally nested under ``slo``."""
        if "slo" in data and isinstance(data["slo"], Mapping):
            _refuse_slo_keys_beside(data, path)
            data = data["slo"]
            prefix = "slo."
        else:
            prefix = ""
        global_fields: dict[str, Any] = {}
        tiers: dict[str, Slo] = {}
        tenants: dict[str, Slo] = {}
        for key, value in data.items():
            if key in ("tier", "tenant"):
                if not isinstance(value, Mapping):
                    raise InputError(path, f"'{prefix}{key}' must be a table of names", column=f"{prefix}{key}")
                target = tiers if key == "tier" else tenants
                for name, entry in value.items():
                    where = f"{prefix}{key}.{name}"
                    if not isinstance(entry, Mapping):
                        raise InputError(path, "must be a table of SLO fields", column=where)
                    target[str(name)] = _slo_from_mapping(entry, path, where)
            else:
                global_fields[key] = value
        return cls(
            global_=_slo_from_mapping(global_fields, path, prefix.rstrip(".") or None),
            tiers=tuple(sorted(tiers.items())),
            tenants=tuple(sorted(tenants.items())),
        )

    @classmethod
    def from_toml_file(cls, path: str) -> "SloTable":
        import tomllib

        from servelab.common.textfile import read_text

        try:
            data = tomllib.loads(read_text(path))  # a folder or a binary file: a one-line InputError
        except FileNotFoundError:
            raise InputError(path, "file not found") from None
        except tomllib.TOMLDecodeError as err:
            raise InputError(path, f"not valid TOML: {err}") from None
        return cls.from_toml(data, path)

    def combined(self, other: "SloTable") -> "SloTable":
        """Merge two partial tables (e.g. several ``--slo`` flags); a field set twice is an error."""
        return SloTable(
            global_=self.global_.merged(other.global_, "global"),
            tiers=_merge_named(self.tiers, other.tiers, "tier", lambda a, b, w: a.merged(b, w)),
            tenants=_merge_named(self.tenants, other.tenants, "tenant", lambda a, b, w: a.merged(b, w)),
        )

    def overridden_by(self, other: "SloTable") -> "SloTable":
        """Entries of ``other`` win field by field (command-line flags over an --slo-file)."""
        return SloTable(
            global_=self.global_.overridden_by(other.global_),
            tiers=_merge_named(self.tiers, other.tiers, "tier", lambda a, b, w: a.overridden_by(b)),
            tenants=_merge_named(self.tenants, other.tenants, "tenant", lambda a, b, w: a.overridden_by(b)),
        )

    def to_dict(self) -> dict[str, Any]:
        """The table as TOML/JSON-ready data that ``from_toml`` reads back (``ttft_s = ..``, ``tier.NAME``, ``tenant.NAME``)."""

        def entry(slo: Slo) -> dict[str, float]:
            return {f.name: getattr(slo, f.name) for f in fields(slo) if getattr(slo, f.name) is not None}

        data: dict[str, Any] = entry(self.global_)
        if self.tiers:
            data["tier"] = {name: entry(slo) for name, slo in self.tiers}
        if self.tenants:
            data["tenant"] = {name: entry(slo) for name, slo in self.tenants}
        return data

    def rows(self) -> pa.Table:
        """The table as rows ``(scope, name, ttft_s, tpot_s, e2e_s, max_stall_s, task_s)`` for the SQL views."""
        entries = [("global", None, self.global_)] if not self.global_.is_empty() else []
        entries += [("tier", n, s) for n, s in self.tiers]
        entries += [("tenant", n, s) for n, s in self.tenants]
        cols: dict[str, list] = {"scope": [], "name": []}
        cols.update({f.name: [] for f in fields(Slo)})
        for scope, name, slo in entries:
            cols["scope"].append(scope)
            cols["name"].append(name)
            for f in fields(Slo):
                cols[f.name].append(getattr(slo, f.name))
        schema = pa.schema([("scope", pa.string()), ("name", pa.string())] + [(f.name, pa.float64()) for f in fields(Slo)])
        return pa.table(cols, schema=schema)

    def describe(self) -> str:
        """One line per entry, for report headers."""
        out = []
        for scope, name, slo in [("global", None, self.global_)] + [("tier", n, s) for n, s in self.tiers] + [
            ("tenant", n, s) for n, s in self.tenants
        ]:
            if slo.is_empty():
                continue
            parts = ", ".join(f"{f.name}={getattr(slo, f.name):g}" for f in fields(slo) if getattr(slo, f.name) is not None)
            out.append(f"{scope}{'=' + name if name else ''}: {parts}")
        return "; ".join(out) if out else "none (attainment = finished)"


# Top-level keys that look like SLO entries: beside an [slo] table they would be silently ignored.
_SLO_LOOKING = frozenset(_KEYS) | {"tier", "tenant", "request"}


def _refuse_slo_keys_beside(data: Mapping[str, Any], path: str) -> None:
    """A file with an [slo] table may be a config or spec file with other sections, which are not ours to
    read; but an SLO-looking key outside [slo] (``[tenant.a]``, ``ttft = ..``) was meant as an SLO and would
    be dropped without a word, so it is an error that says where to put it."""
    for key, value in data.items():
        if key in _SLO_LOOKING:
            example = f"[slo.{key}.{next(iter(value))}]" if isinstance(value, Mapping) and value else f"{key} under [slo]"
            raise InputError(path, f"'{key}' is outside the [slo] table, so it would be ignored: put it under [slo] "
                             f"(e.g. {example})", column=key)


def _merge_named(a, b, kind, merge) -> tuple[tuple[str, Slo], ...]:
    out = dict(a)
    for name, slo in b:
        out[name] = merge(out[name], slo, f"{kind}={name}") if name in out else slo
    return tuple(sorted(out.items()))


# The one rule for SLO times (docs/metrics.md "Units"): a number with a unit (``500ms``, ``0.5s``)
# means what it says; a bare number is seconds, unless it is at or above this bound for its field,
# where it is far likelier to be vLLM's milliseconds (``--goodput ttft:500``) and is refused.
BARE_SECONDS_LIMIT = {"ttft_s": 60.0, "tpot_s": 5.0, "e2e_s": 600.0, "max_stall_s": 60.0}


def _parse_value(raw: str) -> tuple[float, bool]:
    """``(seconds, bare)`` of ``500ms``, ``0.5s`` or a bare number (seconds); ``bare``: it had no unit."""
    text = raw.strip().lower()
    scale, bare = 1.0, False
    if text.endswith("ms"):
        text, scale = text[:-2], 1e-3
    elif text.endswith("s"):
        text = text[:-1]
    else:
        bare = True
    return float(text) * scale, bare


def implausible_bare(field: str, value: float) -> str | None:
    """Why a bare (unit-less) ``value`` for ``field`` is refused, or None when it is plausible seconds."""
    limit = BARE_SECONDS_LIMIT.get(field)
    if limit is None or value < limit:
        return None
    short = field.removesuffix("_s")
    return (f"a bare {value:g} is read as seconds, which is implausible for {short}; write {short}={value:g}ms "
            f"(milliseconds, as vLLM's --goodput) or {short}={value:g}s if you mean seconds")


def _check_value(value: Any, path: str, where: str | None, field: str | None = None, bare_ok: bool = True) -> float:
    """A TOML value: a number of seconds, or a string with a unit (``"500ms"``, ``"0.5s"``); a bare
    number under a short key (``ttft``, not ``ttft_s``) must be plausible seconds."""
    if isinstance(value, str):
        try:
            seconds, bare = _parse_value(value)
        except ValueError:
            raise InputError(path, f"needs a number of seconds, got {value!r} (or a time with a unit: \"500ms\", "
                             "\"0.5s\")", column=where) from None
        value, bare_ok = seconds, bare_ok or not bare
    elif isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InputError(path, f"needs a number of seconds, got {value!r}", column=where)
    value = float(value)
    if not math.isfinite(value) or value <= 0:
        raise InputError(path, f"must be a positive number of seconds, got {value:g}", column=where)
    why = None if bare_ok or field is None else implausible_bare(field, value)
    if why:
        raise InputError(path, why, column=where)
    return value


def _slo_from_mapping(entry: Mapping[str, Any], path: str, where: str | None) -> Slo:
    values: dict[str, float] = {}
    for key, value in entry.items():
        column = f"{where}.{key}" if where else key
        if key not in _KEYS:
            hint = did_you_mean(key, ("ttft_s", "tpot_s", "e2e_s", "max_stall_s", "task_s"))
            raise InputError(path, f"unknown SLO field{hint} (known: ttft_s, tpot_s, e2e_s, max_stall_s, task_s)",
                             column=column)
        field = _KEYS[key]
        if field in values:
            raise InputError(path, f"'{field}' given twice", column=column)
        # a key that names its unit (ttft_s) takes any number of seconds; a short one (ttft) is checked
        values[field] = _check_value(value, path, column, field, bare_ok=key.endswith("_s"))
    return Slo(**values)


def _parse_one(spec: str) -> SloTable:
    text = spec.strip()
    scope_part, colon, body = text.partition(":")
    scope, name = "global", None
    if colon and "=" in scope_part and scope_part.split("=", 1)[0].strip() in ("tier", "tenant"):
        scope, name = (s.strip() for s in scope_part.split("=", 1))
        if not name:
            raise ServelabError(f"--slo '{spec}': empty {scope} name")
    else:
        body = text
    values: dict[str, float] = {}
    for part in body.split(","):
        if not part.strip():
            continue
        key, eq, raw = part.partition("=")
        key = key.strip()
        if not eq:
            raise ServelabError(f"--slo '{spec}': '{part}' is not key=value")
        if key in ("tier", "tenant"):
            raise ServelabError(f"--slo '{spec}': write '{key}=NAME:' before the fields, e.g. {key}=gold:ttft=0.2")
        if key not in _KEYS:
            hint = did_you_mean(key, ("ttft", "tpot", "e2e", "max_stall", "task"))
            raise ServelabError(f"--slo '{spec}': unknown SLO field '{key}'{hint} (known: ttft, tpot, e2e, max_stall, task)")
        try:
            value, bare = _parse_value(raw)
        except ValueError:
            raise ServelabError(f"--slo '{spec}': '{key}' needs a number of seconds, got '{raw}' (or a time with a unit: 500ms, 0.5s)") from None
        if not math.isfinite(value) or value <= 0:
            raise ServelabError(f"--slo '{spec}': '{key}' must be a positive number of seconds")
        field = _KEYS[key]
        why = implausible_bare(field, value) if bare else None
        if why:
            raise ServelabError(f"--slo '{spec}': {why}")
        if field in values:
            raise ServelabError(f"--slo '{spec}': '{field}' given twice")
        values[field] = value
    slo = Slo(**values)
    if slo.is_empty():
        raise ServelabError(f"--slo '{spec}': no SLO fields (e.g. ttft=0.5,tpot=0.05)")
    if scope == "global":
        return SloTable(global_=slo)
    if scope == "tier":
        return SloTable(tiers=((name, slo),))
    return SloTable(tenants=((name, slo),))


def recorded_slo(run_dirs):
    """``(SloTable or None, source)`` from the ``slo`` field the runs' run.json files carry."""
    from servelab.scoring.sources import find_runs

    if isinstance(run_dirs, (str, os.PathLike)):
        run_dirs = [run_dirs]
    try:
        runs = find_runs([str(d) for d in run_dirs])
    except ServelabError:
        return None, None
    tables = {}
    for r in runs:
        data = r.meta.get("slo")
        if isinstance(data, dict) and data:
            table = SloTable.from_toml(data, str(r.path / "run.json"))
            if not table.is_empty:
                tables[r.run_id] = table
    if not tables:
        return None, None
    first_id, first = next(iter(tables.items()))
    if len(set(tables.values())) > 1:
        others = sorted(i for i, t in tables.items() if t != first)
        # one phrase, as it is read inside sentences ("scoring with ... (global: ...); --slo ... replaces it")
        return first, f"the SLO recorded in run.json of {first_id}, not the other SLOs recorded by {', '.join(others)}"
    if len(tables) < len(runs):
        return first, f"the SLO recorded in run.json of {len(tables)} of the {len(runs)} runs"
    return first, "the SLO recorded in run.json"


def as_slo_table(slo: "SloTable | list[str] | tuple[str, ...] | None") -> "SloTable | None":
    """Accept a table, CLI specs (``("ttft=0.5",)``) or None, so callers can pass what they hold."""
    if slo is None or isinstance(slo, SloTable):
        return slo
    if isinstance(slo, str):
        slo = [slo]
    table = SloTable.parse_cli(list(slo))
    return None if table.is_empty else table

