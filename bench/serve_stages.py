"""Where a request's wall time goes between `servelab bench` and `servelab serve`, stage by stage.

Runs bench/bench_serve.py's trace against a `servelab serve` process whose handler, tokenizer, engine
clock and writes are wrapped to stamp ``time.perf_counter()`` (CLOCK_MONOTONIC, so the two processes'
stamps compare), and the live client with the same stamps (aiohttp's trace hooks, every read of the
body). Prints each stage's mean and median in wall milliseconds, and the client's and the engine's
TTFT against the replay's. Diagnosis only: the wrappers cost a few microseconds each.

    python bench/serve_stages.py --scale 10 --rate 2 --prompt uniform:200:600 [--loop auto] [--n 40] [--warmup N]

SERVE_STAGES_PROFILE=FILE also writes a cProfile of the server process to FILE.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
now = time.perf_counter


def _digest(prompt) -> str:  # (hash() differs between processes)
    import hashlib

    return hashlib.sha1(str(prompt).encode()).hexdigest()


_alive: list = []  # every stamped task stays referenced, so no id() is reused


def _key() -> int:
    task = asyncio.current_task()
    if not _alive or _alive[-1] is not task:
        _alive.append(task)
    return id(task)


def server_child(out: str, argv: list[str]) -> None:
    """Run `servelab serve ARGV` with stamps; write them to ``out`` (JSON) at exit."""
    import atexit

    from aiohttp import web, web_protocol

    import servelab.serve.app as app_mod
    from servelab.serve.prompts import PromptCounter
    from servelab.serve.sim import Simulation

    stamps: dict[int, dict] = {}
    rx: dict[int, float] = {}  # protocol -> when its last request's head came
    pieces: dict[int, int] = {}  # protocol -> reads (data_received calls) since its last request began
    by_req: dict[int, int] = {}

    def rec(key: int, name: str, t: float | None = None) -> None:
        stamps.setdefault(key, {}).setdefault(name, now() if t is None else t)

    received = web_protocol.RequestHandler.data_received

    def data_received(self, data):
        if data[:4] in (b"POST", b"GET "):  # a request's head (a body's bytes may come after its handler began)
            rx[id(self)] = now()
        pieces[id(self)] = pieces.get(id(self), 0) + 1
        return received(self, data)

    web_protocol.RequestHandler.data_received = data_received

    serve = app_mod._serve

    cpu: dict[str, float] = {}

    async def _serve(request, chat):
        cpu.setdefault("first", time.process_time())
        t = now()
        key = _key()
        rec(key, "handler", t)
        rec(key, "server_rx", rx.pop(id(request.protocol), t))
        stamps[key]["reads"] = pieces.pop(id(request.protocol), 0)
        return await serve(request, chat)

    app_mod._serve = _serve

    body = app_mod._body

    async def _body(request):
        key = _key()
        rec(key, "body_start")
        out_ = await body(request)
        rec(key, "body_done")
        stamps[key]["prompt"] = _digest(out_.get("prompt"))
        return out_

    app_mod._body = _body

    # the loop's side of counting: count_off_loop where the server has it (the count itself runs in a thread)
    name = "count_off_loop" if hasattr(PromptCounter, "count_off_loop") else "count"
    count = getattr(PromptCounter, name)

    if name == "count":
        def counted(self, text):
            key = _key()
            rec(key, "tok_start")
            n = count(self, text)
            rec(key, "tok_done")
            return n
    else:
        async def counted(self, text):
            key = _key()
            rec(key, "tok_start")
            n = await count(self, text)
            rec(key, "tok_done")
            return n

    setattr(PromptCounter, name, counted)

    submit = Simulation.submit

    def submitted(self, prompt_tokens, max_tokens, received_s):
        key = _key()
        rec(key, "submit")
        rec(key, "received", self.wall_of(received_s))
        req, queue = submit(self, prompt_tokens, max_tokens, received_s)
        by_req[id(req)] = key
        stamps[key]["arrival_sim"] = req.arrival_s
        return req, queue

    Simulation.submit = submitted

    sink = Simulation._sink

    def sunk(self, req, times, ended):
        key = by_req.get(id(req))
        if key is not None and times and "release" not in stamps[key]:
            rec(key, "release")
            rec(key, "due", self.wall_of(times[0]))
            stamps[key]["first_sim"] = times[0]
        return sink(self, req, times, ended)

    Simulation._sink = sunk
    tick = Simulation._tick

    def ticked(self):
        start = now()
        released = [k for k, v in stamps.items() if "release" in v and "tick_end" not in v]
        tick(self)
        for k, v in stamps.items():
            if "release" in v and "tick_end" not in v and k not in released:
                v["tick_start"], v["tick_end"] = start, now()

    Simulation._tick = ticked

    prepare = web.StreamResponse.prepare

    async def prepared(self, request):
        rec(_key(), "prepare")
        return await prepare(self, request)

    web.StreamResponse.prepare = prepared

    write = web.StreamResponse.write
    writes: list[float] = []  # every write's start

    async def written(self, data):
        writes.append(now())
        key = _key()
        first = "write_done" not in stamps.get(key, {}) and b'"text":" token"' in data  # (not a chat's role chunk)
        if first:
            rec(key, "write_start")
        result = await write(self, data)
        cpu["last"] = time.process_time()
        if first:
            rec(key, "write_done")
        return result

    web.StreamResponse.write = written

    def dump() -> None:
        Path(out).write_text(json.dumps({"offset": now() - time.monotonic(), "cpu_s": cpu.get("last", 0) - cpu.get("first", 0),
                                         "stamps": [{k: v for k, v in s.items()} for s in stamps.values()], "writes": writes}))

    atexit.register(dump)
    if os.environ.get("SERVE_STAGES_PROFILE"):  # cProfile of the server, written beside the stamps
        import cProfile

        profile = cProfile.Profile()
        profile.enable()
        atexit.register(lambda: (profile.disable(), profile.dump_stats(os.environ["SERVE_STAGES_PROFILE"])))
    from servelab.cli.main import main

    main(["serve", *argv])


def client_patches(stamps: dict[int, dict], cpu: dict[str, float]) -> None:
    """Stamp the live client's sends (aiohttp's trace hooks and the body's reads); ``cpu["sending_s"]``:
    the client's CPU time while it sent the run (prompt building and warm-up left out)."""
    import aiohttp

    import servelab.live.backend as backend_mod

    def rec(name: str) -> None:
        stamps.setdefault(_key(), {}).setdefault(name, now())

    trace = aiohttp.TraceConfig()

    def hook(name):
        async def on(session, ctx, params):
            rec(name)
        return on

    trace.on_request_start.append(hook("c_request_start"))
    trace.on_connection_create_start.append(hook("c_new_connection"))
    trace.on_connection_reuseconn.append(hook("c_reused"))
    trace.on_request_headers_sent.append(hook("c_headers_sent"))
    trace.on_request_chunk_sent.append(hook("c_body_sent"))
    trace.on_request_end.append(hook("c_response_headers"))
    session = aiohttp.ClientSession

    def traced_session(*args, **kwargs):
        kwargs.setdefault("trace_configs", [trace])
        return session(*args, **kwargs)

    aiohttp.ClientSession = traced_session
    readany = aiohttp.StreamReader.readany

    async def stamped_readany(self):  # what the client's body reads go through
        data = await readany(self)
        rec("c_rx")
        return data

    aiohttp.StreamReader.readany = stamped_readany
    send = backend_mod.send

    async def sent(http, target, record, prompt, max_tokens, clock):
        s = stamps.setdefault(_key(), {})
        s["offset"] = now() - clock()
        s["record"] = record
        s["prompt"] = _digest(prompt)
        return await send(http, target, record, prompt, max_tokens, clock)

    backend_mod.send = sent
    import servelab.live.bench as bench_mod

    drive = bench_mod._drive

    async def driven(*args):
        cpu0 = time.process_time()
        try:
            return await drive(*args)
        finally:
            cpu["sending_s"] = time.process_time() - cpu0

    bench_mod._drive = driven


