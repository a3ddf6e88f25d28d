"""Seeded synthetic agentic traces (schema v2): ReAct loops, fan-out/aggregate, multi-turn chats, mixes.

A *task* (``session_id``) is a small graph of LLM calls that depend on each other (``depends_on``);
task starts follow an arrival process, the calls after the first arrive during the replay, once
their parents finish plus a delay (``think_s``: a tool's run time, or a user's think time).

- **react**: ``calls`` calls in a chain; each prompt is the previous call's prompt and output, then
  the tool's result (``new_tokens``); the delay before each later call is a tool time (``tool_s``).
- **fanout**: a planning call, ``branches`` calls that each continue its context with their own
  instructions (after a tool time), then an aggregator that waits for every branch (a tool time after
  the last one) and reads the plan, every branch's output and new tokens.
- **chat**: ``chat_turns`` turns; each prompt is the conversation so far and the user's next message
  (``new_tokens``), sent a user think time (``user_think_s``) after the previous answer.
- **mix**: each task draws its shape from ``mix`` weights.

Every call's ``prefix_hashes`` cover its prompt and output in ``prefix_block_tokens`` blocks: the
full blocks of its parent's context (prompt and output; for an aggregator, the plan's) keep the
parent's ids and the rest get fresh ones, so a replay with prefix caching reuses the context. A
dependent row's ``arrival_s`` is its task's start (it only orders the rows; the replay decides the
real arrival). Each aspect draws from its own child of ``SeedSequence(seed)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from servelab.common.errors import ServelabError
from servelab.traces import schema
from servelab.traces.arrivals import ArrivalConfig, arrival_times
from servelab.traces.lengths import LengthDist, parse_length
from servelab.traces.synth import Weights, parse_weights

SHAPES = ("react", "fanout", "chat")
TIME_KINDS = ("fixed", "exp", "uniform", "lognormal")
MAX_TASKS = 10_000_000


@dataclass(frozen=True)
class TimeDist:
    """Seconds >= 0: ``fixed`` a; ``exp`` mean a; ``uniform`` in [a, b]; ``lognormal`` median a, sigma b."""

    kind: str = "fixed"
    a: float = 1.0
    b: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in TIME_KINDS:
            raise ServelabError(f"unknown time distribution '{self.kind}' (known: {', '.join(TIME_KINDS)})")
        if not (math.isfinite(self.a) and math.isfinite(self.b) and self.a >= 0 and self.b >= 0):
            raise ServelabError(f"time distribution parameters must be finite and >= 0 (got {self.a}, {self.b})")
        if self.kind == "uniform" and self.b < self.a:
            raise ServelabError(f"uniform times need low <= high (got {self.a}, {self.b})")
        if self.kind == "lognormal" and not self.a > 0:
            raise ServelabError(f"lognormal times need a median > 0 (got {self.a})")

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        if self.kind == "fixed":
            return np.full(n, float(self.a))
        if self.kind == "exp":
            return rng.exponential(self.a, n) if self.a > 0 else np.zeros(n)
        if self.kind == "uniform":
            return rng.uniform(self.a, self.b, n)
        return rng.lognormal(math.log(self.a), self.b, n)

    def describe(self) -> str:
        return f"{self.a:g}" if self.kind == "fixed" else ":".join([self.kind, f"{self.a:g}"] + (
            [f"{self.b:g}"] if self.kind in ("uniform", "lognormal") else []))


def parse_time(spec: str | float | TimeDist) -> TimeDist:
    """``1.5`` / ``fixed:1.5``, ``exp:MEAN``, ``uniform:LOW:HIGH``, ``lognormal:MEDIAN:SIGMA`` (seconds)."""
    if isinstance(spec, TimeDist):
        return spec
    parts = [p.strip() for p in str(spec).split(":")]
    try:
        values = [float(p) for p in (parts if len(parts) == 1 else parts[1:])]
    except ValueError:
        raise ServelabError(f"bad time spec '{spec}': not a number (use S, exp:MEAN, uniform:LOW:HIGH or "
                            "lognormal:MEDIAN:SIGMA, in seconds)") from None
    if len(parts) == 1:
        return TimeDist("fixed", values[0])
    kind = parts[0]
    wanted = {"fixed": 1, "exp": 1, "uniform": 2, "lognormal": 2}.get(kind)
    if wanted is None or len(values) != wanted:
        raise ServelabError(f"bad time spec '{spec}' (use S, exp:MEAN, uniform:LOW:HIGH or lognormal:MEDIAN:SIGMA)")
    return TimeDist(kind, *values)


@dataclass(frozen=True)
class AgentConfig:
    """Everything an agentic trace depends on (see the module docstring for the shapes)."""

    shape: str = "react"
    tasks: int = 100
    mix: Weights = (("react", 1.0), ("fanout", 1.0), ("chat", 1.0))
    arrival: ArrivalConfig = field(default_factory=ArrivalConfig)  # task starts
    prompt: LengthDist = LengthDist("fixed", 512)  # a task's first prompt (system prompt and task)
    output: LengthDist = LengthDist("fixed", 128)  # every call's output
    new_tokens: LengthDist = LengthDist("fixed", 256)  # what a tool result / user message / branch adds
    calls: LengthDist = LengthDist("fixed", 4)  # react: calls per task
    branches: LengthDist = LengthDist("fixed", 4)  # fanout: parallel branches
    chat_turns: LengthDist = LengthDist("fixed", 3)  # chat: turns
    tool_s: TimeDist = TimeDist("fixed", 1.0)
    user_think_s: TimeDist = TimeDist("fixed", 5.0)
    task_deadline_s: float | None = None
    tenants: Weights = ()
    prefix_block_tokens: int = 16
    seed: int = 0

    def __post_init__(self) -> None:
        if self.shape not in (*SHAPES, "mix"):
            raise ServelabError(f"unknown task shape '{self.shape}' (known: {', '.join(SHAPES)}, mix)")
        if not 1 <= self.tasks <= MAX_TASKS:
            raise ServelabError(f"tasks must be in 1..{MAX_TASKS:,} (got {self.tasks})")
        unknown = [name for name, _ in self.mix if name not in SHAPES]
        if unknown:
            raise ServelabError(f"--mix: unknown shape(s) {', '.join(unknown)} (known: {', '.join(SHAPES)})")
        if self.task_deadline_s is not None and not (math.isfinite(self.task_deadline_s) and self.task_deadline_s > 0):
            raise ServelabError(f"task deadline must be > 0 s (got {self.task_deadline_s})")
        if self.prefix_block_tokens < 1:
            raise ServelabError(f"prefix block tokens must be >= 1 (got {self.prefix_block_tokens})")

    @property
    def source(self) -> str:
        shape = self.shape if self.shape != "mix" else "mix(" + ",".join(f"{n}={w:g}" for n, w in self.mix) + ")"
        return (f"agentic:{shape},tasks={self.tasks},{self.arrival.process}@{self.arrival.rate_per_s:g}/s,"
                f"tool_s={self.tool_s.describe()},think_s={self.user_think_s.describe()},seed={self.seed}")


def make_agent_config(**kwargs) -> AgentConfig:
    """An AgentConfig from loose values: length specs, time specs, weight strings, an ArrivalConfig's fields."""
    for name in ("prompt", "output", "new_tokens", "calls", "branches", "chat_turns"):
        if name in kwargs:
            kwargs[name] = parse_length(kwargs[name])
    for name in ("tool_s", "user_think_s"):
        if name in kwargs:
            kwargs[name] = parse_time(kwargs[name])
    if "mix" in kwargs:
        kwargs["mix"] = parse_weights(kwargs["mix"], "--mix") or AgentConfig.mix
    if "tenants" in kwargs:
        kwargs["tenants"] = parse_weights(kwargs["tenants"], "tenants")
    if isinstance(kwargs.get("arrival"), dict):
        kwargs["arrival"] = ArrivalConfig(**kwargs["arrival"])
    return AgentConfig(**kwargs)


