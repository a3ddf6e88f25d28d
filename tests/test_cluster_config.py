"""The cluster description (replay/cluster/config.py): parsing, errors, and the one-pool case being
today's flat ``--replicas N --router R`` replay byte for byte."""

from __future__ import annotations

import hashlib

import pytest
from helpers_engine import synthetic
from servelab.api import EngineConfig, ReplayConfig, replay, write_run
from servelab.common.errors import ServelabError
from servelab.policies.sarathi import SarathiParams
from servelab.policies.srpt import LengthParams

RUNNER = "linear:base=0.01,prefill_token=0.0001,decode_seq=0.0005"


def digests(result, path):
    write_run(result, path)
    return {name: hashlib.sha256((path / name).read_bytes()).hexdigest()
            for name in ("requests.parquet", "steps.parquet")}


@pytest.mark.parametrize("router", ["round-robin", "least-outstanding", "prefix-affinity", "power-of-two"])
def test_one_mixed_pool_is_the_flat_replay_byte_for_byte(tmp_path, router):
    trace = synthetic(n=400, rate=40.0)
    flat = ReplayConfig(engine=EngineConfig(replicas=3, router=router, num_gpu_blocks=800), runner=RUNNER)
    pool = ReplayConfig.from_dict({"runner": RUNNER, "num_gpu_blocks": 800, "cluster": {
        "pools": [{"name": "all", "role": "mixed", "replicas": 3, "router": router}]}})
    a = digests(replay(trace, flat), tmp_path / "flat")
    b = digests(replay(trace, pool), tmp_path / "pool")
    assert a == b


def test_pool_settings_override_the_top_level_and_round_trip():
    config = ReplayConfig.from_dict({"runner": RUNNER, "max_num_seqs": 64, "policy": "srpt",
                                     "policy_params": {"preempt": True}, "cluster": {
        "pools": [{"name": "p", "role": "prefill", "replicas": 2, "max_num_seqs": 8, "price_per_gpu_hour": 2.5},
                  {"name": "d", "role": "decode", "replicas": 4, "policy": "sarathi", "gpu": "a100-80gb", "tp": 2}],
        "links": [{"from": "p", "to": "d", "bandwidth_gbps": 25, "latency_s": 0.001}]}})
    from servelab.replay.config import pool_config

    p, d = config.cluster.pools
    pc, dc = pool_config(config, p), pool_config(config, d)
    assert (pc.engine.replicas, pc.engine.max_num_seqs, pc.policy, pc.policy_params) == \
        (2, 8, "srpt", LengthParams(preempt=True))
    assert (dc.engine.replicas, dc.engine.max_num_seqs, dc.policy, dc.policy_params) == (4, 64, "sarathi", SarathiParams())
    assert (dc.gpu, dc.tp) == ("a100-80gb", 2)
    assert p.price_per_gpu_hour == 2.5 and config.cluster.link().bandwidth_gbps == 25
    assert ReplayConfig.from_dict(config.to_dict()) == config


@pytest.mark.parametrize("cluster, message", [
    ({"pools": []}, "non-empty array"),
    ({"pools": [{"role": "mixed"}]}, r"pools\[0\]: missing 'name'"),
    ({"pools": [{"name": "a", "role": "prefil"}]}, "role must be one of mixed, prefill, decode, encode; got 'prefil'; did you mean 'prefill'"),
    ({"pools": [{"name": "a", "replicas": 0}]}, "replicas must be >= 1"),
    ({"pools": [{"name": "a", "max_num_seq": 3}]}, r"pools\[0\]: unknown key 'max_num_seq'; did you mean 'max_num_seqs'"),
    ({"pools": [{"name": "a", "queue_cap": 3}]}, "'queue_cap' is the cluster's, not a pool's"),
    ({"pools": [{"name": "a"}, {"name": "a"}]}, "pool name 'a' is used twice"),
    ({"pools": [{"name": "a"}, {"name": "b"}]}, "exactly one pool takes arrivals"),
    ({"pools": [{"name": "p", "role": "prefill"}]}, "needs exactly one decode pool"),
    ({"pools": [{"name": "p", "role": "prefill"}, {"name": "d", "role": "decode"}]}, "no link from prefill pool 'p'"),
    ({"pools": [{"name": "p", "role": "prefill"}, {"name": "d", "role": "decode"}],
      "links": [{"from": "p", "to": "dd"}]}, "no pool 'dd'"),
    ({"pools": [{"name": "p", "role": "prefill"}, {"name": "d", "role": "decode"}],
      "links": [{"from": "p", "to": "d", "bandwidth_gbps": 0}]}, "bandwidth_gbps must be > 0"),
    ({"pools": [{"name": "a", "price_per_gpu_hour": -1}]}, "price_per_gpu_hour must be a finite number >= 0"),
])
def test_bad_cluster_descriptions_are_one_line_errors(cluster, message):
    with pytest.raises(ServelabError, match=message):
        ReplayConfig.from_dict({"cluster": cluster}, source="c.toml")


