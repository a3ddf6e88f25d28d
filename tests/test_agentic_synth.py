"""Synthetic agentic traces (traces/agentic_synth.py, `servelab trace synth --shape`): the task shapes,
their token and hash accounting, seeding, and a 10,000-task mix replayed with every request
accounted once, byte-identically."""

from __future__ import annotations

import hashlib

import pyarrow as pa
import pytest
from helpers_cli import run_main
from helpers_engine import run
from sampled_suites import size

from servelab.common.errors import ServelabError
from servelab.traces import schema
from servelab.traces.agentic_synth import generate_agentic, make_agent_config, parse_time
from servelab.traces.io import read_trace


def rows(table: pa.Table) -> list[dict]:
    return table.to_pylist()


def test_react_chain_grows_its_context_and_continues_the_hash_chain():
    t = generate_agentic(make_agent_config(shape="react", tasks=1, calls="3", prompt="100", output="20",
                                           new_tokens="40", tool_s="uniform:1:2", prefix_block_tokens=16, seed=1))
    r = rows(t)
    assert [x["depends_on"] for x in r] == [[], [0], [1]]
    assert [x["prompt_tokens"] for x in r] == [100, 160, 220]  # + previous output (20) + tool result (40)
    assert r[0]["think_s"] is None and all(1 <= x["think_s"] <= 2 for x in r[1:])
    assert {x["session_id"] for x in r} == {0}
    for parent, child in zip(r, r[1:]):
        keep = (parent["prompt_tokens"] + parent["output_tokens"]) // 16
        assert child["prefix_hashes"][:keep] == parent["prefix_hashes"][:keep]
        assert child["prefix_hashes"][keep] not in parent["prefix_hashes"]  # the partial block's content differs
        assert len(child["prefix_hashes"]) == -(-(child["prompt_tokens"] + child["output_tokens"]) // 16)
    schema.validate(t, "synth")


def test_fanout_waits_for_every_branch():
    t = generate_agentic(make_agent_config(shape="fanout", tasks=2, branches="3", prompt="64", output="16",
                                           new_tokens="32", seed=2))
    r = rows(t)
    assert len(r) == 2 * (1 + 3 + 1)
    assert [x["depends_on"] for x in r[:5]] == [[], [0], [0], [0], [1, 2, 3]]
    assert [x["prompt_tokens"] for x in r[:5]] == [64, 112, 112, 112, 80 + 3 * 16 + 32]
    assert r[5]["depends_on"] == [] and r[9]["depends_on"] == [6, 7, 8]
    assert r[0]["arrival_s"] == 0.0 and all(x["arrival_s"] == r[5]["arrival_s"] for x in r[5:])


def test_chat_turns_wait_for_the_user():
    t = generate_agentic(make_agent_config(shape="chat", tasks=3, chat_turns="2", user_think_s="7",
                                           task_deadline_s=60.0, seed=3))
    r = rows(t)
    assert [x["think_s"] for x in r] == [None, 7.0] * 3
    assert [x["task_deadline_s"] for x in r] == [60.0] * 6


def test_seeded_and_mixed():
    cfg = dict(shape="mix", tasks=300, mix="react=2,fanout=1,chat=1", calls="uniform:1:5",
               tool_s="exp:2", output="lognormal:100:1", seed=9)
    a, b = generate_agentic(make_agent_config(**cfg)), generate_agentic(make_agent_config(**cfg))
    assert a.equals(b)
    assert not a.equals(generate_agentic(make_agent_config(**dict(cfg, seed=10))))
    # every shape appears; a one-call react task is a lone request
    deps = [len(d) for d in a.column("depends_on").to_pylist()]
    assert max(deps) >= 2 and deps.count(0) == 300


@pytest.mark.parametrize("spec, message", [("exp:-1", "finite and >= 0"), ("uniform:3:1", "low <= high"),
                                           ("gauss:1", "bad time spec"), ("x", "not a number")])
def test_bad_time_specs(spec, message):
    with pytest.raises(ServelabError, match=message):
        parse_time(spec)


def test_cli_synth_shape(tmp_path, capsys):
    out = tmp_path / "agents.arrow"
    code, stdout, err = run_main(["trace", "synth", "--shape", "mix", "--tasks", "50", "--rate", "0.5", "--tool-s",
                                  "exp:1", "--task-deadline-s", "120", "-o", out], capsys)
    assert code == 0, err
    assert "in 50 tasks" in stdout
    t = read_trace(out)
    assert t.schema.metadata[b"servelab.schema_version"] == b"2"
    assert t.column("session_id").to_pylist()[-1] == 49
    code, stdout, _ = run_main(["trace", "info", out, "--json"], capsys)
    import json

    info = json.loads(stdout)
    assert code == 0 and info["sessions"] == 50
    assert info["dependent_requests"] == sum(1 for d in t.column("depends_on").to_pylist() if d) > 0
    code, _, err = run_main(["trace", "synth", "--calls", "3", "-o", tmp_path / "x.arrow"], capsys)
    assert code != 0 and "--calls needs --shape" in err
    code, _, err = run_main(["trace", "synth", "--shape", "react", "--turns", "3", "-o", tmp_path / "x.arrow"], capsys)
    assert code != 0 and "--turns does not apply to --shape" in err
    assert not (tmp_path / "x.arrow").exists()


def test_a_large_task_mix_accounted_once_and_byte_identical(tmp_path):
    """A 10,000-task mix (2,000 in a developer's run) under load, with a context limit (some calls rejected) and client timeouts
    (some aborted): every request ends once, finished or not; exactly the requests with a parent
    that did not finish are skipped, never sent; two replays write the same bytes."""
    from servelab.api import write_run

    trace = generate_agentic(make_agent_config(
        shape="mix", tasks=size(10_000, 2_000), arrival={"rate_per_s": 20.0}, prompt="lognormal:256:0.5",
        output="lognormal:24:0.5", new_tokens="lognormal:64:0.5", calls="uniform:2:6", branches="uniform:2:5",
        chat_turns="uniform:2:4", tool_s="exp:1.0", user_think_s="exp:3.0", seed=5))
    runs = []
    for k in range(2):
        r = run(trace, runner="linear:base=0.005,prefill_token=0.00002,decode_seq=0.0002", max_model_len=1200,
                client_timeout_s=4.0, num_gpu_blocks=4000)
        runs.append(write_run(r, tmp_path / f"run{k}"))
    digest = [hashlib.sha256((d / "requests.parquet").read_bytes()).hexdigest() for d in runs]
    assert digest[0] == digest[1]
    assert (runs[0] / "steps.parquet").read_bytes() == (runs[1] / "steps.parquet").read_bytes()

    req = r.requests.to_pylist()
    assert [x["request_id"] for x in req] == trace.column("request_id").to_pylist()
    status = [x["status"] for x in req]
    assert set(status) <= {"finished", "rejected", "aborted", "skipped"}
    counts = {s: status.count(s) for s in set(status)}
    assert counts["rejected"] and counts["aborted"] and counts["skipped"]  # each path exercised
    parents = trace.column("depends_on").to_pylist()
    for x, deps in zip(req, parents):
        parent_failed = any(status[p] != "finished" for p in deps)
        assert (x["status"] == "skipped") == parent_failed
        assert (x["arrival_s"] is None) == parent_failed  # a skipped request was never sent
    assert r.meta["dependencies"]["skipped"] == counts["skipped"]
    assert r.meta["dependencies"]["released"] + counts["skipped"] == sum(1 for d in parents if d)


# ---- transforms keep dependencies consistent


def test_merge_renumbers_dependencies():
    from servelab.traces import transforms

    a = generate_agentic(make_agent_config(shape="react", tasks=20, calls="3", arrival={"rate_per_s": 1.0}, seed=1))
    b = generate_agentic(make_agent_config(shape="fanout", tasks=20, branches="2", arrival={"rate_per_s": 1.0}, seed=2))
    plain = pa.table({"request_id": pa.array([0, 1], pa.int64()), "arrival_s": [0.5, 3.0],
                      "prompt_tokens": pa.array([8, 8], pa.int32()), "output_tokens": pa.array([2, 2], pa.int32())})
    m = transforms.merge([a, plain, b])
    schema.validate(m, "merged")
    assert m.num_rows == a.num_rows + 2 + b.num_rows
    # each request still waits for requests of its own task (sessions renumbered apart), of equal prompts
    sid = m.column("session_id").to_pylist()
    prompt = m.column("prompt_tokens").to_pylist()
    for row, deps in enumerate(m.column("depends_on").to_pylist()):
        for p in deps or ():
            assert sid[p] == sid[row] and p < row and prompt[p] < prompt[row]
    assert m.column("depends_on").null_count == 2  # the plain trace's rows
    # the merged trace replays with the same dependency structure: as many dependents released
    r = run(m, runner="linear:base=0.01,prefill_token=0.00001", num_gpu_blocks=10_000)
    assert set(r.requests.column("status").to_pylist()) == {"finished"}
    assert r.meta["dependencies"]["released"] == 20 * 2 + 20 * 3


def test_cuts_that_orphan_a_request_are_refused():
    from servelab.traces import transforms

    t = generate_agentic(make_agent_config(shape="react", tasks=4, calls="3", arrival={"rate_per_s": 1.0}, seed=1))
    assert transforms.head(t, 5).num_rows == 5  # cuts tasks short, but every kept parent is there
    assert transforms.sample(t, 0, n=2).num_rows == 6  # whole tasks
    # a trace whose dependency crosses tasks: a whole-session sample can orphan it
    deps = t.column("depends_on").to_pylist()
    deps[3] = [2]  # task 1's first call waits for task 0's last
    crossed = t.set_column(t.column_names.index("depends_on"), "depends_on", pa.array(deps, pa.list_(pa.int64())))
    with pytest.raises(ServelabError, match=r"the sample keeps request 3 but drops request 2, which it depends on"):
        for seed in range(50):  # some seed keeps task 1 without task 0
            transforms.sample(crossed, seed, n=1)
    swapped = crossed.take(pa.array([0, 1, 3, 2] + list(range(4, crossed.num_rows))))  # tie: a parent on a later row
    with pytest.raises(ServelabError, match="head 3 keeps request 3 but drops request 2"):
        transforms.head(swapped, 3)


def test_live_bench_refuses_dependent_requests(tmp_path, capsys):
    """A dependent request's arrival_s is a placeholder: a live client sending at it would be wrong."""
    out = tmp_path / "agents.arrow"
    assert run_main(["trace", "synth", "--shape", "react", "--tasks", "3", "-o", out], capsys)[0] == 0
    code, _, err = run_main(["bench", "http://127.0.0.1:9", out, "--model", "m", "-o", tmp_path / "live"], capsys)
    assert code == 1 and "depend on others (depends_on) cannot be sent by servelab bench" in err
    assert not (tmp_path / "live").exists()
