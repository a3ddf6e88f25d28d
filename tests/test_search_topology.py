"""Search over cluster topologies (issue 13 item 7): the spec's pool keys, the GPU budget, the
cost-per-million-tokens objective under the attainment constraint, and the four example specs,
each checked against an exhaustive evaluation computed here: every setting replayed with
`servelab.api.replay` and scored in plain Python (attainment, dollars from the pools' replicas,
TP and prices over first arrival .. last finish), independently of the search and the SQL views."""

from __future__ import annotations

import copy
import itertools
import json
import math
import tomllib
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from servelab.api import ReplayConfig, replay
from servelab.cli.main import cli
from servelab.common.errors import InputError, ServelabError
from servelab.search.space import config_for
from servelab.search.spec import parse_spec
from servelab.traces.io import read_trace

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
TWO_POOLS = {
    "runner": "linear:base=0.005,prefill_token=0.00002,decode_seq=0.0002",
    "replay": {"num_gpu_blocks": 4000, "kv_bytes_per_token": 1000},
    "cluster": {"pools": [{"name": "prefill", "role": "prefill"},
                          {"name": "decode", "role": "decode", "tp": 2, "price_per_gpu_hour": 1.0}],
                "links": [{"from": "prefill", "to": "decode", "bandwidth_gbps": 10.0}]},
}  # fmt: skip


def spec_of(tmp_path, space, **top):
    data = copy.deepcopy(TWO_POOLS)
    data.update(trace="trace.arrow", space=space, **top)
    return parse_spec(data, tmp_path / "spec.toml")


def error_of(tmp_path, space, **top) -> str:
    with pytest.raises(InputError) as info:
        spec_of(tmp_path, space, **top)
    return str(info.value)


# -- the spec ----------------------------------------------------------------------------------------


def test_pool_keys_nested_dotted_and_quoted_read_alike(tmp_path):
    a = spec_of(tmp_path, {"pools": {"prefill": {"replicas": [1, 2]}, "decode": {"router": ["round-robin", "least-kv"]}}})
    b = spec_of(tmp_path, {"pools.prefill.replicas": [1, 2], "pools.decode.router": ["round-robin", "least-kv"]})
    assert a.space == b.space
    assert [(p.name, p.pool, p.key, p.choices) for p in a.space] == [
        ("pools.prefill.replicas", "prefill", "replicas", (1, 2)),
        ("pools.decode.router", "decode", "router", ("round-robin", "least-kv"))]


@pytest.mark.parametrize("space,top,message", [
    ({"pools.prefil.replicas": [1]}, {}, ("column 'space.pools.prefil.replicas': no pool 'prefil' in the base cluster; "
                                         "did you mean 'prefill'")),
    ({"pools.prefill.replica": [1]}, {}, "column 'space.pools.prefill.replica': not a searchable pool key"),
    ({"pools.prefill.replicas": [0, 1]}, {}, ("column 'space.pools.prefill.replicas': value 0: cluster pool 'prefill': "
                                             "replicas must be >= 1, got 0")),
    ({"pools.prefill.router": ["nope"]}, {}, "column 'space.pools.prefill.router': unknown router 'nope'"),
    ({"pools.prefill.autoscale.max": [2]}, {}, ("column 'space.pools.prefill.autoscale.max': pool 'prefill' has no "
                                               "autoscale table")),
    ({"pools.decode.replicas": "fill", "pools.decode.tp": [1]}, {}, "column 'space.pools.decode.replicas': \"fill\" needs gpu_budget"),
    ({"pools.decode.replicas": "fill", "pools.prefill.replicas": "fill", "pools.decode.tp": [1]}, {"gpu_budget": 4},
     "only one pool's replicas may be \"fill\""),
    ({"pools.decode.tp": "fill", "pools.prefill.replicas": [1]}, {"gpu_budget": 4}, "\"fill\" is for a pool's replicas only"),
    ({"replicas": [1, 2]}, {}, ("column 'space.replicas': the base config has a [cluster]: search a pool's replicas "
                               "(\"pools.prefill.replicas\" = ...)")),
    ({"pools.decode.gpu": ["h100-80gb", "a100-80gb"]},
     {"objective": "cost_per_million_tokens", "cost": {"gpu_prices": {"h100-80gb": 2.0, "a100-80gb": 1.0}}},
     "column 'cluster.pools[1].price_per_gpu_hour': pool 'decode' has a fixed price while its gpu is searched"),
    ({"pools.prefill.replicas": [1]}, {"objective": "cost_per_million_tokens"},
     "column 'cost.gpu_prices': no price for GPU 'h100-80gb' of pool 'prefill'"),
])  # fmt: skip
def test_bad_pool_keys_name_the_key(tmp_path, space, top, message):
    assert message in error_of(tmp_path, space, **top)


