"""Live-run pieces that need no server: prompt building, load schedules, the results tables and the
run directory (read back by `report` and `query`), the bench command's argument errors."""

import asyncio
import json
import socket

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers_cli import run_main
from servelab.common.errors import ServelabError
from servelab.live.bench import LiveRun, write_live_run
from servelab.live.client import Record
from servelab.live.load import LoadConfig, schedule
from servelab.live.prompts import Approximate, build_prompt, measure_vocabulary
from servelab.live.results import requests_table, tokens_table
from servelab.scoring.report import report_text


class ShortWords:
    """A made-up tokenizer with a BOS: words of up to two letters are one token, longer ones two."""

    async def count(self, text: str) -> int:
        return 1 + sum(1 if len(w) <= 2 else 2 for w in text.split())


def _vocab():
    return asyncio.run(measure_vocabulary(ShortWords(), exact=True))


def test_vocabulary_keeps_single_token_words_and_measures_the_overhead():
    vocab = _vocab()
    assert vocab.overhead == 1 and vocab.exact
    assert " of" in vocab.words and " z" in vocab.words and " the" not in vocab.words
    assert all(len(w.strip()) <= 2 and w.startswith(" ") for w in vocab.words)


@pytest.mark.parametrize("length", [2, 3, 17, 64, 301])
def test_prompts_have_exactly_the_length(length):
    text, count = asyncio.run(build_prompt(ShortWords(), _vocab(), 0, 5, length))
    assert count == length == asyncio.run(ShortWords().count(text))


def test_prompt_shorter_than_the_overhead_gets_one_word_and_says_so():
    text, count = asyncio.run(build_prompt(ShortWords(), _vocab(), 0, 5, 1))
    assert len(text.split()) == 1 and count == 2


def test_shared_prefix_hashes_share_text_blocks():
    vocab = _vocab()

    def words(rid, hashes, length=14, seed=0):
        text, count = asyncio.run(build_prompt(ShortWords(), vocab, seed, rid, length, hashes, 4))
        assert count == length
        return text.split()

    a, b, c = words(1, [10, 20, 30]), words(2, [10, 20, 31]), words(3, [11, 20, 30])
    # 13 words after the BOS: blocks of 4 from the hashes, then the request's own tail
    assert a[:8] == b[:8] and a[8:12] != b[8:12] and a[12:] != b[12:]
    assert a[:4] != c[:4] and a[4:8] == c[4:8]  # equal ids share text: the trace's ids chain their prefix
    assert words(1, [10, 20, 30]) == a  # deterministic
    assert words(1, [10, 20, 30], seed=1)[:4] != a[:4]  # another seed, other text


def test_approximation_counts_words_plus_one():
    vocab = asyncio.run(measure_vocabulary(Approximate(), exact=False))
    text, count = asyncio.run(build_prompt(Approximate(), vocab, 0, 1, 40))
    assert count == 40 and len(text.split()) == 39 and not vocab.exact


def test_schedules():
    arrivals = pa.array([2.0, 2.5, 4.0]).to_numpy()
    assert schedule(LoadConfig(time_scale=0.5), arrivals).tolist() == [0.0, 0.25, 1.0]
    assert schedule(LoadConfig(shape="constant", rate=4.0), arrivals).tolist() == [0.0, 0.25, 0.5]
    many = schedule(LoadConfig(shape="poisson", rate=20.0, seed=3), pa.array([0.0] * 100_000).to_numpy())
    assert many[0] == 0.0 and (many[1:] >= many[:-1]).all()
    assert many[-1] / (len(many) - 1) == pytest.approx(1 / 20.0, rel=0.02)
    again = schedule(LoadConfig(shape="poisson", rate=20.0, seed=3), pa.array([0.0] * 100_000).to_numpy())
    assert (many == again).all()


@pytest.mark.parametrize("kwargs, message", [
    ({"shape": "poisson"}, "needs --rate"),
    ({"shape": "closed"}, "needs --users"),
    ({"users": 3}, "--users goes with --shape closed"),
    ({"shape": "closed", "users": 2, "max_in_flight": 2}, "--max-in-flight goes with an open-loop shape"),
    ({"max_in_flight": 0}, "--max-in-flight must be >= 1"),
    ({"time_scale": 0}, "--time-scale must be > 0"),
    ({"duration_s": 0}, "--duration must be > 0"),  # (nothing would be sent)
    ({"duration_s": -1}, "--duration must be > 0"),
    ({"shape": "burst"}, "load shape must be one of"),
])
def test_load_config_errors(kwargs, message):
    with pytest.raises(ServelabError, match=message):
        LoadConfig(**kwargs)


