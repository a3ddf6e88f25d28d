"""Issue #26: results a user can trust at first sight (a run keeps its SLO, overload is flagged,
SLO units, vLLM-style booleans, cluster labels, report header and units, progress bar)."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from conftest import make_trace
from helpers_cli import run_main
from helpers_search import grid_spec, write_trace_file
from servelab.traces.io import write_trace


def _trace(folder: Path, n: int, gap_s: float, prompt: int = 200, output: int = 20, name: str = "t.arrow") -> Path:
    path = Path(folder) / name
    write_trace(make_trace([i * gap_s for i in range(n)], [prompt] * n, [output] * n), path, source="test")
    return path


def _ok(argv, capsys) -> tuple[str, str]:
    code, out, err = run_main(argv, capsys)
    assert code == 0, err
    return out, err


# --- 1. a run keeps the SLO it was judged by -------------------------------------------------


def test_a_replays_slo_survives_into_a_later_report_query_and_compare(tmp_path, capsys):
    trace = _trace(tmp_path, 40, 0.01, prompt=2000)
    run = tmp_path / "r"
    out, _ = _ok(["replay", trace, "-o", run, "--slo", "ttft=50ms"], capsys)
    judged = next(line for line in out.splitlines() if line.startswith("overall"))
    assert json.loads((run / "run.json").read_text())["slo"] == {"ttft_s": 0.05}
    later, _ = _ok(["report", run], capsys)
    assert "SLO: global: ttft_s=0.05 (the SLO recorded in run.json)" in later
    assert next(line for line in later.splitlines() if line.startswith("overall")) == judged
    assert "100.0%" not in judged  # the SLO matters here: the share finished would be 100%
    out, err = _ok(["query", run, "SELECT attainment FROM slo_attainment WHERE scope = 'overall'", "--format", "json"],
                   capsys)
    assert json.loads(out)[0]["attainment"] < 1.0
    assert "scoring with the SLO recorded in run.json (global: ttft_s=0.05)" in err
    given, _ = _ok(["report", run, "--slo", "ttft=10s"], capsys)  # told otherwise: the flags win, and it says so
    assert "SLO: global: ttft_s=10 (given with --slo/--slo-file)" in given


def test_a_replays_report_names_the_config_file_its_slo_came_from(tmp_path, capsys, monkeypatch):
    """An SLO from a --config file's [slo] table is not "given with --slo": the header names the file, and
    --slo over it says both."""
    monkeypatch.chdir(tmp_path)  # a short file name: the header line is not wrapped
    trace = _trace(tmp_path, 10, 0.05)
    config = Path("cfgslo.toml")
    config.write_text("[slo]\nttft_s = 0.4\n")
    out, _ = _ok(["replay", trace, "--config", config], capsys)
    assert f"SLO: global: ttft_s=0.4 (the [slo] table in {config})" in out
    out, _ = _ok(["replay", trace, "--config", config, "--slo", "tpot=50ms"], capsys)
    assert f"SLO: global: ttft_s=0.4, tpot_s=0.05 (given with --slo over the [slo] table in {config})" in out
    out, _ = _ok(["replay", trace, "--slo", "ttft=1s"], capsys)
    assert "SLO: global: ttft_s=1 (given with --slo/--slo-file)" in out


def test_compare_of_runs_with_different_recorded_slos_says_which_it_used(tmp_path, capsys):
    trace = _trace(tmp_path, 20, 0.05)
    _ok(["replay", trace, "-o", tmp_path / "a", "--slo", "ttft=50ms", "--no-report"], capsys)
    _ok(["replay", trace, "-o", tmp_path / "b", "--slo", "ttft=1s", "--no-report"], capsys)
    _, err = _ok(["compare", tmp_path / "a", tmp_path / "b"], capsys)
    assert ("scoring with the SLO recorded in run.json of a, not the other SLOs recorded by b (global: ttft_s=0.05); "
            "--slo or --slo-file replaces it") in err


def test_compare_names_what_differs_between_the_runs(tmp_path, capsys):
    """A delta alone cannot say whether the policy or the GPU made it: compare names the settings the
    runs differ in (the report header's first, then the engine's), or says they share them all."""
    trace = _trace(tmp_path, 20, 0.05)
    _ok(["replay", trace, "-o", tmp_path / "a", "--no-report"], capsys)
    _ok(["replay", trace, "-o", tmp_path / "b", "--no-report", "--runner", "roofline:model=qwen3-8b,gpu=l40s",
         "--max-num-seqs", 8], capsys)
    _ok(["replay", trace, "-o", tmp_path / "c", "--no-report"], capsys)
    out, _ = _ok(["compare", tmp_path / "a", tmp_path / "b"], capsys)
    first = out.splitlines()[0]
    assert first.startswith("runs differ in: model (a llama-3.1-8b, b qwen3-8b); gpu (a h100-80gb, b l40s); runner (")
    assert "max_num_seqs (a 256, b 8)" in first
    out, _ = _ok(["compare", tmp_path / "a", tmp_path / "c"], capsys)
    assert out.splitlines()[0].startswith("runs differ in: no recorded setting")
    out, err = _ok(["compare", tmp_path / "a", tmp_path / "b", "--format", "json"], capsys)
    assert json.loads(out) and "runs differ in: model" in err  # machine formats keep stdout for the data


def test_a_search_trials_report_shows_the_studys_slo(tmp_path, capsys):
    write_trace_file(tmp_path)
    spec = grid_spec(tmp_path, n_trials=2)
    _ok(["search", spec, "-o", tmp_path / "s", "--no-progress"], capsys)
    trials = pq.read_table(tmp_path / "s" / "trials.parquet").to_pylist()
    trial = tmp_path / "s" / "trials" / "0000"
    out, _ = _ok(["report", trial, "--format", "json"], capsys)
    data = json.loads(out)[0]
    assert data["slo_source"] == "the SLO recorded in run.json"
    overall = next(r for r in data["attainment"] if r["scope"] == "overall")
    assert overall["attainment"] == pytest.approx(trials[0]["attainment"])
    assert overall["attainment"] < overall["finished"] / overall["requests"]  # not the share finished


# --- 2. overload is not reported as success ---------------------------------------------------


def test_an_overloaded_run_without_slo_says_it_is_overloaded(tmp_path, capsys):
    trace = _trace(tmp_path, 1500, 0.0025, prompt=500, output=100)  # 400 req/s to one replica
    out, _ = _ok(["replay", trace, "-o", tmp_path / "r"], capsys)
    assert "OVERLOADED: offered 400.0 req/s but served" in out
    assert "the queue grew" in out
    assert "joint" not in out and "SLO attainment" not in out  # the share finished is not shown as attainment
    assert "finished %" in out
    data = json.loads(_ok(["report", tmp_path / "r", "--format", "json"], capsys)[0])[0]
    assert data["overload"]["overloaded"] is True


def test_a_run_within_capacity_is_not_called_overloaded(tmp_path, capsys):
    trace = _trace(tmp_path, 300, 0.1, prompt=500, output=100)  # 10 req/s
    out, _ = _ok(["replay", trace, "--slo", "ttft=200ms"], capsys)
    assert "OVERLOADED" not in out
    assert "SLO attainment (joint and per SLO) and goodput" in out


# --- 5. SLO units -----------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["replay", "report", "query", "compare", "sweep"])
def test_a_bare_implausible_slo_is_refused_by_every_command(tmp_path, capsys, command):
    trace = _trace(tmp_path, 10, 0.1)
    _ok(["replay", trace, "-o", tmp_path / "r", "--no-report"], capsys)
    _ok(["replay", trace, "-o", tmp_path / "q", "--no-report"], capsys)
    argv = {"replay": ["replay", trace], "report": ["report", tmp_path / "r"],
            "query": ["query", tmp_path / "r", "SELECT 1"], "compare": ["compare", tmp_path / "r", tmp_path / "q"],
            "sweep": ["sweep", trace, "--rates", "1", "-o", tmp_path / "sw"]}[command]
    code, _, err = run_main([*argv, "--slo", "ttft=500"], capsys)
    assert code == 1
    assert "a bare 500 is read as seconds, which is implausible for ttft; write ttft=500ms" in err
    assert not (tmp_path / "sw").exists()


def test_slo_times_take_units_on_the_command_line_and_in_toml(tmp_path, capsys):
    from servelab.common.errors import ServelabError
    from servelab.scoring.slo import SloTable

    assert SloTable.parse_cli(["ttft=500ms,tpot=0.05s,e2e=30"]).global_.ttft_s == pytest.approx(0.5)
    assert SloTable.parse_cli(["ttft=500s"]).global_.ttft_s == 500.0  # a unit says it is meant
    assert SloTable.from_toml({"ttft": "500ms", "tpot_s": 0.05}).global_.ttft_s == pytest.approx(0.5)
    assert SloTable.from_toml({"ttft_s": 90}).global_.ttft_s == 90.0  # the key names its unit
    with pytest.raises(ServelabError, match="implausible for tpot"):
        SloTable.from_toml({"tier": {"gold": {"tpot": 50}}}, "spec.toml")
    with pytest.raises(ServelabError, match="implausible for tpot"):
        SloTable.parse_cli(["tier=gold:tpot=50"])


def test_a_search_spec_with_a_bare_implausible_slo_is_refused(tmp_path, capsys):
    write_trace_file(tmp_path)
    spec = grid_spec(tmp_path, n_trials=1)
    spec.write_text(spec.read_text().replace("[slo]\n", "[slo]\ne2e = 5000\n"))
    code, _, err = run_main(["search", spec, "-o", tmp_path / "s", "--no-progress"], capsys)
    assert code == 1 and "implausible for e2e" in err


# --- 6. booleans are vLLM's --x/--no-x; vllm-v1 names the default policy ---------------------


def test_no_enable_prefix_caching_works_and_the_old_value_form_is_deprecated(tmp_path, capsys):
    trace = _trace(tmp_path, 10, 0.1)
    _ok(["replay", trace, "-o", tmp_path / "off", "--no-enable-prefix-caching", "--no-report"], capsys)
    assert json.loads((tmp_path / "off" / "run.json").read_text())["engine"]["enable_prefix_caching"] is False
    _ok(["replay", trace, "-o", tmp_path / "on", "--enable-prefix-caching", "--no-journal", "--retry-after",
         "--no-report"], capsys)
    engine = json.loads((tmp_path / "on" / "run.json").read_text())["engine"]
    assert (engine["enable_prefix_caching"], engine["journal"], engine["retry_after"]) == (True, False, True)
    _, err = _ok(["replay", trace, "-o", tmp_path / "old", "--journal", "off", "--no-report"], capsys)
    assert "'--journal off' is deprecated; write --no-journal" in err
    assert json.loads((tmp_path / "old" / "run.json").read_text())["engine"]["journal"] is False


def test_a_config_files_boolean_holds_unless_a_flag_is_given(tmp_path, capsys):
    trace = _trace(tmp_path, 10, 0.1)
    config = tmp_path / "c.toml"
    config.write_text("enable_prefix_caching = false\n")
    _ok(["replay", trace, "--config", config, "-o", tmp_path / "a", "--no-report"], capsys)
    assert json.loads((tmp_path / "a" / "run.json").read_text())["engine"]["enable_prefix_caching"] is False
    _ok(["replay", trace, "--config", config, "-o", tmp_path / "b", "--enable-prefix-caching", "--no-report"], capsys)
    assert json.loads((tmp_path / "b" / "run.json").read_text())["engine"]["enable_prefix_caching"] is True


def test_every_boolean_of_every_command_has_a_no_form():
    import click

    from servelab.cli.main import cli

    def walk(command, path):
        yield path, command
        if isinstance(command, click.Group):
            ctx = click.Context(command)
            for name in command.list_commands(ctx):
                yield from walk(command.get_command(ctx, name), f"{path} {name}")

    seen = 0
    for path, command in walk(cli, "servelab"):
        for param in command.params:
            if isinstance(param, click.Option) and param.is_flag and param.name not in ("help", "version"):
                seen += 1
                assert param.secondary_opts, f"{path} {param.opts[0]} has no --no- form"
    assert seen >= 20  # the walk reached the sub-commands' flags, not only the group's


def test_vllm_v1_names_the_default_policy(tmp_path, capsys):
    trace = _trace(tmp_path, 20, 0.05)
    _ok(["replay", trace, "-o", tmp_path / "a", "--policy", "vllm-v1", "--no-report"], capsys)
    _ok(["replay", trace, "-o", tmp_path / "b", "--policy", "sarathi", "--no-report"], capsys)
    assert pq.read_table(tmp_path / "a" / "requests.parquet").equals(pq.read_table(tmp_path / "b" / "requests.parquet"))
    out, _ = _ok(["policies"], capsys)
    assert "also named: vllm-v1" in out


# --- 7. clusters are counted and labelled per pool ---------------------------------------------

PD_CLUSTER = """
[[cluster.pools]]
name = "prefill"
role = "prefill"
replicas = 1