def test_a_flat_base_has_no_pools_to_search(tmp_path):
    with pytest.raises(InputError, match=r"space.pools.web.replicas': the base config has no \[cluster\]"):
        parse_spec({"trace": "t.arrow", "space": {"pools.web.replicas": [1, 2]}}, tmp_path / "s.toml")
    with pytest.raises(InputError, match="column 'gpu_budget': applies to a \\[cluster\\] base config"):
        parse_spec({"trace": "t.arrow", "gpu_budget": 4, "space": {"max_num_seqs": [1, 2]}}, tmp_path / "s.toml")


def test_values_valid_only_together_are_accepted(tmp_path):
    data = copy.deepcopy(TWO_POOLS)
    data["cluster"] = {"pools": [{"name": "web", "replicas": 1, "autoscale": {"min": 1, "max": 4}}]}
    data.update(trace="t.arrow", space={"pools": {"web": {"replicas": [1, 3], "autoscale": {"min": [1, 3]}}}})
    spec = parse_spec(data, tmp_path / "s.toml")  # min 3 needs replicas 3, which the space has
    with pytest.raises(ServelabError, match="got 1 outside 3..4"):  # that trial is infeasible
        config_for(spec.base, spec.space, {"pools.web.replicas": 1, "pools.web.autoscale.min": 3})
    data["space"]["pools"]["web"]["autoscale"]["min"] = [5]
    with pytest.raises(InputError, match=r"autoscale.min': value 5: cluster.pools\[0\]: autoscale needs 1 <= min <= max, got min 5, max 4"):
        parse_spec(data, tmp_path / "s.toml")


def test_fill_takes_what_the_budget_leaves(tmp_path):
    spec = spec_of(tmp_path, {"pools.prefill.replicas": [1, 2, 3, 4], "pools.decode.replicas": "fill"}, gpu_budget=6)
    assert (spec.gpu_budget, spec.fill_pool) == (6, "decode")

    def pools(prefill):
        config = config_for(spec.base, spec.space, {"pools.prefill.replicas": prefill}, gpu_budget=6, fill_pool="decode")
        return [(p.name, p.replicas) for p in config.cluster.pools]

    assert pools(2) == [("prefill", 2), ("decode", 2)]  # 6 - 2 = 4 GPUs = 2 decode replicas of TP 2
    assert pools(4) == [("prefill", 4), ("decode", 1)]
    for prefill, left in ((1, 5), (3, 3)):  # an odd remainder does not divide into TP 2 replicas
        with pytest.raises(ServelabError, match=f"leaving {left}, not a positive multiple of pool 'decode''s tp 2"):
            pools(prefill)
    spec = spec_of(tmp_path, {"pools.prefill.replicas": [1, 2, 3]}, gpu_budget=3)  # no fill: a ceiling
    config_for(spec.base, spec.space, {"pools.prefill.replicas": 1}, gpu_budget=3)  # 1 + 2 GPUs
    with pytest.raises(ServelabError, match="the pools take 4 GPUs, over gpu_budget 3"):
        config_for(spec.base, spec.space, {"pools.prefill.replicas": 2}, gpu_budget=3)


def test_gpu_prices_price_the_pools_without_one(tmp_path):
    spec = spec_of(tmp_path, {"pools.prefill.gpu": ["h100-80gb", "a100-80gb"]}, objective="cost_per_million_tokens",
                   cost={"gpu_prices": {"h100-80gb": 2.0, "a100-80gb": 1.0}})
    config = config_for(spec.base, spec.space, {"pools.prefill.gpu": "a100-80gb"}, gpu_prices=dict(spec.gpu_prices))
    assert [(p.name, p.price_per_gpu_hour) for p in config.cluster.pools] == [("prefill", 1.0), ("decode", 1.0)]


