"""Layer-by-layer KV streaming (``stream_layers`` on a link, replay/cluster/disagg.py) against hand-traced times.

Every step costs 1 s (``linear:base=1``), so a request's final prefill iteration lasts 1 s; KV is
1,000 bytes per token, so an 8-token prompt is 8,000 B. With L layers the first L - 1 stream during
that iteration: (L - 1) / L x min(8,000 B, share x 1 s), share = bandwidth / (transfers in flight +
requests of the iteration); the rest crosses the link after the first token.
"""

from __future__ import annotations

import pytest
from conftest import make_trace
from servelab.api import ReplayConfig, replay
from servelab.common.errors import ServelabError


def cluster_config(link, decode=None):
    return ReplayConfig.from_dict({
        "runner": "linear:base=1", "num_gpu_blocks": 1000, "kv_bytes_per_token": 1000,
        "max_num_batched_tokens": 4096,
        "cluster": {"pools": [{"name": "p", "role": "prefill", "replicas": 1},
                              {"name": "d", "role": "decode", "replicas": 1, **(decode or {})}],
                    "links": [{"from": "p", "to": "d", "stream_layers": 4, **link}]}})


def second_token_gap(r):
    return (r["finish_s"] - 1.0 * (r["output_tokens"] - 2)) - r["first_token_s"]  # decode steps are 1 s


def test_a_slow_link_streams_what_its_bandwidth_allows_during_the_final_prefill_iteration():
    # 1,000 B/s: 1,000 B could cross during the prefill [0, 1]; 3/4 of it (the first 3 of 4 layers)
    # did: 750 B. The other 7,250 B take 7.25 s + 0.5 s latency: landing at 8.75, token 2 at 9.75.
    result = replay(make_trace([0], [8], [3]), cluster_config({"bandwidth_gbps": 1e-6, "latency_s": 0.5}))
    (r,) = result.requests.to_pylist()
    assert r["first_token_s"] == pytest.approx(1.0)
    assert r["transfer_s"] == pytest.approx(7.75)
    assert second_token_gap(r) == pytest.approx(7.75 + 1.0)  # remaining transfer + one decode step
    assert r["finish_s"] == pytest.approx(10.75)
    transfers = result.meta["cluster"]["transfers"]
    assert transfers["bytes_streamed"] == pytest.approx(750.0) and transfers["bytes_moved"] == pytest.approx(7250.0)


def test_a_fast_link_leaves_only_the_last_layer_after_the_first_token():
    # 16,000 B/s could carry all 8,000 B during the prefill: the first 3 layers (6,000 B) did; the
    # last layer's 2,000 B take 0.125 s + 0.5 s latency: landing at 1.625, token 2 at 2.625.
    (r,) = replay(make_trace([0], [8], [3]), cluster_config({"bandwidth_gbps": 1.6e-5, "latency_s": 0.5})
                  ).requests.to_pylist()
    assert r["transfer_s"] == pytest.approx(0.625)
    assert second_token_gap(r) == pytest.approx(0.625 + 1.0)
    # without streaming the whole 8,000 B: 0.5 s + 0.5 s
    (off,) = replay(make_trace([0], [8], [3]), cluster_config({"bandwidth_gbps": 1.6e-5, "latency_s": 0.5,
                                                                 "stream_layers": 0})).requests.to_pylist()
    assert off["transfer_s"] == pytest.approx(1.0)


def test_requests_of_one_prefill_iteration_share_the_link_while_streaming():
    # A and B prefill together [0, 1] on an 8,000 B/s link: 4,000 B/s each, so 4,000 B each could
    # cross: 3,000 B each streamed (alone it would be 6,000). Their other 5,000 B each share the link:
    # 10,000 B at 8,000 B/s, both land at 2.25.
    rows = replay(make_trace([0, 0], [8, 8], [3, 3]), cluster_config({"bandwidth_gbps": 8e-6})).requests.to_pylist()
    assert [r["transfer_s"] for r in rows] == [pytest.approx(1.25)] * 2
    assert [second_token_gap(r) for r in rows] == [pytest.approx(1.25 + 1.0)] * 2


