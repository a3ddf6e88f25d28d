"""The engine's spec strings (``fail``, ``quota``, ``pause``, ``tier_order``, ``kv_tiers``) are parsed
once, when the first `EngineConfig` holding them is made, and every consumer (the config's own checks,
the cluster's assembly, the platform's hooks) reads the typed values (issue #27 item 3): a
``servelab replay --config`` of a cluster with all five parses each spec string once."""

from __future__ import annotations

import json
import sys

import pytest
from click.testing import CliRunner

import servelab.common.tiers
from helpers_cli import write_small_trace
from servelab.cli.main import cli
from servelab.common.errors import ServelabError
from servelab.replay.config import ReplayConfig
from servelab.replay.core.kv.tiers import TierSpec
from servelab.replay.core.specs import Failure, PauseRule, Quota

# a pool of 3 colocated replicas, every engine spec set once at the top level
CLUSTER = """
runner = "linear:base=0.01,prefill_token=0.0001"
num_gpu_blocks = 400
kv_bytes_per_token = 1024
kv_tiers = ["dram:capacity_gb=1", "ssd:capacity_gb=2"]
quota = ["tenant=*:rpm=6000", "tier=flex:tpm=1e7"]
queue_cap = 64
tier_order = "priority,standard,flex"
pause = "tier=flex,waiting=32,resume=8"
fail = ["replica=0,at=0.5,for=0.5", "replica=2,at=1"]
[[cluster.pools]]
name = "all"
role = "mixed"
replicas = 3
"""


@pytest.fixture
def parsed(monkeypatch):
    """Each spec string parsed while the test runs, by its parser (the typed values' caches emptied first,
    so what an earlier test parsed in this process does not hide a parse)."""
    log: dict[str, list[str]] = {"fail": [], "quota": [], "pause": [], "kv_tiers": [], "tier_order": []}
    for cls, key in ((Failure, "fail"), (Quota, "quota"), (PauseRule, "pause"), (TierSpec, "kv_tiers")):
        parse = cls.parse.__func__

        def counted(cls, spec, *args, parse=parse, key=key):
            log[key].append(spec)
            return parse(cls, spec, *args)

        monkeypatch.setattr(cls, "parse", classmethod(counted))
    parse_tiers = servelab.common.tiers.parse_tiers

    def counted_tiers(spec, owner):
        if owner == "tier_order":  # (a policy's own ``tiers`` parameter is not the engine's)
            log["tier_order"].append(spec)
        return parse_tiers(spec, owner)

    for module in list(sys.modules.values()):  # wherever it was imported by name
        if getattr(module, "__name__", "").startswith("servelab") and getattr(module, "parse_tiers", None) is parse_tiers:
            monkeypatch.setattr(module, "parse_tiers", counted_tiers)
    try:
        from servelab.replay.core import specs
        specs.clear_caches()
    except (ImportError, AttributeError):  # (main's code has no caches)
        pass
    return log


def test_a_cluster_replay_parses_each_engine_spec_once(tmp_path, parsed):
    path = tmp_path / "c.toml"
    path.write_text(CLUSTER)
    trace = write_small_trace(tmp_path)
    result = CliRunner().invoke(cli, ["replay", str(trace), "--config", str(path), "-o", str(tmp_path / "run"),
                                      "--no-report"])
    assert result.exit_code == 0, result.output
    run = json.loads((tmp_path / "run" / "run.json").read_text())
    assert run["platform"]["faults"]["failures"] == 2 and run["counts"]["finished"] == 20  # the specs took effect
    assert {key: sorted(specs) for key, specs in parsed.items()} == {
        "fail": ["replica=0,at=0.5,for=0.5", "replica=2,at=1"],
        "quota": ["tenant=*:rpm=6000", "tier=flex:tpm=1e7"],
        "pause": ["tier=flex,waiting=32,resume=8"],
        "kv_tiers": ["dram:capacity_gb=1", "ssd:capacity_gb=2"],
        "tier_order": ["priority,standard,flex"]}


def test_the_typed_specs_round_trip_as_the_strings_given(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text(CLUSTER)
    config = ReplayConfig.from_toml(path)
    engine = config.to_dict()
    assert engine["fail"] == ["replica=0,at=0.5,for=0.5", "replica=2,at=1"]
    assert engine["pause"] == "tier=flex,waiting=32,resume=8" and engine["tier_order"] == "priority,standard,flex"
    assert ReplayConfig.from_dict(json.loads(json.dumps(engine)), "again") == config


@pytest.mark.parametrize("key, value, message", [
    ("fail", '["replica=0,at=x"]', r"c\.toml: fail 'replica=0,at=x': replica must be an integer"),
    ("quota", '["tenant=a:rpm=-1"]', r"c\.toml: quota 'tenant=a:rpm=-1': 'rpm' must be > 0"),
    ("pause", '"tier=flex"', r"c\.toml: pause 'tier=flex': give tier= and exactly one of"),
    ("kv_tiers", '["dram"]', r"c\.toml: kv_tiers: 'dram' needs capacity_gb"),
    ("tier_order", '"a,a"', r"c\.toml: tier_order: tiers 'a,a' names a tier twice"),
    ("fail", '["replica=9,at=1"]', r"fail replica=9: there are only 3 replica\(s\)"),
])
def test_a_bad_spec_still_names_its_file_and_field(tmp_path, key, value, message):
    path = tmp_path / "c.toml"
    lines = [f"{key} = {value}" if line.startswith(f"{key} =") else line for line in CLUSTER.splitlines()]
    path.write_text("\n".join(lines))
    with pytest.raises(ServelabError, match=message):
        config = ReplayConfig.from_toml(path)
        from servelab.assembly import build_cluster
        build_cluster(config, None, None)