def _instances_spec(tmp_path, instances):
    data = {"trace": "trace.arrow", "runner": "roofline", "model": "llama-3.1-8b", "objective": "cost_per_million_tokens",
            "cost": {"gpu_prices": {"a100-80gb": 1.25}}, "space": {"pools.web.replicas": [1, 2]},
            "cluster": {"pools": [{"name": "web", "replicas": 1, "instances": instances}]}}  # fmt: skip
    return parse_spec(data, tmp_path / "spec.toml")


def test_gpu_prices_price_the_instance_types_without_one(tmp_path):
    """A pool of instance types (replay/cluster/instances.py) is priced per type: [cost] gpu_prices fills the
    types without a price of their own, and the pool itself gets none (it may not have one)."""
    spec = _instances_spec(tmp_path, [{"gpu": "h100-80gb", "price_per_gpu_hour": 2.5, "available": 1},
                                      {"gpu": "a100-80gb"}])
    config = config_for(spec.base, spec.space, {"pools.web.replicas": 2}, gpu_prices=dict(spec.gpu_prices))
    (pool,) = config.cluster.pools
    assert pool.price_per_gpu_hour is None and pool.replicas == 2
    assert [(t.gpu, t.price_per_gpu_hour) for t in pool.instances] == [("h100-80gb", 2.5), ("a100-80gb", 1.25)]


def test_an_instance_type_without_any_price_is_refused(tmp_path):
    with pytest.raises(InputError, match=r"column 'cluster.pools\[0\].instances\[0\].price_per_gpu_hour': no price "
                                         r"for instance type 'h100-80gb' of pool 'web'"):
        _instances_spec(tmp_path, [{"gpu": "h100-80gb"}, {"gpu": "a100-80gb"}])


# -- the examples, against exhaustive evaluations ----------------------------------------------------


def search(spec: Path, study: Path) -> list[dict]:
    result = CliRunner().invoke(cli, ["search", str(spec), "-o", str(study), "--no-progress"])
    assert result.exit_code == 0, result.output
    return pq.read_table(study / "trials.parquet").to_pylist()


def met_all(row: dict, slo: dict) -> bool:
    if row["status"] != "finished":
        return False
    n = row["generated_tokens"]
    tpot = 0.0 if n <= 1 else (row["finish_s"] - row["first_token_s"]) / (n - 1)
    return row["first_token_s"] - row["arrival_s"] <= slo["ttft_s"] and tpot <= slo["tpot_s"]


def held_seconds(pool: dict, lo: float, hi: float) -> float:
    """Replica-seconds a pool held over [lo, hi]: its replicas, or its autoscale timeline integrated."""
    rows = (pool.get("autoscale") or {}).get("timeline")
    if not rows:
        return len(pool["replicas"]) * (hi - lo)
    total = 0.0
    for i, (t, active, starting, draining, *_) in enumerate(rows):
        end = rows[i + 1][0] if i + 1 < len(rows) else math.inf
        total += (active + starting + draining) * max(0.0, min(end, hi) - max(t, lo))
    return total


def evaluate(trace, config: dict, slo: dict) -> tuple[float, float]:
    """(attainment, dollars per million output tokens) of one setting, replayed and scored here."""
    result = replay(trace, ReplayConfig.from_dict(config))
    rows = result.requests.to_pylist()
    attainment = sum(met_all(r, slo) for r in rows) / len(rows)
    lo = min(r["arrival_s"] for r in rows)
    hi = max(r["finish_s"] for r in rows if r["status"] == "finished")
    dollars = sum(held_seconds(p, lo, hi) * p["tp"] * (p["price_per_gpu_hour"] or 0.0) / 3600
                  for p in result.meta["cluster"]["pools"])  # fmt: skip
    return attainment, dollars / sum(r["generated_tokens"] or 0 for r in rows) * 1e6