def _records():
    done = Record(0, 7, scheduled_s=1.0, send_s=1.002, first_token_s=1.2, finish_s=1.4, end_s=1.41,
                  token_times=[1.2, 1.25, 1.4], usage_prompt_tokens=12, usage_completion_tokens=3,
                  finish_reason="length", saw_done=True, status="finished")
    failed = Record(1, 8, scheduled_s=2.0, send_s=2.001, first_token_s=2.1, end_s=2.3, token_times=[2.1, 2.3],
                    status="failed", reason="RemoteProtocolError: peer closed connection")
    cancelled = Record(2, 9, scheduled_s=3.0, send_s=3.0, end_s=3.5, status="cancelled", reason="interrupt")
    return [done, failed, cancelled]


def _trace():
    return pa.table({"request_id": [7, 8, 9], "arrival_s": [0.0, 1.0, 2.0], "prompt_tokens": [12, 20, 30],
                     "output_tokens": [3, 5, 6], "tenant": ["a", "b", "a"], "tier": ["standard"] * 3})


def test_requests_table_values():
    t = requests_table(_records(), _trace(), [0, 1, 2], [12, 20, 30]).to_pydict()
    assert t["status"] == ["finished", "failed", "cancelled"]
    assert t["arrival_s"] == [1.002, 2.001, 3.0]
    assert t["ttft_s"][:2] == pytest.approx([0.198, 0.099]) and t["ttft_s"][2] is None
    assert t["tpot_s"][0] == pytest.approx((1.4 - 1.2) / 2) and t["tpot_s"][1:] == [None, None]
    assert t["e2e_s"][0] == pytest.approx(0.398) and t["e2e_s"][1:] == [None, None]
    assert t["max_itl_s"][0] == pytest.approx(0.15) and t["max_itl_s"][1] == pytest.approx(0.2)
    assert t["output_tokens"] == [3, 5, 6] and t["generated_tokens"] == [3, 2, 0]
    assert t["prompt_tokens"] == [12, 20, 30] and t["finish_s"] == [1.4, None, None]
    assert t["send_lag_s"] == pytest.approx([0.002, 0.001, 0.0])
    assert t["usage_reported"] == [True, False, False] and t["tenant"] == ["a", "b", "a"]
    tok = tokens_table(_records()).to_pydict()
    assert tok["request_id"] == [7, 7, 7, 8, 8] and tok["token_index"] == [1, 2, 3, 1, 2]
    assert tok["itl_s"][0] is None and tok["itl_s"][1] == pytest.approx(0.05) and tok["itl_s"][3] is None


