"""A cluster's per-pool overrides, policy parameters included, are typed once when the config is read
and never again (issue #27 item 3): replaying it coerces nothing, makes no config, builds no policy
``Params`` and splits no string in a policy; ``validate --real`` types a config file once for a whole
sweep and puts only the keys the file sets over each measured run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import servelab.common.coerce
import servelab.replay.cluster.config
import servelab.replay.config
import servelab.replay.core.engine_config
from helpers_cli import run_main, write_small_trace
from helpers_engine import count_builds, string_splits
from servelab.api import replay
from servelab.policies.edf import EdfParams
from servelab.policies.tiers import TiersParams
from servelab.common.errors import ServelabError
from servelab.replay.config import EngineConfig, ReplayConfig, pool_config
from servelab.traces.io import read_trace

POLICIES = Path(servelab.policies.edf.__file__).parent
FIX = Path(__file__).parent / "fixtures" / "real_runs"

# 2 prefill replicas on edf with their own per-tier TTFT table and batch size, 2 decode replicas on the
# top level's tiers policy with its tier list and reserved share (strings, an array and a table)
CLUSTER = """
runner = "linear:base=0.01,prefill_token=0.0001"
num_gpu_blocks = 400
kv_bytes_per_token = 1024
policy = "tiers"
[policy_params]
tiers = ["priority", "standard", "flex"]
reserve = { flex = 0.25 }
best_effort = "flex"
[[cluster.pools]]
name = "prefill"
role = "prefill"
replicas = 2
policy = "edf"
max_num_seqs = 32
policy_params = { tier_ttft = "priority=0.5,flex=30", ttft_slo_s = 2 }
[[cluster.pools]]
name = "decode"
role = "decode"
replicas = 2
[[cluster.links]]
from = "prefill"
to = "decode"
bandwidth_gbps = 50.0
"""


@pytest.fixture
def seen(monkeypatch):
    """What is typed or made while the test runs: every ``where`` a value is coerced at (in the modules
    that type configs, and the structured kinds' own calls), ``from_dict`` calls, replay configs made
    (``ReplayConfig.__post_init__``), and the policies' ``Params`` built."""
    log = {"coerced": [], "from_dict": 0, "configs": 0, "params": 0}
    for module in (servelab.common.coerce, servelab.replay.config, servelab.replay.core.engine_config,
                   servelab.replay.cluster.config):
        coerce = module.coerce

        def counted(value, kind, where, coerce=coerce):
            log["coerced"].append(where)
            return coerce(value, kind, where)

        monkeypatch.setattr(module, "coerce", counted)
    from_dict = ReplayConfig.from_dict.__func__

    def counted_from_dict(cls, *args, **kwargs):
        log["from_dict"] += 1
        return from_dict(cls, *args, **kwargs)

    monkeypatch.setattr(ReplayConfig, "from_dict", classmethod(counted_from_dict))
    return count_builds(monkeypatch, {ReplayConfig: "configs", TiersParams: "params", EdfParams: "params"}, log)


def policy_string_calls(run):
    """``str`` splitting calls made from the policies' files while ``run()`` runs, and its result."""
    return string_splits(run, {POLICIES})


def test_a_clusters_pool_overrides_are_typed_once_and_replaying_types_nothing(tmp_path, seen):
    path = tmp_path / "c.toml"
    path.write_text(CLUSTER)
    trace = read_trace(write_small_trace(tmp_path))
    config = ReplayConfig.from_toml(path)
    reading = list(seen["coerced"])
    assert len(reading) == len(set(reading)), sorted(w for w in reading if reading.count(w) > 1)
    assert f"{path}: cluster.pools[0].max_num_seqs" in reading
    assert seen["from_dict"] == 1 and seen["params"] == 2  # the top level's tiers and the prefill pool's edf
    prefill, decode = (pool_config(config, p) for p in config.cluster.pools)
    assert prefill.policy_params == EdfParams(ttft_slo_s=2.0, tier_ttft=(("priority", 0.5), ("flex", 30.0)))
    assert decode.policy_params == TiersParams(reserve=(("flex", 0.25),)) is not None
    assert (prefill.engine.max_num_seqs, decode.engine.max_num_seqs) == (32, config.engine.max_num_seqs)

    for key in ("coerced", "from_dict", "configs", "params"):
        seen[key] = [] if key == "coerced" else 0
    split, result = policy_string_calls(lambda: replay(trace, config))
    assert result.meta["counts"]["finished"] == 20
    assert seen == {"coerced": [], "from_dict": 0, "configs": 0, "params": 0}  # 4 replicas in 2 pools built from it
    assert split == []  # no policy parses its parameters again, per replica or per pool


def test_typed_pool_parameters_round_trip_as_tables_and_arrays(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text(CLUSTER)
    config = ReplayConfig.from_toml(path)
    data = config.to_dict()
    assert data["policy_params"] == {"reserve": {"flex": 0.25}}  # the tiers and best_effort given are the defaults
    assert data["cluster"]["pools"][0]["policy_params"] == {"ttft_slo_s": 2.0,
                                                            "tier_ttft": {"priority": 0.5, "flex": 30.0}}
    assert ReplayConfig.from_dict(json.loads(json.dumps(data)), "again") == config


def test_validate_real_types_a_config_file_once_and_puts_only_its_keys_over_each_run(tmp_path, capsys, seen):
    sweep = tmp_path / "sweep"
    code, _, err = run_main(["run", "import", FIX / "guidellm_0.8.1_serve_sweep.json", "-o", sweep,
                             "--setting", "model=llama-3.1-8b", "--setting", "gpu=a100-80gb"], capsys)
    assert code == 0, err
    path = tmp_path / "v.toml"
    path.write_text("max_num_seqs = 48\n[policy_params]\nlong_prefill_threshold = 64\n")
    seen["coerced"].clear()
    seen["from_dict"] = 0
    code, text, err = run_main(["validate", "--real", sweep, "--config", path, "--format", "json"], capsys)
    assert code == 0, err
    runs = json.loads(text)["runs"]
    assert len(runs) == 4
    for report in runs:  # the file's keys over the run's; the GPU the run recorded, not the file's default
        assert (report["config"]["gpu"], report["config"]["max_num_seqs"]) == ("a100-80gb", 48)
        assert report["config"]["policy_params"] == {"long_prefill_threshold": 64}
        settings = {row["setting"]: row["from"] for row in report["settings"]}
        assert settings["max_num_seqs"] == "option" and settings["gpu"].startswith("run")
    file_values = [where for where in seen["coerced"] if where.startswith(str(path)) or "long_prefill" in where]
    assert file_values == [f"{path}: max_num_seqs", "policy 'sarathi': long_prefill_threshold"]  # once for 4 runs
    assert seen["from_dict"] == 4  # each run's own recorded settings, typed once each


# -- typed variants, for a search's trials -----------------------------------------------------------------

def test_pool_keys_over_a_typed_config_type_the_new_values_alone(tmp_path, seen):
    """What a trial does to its base (``with_pool_keys``, ``with_options``) equals writing the base out,
    setting the keys and reading it all again, while typing the trial's values alone."""
    path = tmp_path / "c.toml"
    path.write_text(CLUSTER)
    base = ReplayConfig.from_toml(path)
    values = {("prefill", "replicas"): 3, ("prefill", "policy"): "srpt", ("decode", "max_num_seqs"): "16",
              ("decode", "policy_params"): {"reserve": "standard=0.5"}}
    seen["coerced"].clear()
    trial = base.with_pool_keys(values, "trial 3").with_options({"max_num_batched_tokens": 1024}, "trial 3")
    assert sorted(seen["coerced"]) == sorted([
        "trial 3: cluster pool 'prefill'.replicas", "trial 3: cluster pool 'prefill'.policy",
        "trial 3: cluster pool 'decode'.max_num_seqs", "policy 'tiers': reserve", "policy 'tiers': reserve.standard",
        "trial 3: max_num_batched_tokens"])
    data = base.to_dict()  # the long way round: out to a table and typed whole again
    pools = {p["name"]: p for p in data["cluster"]["pools"]}
    pools["prefill"].update(replicas=3, policy="srpt")
    del pools["prefill"]["policy_params"]  # (edf's are not srpt's)
    pools["decode"].update(max_num_seqs=16, policy_params={"reserve": {"standard": 0.5}})
    assert trial == ReplayConfig.from_dict({**data, "max_num_batched_tokens": 1024}, "again")
    assert pool_config(trial, trial.cluster.pools[1]).policy_params.reserve == (("standard", 0.5),)
    with pytest.raises(ServelabError, match=r"^trial 4: cluster pool 'decode': 'seed' is the cluster's"):
        base.with_pool_keys({("decode", "seed"): 1}, "trial 4")
    with pytest.raises(ServelabError, match=r"^trial 4: no cluster pool 'decod'; did you mean 'decode'\?"):
        base.with_pool_keys({("decod", "replicas"): 1}, "trial 4")
    with pytest.raises(ServelabError, match=r"^trial 4: cluster pool 'decode': policy 'tiers': unknown parameter"):
        base.with_pool_keys({("decode", "policy_params"): {"reserv": "a=1"}}, "trial 4")


def test_options_typed_once_go_over_many_configs():
    from servelab.replay.config import Options

    options = Options.parse({"max_num_seqs": "8", "policy_params": {"noise_sigma": "0.5"}}, "spec.toml")
    assert options.keys() == {"max_num_seqs", "policy_params"} and options.get("max_num_seqs") == 8
    configs = [ReplayConfig(policy="srpt", engine=EngineConfig(seed=s)).with_options(options) for s in range(3)]
    assert all(c.engine.max_num_seqs == 8 and c.policy_params.noise_sigma == 0.5 for c in configs)
    assert configs[0].policy_params is not configs[1].policy_params  # each config's own Params, one typing
    with pytest.raises(ServelabError, match=r"^spec.toml: policy 'sarathi': unknown parameter 'noise_sigma'"):
        ReplayConfig().with_options(options)


def test_an_instance_types_price_is_a_pool_key_too():
    base = ReplayConfig.from_toml(Path(__file__).resolve().parent.parent / "examples" / "clusters" / "spot-fallback.toml")
    pool = next(p for p in base.cluster.pools if p.instances)
    trial = base.with_pool_keys({(pool.name, "instances.l40s.price_per_gpu_hour"): "1.5"}, "trial 5")
    assert [t.price_per_gpu_hour for t in trial.cluster.pools[base.cluster.pools.index(pool)].instances] == [2.5, 1.6, 1.5]
    with pytest.raises(ServelabError, match=r"^trial 5: cluster pool 'web': no instance type 'l40'; did you mean 'l40s'"):
        base.with_pool_keys({(pool.name, "instances.l40.price_per_gpu_hour"): 1}, "trial 5")
