"""A calibration sweep: batch shapes sent to a live server, measured, and turned into a profile that
``runners/fitted.py`` fits (``servelab fit --endpoint URL`` / ``servelab fit --live SWEEP_DIR``).

The server's iterations are not visible from outside, so the sweep sends loads whose iterations
are known. Two kinds of level, each a closed loop (live/load.py) of ``rounds`` requests per user,
every prompt text new (no prefix cache hits), outputs forced to their length (``ignore_eos``):

- **prefill** ``prefill_<P>``: one user, prompts of exactly P tokens, 2 output tokens. Alone on
  the server, a request's TTFT is one prefill step of one sequence of P new tokens
  (``prefill_tokens`` P, ``prefill_seqs`` 1, ``prefill_attention_pairs`` P(P+1)/2) plus the HTTP and
  tokenisation time of the request, which the per-sequence and intercept terms take (a replay's
  TTFT is step time too, so that is where it belongs);
- **decode** ``users_<C>_prompt_<P>``: C users, prompts of P tokens, O output tokens. Started
  together with equal lengths, the users finish together and send again together, so the server
  decodes C sequences per step. A request's mean inter-token gap (tokens.parquet) over the steps
  that held no other request's prefill (no other request got its first token then) is one decode
  step of C sequences at the mean context (``decode_seqs`` C, ``decode_context_tokens``
  C x (P + O/2)); the steps left out are the mixed ones, which the replay prices itself. With
  C = 1 the level's TTFTs are prefill rows as well.

The whole list of levels runs ``passes`` times, one pass after the other, so that a burst of other
work on the machine spoils one pass of a shape rather than all of them. Each finished request gives
a row of each kind it measures; ``fit_model`` takes the median of each shape's rows and fits
non-negative least squares on relative error (runners/fitted.py).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa
from servelab.common.errors import InputError, ServelabError
from servelab.runners.profiling import FEATURES, PROFILE_SCHEMA

SWEEP_KIND = "live-calibration-sweep"


@dataclass(frozen=True, slots=True)
class SweepPlan:
    prefill_prompt_tokens: tuple[int, ...] = (16, 128, 256, 512, 1024, 1536)  # prefill levels (one user)
    users: tuple[int, ...] = (1, 2, 4, 8, 16)  # decode levels: decode batch sizes ...
    decode_prompt_tokens: tuple[int, ...] = (32, 256)  # ... at these prompt lengths
    output_tokens: int = 32  # decode levels' output length
    rounds: int = 1  # requests per user per decode level and pass
    prefill_rounds: int = 2  # requests per prefill level and pass
    prefill_think_s: float = 0.15  # idle time before each prefill-level request: the server waits idle, as between sparse arrivals
    passes: int = 3  # the whole list of levels is run this many times, one pass after the other
    warmup: int = 2  # requests before the first level, left out

    def __post_init__(self) -> None:
        for name in ("prefill_prompt_tokens", "users", "decode_prompt_tokens"):
            values = getattr(self, name)
            if any(int(v) < 1 for v in values):
                raise ServelabError(f"calibration sweep: {name} needs whole numbers >= 1, got {values}")
        if not self.users or not self.decode_prompt_tokens:
            raise ServelabError("calibration sweep: needs at least one user count and one decode prompt length")
        if self.output_tokens < 3:
            raise ServelabError(f"calibration sweep: output tokens must be >= 3 (decode gaps), got {self.output_tokens}")
        if min(self.rounds, self.prefill_rounds, self.passes) < 1 or self.warmup < 0 or self.prefill_think_s < 0:
            raise ServelabError("calibration sweep: rounds and passes must be >= 1, warmup and think time >= 0")

    def levels(self) -> list[tuple[str, int, int, int, int, float]]:
        """(name, users, prompt tokens, output tokens, rounds, think s) of every level in the order run:
        each pass the prefill levels, then the decode levels; names end with the pass."""
        one = [(f"prefill_{p}", 1, p, 2, self.prefill_rounds, self.prefill_think_s) for p in self.prefill_prompt_tokens]
        one += [(f"users_{c}_prompt_{p}", c, p, self.output_tokens, self.rounds, 0.0)
                for p in self.decode_prompt_tokens for c in self.users]
        return [(f"{name}_pass_{k}", *rest) for k in range(1, self.passes + 1) for name, *rest in one]


def level_trace(users: int, prompt: int, output: int, rounds: int, first_id: int) -> pa.Table:
    """``users`` x ``rounds`` requests of one level, ids from ``first_id``: ids are distinct across the
    levels, so every prompt's text is new to the server (prompts are seeded by request id)."""
    n = users * rounds
    return pa.table({"request_id": pa.array(np.arange(first_id, first_id + n), pa.int64()),
                     "arrival_s": pa.array(np.zeros(n)),
                     "prompt_tokens": pa.array(np.full(n, prompt), pa.int32()),
                     "output_tokens": pa.array(np.full(n, output), pa.int32())})


