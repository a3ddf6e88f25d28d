"""`servelab bench` against `servelab serve --time-scale K` records K (the server publishes it in
/v1/models), and report and compare say which clock the times are in: the client's wall-clock seconds,
K times fewer than the simulated seconds of the server's own metrics."""

from __future__ import annotations

import json

from helpers_cli import run_main, write_small_trace
from helpers_serve import serving

from servelab.replay.config import ReplayConfig

CONFIG = {"runner": "linear:base=0.03,decode_seq=0.001", "num_gpu_blocks": 2000, "max_num_seqs": 8}


def test_bench_records_the_servers_time_scale_and_report_and_compare_name_the_clock(tmp_path, capsys, free_port):
    trace, live, sim = write_small_trace(tmp_path, 4), tmp_path / "live", tmp_path / "sim"
    with serving(free_port, ReplayConfig.from_dict(CONFIG, source="test"), time_scale=10.0) as url:
        code, _, err = run_main(["bench", url, trace, "-o", live, "--no-report", "--extensions", "off",
                                 "--time-scale", "0.1"], capsys)  # fmt: skip
    assert code == 0, err
    assert json.loads((live / "run.json").read_text())["endpoint"]["server_time_scale"] == 10.0
    code, text, err = run_main(["report", str(live)], capsys)
    assert code == 0, err
    assert ("times are the client's wall-clock seconds; the server simulated 10 s per wall second (servelab serve "
            "--time-scale 10): multiply by 10 for simulated seconds, the unit of its metrics") in " ".join(text.split())
    code, _, err = run_main(["replay", trace, "-o", sim, "--no-report", "--runner", CONFIG["runner"],
                             "--num-gpu-blocks", "2000", "--max-num-seqs", "8"], capsys)  # fmt: skip
    assert code == 0, err
    code, text, err = run_main(["compare", str(live), str(sim)], capsys)
    assert code == 0, err
    assert ("times: live in the client's wall-clock seconds at server time scale 10 (x10 for simulated seconds); "
            "sim in simulated seconds") in " ".join(text.split())


def test_a_server_without_a_time_scale_records_none(tmp_path, capsys):
    from helpers_live_server import Reply, ServerThread, chunk, usage

    reply = Reply(pieces=[(0, chunk("a")), (0, chunk("b", "length")), (0, usage(2)), (0, b"data: [DONE]\n\n")])
    with ServerThread({}, default=reply) as srv:
        code, text, err = run_main(["bench", srv.url, write_small_trace(tmp_path, 2), "-o", tmp_path / "r",
                                    "--no-metrics", "--extensions", "off"], capsys)  # fmt: skip
    assert code == 0, err
    assert "server_time_scale" not in json.loads((tmp_path / "r" / "run.json").read_text())["endpoint"]
    assert "wall-clock" not in text