STAGES = [  # (label, from, to): wall ms between two stamps of the same request
    ("client: send -> aiohttp request start", "c_send", "c_request_start"),
    ("client: request start -> headers written", "c_request_start", "c_headers_sent"),
    ("client: headers -> body written", "c_headers_sent", "c_body_sent"),
    ("loopback: headers written -> server's first bytes", "c_headers_sent", "server_rx"),
    ("server: first bytes -> handler start (receipt)", "server_rx", "handler"),
    ("server: handler -> body parsed (JSON)", "handler", "body_done"),
    ("server: body parsed -> tokenised", "body_done", "tok_done"),
    ("server: tokenised -> submitted", "tok_done", "submit"),
    ("engine: receipt -> first token due (engine TTFT)", "received", "due"),
    ("clock: due -> timer fired", "due", "tick_start"),
    ("clock: timer fired -> released", "tick_start", "release"),
    ("clock: released -> engine advanced (tick ends)", "release", "tick_end"),
    ("server: tick ends -> handler writes the token", "tick_end", "write_start"),
    ("(clock: due -> released)", "due", "release"),
    ("(server: released -> handler writes the token)", "release", "write_start"),
    ("server: first token's write", "write_start", "write_done"),
    ("loopback: written -> client's first bytes", "write_done", "c_rx"),
    ("client: first bytes -> token parsed", "c_rx", "c_first"),
    ("client: response headers -> first bytes", "c_response_headers", "c_rx"),
]