def run_sweep(target, plan: SweepPlan, out_dir: str | Path, seed: int, options=None, echo=lambda s: None) -> Path:
    """Run every level against the server; write ``out_dir/<level>/`` run directories and
    ``out_dir/sweep.json`` (the plan and the levels done, updated after each)."""
    import asyncio

    from servelab.common.atomic import atomic_path
    from servelab.live.bench import LiveOptions, run_live, write_live_run
    from servelab.live.load import LoadConfig

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    options = options or LiveOptions(metrics=False)
    done: list[dict] = []
    first_id = 0
    for k, (name, users, prompt, output, rounds, think_s) in enumerate(plan.levels()):
        trace = level_trace(users, prompt, output, rounds, first_id)
        first_id += trace.num_rows
        # Each level is a client session of its own: with one user, one warm-up request opens its
        # connection, or the first TTFT would pay for the TCP connect (a trace's run pays it once).
        warmup = max(plan.warmup if k == 0 else 0, 1 if users == 1 else 0)
        load = LoadConfig(shape="closed", users=users, think_s=think_s, warmup=warmup, seed=seed)
        echo(f"calibration level {name}: {trace.num_rows} requests")
        run = asyncio.run(run_live(trace, target, load, options))
        if run.meta["stopped_by"] == "interrupt":
            raise KeyboardInterrupt
        failed = sum(r.status != "finished" for r in run.records)
        if failed:
            reasons = sorted({r.reason for r in run.records if r.status != "finished"})
            raise ServelabError(f"calibration level {name}: {failed} requests did not finish ({reasons[0]})")
        write_live_run(run, trace, {"name": name, "calibration": True}, out_dir / name, token_log=True)
        done.append({"run": name, "users": users, "prompt_tokens": prompt, "output_tokens": output})
        with atomic_path(out_dir / "sweep.json") as tmp:
            tmp.write_text(json.dumps({"kind": SWEEP_KIND, "plan": asdict(plan), "seed": seed,
                                       "endpoint": target.root, "model": target.model, "runs": done},
                                      indent=2) + "\n")
    return out_dir


def read_sweep(sweep_dir: str | Path) -> tuple[dict, list[tuple[dict, Path, Path]]]:
    """sweep.json and each level's requests.parquet and tokens.parquet paths."""
    sweep_dir = Path(sweep_dir)
    path = sweep_dir / "sweep.json"
    try:
        meta = json.loads(path.read_text())
    except FileNotFoundError:
        raise InputError(sweep_dir, "not a calibration sweep (no sweep.json; run `servelab fit --endpoint URL "
                                    "--sweep-out DIR`)") from None
    except json.JSONDecodeError as err:
        raise InputError(path, f"invalid JSON ({err})") from None
    if meta.get("kind") != SWEEP_KIND:
        raise InputError(path, f"not a calibration sweep (kind {meta.get('kind')!r}, expected {SWEEP_KIND!r})")
    levels = []
    for i, level in enumerate(meta.get("runs") or []):
        requests = sweep_dir / str(level.get("run")) / "requests.parquet"
        if not requests.is_file():
            raise InputError(path, f"level {level.get('run')!r}: {requests} is missing", column="runs", row=i)
        for column in ("users", "prompt_tokens", "output_tokens"):
            if not isinstance(level.get(column), int) or level[column] < 1:
                raise InputError(path, f"level {level.get('run')!r}: {column} must be a whole number >= 1",
                                 column=f"runs.{column}", row=i)
        tokens = requests.with_name("tokens.parquet")
        if not tokens.is_file():
            raise InputError(path, f"level {level.get('run')!r}: {tokens} is missing", column="runs", row=i)
        levels.append((level, requests, tokens))
    if not levels:
        raise InputError(path, "the sweep has no level done")
    return meta, levels