def test_cli_replay_takes_a_cluster_config(tmp_path, capsys):
    from conftest import make_trace
    from helpers_cli import run_main
    from servelab.traces.io import write_trace

    trace = tmp_path / "t.arrow"
    write_trace(make_trace([0, 0], [8, 8], [3, 3]), trace, "test")
    (tmp_path / "c.toml").write_text(
        'runner = "linear:base=1"\nnum_gpu_blocks = 100\nkv_bytes_per_token = 1000\n'
        '[[cluster.pools]]\nname = "p"\nrole = "prefill"\n'
        '[[cluster.pools]]\nname = "d"\nrole = "decode"\nreplicas = 2\nrouter = "least-outstanding"\n'
        '[[cluster.links]]\nfrom = "p"\nto = "d"\nbandwidth_gbps = 8e-6\n')
    out = tmp_path / "run"
    code, _, err = run_main(["replay", trace, "--config", tmp_path / "c.toml", "-o", out], capsys)
    assert code == 0, err
    import pyarrow.parquet as pq

    rows = pq.read_table(out / "requests.parquet").to_pylist()
    # both prefill in [0, 1]; each 8,000 B at 4,000 B/s shared -> land at 3; decode [3, 4], [4, 5]
    assert [r["decode_replica"] for r in rows] == [1, 2]
    assert [r["finish_s"] for r in rows] == [5.0, 5.0]


def test_flat_replicas_beside_a_cluster_is_an_error_not_ignored():
    with pytest.raises(ServelabError, match="each pool sets its own replicas"):
        ReplayConfig.from_dict({"replicas": 4, "cluster": {"pools": [{"name": "a"}]}})


def test_a_search_spec_takes_a_cluster_and_its_trials_keep_it(tmp_path):
    from servelab.search.space import config_for
    from servelab.search.spec import load_spec

    (tmp_path / "s.toml").write_text(
        'trace = "t.arrow"\nobjective = "attainment"\nn_trials = 2\n[slo]\nttft_s = 2.0\n'
        '[replay]\nrunner = "linear:base=1"\nnum_gpu_blocks = 100\nkv_bytes_per_token = 1000\n'
        '[[replay.cluster.pools]]\nname = "p"\nrole = "prefill"\n'
        '[[replay.cluster.pools]]\nname = "d"\nrole = "decode"\nreplicas = 2\n'
        '[[replay.cluster.links]]\nfrom = "p"\nto = "d"\n'
        '[space]\nmax_num_seqs = { low = 8, high = 64 }\n')
    spec = load_spec(tmp_path / "s.toml")
    assert spec.base.cluster.disaggregated
    trial = config_for(spec.base, spec.space, {"max_num_seqs": 16})
    assert trial.cluster == spec.base.cluster and trial.engine.max_num_seqs == 16


def test_sweep_takes_a_cluster_config(tmp_path, capsys):
    import json

    from conftest import make_trace
    from helpers_cli import run_main
    from servelab.traces.io import write_trace

    trace = tmp_path / "t.arrow"
    write_trace(make_trace([0, 1, 2, 3], [8] * 4, [3] * 4), trace, "test")
    (tmp_path / "c.toml").write_text(
        'runner = "linear:base=1"\nnum_gpu_blocks = 100\nkv_bytes_per_token = 1000\n'
        '[[cluster.pools]]\nname = "p"\nrole = "prefill"\n'
        '[[cluster.pools]]\nname = "d"\nrole = "decode"\n'
        '[[cluster.links]]\nfrom = "p"\nto = "d"\n')
    code, _, err = run_main(["sweep", trace, "--config", tmp_path / "c.toml", "--rates", "0.5,1",
                             "--slo", "ttft=2", "-o", tmp_path / "sw"], capsys)
    assert code == 0, err
    points = json.loads((tmp_path / "sw" / "sweep.json").read_text())["points"]
    assert len(points) == 2 and all(p["attainment"] == 1.0 for p in points)
    meta = json.loads((tmp_path / "sw" / "rate_0.5" / "run.json").read_text())
    assert meta["cluster"]["transfers"]["transfers"] == 4
