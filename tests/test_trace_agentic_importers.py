"""Agentic and multi-turn importers (traces/agentic_importers.py): hand-computed traces from the fixtures in
tests/fixtures/agentic (written in each source's format; NOTICE.md there names the format sources) and one
test per bad-record rule."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from helpers_traces import FIXTURES, assert_input_error

from servelab.cli.main import cli
from servelab.common.errors import ServelabError
from servelab.traces.arrivals import ArrivalConfig
from servelab.traces.importers import detect_format, import_trace
from servelab.traces.io import read_trace
from servelab.traces.prefixes import token_hashes

AGENTIC = FIXTURES.parent / "agentic"
LSS = AGENTIC / "llmservingsim_sessions.jsonl"
MOONCAKE_TOOLS = AGENTIC / "mooncake_toolagent_form.jsonl"
MOONCAKE_SESSIONS = AGENTIC / "mooncake_sessions_form.jsonl"
SHAREGPT = AGENTIC / "sharegpt_chats.json"
MESSAGES = AGENTIC / "chat_messages.jsonl"


def _col(table, name):
    return table.column(name).to_pylist()


# ---- LLMServingSim agentic sessions


def test_llmservingsim_sessions_become_chains_with_tool_waits():
    r = import_trace("llmservingsim", [LSS])
    t = r.table
    # flat request at 0.5 s; session_0 at 1.0 s (calls wait 1 s, then 2 s); session_1 at 2.5 s (0.25 s)
    # earliest arrivals, rebased to the flat request: 0, 0.5, 1.5, 2.0, 2.25, 3.5
    assert _col(t, "arrival_s") == [0.0, 0.5, 1.5, 2.0, 2.25, 3.5]
    assert _col(t, "prompt_tokens") == [50, 100, 130, 32, 40, 170]
    assert _col(t, "output_tokens") == [7, 10, 20, 4, 3, 5]
    assert _col(t, "session_id") == [1, 0, 0, 2, 2, 0]  # tasks numbered in file order
    assert _col(t, "depends_on") == [[], [], [1], [], [3], [2]]
    assert _col(t, "think_s") == [None, None, 1.0, None, 0.25, 2.0]
    assert (r.rows_read, r.read_unit, r.prefix_block_tokens) == (3, "records", 16)


def test_llmservingsim_token_ids_give_shared_prefix_hashes():
    t = import_trace("llmservingsim", [LSS]).table
    hashes = _col(t, "prefix_hashes")
    ids0 = list(range(1000, 1032))
    assert hashes[3] == token_hashes(ids0, 16) and len(hashes[3]) == 2
    assert hashes[4] == hashes[3]  # 40 tokens: two full blocks, both the first call's
    assert hashes[0] == hashes[1] == []  # no token ids: no hashes
    assert import_trace("llmservingsim", [LSS], block_tokens=8).table.column("prefix_hashes")[4].as_py() \
        == token_hashes(ids0 + [7, 8, 9, 10, 2000, 2001, 2002, 2003], 8)


def test_llmservingsim_task_deadline_column():
    t = import_trace("llmservingsim", [LSS], task_deadline_s=30.0).table
    assert _col(t, "task_deadline_s") == [30.0] * 6
    assert "task_deadline_s" not in import_trace("llmservingsim", [LSS]).table.column_names


def test_two_files_continue_ids_and_tasks(tmp_path):
    second = tmp_path / "more.jsonl"
    second.write_text(json.dumps({"session_id": "s", "arrival_time_ns": 0, "sub_requests": [
        {"input_toks": 10, "output_toks": 2, "tool_duration_ns": 100000000}, {"input_toks": 20, "output_toks": 2}]}) + "\n")
    t = import_trace("llmservingsim", [LSS, second]).table
    assert t.num_rows == 8
    assert _col(t, "request_id") == list(range(8))
    arrival = _col(t, "arrival_s")
    assert arrival == sorted(arrival)
    rows = {(p, s): (i, d) for i, p, s, d in zip(_col(t, "request_id"), _col(t, "prompt_tokens"), _col(t, "session_id"),
                                                 _col(t, "depends_on"))}
    first, child = rows[(10, 3)], rows[(20, 3)]  # the second file's task is task 3
    assert child[1] == [first[0]]
    for i, deps in enumerate(_col(t, "depends_on")):
        assert all(d < i for d in deps)  # parents before children


@pytest.mark.parametrize("record, rule, column", [
    ({"session_id": "s", "arrival_time_ns": 0, "sub_requests": []}, "non-empty list", "sub_requests"),
    ({"session_id": "s", "arrival_time_ns": 0, "sub_requests": [{"input_toks": 0, "output_toks": 1}]},
     "must be >= 1", "sub_requests[0].input_toks"),
    ({"session_id": "s", "arrival_time_ns": 0, "sub_requests": [{"input_toks": 5, "output_toks": 1},
                                                                 {"input_toks": 5}]},
     "missing value", "sub_requests[1].output_toks"),
    ({"session_id": "s", "arrival_time_ns": 0, "sub_requests": [{"input_toks": 5, "output_toks": 1,
                                                                  "tool_duration_ns": -3}]},
     "must be >= 0", "sub_requests[0].tool_duration_ns"),
    ({"session_id": "s", "arrival_time_ns": "soon", "sub_requests": [{"input_toks": 5, "output_toks": 1}]},
     "not a number", "arrival_time_ns"),
    ({"session_id": "s", "arrival_time_ns": 0, "sub_requests": [{"input_toks": 3, "output_toks": 1,
                                                                  "input_tok_ids": [1, 2]}]},
     "holds 2 ids", "sub_requests[0].input_tok_ids"),
    ({"input_toks": 5, "output_toks": 1.5, "arrival_time_ns": 0}, "not an integer", "output_toks"),
])
def test_llmservingsim_bad_record_names_file_field_and_row(tmp_path, record, rule, column):
    path = tmp_path / "bad.jsonl"
    good = {"input_toks": 5, "output_toks": 1, "arrival_time_ns": 0}
    path.write_text(json.dumps(good) + "\n\n" + json.dumps(record) + "\n")
    with pytest.raises(ServelabError) as err:
        import_trace("llmservingsim", [path])
    assert_input_error(err, path, rule, column=column, row=2)  # the blank line is not a record


def test_llmservingsim_not_json_and_not_object(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"input_toks": 5, "output_toks": 1, "arrival_time_ns": 0}\n{"input_toks": \n')
    with pytest.raises(ServelabError) as err:
        import_trace("llmservingsim", [path])
    assert_input_error(err, path, "not valid JSON", row=2)
    path.write_text("[1, 2]\n")
    with pytest.raises(ServelabError) as err:
        import_trace("llmservingsim", [path])
    assert_input_error(err, path, "not a JSON object", row=1)


# ---- Mooncake as chains


def test_mooncake_chains_follow_whole_prompt_prefixes():
    r = import_trace("mooncake-chains", [MOONCAKE_TOOLS])
    t = r.table
    # [0,1,2] -> [0,1,2,4] -> [0,1,2,4,6,7]; [0,1,2] -> [0,1,2,8] (a second branch); [0,3] -> [0,3,5].
    # Sharing block 0 alone (a system prompt) links nothing: [0] is no earlier request's whole prompt.
    assert _col(t, "depends_on") == [[], [], [0], [1], [2], [0]]
    assert _col(t, "session_id") == [0, 1, 0, 1, 0, 0]
    # think: the recorded gap since the parent's arrival (3.0 s, 4.4 s, 4.0 s, 8.0 s)
    assert _col(t, "think_s") == [None, None, 3.0, pytest.approx(4.4), 4.0, 8.0]
    assert _col(t, "arrival_s") == [0.0, 0.1, 3.0, pytest.approx(4.5), 7.0, 8.0]
    assert r.prefix_block_tokens == 512
    assert _col(t, "prefix_hashes")[4] == [0, 1, 2, 4, 6, 7]


def test_mooncake_chains_fixed_think_time():
    t = import_trace("mooncake-chains", [MOONCAKE_TOOLS], think_s=0.5).table
    assert _col(t, "think_s") == [None, None, 0.5, 0.5, 0.5, 0.5]
    # earliest arrivals: parents' + 0.5 s, so the order changes: [0,3] (0.1 s) -> its child at 0.6 s
    assert _col(t, "arrival_s") == [0.0, 0.1, 0.5, 0.5, pytest.approx(0.6), 1.0]


def test_mooncake_chains_by_session_field():
    t = import_trace("mooncake-chains", [MOONCAKE_SESSIONS]).table
    assert _col(t, "session_id") == [0, 1, 0, 0]
    assert _col(t, "depends_on") == [[], [], [0], [2]]
    assert _col(t, "think_s") == [None, None, 2.0, pytest.approx(0.6)]


def test_mooncake_chains_bad_session_and_hashes(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1],
                                "session_id": {"x": 1}}) + "\n")
    with pytest.raises(ServelabError) as err:
        import_trace("mooncake-chains", [path])
    assert_input_error(err, path, "session id must be", column="session_id", row=1)
    path.write_text(json.dumps({"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": ["a"]}) + "\n")
    with pytest.raises(ServelabError) as err:
        import_trace("mooncake-chains", [path])
    assert_input_error(err, path, "list of integers", column="hash_ids", row=1)
    path.write_text(json.dumps({"timestamp": -1, "input_length": 5, "output_length": 1, "hash_ids": []}) + "\n")
    with pytest.raises(ServelabError) as err:
        import_trace("mooncake-chains", [path])
    assert_input_error(err, path, "must be >= 0", column="timestamp", row=1)


def test_mooncake_chains_on_the_real_slice_keeps_every_row_once():
    t = import_trace("mooncake-chains", [FIXTURES / "mooncake_synthetic_head200.jsonl"]).table
    assert t.num_rows == 200
    hashes = _col(t, "prefix_hashes")
    for i, deps in enumerate(_col(t, "depends_on")):
        for d in deps:  # a parent's whole prompt starts the child's
            assert d < i and hashes[i][:len(hashes[d])] == hashes[d] and len(hashes[d]) < len(hashes[i])


# ---- ShareGPT-style chats


def test_sharegpt_turns_become_chains_with_growing_context():
    r = import_trace("sharegpt", [SHAREGPT], think_s=2.0, arrival=ArrivalConfig(process="constant", rate_per_s=0.1))
    t = r.table
    # a1: 40-char question (10 tokens) -> 80-char reply (20); then the 140 chars so far (35) -> 8 chars (2)
    # b2: a 16-char system prompt + 12-char question (7) -> 4 chars (1); its last question has no reply
    assert _col(t, "prompt_tokens") == [10, 35, 7]
    assert _col(t, "output_tokens") == [20, 2, 1]
    assert _col(t, "session_id") == [0, 0, 1]
    assert _col(t, "depends_on") == [[], [0], []]
    assert _col(t, "think_s") == [None, 2.0, None]
    assert _col(t, "arrival_s") == [0.0, 2.0, pytest.approx(10.0)]  # conversations 10 s apart (0.1/s)
    assert r.dropped == {"conversations without a reply": 1, "unanswered last messages": 1}
    assert (r.rows_read, r.read_unit) == (3, "conversations")


def test_sharegpt_later_turn_shares_the_earlier_prompt_blocks():
    t = import_trace("sharegpt", [MESSAGES], block_tokens=4).table
    # turn 1: 64 chars = 16 tokens = 4 blocks of 16 chars, its reply 4 more; turn 2's prompt starts with the
    # same 128 chars (question and reply), so it shares all 8; its own 192 chars + 4-char reply: 12 full blocks
    h = _col(t, "prefix_hashes")
    assert len(h[0]) == 8 and h[1][:8] == h[0] and len(h[1]) == 12
    assert _col(t, "prompt_tokens") == [16, 48]


def test_sharegpt_exponential_think_is_seeded():
    a = import_trace("sharegpt", [SHAREGPT], think_s=5.0, think="exponential", seed=3).table
    b = import_trace("sharegpt", [SHAREGPT], think_s=5.0, think="exponential", seed=3).table
    c = import_trace("sharegpt", [SHAREGPT], think_s=5.0, think="exponential", seed=4).table
    assert a.equals(b) and not a.equals(c)
    think = [w for w, d in zip(_col(a, "think_s"), _col(a, "depends_on")) if d]
    assert len(think) == 1 and think[0] > 0


def test_sharegpt_limit_keeps_the_first_conversations():
    t = import_trace("sharegpt", [SHAREGPT], limit=1).table
    assert t.num_rows == 2 and set(_col(t, "session_id")) == {0}


@pytest.mark.parametrize("record, rule, column", [
    ({"id": "x"}, "no turns", None),
    ({"conversations": "hi"}, "list of messages", "conversations"),
    ({"conversations": [{"from": "robot", "value": "hi"}]}, "unknown role", "conversations[0].from"),
    ({"conversations": [{"from": "human"}]}, "no text", "conversations[0]"),
    ({"messages": [{"role": "user", "content": 5}]}, "must be a string", "messages[0].content"),
])
def test_sharegpt_bad_record_names_file_field_and_row(tmp_path, record, rule, column):
    path = tmp_path / "bad.json"
    good = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}
    path.write_text(json.dumps([good, record]))
    with pytest.raises(ServelabError) as err:
        import_trace("sharegpt", [path])
    assert_input_error(err, path, rule, column=column, row=2)


def test_sharegpt_no_complete_turn(tmp_path):
    path = tmp_path / "none.json"
    path.write_text(json.dumps([{"conversations": [{"from": "human", "value": "hi"}]}]))
    with pytest.raises(ServelabError, match="no conversation has a user message answered"):
        import_trace("sharegpt", [path])


def test_bad_options():
    with pytest.raises(ServelabError, match="--chars-per-token"):
        import_trace("sharegpt", [SHAREGPT], chars_per_token=0)
    with pytest.raises(ServelabError, match="--think-s"):
        import_trace("mooncake-chains", [MOONCAKE_TOOLS], think_s=-1.0)
    with pytest.raises(ServelabError, match="--task-deadline-s"):
        import_trace("llmservingsim", [LSS], task_deadline_s=0.0)


# ---- detection and the CLI


def test_detect_format():
    assert detect_format([LSS]) == "llmservingsim"
    assert detect_format([SHAREGPT]) == "sharegpt"
    assert detect_format([MESSAGES]) == "sharegpt"
    assert detect_format([MOONCAKE_TOOLS]) == "mooncake"  # chains are asked for with --format mooncake-chains


def test_cli_import_writes_a_trace_with_dependencies(tmp_path):
    out = tmp_path / "agents.parquet"
    res = CliRunner().invoke(cli, ["trace", "import", "--format", "llmservingsim", str(LSS), "-o", str(out),
                                   "--task-deadline-s", "20"])
    assert res.exit_code == 0, res.output
    t = read_trace(out)
    assert _col(t, "depends_on") == [[], [], [1], [], [3], [2]]
    assert _col(t, "task_deadline_s") == [20.0] * 6
    out2 = tmp_path / "chats.arrow"
    res = CliRunner().invoke(cli, ["trace", "import", str(SHAREGPT), "-o", str(out2), "--think-s", "1.5",
                                   "--rate", "2", "--arrival", "constant"])
    assert res.exit_code == 0, res.output
    assert _col(read_trace(out2), "think_s") == [None, None, 1.5]  # the second chat starts at 0.5 s
    res = CliRunner().invoke(cli, ["trace", "import", "--format", "llmservingsim", str(LSS), "-o", str(out),
                                   "--think-s", "1"])
    assert res.exit_code != 0 and "--think-s does not apply to --format llmservingsim" in str(res.exception)


# ---- replay: an imported chain runs in dependency order


def test_imported_chains_replay_in_dependency_order():
    from helpers_engine import column, run

    trace = import_trace("llmservingsim", [LSS]).table
    result = run(trace, runner="linear:base=0.01,prefill_token=0.0001")
    arrival, finish = column(result, "arrival_s"), column(result, "finish_s")
    assert column(result, "status") == ["finished"] * 6
    for i, (deps, think) in enumerate(zip(_col(trace, "depends_on"), _col(trace, "think_s"))):
        if deps:  # a call arrives when its parent has finished plus the tool wait
            assert arrival[i] == pytest.approx(max(finish[d] for d in deps) + think, abs=1e-9)
        else:
            assert arrival[i] == _col(trace, "arrival_s")[i]


def test_imported_fan_out_replays_in_dependency_order():
    from helpers_engine import column, run

    # the tool-agent form has a second branch off the first prompt (request 5 depends on request 0 only),
    # which a closed-loop session would chain after request 4 instead
    trace = import_trace("mooncake-chains", [MOONCAKE_TOOLS], think_s=0.5).table  # (its ids are 512-token blocks)
    result = run(trace, runner="linear:base=0.01,prefill_token=0.0001")
    arrival, finish = column(result, "arrival_s"), column(result, "finish_s")
    assert column(result, "status") == ["finished"] * 6
    for i, deps in enumerate(_col(trace, "depends_on")):
        if deps:
            assert arrival[i] == pytest.approx(max(finish[d] for d in deps) + 0.5, abs=1e-9)