class _Rows:
    """The trace's columns, a row at a time, with each row's hash chain (prompt + output blocks)."""

    def __init__(self, block: int):
        self.block = block
        self.next_id = 0
        self.cols: dict[str, list] = {k: [] for k in ("arrival_s", "prompt", "output", "session", "depends_on", "think")}
        self.chains: list[np.ndarray] = []

    def add(self, task: int, start: float, prompt: int, output: int, parents: list[int], think: float | None,
            context_of: int | None) -> int:
        """A call of ``prompt`` tokens (the first ones the context of row ``context_of``) and ``output``;
        returns its row."""
        row = len(self.chains)
        keep = np.empty(0, np.int64)
        if context_of is not None:  # the full blocks of the parent's prompt + output continue its chain
            parent = self.cols["prompt"][context_of] + self.cols["output"][context_of]
            keep = self.chains[context_of][: parent // self.block]
        blocks = -(-(prompt + output) // self.block)
        fresh = blocks - len(keep)
        self.chains.append(np.concatenate([keep, np.arange(self.next_id, self.next_id + fresh, dtype=np.int64)]))
        self.next_id += fresh
        for name, value in (("arrival_s", start), ("prompt", prompt), ("output", output), ("session", task),
                            ("depends_on", parents), ("think", think)):
            self.cols[name].append(value)
        return row


def generate_agentic(config: AgentConfig) -> pa.Table:
    """The trace of ``config``: rows task by task (tasks in start order), ids = rows."""
    arrival_rng, shape_rng, count_rng, length_rng, time_rng, tenant_rng = (
        np.random.default_rng(s) for s in np.random.SeedSequence(config.seed).spawn(6))
    k = config.tasks
    starts = arrival_times(config.arrival, arrival_rng, n=k)
    if config.shape == "mix":
        names = [n for n, _ in config.mix]
        p = np.array([w for _, w in config.mix], dtype=np.float64)
        shapes = [names[i] for i in shape_rng.choice(len(names), size=k, p=p / p.sum())]
    else:
        shapes = [config.shape] * k
    counts = {"react": config.calls.sample(k, count_rng), "fanout": config.branches.sample(k, count_rng),
              "chat": config.chat_turns.sample(k, count_rng)}
    first_prompt = config.prompt.sample(k, length_rng)
    rows_of = [int(counts[s][t]) + (2 if s == "fanout" else 0) for t, s in enumerate(shapes)]
    n = int(sum(rows_of))
    output = config.output.sample(n, length_rng).tolist()
    new = config.new_tokens.sample(n, length_rng).tolist()
    tool = config.tool_s.sample(n, time_rng).tolist()
    think = config.user_think_s.sample(n, time_rng).tolist()
    rows = _Rows(config.prefix_block_tokens)
    for t, shape in enumerate(shapes):
        start, p0, c = float(starts[t]), int(first_prompt[t]), int(counts[shape][t])
        i = len(rows.chains)  # this task's draws: rows i .. i + rows_of[t] - 1
        if shape == "fanout":
            root = rows.add(t, start, p0, output[i], [], None, None)
            context = p0 + output[i]
            branches = [rows.add(t, start, context + new[i + 1 + b], output[i + 1 + b], [root], tool[i + 1 + b], root)
                        for b in range(c)]
            j = i + 1 + c
            read = sum(output[i + 1 + b] for b in range(c)) + new[j]
            rows.add(t, start, context + read, output[j], branches, tool[j], root)
            continue
        delay = tool if shape == "react" else think
        prev = rows.add(t, start, p0, output[i], [], None, None)
        prompt = p0
        for j in range(i + 1, i + c):
            prompt = prompt + output[j - 1] + new[j]
            prev = rows.add(t, start, prompt, output[j], [prev], delay[j], prev)
    cols = rows.cols
    if max(p + o for p, o in zip(cols["prompt"], cols["output"])) > np.iinfo(np.int32).max:
        raise ServelabError("a generated context exceeds 2^31 tokens; lower the calls, turns or lengths")
    chains = rows.chains
    offsets = np.concatenate([[0], np.cumsum([len(c) for c in chains])])
    table = {
        "request_id": pa.array(np.arange(n, dtype=np.int64)),
        "arrival_s": pa.array(cols["arrival_s"], pa.float64()),
        "prompt_tokens": pa.array(cols["prompt"], pa.int32()),
        "output_tokens": pa.array(cols["output"], pa.int32()),
        "session_id": pa.array(cols["session"], pa.int64()),
        "think_s": pa.array(cols["think"], pa.float64()),
        "prefix_hashes": pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), pa.array(np.concatenate(chains))),
        "depends_on": pa.array(cols["depends_on"], pa.list_(pa.int64())),
    }
    if config.tenants:
        names = [name for name, _ in config.tenants]
        p = np.array([w for _, w in config.tenants], dtype=np.float64)
        codes = tenant_rng.choice(len(names), size=k, p=p / p.sum()).astype(np.int32)
        table["tenant"] = pa.DictionaryArray.from_arrays(pa.array(codes[cols["session"]]), pa.array(names, pa.string()))
    if config.task_deadline_s is not None:
        table["task_deadline_s"] = pa.array(np.full(n, config.task_deadline_s))
    meta = {schema.META_SOURCE: config.source.encode(), schema.META_BLOCK_TOKENS: str(config.prefix_block_tokens).encode()}
    return pa.table(table).replace_schema_metadata(meta)


__all__ = ["AgentConfig", "SHAPES", "TimeDist", "generate_agentic", "make_agent_config", "parse_time"]