def grid_settings(spec: dict) -> list[dict[tuple[str, str], object]]:
    """Every combination of the example's [space.pools.NAME] choices: {(pool, dotted key): value}."""
    axes = []
    for pool, keys in spec["space"]["pools"].items():
        for key, values in keys.items():
            if isinstance(values, dict):  # autoscale = { min = [...] }
                axes += [((pool, f"{key}.{sub}"), v) for sub, v in values.items()]
            elif values != "fill":
                axes.append(((pool, key), values))
    return [dict(zip([a[0] for a in axes], combo)) for combo in itertools.product(*(a[1] for a in axes))]


def setting_config(spec: dict, setting: dict) -> dict | None:
    """The replay config of one setting, built from the TOML by hand (None: the cluster rules refuse it)."""
    config = {k: spec[k] for k in ("runner", "model", "gpu") if k in spec}
    cluster = copy.deepcopy(spec["cluster"])
    pools = {p["name"]: p for p in cluster["pools"]}
    for (pool, key), value in setting.items():
        if key.startswith("autoscale."):
            pools[pool]["autoscale"][key.split(".")[1]] = value
        else:
            pools[pool][key] = value
    for p in pools.values():
        price = spec.get("cost", {}).get("gpu_prices", {}).get(p.get("gpu", spec.get("gpu")))
        if price is not None:
            p.setdefault("price_per_gpu_hour", price)
        scale = p.get("autoscale")
        if scale and not scale["min"] <= p.get("replicas", 1) <= scale["max"]:
            return None
    config["cluster"] = cluster
    return config


def trial_setting(trial: dict) -> dict:
    return {tuple(k[len("param.pools."):].split(".", 1)): v for k, v in trial.items()
            if k.startswith("param.pools.") and v is not None}  # fmt: skip


@pytest.mark.parametrize("example,cheaper_misses", [
    ("search_topology_hardware.toml", True),  # all-A100 is cheapest but misses TTFT
    ("search_topology_autoscale.toml", True),  # scaling on the queue depth is cheaper but misses TPOT
    ("search_topology_burst.toml", False),  # scaling in and booting again costs more *and* misses
])  # fmt: skip
def test_cost_examples_pick_the_cheapest_setting_that_meets_the_target(tmp_path, example, cheaper_misses):
    spec = tomllib.loads((EXAMPLES / example).read_text())
    trials = search(EXAMPLES / example, tmp_path / "study")
    trace = read_trace(tmp_path / "study" / "trace.arrow")  # the example's window/head/rate of the bundled trace
    expected = {}
    for setting in grid_settings(spec):
        config = setting_config(spec, setting)
        key = tuple(sorted(setting.items()))
        expected[key] = None if config is None else evaluate(trace, config, spec["slo"])
    assert len(trials) == len(expected) == spec["n_trials"]  # the grid: every setting tried once
    for trial in trials:
        want = expected[tuple(sorted(trial_setting(trial).items()))]
        if want is None:
            assert trial["outcome"] == "infeasible" and "must be within autoscale min..max" in trial["reason"]
            continue
        below = want[0] < spec["target"]  # complete, with its values, but below the target: says so
        assert trial["state"] == "complete" and trial["feasible"] is (not below)
        assert trial["outcome"] == ("infeasible" if below else "ok")
        assert trial["attr.attainment"] == pytest.approx(want[0])
        assert trial["cost_per_million_tokens"] == pytest.approx(want[1], rel=1e-9)
    feasible = {k: v for k, v in expected.items() if v is not None and v[0] >= spec["target"]}
    infeasible = [k for k, v in expected.items() if v is not None and v[0] < spec["target"]]
    assert feasible and infeasible  # the constraint matters in every example
    cheapest = min(feasible, key=lambda k: feasible[k][1])
    assert (min(v[1] for v in expected.values() if v) < feasible[cheapest][1]) is cheaper_misses
    out = CliRunner().invoke(cli, ["search", "best", str(tmp_path / "study"), "-o", str(tmp_path / "best.toml")])
    assert out.exit_code == 0, out.output
    best = ReplayConfig.from_toml(tmp_path / "best.toml")
    want = ReplayConfig.from_dict(setting_config(spec, dict(cheapest)))
    assert best.cluster == want.cluster