# Per finished request: its TTFT and its mean inter-token gap over the decode steps in which no other
# request got its first token (a step holding another request's prefill). A chunk of the same step
# may reach the client just before or after that first token, so the gap containing it and the gap
# after are both left out.
GAPS_SQL = """
WITH tok AS (SELECT request_id, time_s, itl_s,
                    lag(time_s, 2) OVER (PARTITION BY request_id ORDER BY token_index) AS before_s
             FROM read_parquet(?)),
firsts AS (SELECT request_id, min(time_s) AS first_s FROM tok GROUP BY request_id),
clean AS (SELECT t.request_id, t.itl_s FROM tok t
          WHERE t.itl_s IS NOT NULL AND NOT EXISTS (
              SELECT 1 FROM firsts f WHERE f.request_id <> t.request_id
                AND f.first_s > coalesce(t.before_s, t.time_s - t.itl_s) AND f.first_s <= t.time_s))
SELECT r.ttft_s, (SELECT avg(c.itl_s) FROM clean c WHERE c.request_id = r.request_id)
FROM read_parquet(?) r WHERE r.status = 'finished' ORDER BY r.request_id
"""


def profile_rows(sweep_dirs: list[str | Path]) -> pa.Table:
    """The sweeps' measured steps as a profile (runners/profiling.py's schema): one row per request and
    kind (its TTFT; its mean clean decode gap). ``fit_model`` takes each shape's median over requests."""
    rows: dict[str, list] = {name: [] for name in (*FEATURES, "step_s")}

    def add(step_s: float, **counts: int) -> None:
        for name in FEATURES:
            rows[name].append(int(counts.get(name, 0)))
        rows["step_s"].append(float(step_s))

    for sweep_dir in sweep_dirs:
        _, levels = read_sweep(sweep_dir)
        for level, requests, tokens in levels:
            c, p, out = level["users"], level["prompt_tokens"], level["output_tokens"]
            found = duckdb.sql(GAPS_SQL, params=[str(tokens), str(requests)]).fetchall()
            for ttft, itl in found:
                if c == 1 and ttft is not None and ttft > 0:
                    add(ttft, prefill_tokens=p, prefill_seqs=1, prefill_attention_pairs=p * (p + 1) // 2)
                if out >= 3 and itl is not None and itl > 0:
                    add(itl, decode_seqs=c, decode_context_tokens=c * (p + out // 2))
    if not rows["step_s"]:
        raise ServelabError("the calibration sweeps hold no finished request to fit")
    return pa.table({f.name: pa.array(rows[f.name], f.type) for f in PROFILE_SCHEMA}, schema=PROFILE_SCHEMA)


def fit_live(sweep_dirs: list[str | Path], output: str | Path, *, buckets: tuple[int, ...] = (),
             test_fraction: float = 0.2, seed: int = 0):
    """Fit a ``fitted`` model to the sweeps (runners/fitted.py) and write it atomically."""
    from servelab.common.atomic import atomic_path
    from servelab.runners.fitted import fit_model

    table = profile_rows(sweep_dirs)
    model = fit_model(table, buckets=buckets, test_fraction=test_fraction, seed=seed,
                      source=", ".join(str(d) for d in sweep_dirs), meta={"runner": "live"})
    with atomic_path(output) as tmp:
        tmp.write_text(json.dumps(model.to_json(), indent=2, allow_nan=False) + "\n")
    return model