EXPOSITION = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 3.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.01",model_name="tiny"} 1.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="tiny"} 4.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="tiny"} 4.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="tiny"} 0.125
# HELP python_gc_objects_collected_total Objects collected during gc
# TYPE python_gc_objects_collected_total counter
python_gc_objects_collected_total{generation="0"} 7.0
"""


def test_parse_metrics_keeps_the_servers_families():
    from servelab.live.prometheus import parse_metrics

    rows = parse_metrics(EXPOSITION)
    assert rows == [
        ("vllm:num_requests_running", '{"engine": "0", "model_name": "tiny"}', 3.0),
        ("vllm:time_to_first_token_seconds_bucket", '{"engine": "0", "le": "0.01", "model_name": "tiny"}', 1.0),
        ("vllm:time_to_first_token_seconds_bucket", '{"engine": "0", "le": "+Inf", "model_name": "tiny"}', 4.0),
        ("vllm:time_to_first_token_seconds_count", '{"engine": "0", "model_name": "tiny"}', 4.0),
        ("vllm:time_to_first_token_seconds_sum", '{"engine": "0", "model_name": "tiny"}', 0.125),
    ]
    assert len(parse_metrics(EXPOSITION, prefixes=())) == 6  # python_gc_... too


def test_run_directory_reads_back(tmp_path, capsys):
    from servelab.live.prometheus import METRICS_SCHEMA, parse_metrics

    samples = [(t, *row) for t in (-0.01, 1.0) for row in parse_metrics(EXPOSITION)]
    metrics = pa.Table.from_pylist([dict(zip(METRICS_SCHEMA.names, r)) for r in samples], schema=METRICS_SCHEMA)
    run = LiveRun(_records(), [0, 1, 2], [12, 20, 30], {"kind": "live", "counts": {}}, metrics)
    out = write_live_run(run, _trace(), {"path": "t.arrow", "name": "t"}, tmp_path / "live", token_log=True)
    assert sorted(p.name for p in out.iterdir()) == ["metrics.parquet", "requests.parquet", "run.json",
                                                     "steps.parquet", "tokens.parquet", "trace.arrow"]
    sql = "SELECT run_id, time_s, value FROM server_metrics WHERE metric = 'vllm:num_requests_running' ORDER BY time_s"
    code, stdout, err = run_main(["query", out, "--read-only", "--format", "csv", sql], capsys)
    assert code == 0 and stdout.splitlines()[1:] == ['"live",-0.01,3', '"live",1,3'], err
    assert pq.read_metadata(out / "steps.parquet").num_rows == 0
    meta = json.loads((out / "run.json").read_text())
    assert meta["run_id"] == "live" and meta["trace"]["rows"] == 3
    text = report_text(out, None)
    assert "requests 3: 1 finished, 0 unfinished, 0 rejected, 0 throttled, 0 dropped, 1 failed, 0 timeout, " \
           "1 cancelled" in " ".join(text.split())


def test_bench_argument_errors(tmp_path, capsys):
    code, _, err = run_main(["bench", "localhost:8000", tmp_path / "t.arrow", "-o", tmp_path / "o"], capsys)
    assert code == 2 and "must start with http:// or https://" in err
    code, _, err = run_main(["bench", "http://127.0.0.1:9", tmp_path / "t.arrow", "-o", tmp_path / "o",
                             "--shape", "closed", "--model", "m"], capsys)  # fmt: skip
    assert code == 1 and err.strip() == "error: the closed load shape needs --users >= 1"
    assert not (tmp_path / "o").exists()


def test_bench_unreachable_server_fails_the_command(tmp_path, capsys):
    from helpers_cli import write_small_trace

    with socket.socket() as s:  # a loopback port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code, _, err = run_main(["bench", f"http://127.0.0.1:{port}", write_small_trace(tmp_path), "-o", tmp_path / "o",
                             "--model", "m"], capsys)  # fmt: skip
    assert code == 1 and err.splitlines()[-1].startswith(
        f"error: http://127.0.0.1:{port}: cannot reach the server (ClientConnectorError: Cannot connect to host")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("args, message", [
    (["--sweep-rates", "1,2", "--sweep-users", "2"], "give one of --sweep-rates and --sweep-users"),
    (["--sweep-users", "2,4"], "Invalid value for --sweep-users: goes with --shape closed"),
    (["--shape", "closed", "--users", "2", "--sweep-rates", "1"], "goes with an open-loop --shape"),
    (["--sweep-rates", "1,x"], "'x' is not a number"),
    (["--sweep-rates", "1,0"], "0 must be > 0"),
    (["--sweep-rates", "2,2.0"], "a level is repeated"),
])
def test_bench_sweep_argument_errors(tmp_path, capsys, args, message):
    code, _, err = run_main(["bench", "http://127.0.0.1:9", tmp_path / "t.arrow", "-o", tmp_path / "o", "--model", "m",
                             *args], capsys)  # fmt: skip
    assert code == 2 and message in err, err
    assert not (tmp_path / "o").exists()


def test_local_tokenizer_json_gives_exact_lengths(tmp_path):
    """A byte-level BPE trained here (with a BOS its post-processor adds) as a local tokenizer.json."""
    tokenizers = pytest.importorskip("tokenizers")
    from servelab.live.prompts import CANDIDATES
    from servelab.live.tokenize import LocalTokenizer
    from tokenizers import models, pre_tokenizers, processors, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    corpus = [" ".join(CANDIDATES[(i * 7) % len(CANDIDATES):] + CANDIDATES[:(i * 7) % len(CANDIDATES)])
              for i in range(200)]  # fmt: skip
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>"], show_progress=False))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))

    local = LocalTokenizer(path)
    vocab = asyncio.run(measure_vocabulary(local, exact=True))
    assert vocab.overhead == 1 and len(vocab.words) >= 20
    for length in (5, 33, 200):
        text, count = asyncio.run(build_prompt(local, vocab, 0, 3, length, [1, 2], 8))
        assert count == length == len(tok.encode(text).ids)
    with pytest.raises(RuntimeError, match="not a readable tokenizer.json"):
        LocalTokenizer(tmp_path / "t.arrow")
