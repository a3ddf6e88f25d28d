"""The sample of a long suite is fixed: the same cases on every run and machine, whatever the collection order."""

from __future__ import annotations

import subprocess
import sys

from conftest import REPO
from sampled_suites import FULL_ENV, cases, sample, size


def test_sample_is_fixed_and_independent_of_order():
    ids = [f"t.py::test_x[{i}]" for i in range(20)]
    kept = sample(ids, 5, "t.py::test_x")
    assert len(kept) == 5 and kept <= set(ids)
    assert sample(list(reversed(ids)), 5, "t.py::test_x") == kept
    assert sample(ids, 50, "t.py::test_x") == set(ids)  # a suite smaller than its sample runs whole


def _collected(env_value: str | None) -> list[str]:
    import os

    env = {k: v for k, v in os.environ.items() if k != FULL_ENV}
    if env_value is not None:
        env[FULL_ENV] = env_value
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-p", "no:cacheprovider",
                          "tests/test_policy_queues.py"], cwd=REPO, env=env, capture_output=True, text=True, check=True)  # fmt: skip
    return [line for line in out.stdout.splitlines() if "::test_incremental_waiting_order_equals_a_full_sort" in line]


def test_full_suites_run_every_case_and_the_default_a_fixed_sample():
    full = _collected("1")
    sampled = _collected(None)
    assert len(full) == 17 and len(sampled) == 2 and set(sampled) < set(full)
    assert _collected(None) == sampled


def test_size_is_the_full_one_only_under_full_suites(monkeypatch):
    monkeypatch.setenv(FULL_ENV, "1")
    assert size(250, 150) == 250
    monkeypatch.setenv(FULL_ENV, "0")
    assert size(250, 150) == 150
    monkeypatch.delenv(FULL_ENV)
    assert size(250, 150) == 150


def test_cases_are_a_fixed_sample_in_order_and_all_under_full_suites(monkeypatch):
    items = [f"case {i}" for i in range(30)]
    monkeypatch.delenv(FULL_ENV, raising=False)
    kept = cases(items, 7, "a loop")
    assert len(kept) == 7 and kept == [i for i in items if i in kept]  # a subset, in the loop's order
    assert cases(items, 7, "a loop") == kept and cases(items, 7, "another loop") != kept
    assert cases(items, 40, "a loop") == items
    monkeypatch.setenv(FULL_ENV, "1")
    assert cases(items, 7, "a loop") == items


def test_checking_engine_checks_every_event_under_full_suites_else_every_fourth(monkeypatch):
    from helpers_engine import QUICK_EVERY, checking_engine, run
    import servelab.assembly
    from servelab.traces.synth import synth_trace

    trace = synth_trace(n=20, rate=5.0, prompt="uniform:16:64", output="uniform:1:8", seed=1)
    for full, every in (("1", 1), ("", QUICK_EVERY)):
        monkeypatch.setenv(FULL_ENV, full)
        seen = []
        engine = checking_engine(lambda e: seen.append(e))
        monkeypatch.setattr(servelab.assembly, "Engine", engine)
        run(trace)
        assert engine.events > 40 and engine.checks == len(seen) == engine.events // every
