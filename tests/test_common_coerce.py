"""The one typed coercion (common/coerce.py) the CLI, replay configs, policy parameters and search specs use."""

from __future__ import annotations

import pytest

from servelab.common.coerce import coerce
from servelab.common.errors import ServelabError
from servelab.replay.config import EngineConfig, ReplayConfig


def test_cli_strings_and_toml_values_become_the_fields_type():
    assert coerce("64", "int", "x") == 64 and coerce(64, "int", "x") == 64 and coerce(64.0, "int", "x") == 64
    assert coerce("0.5", "float", "x") == 0.5 and coerce(2, "float", "x") == 2.0
    assert coerce("on", "bool", "x") is True and coerce(False, "bool", "x") is False
    assert coerce("none", "float | None", "x") is None and coerce(None, "int | None", "x") is None


@pytest.mark.parametrize("value, annotation", [
    (True, "int"), (False, "float"), ("nan", "float | None"), (float("inf"), "float"), ("2.5", "int"),
    (2.5, "int"), ("maybe", "bool"), (1, "bool"), (3, "str"),
])
def test_a_value_of_another_type_is_an_error_naming_where(value, annotation):
    with pytest.raises(ServelabError, match="x: expected"):
        coerce(value, annotation, "x")


def test_replay_config_refuses_a_boolean_count_and_a_nan_horizon():
    with pytest.raises(ServelabError, match="max_num_seqs: expected a finite int, got True"):
        ReplayConfig.from_dict({"max_num_seqs": True})
    with pytest.raises(ServelabError, match="until_s"):
        ReplayConfig.from_dict({"until_s": "nan"})
    with pytest.raises(ServelabError, match="until_s must be a finite"):
        EngineConfig(until_s=float("nan"))
    with pytest.raises(ServelabError, match="tier_order: tiers 'a,a' names a tier twice"):
        EngineConfig(tier_order="a,a")
