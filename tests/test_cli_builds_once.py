"""`servelab replay --config` of a cluster example parses and types its config once and builds its
pools once (issue #27 item 3): the command checks the config by building the pools before it reads
the trace, and the replay takes them instead of building them again."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

import servelab.api
import servelab.assembly
from helpers_cli import write_small_trace
from servelab.cli.main import cli
from servelab.common.errors import ServelabError
from servelab.replay.config import ReplayConfig

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "clusters"


@pytest.fixture
def counts(monkeypatch):
    """How many times the replay's config is typed (``ReplayConfig.from_dict``) and its pools built
    (``build_cluster``, wherever it is called from) during the test."""
    seen = {"from_dict": 0, "build_cluster": 0}
    from_dict, build = ReplayConfig.from_dict.__func__, servelab.assembly.build_cluster

    def counted_from_dict(cls, *args, **kwargs):
        seen["from_dict"] += 1
        return from_dict(cls, *args, **kwargs)

    def counted_build(*args, **kwargs):
        seen["build_cluster"] += 1
        return build(*args, **kwargs)

    monkeypatch.setattr(ReplayConfig, "from_dict", classmethod(counted_from_dict))
    monkeypatch.setattr(servelab.assembly, "build_cluster", counted_build)
    monkeypatch.setattr(servelab.api, "build_cluster", counted_build)
    return seen


@pytest.mark.parametrize("example", ["colocated-2", "disagg-autoscale", "spot-fallback"])
def test_a_cluster_example_is_typed_once_and_built_once(tmp_path, counts, example):
    trace = write_small_trace(tmp_path)
    result = CliRunner().invoke(cli, ["replay", str(trace), "--config", str(EXAMPLES / f"{example}.toml"),
                                      "-o", str(tmp_path / "run"), "--no-report"])
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "run" / "run.json").read_text())["counts"]["finished"] == 20
    assert counts == {"from_dict": 1, "build_cluster": 1}


def test_options_on_top_of_a_file_still_win(tmp_path, counts):
    """With an option given, the file is typed once and the option alone over it (``with_options``)."""
    trace = write_small_trace(tmp_path)
    result = CliRunner().invoke(cli, ["replay", str(trace), "--config", str(EXAMPLES / "colocated-2.toml"),
                                      "--max-num-seqs", "3", "-o", str(tmp_path / "run"), "--no-report"])
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "run" / "run.json").read_text())["engine"]["max_num_seqs"] == 3
    assert counts == {"from_dict": 1, "build_cluster": 1}


def test_a_built_cluster_serves_one_replay_of_its_own_config(tmp_path):
    from servelab.api import build_cluster, replay
    from servelab.traces.io import read_trace

    trace = read_trace(write_small_trace(tmp_path))
    config = ReplayConfig.from_toml(EXAMPLES / "colocated-2.toml")
    cluster = build_cluster(config)
    assert replay(trace, config, cluster=cluster).meta["counts"]["finished"] == 20
    with pytest.raises(ServelabError, match="serves one replay"):
        replay(trace, config, cluster=cluster)
    with pytest.raises(ServelabError, match="built for another config"):
        replay(trace, ReplayConfig.from_toml(EXAMPLES / "colocated-2.toml"), cluster=build_cluster(config))
