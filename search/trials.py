"""Read a study back: the trials table (Arrow, written as trials.parquet), the best trial(s), the best config as TOML."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any, Callable

import pyarrow as pa
import pyarrow.parquet as pq

from servelab.common.atomic import atomic_path
from servelab.common.errors import ServelabError

_PARAM_TYPES = {"IntDistribution": pa.int64(), "FloatDistribution": pa.float64()}


TRIALS_WRITE_S = 30.0  # how long an orphaned worker keeps trying to write trials.parquet


def write_trials_retrying(write: Callable[[], None]) -> None:
    """Call ``write`` (open the study, write trials.parquet) until it succeeds or TRIALS_WRITE_S pass,
    waiting 0.1 s, then twice as long each time (at most 2 s): orphaned workers write at once, and one
    may meet another's half-done write or the journal's lock, for longer on a loaded machine. If every
    try failed, it says so on stderr (a dying search's worker has no one else to tell)."""
    deadline, pause = time.monotonic() + TRIALS_WRITE_S, 0.1
    while True:
        try:
            write()
            return
        except Exception as err:  # noqa: BLE001 -- any failure is worth another try until the deadline
            if time.monotonic() + pause > deadline:
                print(f"servelab search worker: could not write trials.parquet: {err}", file=sys.stderr)
                return
            time.sleep(pause)
            pause = min(2 * pause, 2.0)


def _column(values: list[Any]) -> pa.Array:
    try:
        arr = pa.array(values)
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        arr = pa.array([None if v is None else (v if isinstance(v, str) else json.dumps(v)) for v in values])
    return arr.cast(pa.string()) if pa.types.is_null(arr.type) else arr


def counts(study) -> dict[str, int]:
    """Trials by state (lower-case names), plus "finished": complete and pruned ones, which count toward n_trials."""
    from optuna.trial import TrialState

    out = {s.name.lower(): 0 for s in TrialState}
    for t in study.get_trials(deepcopy=False):
        out[t.state.name.lower()] += 1
    out["finished"] = out["complete"] + out["pruned"]
    return out


def trials_table(study) -> pa.Table:
    """One row per trial: number, state, outcome, reason, times, objective values, params, user attributes."""
    trials = sorted(study.get_trials(deepcopy=False), key=lambda t: t.number)
    objectives = study.user_attrs.get("objectives") or [f"value_{i}" for i in range(len(study.directions))]
    cols: dict[str, pa.Array] = {
        "number": pa.array([t.number for t in trials], pa.int64()),
        "state": pa.array([t.state.name.lower() for t in trials], pa.string()),
        "outcome": pa.array([t.user_attrs.get("outcome") for t in trials], pa.string()),
        "reason": pa.array([t.user_attrs.get("reason") for t in trials], pa.string()),
        # a constrained objective's verdict (attainment >= target), as Optuna's samplers and best_trial
        # read it; null where the study has no constraint or the trial did not complete
        "feasible": pa.array([_feasible(t) for t in trials], pa.bool_()),
        "datetime_start": pa.array([t.datetime_start for t in trials], pa.timestamp("us")),
        "datetime_complete": pa.array([t.datetime_complete for t in trials], pa.timestamp("us")),
        "duration_s": pa.array([(t.datetime_complete - t.datetime_start).total_seconds()
                                if t.datetime_complete and t.datetime_start else None for t in trials], pa.float64()),
    }  # fmt: skip
    for i, name in enumerate(objectives):
        cols[name] = pa.array([t.values[i] if t.values is not None else None for t in trials], pa.float64())
    names: dict[str, pa.DataType | None] = {}
    for t in trials:
        for pname, dist in t.distributions.items():
            names.setdefault(pname, _PARAM_TYPES.get(type(dist).__name__))
    for pname in sorted(names):
        values = [t.params.get(pname) for t in trials]
        cols[f"param.{pname}"] = pa.array(values, names[pname]) if names[pname] is not None else _column(values)
    attr_keys: list[str] = []
    for t in trials:
        flat = _flat_attrs(t.user_attrs)
        for k in flat:
            if k not in attr_keys:
                attr_keys.append(k)
    flats = [_flat_attrs(t.user_attrs) for t in trials]
    for k in sorted(attr_keys):
        cols[f"attr.{k}"] = _column([f.get(k) for f in flats])
    cols["intermediate"] = pa.array(
        [[{"step": s, "value": v} for s, v in sorted(t.intermediate_values.items())] for t in trials],
        pa.list_(pa.struct([("step", pa.int64()), ("value", pa.float64())])),
    )
    return pa.table(cols)


def _feasible(trial) -> bool | None:
    # Optuna >= 5.1's trial.set_constraint(name, v) stores "constraints:NAME"; before, one "constraints" list
    attrs = trial.system_attrs
    constraints = list(attrs.get("constraints") or []) + [v for k, v in attrs.items() if k.startswith("constraints:")]
    if not constraints or trial.state.name != "COMPLETE":
        return None
    return all(c <= 0 for c in constraints)


def _flat_attrs(attrs: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for k, v in attrs.items():
        if k in ("outcome", "reason"):
            continue
        if k == "metrics" and isinstance(v, dict):
            out.update(v)
        elif k == "config":
            out[k] = json.dumps(v, sort_keys=True)
        else:
            out[k] = v
    return out


def write_trials(study, study_dir: Path) -> Path:
    path = Path(study_dir) / "trials.parquet"
    table = trials_table(study)
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp, compression="zstd")
    return path


def best_trials(study) -> list:
    """The best finished trial (single objective, constraints respected), or the Pareto front (several)."""
    from optuna.trial import TrialState

    if not study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
        return []
    if len(study.directions) > 1:
        return sorted(study.best_trials, key=lambda t: t.number)
    try:
        return [study.best_trial]
    except ValueError:  # no feasible trial (cost objective: nothing met the target)
        return []


def best_config(study, trial_number: int | None = None):
    """(trial, ReplayConfig) of the best trial, or of ``trial_number``; several objectives: best on the first of the front."""
    from optuna.trial import TrialState

    from servelab.replay.config import ReplayConfig

    if trial_number is not None:
        matches = [t for t in study.get_trials(deepcopy=False) if t.number == trial_number]
        if not matches:
            raise ServelabError(f"study '{study.study_name}' has no trial {trial_number}")
        trial = matches[0]
        if trial.state != TrialState.COMPLETE:
            raise ServelabError(f"trial {trial_number} is {trial.state.name.lower()}, not complete")
    else:
        front = best_trials(study)
        if not front:
            raise ServelabError(f"study '{study.study_name}' has no complete (feasible) trial yet")
        sign = 1 if study.directions[0].name.lower() == "maximize" else -1
        trial = max(front, key=lambda t: (sign * t.values[0], -t.number))
    if "config" not in trial.user_attrs:
        raise ServelabError(f"trial {trial.number} has no recorded config")
    return trial, ReplayConfig.from_dict(trial.user_attrs["config"], source=f"trial {trial.number}")


def scored_trace(study, study_dir: Path | None) -> tuple[str | None, str | None]:
    """(the trace file the study's trials replayed, how it was made from the spec's trace).

    A spec with window/head/rate transforms replays STUDY_DIR/trace.arrow, written once by the
    study; without transforms, the spec's trace itself.
    """
    from servelab.search.storage import SPEC_ATTR

    trace = ((study.user_attrs.get(SPEC_ATTR) or {}).get("trace")) or {}
    steps = ", ".join(f"{k} {json.dumps(v)}" for k in ("window_s", "head", "rate_scale", "rate_rps")
                      if (v := trace.get(k)) is not None)  # fmt: skip
    if study_dir is not None and (Path(study_dir) / "trace.arrow").is_file():
        return str(Path(study_dir) / "trace.arrow"), f"{trace.get('path', '?')} with {steps}" if steps else None
    return trace.get("path"), None


def best_toml_header(study, trial, config, out: Path, study_dir: Path | None = None) -> str:
    """Comment lines on top of best.toml: study, trial, scores, the trace scored on, oracle lengths."""
    from servelab.scoring.lengths import output_length_note

    objectives = study.user_attrs.get("objectives") or []
    scores = ", ".join(f"{n} = {v:.6g}" for n, v in zip(objectives, trial.values))
    lines = [f"best configuration of study '{study.study_name}': trial {trial.number} ({scores})"]
    trace, made = scored_trace(study, study_dir)
    if trace:
        lines.append(f"scored on trace {trace}" + (f" ({made})" if made else ""))
    note = output_length_note(config.policy, config.to_dict().get("policy_params"))
    if note:
        lines.append(f"policy {config.policy}: {note}")
        if "oracle" in note:
            lines.append("its scores are an upper bound for this policy")
    lines.append(f"use it with: servelab replay {trace or 'TRACE'} --config {Path(out).name}")
    return "".join(f"# {line}\n" for line in lines)


def study_slo(study, study_dir: Path | None = None) -> dict[str, Any] | None:
    """The SLO the study scored its trials against, as ``[slo]`` data (SloTable.to_dict); None when unknown.

    A study records it when opened; one begun before that (and not resumed since) takes it from the
    spec file study.json names, when that spec still defines this study.
    """
    from servelab.search.storage import SLO_ATTR, SPEC_ATTR

    if SLO_ATTR in study.user_attrs:
        return study.user_attrs[SLO_ATTR]
    if study_dir is None:
        return None
    from servelab.search.spec import comparable_identity, load_spec

    try:
        info = json.loads((Path(study_dir) / "study.json").read_text())
        spec = load_spec(info["spec_path"])
    except (OSError, ValueError, KeyError, TypeError, ServelabError):
        return None
    if comparable_identity(spec.identity()) != comparable_identity(study.user_attrs.get(SPEC_ATTR) or {}):
        return None
    return spec.slo.to_dict()


def write_best_toml(study, out: Path, trial_number: int | None = None,
                    study_dir: Path | None = None) -> tuple[Any, Path]:  # fmt: skip
    """Write the best trial's config in `servelab replay --config` form (ReplayConfig.to_dict), with the
    study's SLO as its ``[slo]`` table (as recommend's recommended.toml), so the replay scores it alike.

    Comment lines above it name the study, the trial and its scores, the trace the trials were
    scored on (STUDY_DIR/trace.arrow when the spec transformed its trace) and, for a policy that
    ranks by output length, whether it knew the true lengths (an oracle) or predicted them.
    """
    import tomli_w

    trial, config = best_config(study, trial_number)
    header = best_toml_header(study, trial, config, out, study_dir)
    data = config.to_dict()
    slo = study_slo(study, study_dir)
    if slo:
        data["slo"] = slo
    with atomic_path(out) as tmp:
        tmp.write_text(header + tomli_w.dumps(data))
    return trial, Path(out)


def load_study_dir(study_dir: Path, storage_url: str | None = None):
    """Open the study a directory belongs to (its study.json says where the storage is)."""
    import optuna

    study_dir = Path(study_dir)
    info_path = study_dir / "study.json"
    if not info_path.is_file():
        raise ServelabError(f"{study_dir}: not a study directory (no study.json)")
    info = json.loads(info_path.read_text())
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    url = storage_url or info["storage"]
    if url.startswith("journal:"):
        from servelab.search.storage import journal_storage

        journal = study_dir / url.removeprefix("journal:")
        if not journal.is_file():
            raise ServelabError(f"{journal}: no such study journal")
        storage = journal_storage(journal)
    else:
        from servelab.search.storage import rdb_storage

        storage = rdb_storage(url)
    try:
        return optuna.load_study(study_name=info["study_name"], storage=storage)
    except KeyError:
        raise ServelabError(f"{study_dir}: study '{info['study_name']}' is not in its storage") from None


__all__ = ["counts", "trials_table", "write_trials", "best_trials", "best_config", "write_best_toml", "load_study_dir"]
