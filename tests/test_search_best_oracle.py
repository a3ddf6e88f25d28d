"""best.toml names the trace its trials were scored on (STUDY_DIR/trace.arrow when the spec transformed it),
and a best config whose policy ranks by true output lengths says it is an oracle, there and in the report
(issue 16 item 14)."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers_cli import invoke
from helpers_search import GRID_SPACE, grid_spec, write_trace_file

from servelab.replay.config import ReplayConfig
from servelab.scoring.report import output_length_knowledge

SRPT_SPACE = """
[space]
policy = ["srpt"]
max_num_seqs = [4, 8]
"""
NOISY_SPACE = SRPT_SPACE + """
[space.policy_params.srpt]
noise_sigma = [0.5]
"""


def search_best(folder: Path, study: Path, space: str, trace: str = "") -> tuple[str, ReplayConfig]:
    spec = grid_spec(folder, n_trials=2, space=space, top=trace, name=f"{study.name}.toml")
    invoke("search", spec, "-o", study, "--no-progress")
    best = study.parent / f"{study.name}-best.toml"
    invoke("search", "best", study, "-o", best)
    return best.read_text(), ReplayConfig.from_toml(best)  # the comments leave it a valid --config


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("lengths")
    write_trace_file(folder, n=120)
    return folder


def test_oracle_srpt_on_a_transformed_trace(folder, tmp_path):
    transformed = 'trace = { path = "trace.arrow", head = 100, rate_scale = 1.5 }\n'
    study = tmp_path / "s"
    spec = grid_spec(folder, n_trials=2, space=SRPT_SPACE, name="t.toml")
    spec.write_text(spec.read_text().replace('trace = "trace.arrow"\n', transformed))
    invoke("search", spec, "-o", study, "--no-progress")
    out = invoke("search", "best", study, "-o", tmp_path / "best.toml")
    assert out.startswith("trial ")
    text = (tmp_path / "best.toml").read_text()
    config = ReplayConfig.from_toml(tmp_path / "best.toml")
    assert config.policy == "srpt"
    assert (study / "trace.arrow").is_file()
    assert f"# scored on trace {study / 'trace.arrow'} ({folder / 'trace.arrow'} with head 100, rate_scale 1.5)" in text
    assert f"# use it with: servelab replay {study / 'trace.arrow'} --config best.toml" in text
    assert "# policy srpt: oracle: ranks by every request's true output length (noise_sigma = 0)" in text
    report = invoke("report", study / "trials" / "0000")
    assert "policy srpt: oracle" in report


def test_predicted_lengths_and_plain_trace(folder, tmp_path):
    text, config = search_best(folder, tmp_path / "noisy", NOISY_SPACE)
    assert config.to_dict()["policy_params"] == {"noise_sigma": 0.5} and config.policy_params.noise_sigma == 0.5
    assert "# policy srpt: output lengths predicted (lognormal noise_sigma = 0.5)" in text and "oracle" not in text
    assert f"# scored on trace {folder / 'trace.arrow'}\n" in text  # no transforms: the spec's own trace
    assert "policy srpt: output lengths predicted" in invoke("report", tmp_path / "noisy" / "trials" / "0000")


def test_policies_that_do_not_rank_by_length_say_nothing(folder, tmp_path):
    text, config = search_best(folder, tmp_path / "grid", GRID_SPACE.replace("[1, 2, 4, 8, 16, 32, 64]", "[8]"))
    assert config.policy in ("sarathi", "vllm-v0")
    assert "oracle" not in text and "predicted" not in text
    assert "oracle" not in invoke("report", tmp_path / "grid" / "trials" / "0000")


@pytest.mark.parametrize("policy,params,expected", [
    ("srpt", {}, "oracle"), ("sjf", {"noise_sigma": 0.0}, "oracle"), ("sjf", {"noise_sigma": 0.3}, "predicted"),
    ("tiers", {"within": "srpt"}, "oracle"), ("vtc", {"within": "sjf", "noise_sigma": 1}, "predicted"),
    ("tiers", {"within": "fcfs"}, None), ("sarathi", {}, None), (None, None, None),
])  # fmt: skip
def test_output_length_knowledge(policy, params, expected):
    assert output_length_knowledge(policy, params) == expected
