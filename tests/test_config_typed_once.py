"""Policy and router parameters, and options over a config file, are typed once at the edge (issue #27
item 3): the config holds the policy's and router's frozen ``Params``; building a cluster's replicas and
pools parses nothing; an option over a file types the option alone and never the file's values again."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from click.testing import CliRunner

import servelab.replay.config
from helpers_cli import write_small_trace
from helpers_engine import count_builds
from servelab.api import replay
from servelab.cli.main import cli
from servelab.cli.replay_cmd import config_from_options
from servelab.common.errors import ServelabError
from servelab.policies.base import make_policy
from servelab.policies.sarathi import SarathiParams
from servelab.policies.srpt import LengthParams
from servelab.replay.config import EngineConfig, ReplayConfig, pool_config
from servelab.routers.session import SessionParams
from servelab.traces.io import read_trace

# 4 replicas in 2 pools (2 prefill + 2 decode), srpt with a parameter, the session router with one
CLUSTER = """
runner = "linear:base=0.01,prefill_token=0.0001"
num_gpu_blocks = 400
kv_bytes_per_token = 1024
policy = "srpt"
router = "session"
[policy_params]
noise_sigma = 0.5
[router_params]
balance = 2.0
[[cluster.pools]]
name = "prefill"
role = "prefill"
replicas = 2
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
def built(monkeypatch):
    """How many times srpt's and the session router's ``Params`` are built (each build is a parse of a
    table, or a copy: a config's typed ones are passed through)."""
    return count_builds(monkeypatch, {LengthParams: "policy", SessionParams: "router"}, {"policy": 0, "router": 0})


def test_a_policys_and_routers_params_are_parsed_once_for_a_4_replica_2_pool_cluster(tmp_path, built):
    path = tmp_path / "c.toml"
    path.write_text(CLUSTER)
    config = ReplayConfig.from_toml(path)
    assert built == {"policy": 1, "router": 1}
    result = replay(read_trace(write_small_trace(tmp_path)), config)
    assert result.meta["counts"]["finished"] == 20
    assert built == {"policy": 1, "router": 1}  # building 4 replicas' policies and 2 pools' routers parsed nothing
    assert config.policy_params == LengthParams(noise_sigma=0.5) and config.router_params == SessionParams(balance=2.0)


def test_the_command_parses_them_once_too(tmp_path, built):
    path = tmp_path / "c.toml"
    path.write_text(CLUSTER)
    result = CliRunner().invoke(cli, ["replay", str(write_small_trace(tmp_path)), "--config", str(path),
                                      "-o", str(tmp_path / "run"), "--no-report"])
    assert result.exit_code == 0, result.output
    assert built == {"policy": 1, "router": 1}
    config = json.loads((tmp_path / "run" / "run.json").read_text())["config"]
    assert (config["policy_params"], config["router_params"]) == ({"noise_sigma": 0.5}, {"balance": 2.0})


def test_typed_params_round_trip_exactly_and_a_pools_reset_is_kept(tmp_path):
    path = tmp_path / "c.toml"
    text = CLUSTER.replace('role = "decode"\n', 'role = "decode"\npolicy_params = {}\n')  # decode: srpt's defaults
    path.write_text(text.replace('role = "prefill"\n', 'role = "prefill"\npolicy = "sarathi"\n'
                                 "policy_params = { long_prefill_threshold = 64 }\n"))
    config = ReplayConfig.from_toml(path)
    assert ReplayConfig.from_dict(config.to_dict(), "again") == config
    prefill, decode = (pool_config(config, p) for p in config.cluster.pools)
    assert prefill.policy_params == SarathiParams(long_prefill_threshold=64)
    assert decode.policy_params == LengthParams()  # not the top level's noise_sigma: the pool reset them
    pools = config.to_dict()["cluster"]["pools"]
    assert pools[0]["policy_params"] == {"long_prefill_threshold": 64} and pools[1]["policy_params"] == {}


