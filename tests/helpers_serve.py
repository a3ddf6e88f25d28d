"""A real `servelab serve` application on a free local port, run in a thread with its own event loop."""

from __future__ import annotations

import asyncio
import threading
from contextlib import contextmanager

from aiohttp import web

from servelab.replay.config import ReplayConfig
from servelab.serve.app import make_app
from servelab.serve.prompts import PromptCounter
from servelab.serve.sim import Simulation


@contextmanager
def serving(port: int, config: ReplayConfig | None = None, time_scale: float = 1.0, model: str = "sim",
            tokenizer: str | None = None):
    """Yield the base URL of a server for ``config`` (default: one roofline replica) until the block ends."""
    config = config or ReplayConfig.from_dict({}, source="test")
    sim = Simulation(config, time_scale)
    app = make_app(sim, model, PromptCounter(tokenizer))
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app, handler_cancellation=True)
    ready = threading.Event()

    def run() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(runner.setup())
        loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
        ready.set()
        loop.run_forever()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert ready.wait(30), "the server did not start"
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
        loop.close()


def train_tokenizer(path) -> str:
    """A small byte-level BPE (with a BOS its post-processor adds) saved as ``path``: the same exact
    prompt lengths for the client (`bench --tokenizer`) and the server (`serve --tokenizer`)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

    from servelab.live.prompts import CANDIDATES

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    corpus = [" ".join(CANDIDATES[(i * 7) % len(CANDIDATES):] + CANDIDATES[:(i * 7) % len(CANDIDATES)])
              for i in range(200)]  # fmt: skip
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>"], show_progress=False))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tok.save(str(path))
    return str(path)


@contextmanager
def serving_process(port: int, args: list[str], timeout_s: float = 60.0, launcher: list[str] | None = None):
    """Yield the base URL of a `servelab serve` subprocess (its own process, as a user runs it) until the block
    ends; ``launcher``: what runs instead of ``-m servelab serve`` (bench/serve_stages.py's stamped server)."""
    import subprocess
    import sys
    import time
    import urllib.request

    launcher = ["-m", "servelab", "serve"] if launcher is None else launcher
    proc = subprocess.Popen([sys.executable, *launcher, "--port", str(port), *map(str, args)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                with urllib.request.urlopen(url + "/health", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                if proc.poll() is not None:
                    raise RuntimeError(f"servelab serve exited: {proc.stderr.read()}") from None
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def guidellm_venv():
    """GuideLLM's own venv (.ci/guidellm.sh: $SERVELAB_TEST_GUIDELLM_VENV, else .guidellm-venv in the
    checkout), or None when GuideLLM is not installed there; with SERVELAB_TEST_REQUIRE_GUIDELLM=1 (as in
    CI) its absence fails the calling test instead of skipping it."""
    import os
    from pathlib import Path

    import pytest

    venv = Path(os.environ.get("SERVELAB_TEST_GUIDELLM_VENV") or Path(__file__).resolve().parents[1] / ".guidellm-venv")
    if (venv / "bin" / "guidellm").is_file():
        return venv
    if os.environ.get("SERVELAB_TEST_REQUIRE_GUIDELLM") == "1":
        pytest.fail(f"SERVELAB_TEST_REQUIRE_GUIDELLM=1 but {venv}/bin/guidellm is missing (source .ci/guidellm.sh)",
                    pytrace=False)
    pytest.skip("GuideLLM not installed (source .ci/guidellm.sh)")


def guidellm_tokenizer(venv, tokenizer_json, out_dir) -> str:
    """``tokenizer_json`` saved as a Hugging Face tokenizer directory (tokenizer.json + tokenizer_config.json,
    by ``transformers`` in GuideLLM's venv), the "processor" GuideLLM's synthetic prompts need, so it
    downloads nothing; its decoder turns sampled ids back into plain text (GuideLLM sends decoded prompts)."""
    import subprocess

    script = ("import sys\n"
              "from tokenizers import Tokenizer, decoders\n"
              "from transformers import PreTrainedTokenizerFast\n"
              "tok = Tokenizer.from_file(sys.argv[1])\n"
              "tok.decoder = decoders.ByteLevel()\n"
              "PreTrainedTokenizerFast(tokenizer_object=tok, bos_token='<s>').save_pretrained(sys.argv[2])\n")
    proc = subprocess.run([str(venv / "bin" / "python"), "-c", script, str(tokenizer_json), str(out_dir)],
                          capture_output=True, text=True, timeout=300, check=False)
    if proc.returncode:
        raise RuntimeError(f"saving the tokenizer for GuideLLM failed: {proc.stderr[-3000:]}")
    return str(out_dir)