def test_a_request_waiting_for_room_streamed_nothing():
    # One decode seat: A is placed at its first token (streams 6,000 B: share 16,000 / 2 requests x 1 s),
    # its last 2,000 B land at 1.125, it decodes [1.125, 3.125]. B waits for the seat until 3.125 and
    # then moves all 8,000 B: 0.5 s, landing at 3.625, finishing at 5.625.
    rows = replay(make_trace([0, 0], [8, 8], [3, 3]),
                  cluster_config({"bandwidth_gbps": 1.6e-5}, {"max_num_seqs": 1})).requests.to_pylist()
    a, b = rows
    assert a["transfer_s"] == pytest.approx(0.125) and a["finish_s"] == pytest.approx(3.125)
    assert b["handoff_wait_s"] == pytest.approx(2.125) and b["transfer_s"] == pytest.approx(0.5)
    assert b["finish_s"] == pytest.approx(5.625)


def test_one_layer_streams_nothing_and_a_bad_count_is_an_error():
    trace = make_trace([0, 0.5, 3], [8, 30, 8], [3, 5, 4])
    one = replay(trace, cluster_config({"bandwidth_gbps": 1e-6, "stream_layers": 1}))
    off = replay(trace, cluster_config({"bandwidth_gbps": 1e-6, "stream_layers": 0}))
    assert one.requests.equals(off.requests) and one.steps.equals(off.steps)
    with pytest.raises(ServelabError, match="stream_layers .* must be >= 0"):
        cluster_config({"bandwidth_gbps": 1.0, "stream_layers": -1})


def test_streaming_keeps_the_books_after_every_event_and_moves_less_after_the_first_token(monkeypatch):
    """A bursty trace on a slow link with small decode KV (handoffs wait, transfers share the link):
    KV and outstanding tokens add up after every event (tests/test_engine_invariants.py), every
    request is served, and with streaming the bytes moved after the first token plus those streamed
    are all the KV, while the mean transfer after the first token is shorter than without."""
    import servelab.assembly
    from helpers_engine import synthetic
    from test_engine_invariants import CheckedEngine

    monkeypatch.setattr(servelab.assembly, "Engine", CheckedEngine)
    trace = synthetic(n=300, rate=40.0, seed=4)

    def run(layers):
        return replay(trace, ReplayConfig.from_dict({
            "runner": "linear:base=0.01,prefill_token=0.0001,decode_seq=0.0005", "kv_bytes_per_token": 1024,
            "router": "least-outstanding",
            "cluster": {"pools": [{"name": "p", "role": "prefill", "replicas": 2, "num_gpu_blocks": 400},
                                  {"name": "d", "role": "decode", "replicas": 2, "num_gpu_blocks": 300}],
                        "links": [{"from": "p", "to": "d", "bandwidth_gbps": 0.5, "stream_layers": layers}]}}))

    before = CheckedEngine.events
    on, off = run(32), run(0)
    assert CheckedEngine.events - before > 600
    for result in (on, off):
        assert set(result.requests.column("status").to_pylist()) <= {"finished", "rejected"}
    t_on, t_off = on.meta["cluster"]["transfers"], off.meta["cluster"]["transfers"]
    assert t_on["transfers"] == t_off["transfers"] > 250 and t_on["max_handoffs_waiting"] > 0
    assert t_on["bytes_streamed"] > 0
    # every transfer moved its request's whole context (prompt tokens x 1,024 B), streamed or not
    moved = sum(r["prompt_tokens"] * 1024 for r in on.requests.to_pylist() if r["transfer_s"] is not None)
    assert t_on["bytes_moved"] + t_on["bytes_streamed"] == pytest.approx(moved) == pytest.approx(t_off["bytes_moved"])

    def mean_transfer(result):
        values = [v for v in result.requests.column("transfer_s").to_pylist() if v is not None]
        return sum(values) / len(values)

    assert mean_transfer(on) < mean_transfer(off)