def test_bad_parameters_name_the_file_pool_and_key(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text(CLUSTER.replace('role = "decode"\n', 'role = "decode"\npolicy_params = { noise = 1 }\n'))
    with pytest.raises(ServelabError, match=rf"^{path}: cluster pool 'decode': policy 'srpt': unknown parameter "
                                            r"'noise'; did you mean 'noise_sigma'\?"):
        ReplayConfig.from_toml(path)
    path.write_text(CLUSTER.replace("balance = 2.0", "balance = -1"))
    with pytest.raises(ServelabError, match=rf"^{path}: router 'session': balance and slack_tokens must be >= 0"):
        ReplayConfig.from_toml(path)


def test_a_variant_keeps_typed_params_and_another_policy_starts_from_its_defaults():
    config = ReplayConfig(policy="srpt", policy_params={"noise_sigma": "0.5"})  # from Python: typed here
    assert config.policy_params == LengthParams(noise_sigma=0.5)
    assert replace(config, engine=replace(config.engine, max_num_seqs=4)).policy_params is config.policy_params
    assert replace(ReplayConfig(), policy="srpt").policy_params == LengthParams()  # the defaults of one, another's
    with pytest.raises(ServelabError, match="policy 'sarathi': policy_params LengthParams.* are not its parameters"):
        replace(config, policy="sarathi")


def test_building_a_policy_takes_typed_params_only():
    assert make_policy("srpt", LengthParams(preempt=True), EngineConfig()).params.preempt is True
    assert make_policy("srpt", None, EngineConfig()).params == LengthParams()
    with pytest.raises(TypeError, match="srpt takes its typed LengthParams, got dict"):
        make_policy("srpt", {"preempt": True}, EngineConfig())


# -- options over a file -----------------------------------------------------------------------------

@pytest.fixture
def coerced(monkeypatch):
    """Every ``where`` the edge's coercion helper is called with while the config is read."""
    seen: list[str] = []
    for module in (servelab.replay.config, servelab.replay.core.engine_config, servelab.replay.cluster.config):
        coerce = module.coerce

        def counted(value, kind, where, coerce=coerce):
            seen.append(where)
            return coerce(value, kind, where)

        monkeypatch.setattr(module, "coerce", counted)
    return seen


def test_an_option_over_a_file_types_the_option_alone(tmp_path, coerced):
    path = tmp_path / "c.toml"
    path.write_text(CLUSTER)
    ReplayConfig.from_toml(path)
    reading = list(coerced)  # the file's values and its policy's and router's parameters, each once
    assert len(reading) == len(set(reading)) and f"{path}: num_gpu_blocks" in reading
    coerced.clear()
    config = config_from_options(config_file=str(path), max_num_seqs="3", policy_param=("preempt=true",))
    assert coerced == [*reading, "options: max_num_seqs", "policy 'srpt': preempt"]  # and none of the file's again
    assert config.engine.max_num_seqs == 3 and config.engine.num_gpu_blocks == 400
    assert config.policy_params == LengthParams(preempt=True, noise_sigma=0.5)  # the file's kept, the option's over it
    assert config.router_params == SessionParams(balance=2.0)


def test_another_policy_on_the_command_line_does_not_take_the_files_params(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text(CLUSTER)
    assert config_from_options(config_file=str(path), policy="sarathi").policy_params == SarathiParams()
    both = config_from_options(config_file=str(path), policy="sarathi", policy_param=("long_prefill_threshold=8",))
    assert both.policy_params == SarathiParams(long_prefill_threshold=8)


@pytest.mark.parametrize("options, message", [
    ({"max_num_seqs": "many"}, "options: max_num_seqs: expected a finite int"),
    ({"max_num_seqs": "0"}, "max_num_seqs must be >= 1"),
    ({"policy_param": ("noise=1",)}, "policy 'srpt': unknown parameter 'noise'"),
    ({"router_param": ("balance=-1",)}, "router 'session': balance and slack_tokens must be >= 0"),
])
def test_a_bad_option_over_a_file_fails_as_without_one(tmp_path, options, message):
    path = tmp_path / "c.toml"
    path.write_text(CLUSTER)
    alone = {**options, "policy": "srpt", "router": "session"}
    for kwargs in ({"config_file": str(path), **options}, alone):
        with pytest.raises(ServelabError) as err:
            config_from_options(**kwargs)
        assert str(err.value).startswith(message), str(err.value)