def test_split_example_finds_the_split_with_the_most_goodput_per_gpu(tmp_path):
    """Each trial's goodput rate really meets the target and its bracket's upper end really misses it
    (replayed and scored here), and the winner has the most of it per GPU (4: the budget)."""
    from servelab.scoring.sweep import native_rate
    from servelab.traces.transforms import scale_rate

    example = EXAMPLES / "search_topology_split.toml"
    spec = tomllib.loads(example.read_text())
    trials = search(example, tmp_path / "study")
    trace = read_trace(EXAMPLES / spec["trace"]["path"]).slice(0, spec["trace"]["head"])
    native = native_rate(trace)
    assert sorted(t["param.pools.prefill.replicas"] for t in trials) == [1, 2, 3]
    for t in trials:
        prefill = t["param.pools.prefill.replicas"]
        config = setting_config(spec, {("prefill", "replicas"): prefill, ("decode", "replicas"): 4 - prefill})
        run = json.loads((tmp_path / "study" / "trials" / f"{t['number']:04d}" / "sweep.json").read_text())
        assert run["goodput_rate_rps"] == pytest.approx(t["attr.goodput"])
        for rate, meets in ((t["attr.goodput"], True), (t["attr.goodput_bracket_hi"], False)):
            attainment, _ = evaluate(scale_rate(trace, rate / native), config, spec["slo"])
            assert (attainment >= spec["target"]) is meets, (prefill, rate, attainment)
        assert t["goodput_per_gpu"] == pytest.approx(t["attr.goodput"] / 4)
    best = max(trials, key=lambda t: t["goodput_per_gpu"])
    out = CliRunner().invoke(cli, ["search", "best", str(tmp_path / "study"), "-o", str(tmp_path / "best.toml")])
    assert out.exit_code == 0, out.output
    pools = ReplayConfig.from_toml(tmp_path / "best.toml").cluster.pools
    assert [p.replicas for p in pools] == [best["param.pools.prefill.replicas"], 4 - best["param.pools.prefill.replicas"]]


@pytest.mark.parametrize("priced", [True, False])
def test_cost_objective_of_a_cluster_is_dollars_per_hour_of_its_pools(tmp_path, priced):
    """`cost` ($/hour) counts every pool's GPUs: 1 or 2 prefill replicas on H100 at $2, 1 decode replica of
    TP 2 at its own $1: 2 + 2 = $4/h or 4 + 2 = $6/h (it used to count one replica of the top level's TP);
    without prices, the GPUs: 1 + 2 or 2 + 2."""
    from helpers_search import write_trace_file

    write_trace_file(tmp_path, n=40)
    lines = ["trace = 'trace.arrow'", "objective = 'cost'", "sampler = 'grid'", "n_trials = 2", "target = 0.01",
             f"runner = '{TWO_POOLS['runner']}'", "[replay]", "num_gpu_blocks = 4000", "kv_bytes_per_token = 1000",
             "[cost]", "gpu_prices = { 'h100-80gb' = 2.0 }", "[slo]", "ttft_s = 10.0",
             "[[cluster.pools]]", "name = 'prefill'", "role = 'prefill'",
             "[[cluster.pools]]", "name = 'decode'", "role = 'decode'", "tp = 2", "price_per_gpu_hour = 1.0",
             "[[cluster.links]]", "from = 'prefill'", "to = 'decode'", "bandwidth_gbps = 10.0",
             "[space]", "'pools.prefill.replicas' = [1, 2]"]  # fmt: skip
    if not priced:
        lines = [line for line in lines if "price" not in line and not line.startswith("[cost]")]
    (tmp_path / "spec.toml").write_text("\n".join(lines) + "\n")
    trials = search(tmp_path / "spec.toml", tmp_path / "study")
    got = {t["param.pools.prefill.replicas"]: t["cost"] for t in trials}
    assert got == ({1: pytest.approx(4.0), 2: pytest.approx(6.0)} if priced else {1: pytest.approx(3.0), 2: pytest.approx(4.0)})
