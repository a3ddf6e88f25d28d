"""`servelab bench` and `servelab serve`'s own /tokenize agree: without `serve --tokenizer` the server's
counts are an approximation (characters / 4) that one more word does not always change, so bench
cannot size prompts with them and says so (not that the server has no /tokenize); with the same
tokenizer.json on the server, `--tokenizer server` gives exact lengths."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
from helpers_cli import run_main, write_small_trace
from helpers_live_server import Reply, ServerThread, chunk, usage
from helpers_serve import serving, train_tokenizer

ARGS = ["--no-metrics", "--no-report", "--extensions", "off", "--num-requests", "3"]


def test_tokenizer_server_against_an_approximate_serve_says_why(tmp_path, capsys, free_port):
    with serving(free_port) as url:
        code, _, err = run_main(["bench", url, write_small_trace(tmp_path, 3), "-o", tmp_path / "r",
                                 "--tokenizer", "server", *ARGS], capsys)  # fmt: skip
    last = err.strip().splitlines()[-1]
    assert code == 1
    assert "did not answer" not in last
    assert "/tokenize counts ' a' and ' a a' as 1 and 1 tokens" in last
    assert "servelab serve without --tokenizer" in last and "--tokenizer approximate" in last


def test_auto_against_an_approximate_serve_warns_with_the_true_reason(tmp_path, capsys, free_port):
    out = tmp_path / "r"
    with serving(free_port) as url:
        code, _, err = run_main(["bench", url, write_small_trace(tmp_path, 3), "-o", out, *ARGS], capsys)
    assert code == 0, err
    assert "has no /tokenize" not in err
    assert "prompt lengths approximate (real counts come from usage): " in err and "/tokenize counts ' a' and ' a a' as 1 and 1 tokens" in err
    assert json.loads((out / "run.json").read_text())["prompts"]["tokenizer"] == "approximate"


def test_tokenizer_server_against_serve_with_a_tokenizer_is_exact(tmp_path, capsys, free_port):
    pytest.importorskip("tokenizers")
    tokenizer = train_tokenizer(tmp_path / "tokenizer.json")
    out = tmp_path / "r"
    with serving(free_port, tokenizer=tokenizer) as url:
        code, _, err = run_main(["bench", url, write_small_trace(tmp_path, 3), "-o", out, "--tokenizer", "server",
                                 *ARGS], capsys)  # fmt: skip
    assert code == 0, err
    assert json.loads((out / "run.json").read_text())["prompts"]["tokenizer"] == "server"
    assert pq.read_table(out / "requests.parquet").column("prompt_tokens").to_pylist() == [50] * 3


def test_a_tokenize_answer_without_a_count_is_named_so(tmp_path, capsys):
    reply = Reply(pieces=[(0, chunk("a")), (0, chunk("b", "length")), (0, usage(2)), (0, b"data: [DONE]\n\n")])
    with ServerThread({}, default=reply, tokenize=lambda body: {"detail": "no"}) as srv:
        code, _, err = run_main(["bench", srv.url, write_small_trace(tmp_path, 3), "-o", tmp_path / "r",
                                 "--tokenizer", "server", *ARGS], capsys)  # fmt: skip
    assert code == 1 and "/tokenize answered without a token count" in err.strip().splitlines()[-1]