def main() -> None:
    sys.path.insert(0, str(HERE))
    import bench_serve
    from helpers_serve import serving_process, train_tokenizer

    from servelab.assembly import replay
    from servelab.common.loops import run as run_on
    from servelab.live.bench import LiveOptions, run_live
    from servelab.live.client import Target
    from servelab.live.load import LoadConfig

    parser = argparse.ArgumentParser()
    parser.add_argument("--scale", type=float, default=10.0)
    parser.add_argument("--n", type=int, default=40)
    parser.add_argument("--rate", type=float, default=2.0)
    parser.add_argument("--prompt", default="uniform:200:600")
    parser.add_argument("--output", default="uniform:8:24")
    parser.add_argument("--loop", default="auto")
    parser.add_argument("--warmup", type=int, default=0, help="requests sent at once and awaited first")
    args = parser.parse_args()
    tokenizer = train_tokenizer(Path(tempfile.mkdtemp()) / "tokenizer.json")
    table = bench_serve.trace(args.n, args.rate, args.prompt, args.output)
    replay_ttft = replay(table, bench_serve.config()).requests.column("ttft_s").to_pylist()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = Path(tempfile.mkdtemp()) / "server.json"
    serve_args = ["--runner", bench_serve.RUNNER, "--num-gpu-blocks", str(bench_serve.NUM_GPU_BLOCKS),
                  "--time-scale", str(args.scale), "--tokenizer", tokenizer, "--served-model-name", "sim",
                  "--loop", args.loop]
    client: dict[int, dict] = {}
    client_cpu: dict[str, float] = {}
    client_patches(client, client_cpu)
    load = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    child = [str(Path(__file__).resolve()), "--child", str(out), "--"]
    with serving_process(port, serve_args, launcher=child) as url:
        target = Target(url, "sim", timeout_s=120.0, ignore_eos=True, min_tokens=True)
        run = run_on(run_live(table, target, LoadConfig(time_scale=1.0 / args.scale, warmup=args.warmup),
                              LiveOptions(metrics=False, tokenizer=tokenizer, extensions="off")), args.loop)
    for _ in range(100):
        if out.exists():
            break
        time.sleep(0.1)
    server = json.loads(out.read_text())
    by_prompt = {s["prompt"]: s for s in server["stamps"] if "prompt" in s}
    rows = []
    for c in client.values():
        r = c.get("record")
        if r is None or r.status != "finished" or r.scheduled_s is None or c["prompt"] not in by_prompt:
            continue
        s = by_prompt[c["prompt"]]
        row = {k: v for k, v in c.items() if k.startswith("c_")}
        row["c_send"] = r.send_s + c["offset"]
        row["c_first"] = r.first_token_s + c["offset"]
        row.update({k: v - server["offset"] if k not in ("prompt", "arrival_sim", "first_sim") and isinstance(v, float)
                    else v for k, v in s.items()})
        row["replay_ttft"] = replay_ttft[r.index]
        row["new_conn"] = "c_new_connection" in c
        row["reads"] = s.get("reads", 0)
        rows.append(row)
    print(f"{len(rows)} of {len(run.records)} requests matched; x{args.scale:g}, {args.loop} loop, "
          f"prompts {args.prompt}, {args.rate}/s; load {load}; offsets perf-mono client/server "
          f"{server['offset'] * 1e6:.0f} us; new connections {sum(r['new_conn'] for r in rows)}; server reads per request "
          f"before its handler {statistics.fmean(r['reads'] for r in rows):.2f}")
    for label, a, b in STAGES:
        d = [(r[b] - r[a]) * 1e3 for r in rows if a in r and b in r]
        if d:
            print(f"  {label:52s} mean {statistics.fmean(d):7.3f}  p50 {statistics.median(d):7.3f}  "
                  f"max {max(d):7.3f} ms  (n={len(d)})")
    over = [((r["c_first"] - r["c_send"]) - (r["due"] - r["received"])) * 1e3 for r in rows]
    for new in (True, False):
        part = [((r["received"] - r["c_send"]) * 1e3, (r["c_first"] - r["due"]) * 1e3) for r in rows if r["new_conn"] == new]
        if part:
            print(f"  {'new' if new else 'reused'} connections ({len(part)}): send -> receipt mean "
                  f"{statistics.fmean(p[0] for p in part):.3f} p50 {statistics.median(p[0] for p in part):.3f} ms; "
                  f"due -> client parsed mean {statistics.fmean(p[1] for p in part):.3f} ms")
    before = [(r["received"] - r["c_send"]) * 1e3 for r in rows]
    after = [(r["c_first"] - r["due"]) * 1e3 for r in rows]
    print(f"  client TTFT - engine TTFT (wall):  mean {statistics.fmean(over):.3f} ms = send -> receipt "
          f"{statistics.fmean(before):.3f} + due -> client parsed {statistics.fmean(after):.3f}")
    rt = statistics.fmean(replay_ttft[r.index] for r in run.records if r.status == "finished")
    ct = statistics.fmean((r["c_first"] - r["c_send"]) * args.scale for r in rows)
    et = statistics.fmean(r["first_sim"] - r["arrival_sim"] for r in rows)
    st = statistics.fmean((r["due"] - r["received"]) * args.scale for r in rows)
    diff = [(r["first_sim"] - r["arrival_sim"] - r["replay_ttft"]) * 1e3 for r in rows]
    print(f"  engine TTFT - replay TTFT per request (simulated ms): {sum(d > 5 for d in diff)} later by > 5 ms "
          f"(mean {statistics.fmean([d for d in diff if d > 5] or [0]):.1f}), {sum(d < -5 for d in diff)} earlier "
          f"(mean {statistics.fmean([d for d in diff if d < -5] or [0]):.1f}), the rest within 5 ms; "
          f"the client's send lag (scheduled -> sent) mean "
          f"{statistics.fmean((r['record'].send_s - r['record'].scheduled_s) for r in client.values() if 'record' in r and r['record'].scheduled_s is not None) * 1e3:.3f} ms")
    import bisect

    starts = [w - server["offset"] for w in server["writes"]]
    ahead = [bisect.bisect_left(starts, r["write_start"]) - bisect.bisect_right(starts, r["tick_end"])
             for r in rows if "tick_end" in r and "write_start" in r]
    print(f"  other streams' writes between the tick's end and the first token's write: mean "
          f"{statistics.fmean(ahead):.1f}, max {max(ahead)}")
    tokens = sum(len(r.token_times) for r in run.records)
    print(f"  CPU: client {client_cpu['sending_s'] * 1e3:.0f} ms sending ({client_cpu['sending_s'] / tokens * 1e6:.0f} us a token); server "
          f"{server['cpu_s'] * 1e3:.0f} ms ({server['cpu_s'] / tokens * 1e6:.0f} us a token) from its first request to "
          f"its last write; {tokens} tokens")
    print(f"  mean TTFT (simulated ms): replay {rt * 1e3:.1f}; client {ct * 1e3:.1f} ({(ct / rt - 1) * 100:+.1f}%); "
          f"engine from arrival {et * 1e3:.1f} ({(et / rt - 1) * 100:+.1f}%); from receipt {st * 1e3:.1f} "
          f"({(st / rt - 1) * 100:+.1f}%)")


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        server_child(sys.argv[2], sys.argv[4:])
    else:
        main()