[[cluster.pools]]
name = "decode"
role = "decode"
replicas = 2

[[cluster.links]]
from = "prefill"
to = "decode"
bandwidth_gbps = 50.0
"""


def test_a_pd_clusters_progress_line_and_report_count_every_pool(tmp_path, capsys):
    trace = _trace(tmp_path, 60, 0.05)
    config = tmp_path / "pd.toml"
    config.write_text(PD_CLUSTER)
    out, err = _ok(["replay", trace, "--config", config, "-o", tmp_path / "r"], capsys)
    assert "pool prefill (prefill): 1 replica; pool decode (decode): 2 replicas; 3 replicas in all" in err
    assert "1 replica(s)" not in err
    assert "replicas 3, GPUs 3" in out
    assert "pool prefill (prefill): 1 replica, model llama-3.1-8b  GPU h100-80gb  TP 1" in out
    assert "pool decode (decode): 2 replicas" in out
    balance = next(line for line in out.splitlines() if line.startswith("replica balance"))
    assert balance.startswith("replica balance per pool: decode 2 replicas, requests ")  # prefill has one: no balance
    assert "3 replicas" not in balance


def test_the_report_header_names_model_gpu_tp_and_policy(tmp_path, capsys):
    trace = _trace(tmp_path, 10, 0.1)
    out, _ = _ok(["replay", trace, "--tp", "2", "--model", "llama-3.1-70b", "--policy", "vllm-v0"], capsys)
    assert "model llama-3.1-70b  GPU h100-80gb  TP 2  policy vllm-v0  runner roofline  replicas 1, GPUs 2" in out


# --- 10. one unit per metric; compare without six-digit noise -----------------------------------


def test_latencies_are_ms_in_report_compare_and_sweep(tmp_path, capsys):
    trace = _trace(tmp_path, 30, 0.05)
    out, _ = _ok(["replay", trace, "-o", tmp_path / "a"], capsys)
    wait = next(line for line in out.splitlines() if line.startswith("longest wait"))
    assert wait.endswith(" ms") and " s" not in wait
    _ok(["replay", trace, "-o", tmp_path / "b", "--max-num-seqs", "4", "--no-report"], capsys)
    out, _ = _ok(["compare", tmp_path / "a", tmp_path / "b", "--format", "json"], capsys)
    metrics = {r["metric"] for r in json.loads(out)}
    assert "max_wait_ms" in metrics and "max_wait_s" not in metrics
    text, _ = _ok(["compare", tmp_path / "a", tmp_path / "b"], capsys)
    row = next(line.split() for line in text.splitlines() if line.strip().startswith("ttft_mean_ms"))
    assert all(len(cell.replace("-", "").replace(".", "").lstrip("0")) <= 4 for cell in row[1:])  # 4 significant digits
    out, _ = _ok(["sweep", trace, "--rates", "5", "-o", tmp_path / "sw", "--slo", "ttft=1s"], capsys)
    assert "ttft_p99_ms" in out and "attainment_pct" in out and "ttft_p99_s" not in out


# --- 12. a prefix-cache hit share above the trace's ideal reuse is explained ---------------------


def test_a_hit_share_above_the_ideal_reuse_is_explained(tmp_path, capsys):
    from servelab.traces.synth import synth_trace

    trace = write_trace(synth_trace(n=300, rate=40, prompt="1000", output="200", seed=3, prefix_block_tokens=16),
                        tmp_path / "p.arrow", "synth")
    out, _ = _ok(["replay", trace, "--num-gpu-blocks", "400", "-o", tmp_path / "r"], capsys)
    assert json.loads((tmp_path / "r" / "run.json").read_text())["trace"]["prefix_reuse_share"] == 0.0
    assert "above the trace's ideal reuse of 0.0%" in out
    assert "re-admitted after a preemption" in out


def test_hits_on_a_trace_without_prefix_hashes_are_explained(tmp_path, capsys):
    from servelab.traces.synth import synth_trace

    trace = write_trace(synth_trace(n=300, rate=40, prompt="1000", output="200", seed=3), tmp_path / "p.arrow", "synth")
    out, _ = _ok(["replay", trace, "--num-gpu-blocks", "400", "-o", tmp_path / "r"], capsys)
    assert "prefix_reuse_share" not in json.loads((tmp_path / "r" / "run.json").read_text())["trace"]
    assert "served from cache" in out
    assert "all of them on requests re-admitted after a preemption" in out


# --- 11. a progress bar for every replay longer than a few seconds ------------------------------


def test_a_small_slow_replay_gets_a_progress_bar_and_a_quick_one_none(tmp_path):
    import io

    from rich.console import Console

    from servelab.cli.replay_cmd import PROGRESS_DELAY_S, _progress_bar
    from servelab.traces.io import read_trace

    assert PROGRESS_DELAY_S <= 5.0  # "a few seconds"
    trace = read_trace(_trace(tmp_path, 100, 0.1))  # 100 requests, far below the old 50,000
    with _progress_bar(trace, Console(file=io.StringIO(), width=80), delay_s=0.0) as bar:
        assert bar is not None
        bar(5.0, 10, 100)  # the replay has run past the delay: the bar shows
        assert bar.started and bar.progress.live.is_started
    assert not bar.started  # stopped (and cleared: transient) when the replay ends
    with _progress_bar(trace, Console(file=io.StringIO(), width=80), delay_s=60.0) as bar:
        bar(5.0, 10, 100)  # within the delay: nothing shown yet
        assert not bar.started


# --- 8. help shows kinds and defaults; one rate vocabulary -------------------------------------


def test_replay_help_shows_each_numbers_kind_and_default(capsys):
    out, _ = _ok(["replay", "--help"], capsys)
    flat = " ".join(out.split())
    assert "--block-size INTEGER Tokens per KV block. [default: 16]" in flat
    assert "--gpu-memory-utilization FLOAT" in flat and "[default: 0.9]" in flat
    assert "--max-num-seqs TEXT" not in flat


def test_rate_scale_is_one_name_and_the_old_names_still_work(tmp_path, capsys):
    from servelab.traces.io import read_trace

    src = _trace(tmp_path, 20, 0.1)
    _ok(["trace", "transform", src, "-o", tmp_path / "new.arrow", "--rate-scale", "2"], capsys)
    _, err = _ok(["trace", "transform", src, "-o", tmp_path / "old.arrow", "--scale-rate", "2"], capsys)
    assert "--scale-rate is deprecated; write --rate-scale" in err
    assert read_trace(tmp_path / "new.arrow")["arrival_s"].equals(read_trace(tmp_path / "old.arrow")["arrival_s"])
    assert read_trace(tmp_path / "new.arrow")["arrival_s"][-1].as_py() == pytest.approx(0.95)
    out, _ = _ok(["sweep", src, "--rate-scales", "2", "-o", tmp_path / "sw", "--slo", "ttft=1s"], capsys)
    assert "rate_20" in out
    _, err = _ok(["sweep", src, "--scales", "2", "-o", tmp_path / "sw2", "--slo", "ttft=1s"], capsys)
    assert "--scales is deprecated; write --rate-scales" in err


def test_query_compare_and_report_tables_share_one_style(tmp_path, capsys):
    trace = _trace(tmp_path, 10, 0.1)
    report, _ = _ok(["replay", trace, "-o", tmp_path / "a", "--slo", "ttft=1s"], capsys)
    _ok(["replay", trace, "-o", tmp_path / "b", "--no-report"], capsys)
    query, _ = _ok(["query", tmp_path / "a", "SELECT scope, attainment FROM slo_attainment"], capsys)
    compare, _ = _ok(["compare", tmp_path / "a", tmp_path / "b"], capsys)

    def rule_and_header(text):  # the line above the first rule: flush left, as is the rule
        lines = text.splitlines()
        i = next(i for i, line in enumerate(lines) if line.lstrip().startswith("─"))
        return lines[i - 1][:1] != " ", lines[i][:1]

    assert rule_and_header(report) == rule_and_header(query) == rule_and_header(compare) == (True, "─")
