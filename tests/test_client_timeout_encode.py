"""Client timeouts with an encode pool (replay/cluster/encode_pool.py ``EncodePool.abandon``,
replay/platform/abort.py): a request whose client gives up in the encode stage ends ``aborted`` at its
deadline and is never routed; taken off its encode replica's queue, the requests behind it start
earlier; being encoded, the encoder finishes it and sends nothing; in transfer, the transfer is
cancelled. After its embeddings land it times out on the arrivals' pool as any request.

Timelines by hand in the symbols of tests/test_multimodal.py: Qwen2.5-7B on H100s (roofline), one
encode replica with Qwen2.5-VL's ViT, every image 1,024 tokens: E = one image's encoder seconds,
T = its embeddings' transfer (1 ms + 1,024 x 3,584 x 2 bytes at 1 GB/s), P = a 1,500-token prefill."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pyarrow as pa
import pytest
from helpers_engine import check_after_each_abort, column, synthetic
from test_client_timeout_faults import ends  # noqa: F401 (a fixture: Engine.ended calls per request)
from test_engine_invariants import CheckedEngine
from test_multimodal import MODEL, GPU, mm_trace, prefill_s, runner

import servelab.assembly
from servelab.api import EngineConfig, ReplayConfig, not_streamed, replay
from servelab.replay.cluster.config import ClusterConfig
from servelab.runners.encoders import EncoderPricer
from servelab.traces.io import prepare

ENC = 2  # the encode replica's id with one LLM pool of two replicas (ids 0, 1) before it
ENCODE_COLUMNS = ("encode_replica", "encode_wait_s", "encode_s", "embedding_transfer_s")


def cluster(llm: list[dict], links: list[dict], bandwidth_gbps: float = 1.0, encode: dict | None = None,
            **engine) -> ReplayConfig:
    pools = llm + [dict({"name": "enc", "role": "encode", "replicas": 1, "vision_encoder": "qwen2.5-vl-vit"},
                        **(encode or {}))]
    links = links + [{"from": "enc", "to": llm[0]["name"], "bandwidth_gbps": bandwidth_gbps, "latency_s": 0.001}]
    spec = ClusterConfig.from_dict({"pools": pools, "links": links})
    return ReplayConfig(engine=EngineConfig(**dict(dict(num_gpu_blocks=20_000), **engine)), model=MODEL, gpu=GPU,
                        cluster=spec)


def mixed(replicas: int = 2, **kw) -> ReplayConfig:
    return cluster([{"name": "llm", "role": "mixed", "replicas": replicas}], [], **kw)


def pd(**kw) -> ReplayConfig:
    return cluster([{"name": "p", "role": "prefill", "replicas": 1}, {"name": "d", "role": "decode", "replicas": 1}],
                   [{"from": "p", "to": "d", "bandwidth_gbps": 25.0}], **kw)


@pytest.fixture(scope="module")
def times():
    r = runner()
    return r, EncoderPricer(r, "qwen2.5-vl-vit", None)("image", 1024), 0.001 + 1024 * 3584 * 2 / 1e9, prefill_s(r, 1500)


def images(n: int, timeouts, hashes=None, arrivals=None, **columns) -> pa.Table:
    return mm_trace(arrivals or [0.0] * n, [1500] * n, [4] * n, hashes=hashes or [[i + 1] for i in range(n)],
                    images=[1] * n, image_tokens=[1024] * n, timeout_s=pa.array(timeouts, pa.float64()), **columns)


def row(result, i: int) -> list:
    return [column(result, name)[i] for name in ENCODE_COLUMNS]


def test_a_request_abandoned_in_the_encode_queue_leaves_it_and_the_next_starts_earlier(times, ends):
    # A, B, C (t=0, three new images) queue on the one encode replica: A [0, E], B [E, 2E], C [2E, 3E].
    # B's client gives up at E/2, queued: B leaves the queue and C starts at E, landing at 2E + T on the
    # idle replica 1 (A took replica 0 at E + T). B is never routed: no replica, no token.
    r, E, T, _ = times
    result = replay(images(3, [None, 0.5 * E, None]), mixed(), runner=r)
    assert column(result, "status") == ["finished", "aborted", "finished"]
    assert column(result, "refused_s")[1] == 0.5 * E
    assert column(result, "reason")[1] == f"client timeout after {0.5 * E:g} s"
    assert column(result, "replica")[1] is None and column(result, "generated_tokens")[1] == 0
    assert row(result, 1) == [ENC, None, None, None]  # queued there; nothing else happened
    assert column(result, "encode_wait_s")[2] == pytest.approx(E, rel=1e-12)
    assert column(result, "first_scheduled_s")[2] == pytest.approx(2 * E + T, rel=1e-12)
    meta = result.meta["cluster"]["encode"]
    assert meta["requests"] == 2 and meta["busy_s"][str(ENC)] == pytest.approx(2 * E, rel=1e-12)
    assert meta["abandoned"] == {"queued": 1, "encoding": 0, "in_transfer": 0}
    assert dict(ends) == {0: 1, 1: 1, 2: 1}
    plain = replay(images(3, [None, None, None]), mixed(), runner=r)
    assert column(plain, "encode_wait_s")[2] == pytest.approx(2 * E, rel=1e-12)  # C started E later with B


def test_an_encoding_that_never_ran_caches_nothing(times):
    # B and C show the same image (hash 7). Without timeouts B encodes it at [E, 2E] and C hits the
    # cache (0 s). B abandoned in the queue never encoded it: C encodes it itself, [E, 2E].
    r, E, _, _ = times
    hashes = [[1], [7], [7]]
    result = replay(images(3, [None, 0.5 * E, None], hashes), mixed(), runner=r)
    assert row(result, 2)[1:3] == [pytest.approx(E, rel=1e-12), pytest.approx(E, rel=1e-12)]
    plain = replay(images(3, [None, None, None], hashes), mixed(), runner=r)
    assert row(plain, 2)[1:3] == [pytest.approx(2 * E, rel=1e-12), 0.0]


def test_a_request_abandoned_while_encoded_is_finished_by_the_encoder_and_not_sent(times, ends):
    # A [0, E], B [E, 2E]. A's client gives up at E/2, inside its encoding: the encoder finishes it (B
    # still starts at E; the replica was busy 2E), its embeddings are not sent and it is never routed:
    # the LLM pool prefills B's 1,500 tokens only.
    r, E, T, _ = times
    result = replay(images(2, [0.5 * E, None]), mixed(), runner=r)
    assert column(result, "status") == ["aborted", "finished"]
    assert column(result, "refused_s")[0] == 0.5 * E and column(result, "replica")[0] is None
    assert row(result, 0) == [ENC, 0.0, pytest.approx(E, rel=1e-12), None]
    assert column(result, "encode_wait_s")[1] == pytest.approx(E, rel=1e-12)
    assert column(result, "first_scheduled_s")[1] == pytest.approx(2 * E + T, rel=1e-12)
    assert sum(s["prefill_tokens"] for s in result.steps.to_pylist()) == 1500
    meta = result.meta["cluster"]["encode"]
    assert meta["busy_s"][str(ENC)] == pytest.approx(2 * E, rel=1e-12) and meta["requests"] == 2
    assert meta["abandoned"] == {"queued": 0, "encoding": 1, "in_transfer": 0}
    assert dict(ends) == {0: 1, 1: 1}


def test_a_request_abandoned_while_its_embeddings_cross_the_link_never_reaches_the_prefill_pool(times, ends):
    # Prefill/decode pools behind the encode pool. A alone: encoded [0, E], embeddings in transfer
    # [E, E + T]; its client gives up at E + T/2: the transfer is cancelled, A is never routed, and no
    # iteration ever runs (no KV allocated on the prefill replica, nothing handed off).
    r, E, T, _ = times
    deadline = E + 0.5 * T
    result = replay(images(1, [deadline]), pd(), runner=r)
    assert column(result, "status") == ["aborted"] and column(result, "refused_s") == [deadline]
    assert column(result, "replica") == [None]
    assert row(result, 0) == [ENC, 0.0, pytest.approx(E, rel=1e-12), None]
    assert result.steps.num_rows == 0
    assert column(result, "prefill_replica") == [None]
    assert result.meta["cluster"]["encode"]["abandoned"] == {"queued": 0, "encoding": 0, "in_transfer": 1}
    assert dict(ends) == {0: 1}


def test_after_its_embeddings_land_a_timeout_is_an_ordinary_one_on_the_prefill_replica(times, ends):
    # A lands at E + T and prefills [E + T, E + T + P] on replica 0; its client gives up at E + T + P/2,
    # inside that iteration: it leaves at its end, its first token (after the deadline) is no TTFT. Its
    # encode columns are all there: the encode stage was done.
    r, E, T, P = times
    deadline = E + T + 0.5 * P
    result = replay(images(1, [deadline]), mixed(), runner=r)
    assert column(result, "status") == ["aborted"] and column(result, "refused_s") == [deadline]
    assert column(result, "replica") == [0] and column(result, "generated_tokens") == [1]
    assert column(result, "first_token_s") == [None]
    assert row(result, 0) == [ENC, 0.0, pytest.approx(E, rel=1e-12), pytest.approx(T, rel=1e-12)]
    assert result.steps.column("duration_s").to_pylist() == [pytest.approx(P, rel=1e-12)]
    assert result.meta["cluster"]["encode"]["abandoned"] == {"queued": 0, "encoding": 0, "in_transfer": 0}
    assert dict(ends) == {0: 1}


def test_a_session_turn_follows_a_turn_abandoned_in_the_encode_queue(times):
    # B (session 7, queued behind A) is abandoned at E/2; the session's next turn C (text, think 1 s) is
    # sent 1 s after that deadline.
    r, E, _, _ = times
    trace = mm_trace([0.0, 0.0, 0.0], [1500, 1500, 100], [4, 4, 4], hashes=[[1], [2], []], images=[1, 1, 0],
                     image_tokens=[1024, 1024, 0], session_id=[None, 7, 7], think_s=[None, None, 1.0],
                     timeout_s=pa.array([None, 0.5 * E, None], pa.float64()))
    result = replay(trace, mixed(), runner=r)
    assert column(result, "status") == ["finished", "aborted", "finished"]
    assert column(result, "arrival_s")[2] == 0.5 * E + 1.0


def random_trace(seed: int, n: int = 160) -> pa.Table:
    """Bursty arrivals at 30/s, 60% of them with a 1,024-token image from six (cache hits and misses);
    40% of the clients give up after 2-80 ms (around the encoder's and the link's times), the others
    after 0.1-1 s."""
    base = synthetic(n=n, rate=30.0, seed=seed, prompt="lognormal:300:0.8", output="lognormal:20:0.8")
    rng = np.random.default_rng(seed)
    has = rng.random(n) < 0.6
    tokens = np.where(has, 1024, 0)
    table = base.set_column(base.column_names.index("prompt_tokens"), "prompt_tokens",
                            pa.array(base.column("prompt_tokens").to_numpy() + tokens, pa.int32()))
    table = table.append_column("images", pa.array(has.astype(np.int32)))
    table = table.append_column("image_tokens", pa.array(tokens.astype(np.int32)))
    table = table.append_column("image_hashes", pa.array([[int(h)] if x else [] for h, x in
                                                          zip(rng.integers(0, 6, n), has)], pa.list_(pa.int64())))
    timeouts = np.where(rng.random(n) < 0.4, rng.uniform(0.002, 0.08, n), rng.uniform(0.1, 1.0, n))
    return prepare(table.append_column("timeout_s", pa.array(timeouts, pa.float64())), "t", "t")


@pytest.fixture
def checked(monkeypatch):
    """Replays on an engine whose KV and outstanding tokens are checked after every arrival, decision,
    completed step and client timeout (tests/test_engine_invariants.py's check)."""
    monkeypatch.setattr(servelab.assembly, "Engine", CheckedEngine)
    check_after_each_abort(monkeypatch)
    return CheckedEngine


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("pools", ["mixed", "pd"])
def test_every_request_is_accounted_once_with_timeouts_and_an_encode_pool(checked, ends, seed, pools):
    trace = random_trace(seed)
    kw = dict(bandwidth_gbps=0.5, encode={"gpu": "l40s"}, num_gpu_blocks=3000, encoder_cache_tokens=2048)
    cfg = mixed(**kw) if pools == "mixed" else cluster(
        [{"name": "p", "role": "prefill", "replicas": 2}, {"name": "d", "role": "decode", "replicas": 2}],
        [{"from": "p", "to": "d", "bandwidth_gbps": 25.0}], **kw)
    assert not_streamed(cfg) is not None  # (a cluster replays in memory: nothing streamed to keep true)
    before = checked.events
    result = replay(trace, cfg)
    assert checked.events - before > 500
    status = column(result, "status")
    assert Counter(status)["aborted"] > 20 and Counter(status)["finished"] > 20
    assert set(status) == {"finished", "aborted"}
    abandoned = result.meta["cluster"]["encode"]["abandoned"]
    assert min(abandoned.values()) > 0, abandoned  # every place in the encode stage was hit
    timeouts = trace.column("timeout_s").to_pylist()
    arrival, finish, refused, replica = (column(result, c) for c in ("arrival_s", "finish_s", "refused_s", "replica"))
    enc, wait, encode_s, transfer = (column(result, c) for c in ENCODE_COLUMNS)
    in_stage = 0
    for i, s in enumerate(status):
        assert ends[i] == 1, (i, s, ends[i])  # finished or aborted, exactly once
        if s == "finished":
            assert finish[i] - arrival[i] <= timeouts[i] + 1e-9
        else:
            assert refused[i] == pytest.approx(arrival[i] + timeouts[i]) and finish[i] is None
        if enc[i] is not None and transfer[i] is None:  # abandoned in the encode stage: never routed
            assert s == "aborted" and replica[i] is None, i
            in_stage += 1
        elif enc[i] is not None:  # its embeddings landed (by its deadline): it reached the arrivals' pool
            assert replica[i] is not None, i
            if s == "aborted":
                assert arrival[i] + wait[i] + encode_s[i] + transfer[i] <= refused[i] + 1e-12, i
    assert in_stage == sum(abandoned.values())
    # the encode replica works whenever it has work, in arrival order: a request abandoned in its queue
    # left no gap (each encoding starts when the one before ended, or at its arrival)
    end = 0.0
    for i in sorted((i for i in range(len(status)) if encode_s[i] is not None), key=lambda i: (arrival[i], i)):
        start = arrival[i] + wait[i]
        assert start == pytest.approx(max(end, arrival[i]), abs=1e-12), i
        end = start + encode_s[i]
    again = replay(trace, cfg)
    assert again.requests.equals(result.requests) and again.steps.equals(result.steps)
    assert again.meta["cluster"] == result.meta["cluster"]
