"""`KEY=VALUE` options share one parser (cli/key_values.py): values stripped, bad items one-line errors."""

from __future__ import annotations

import pytest
from click.testing import CliRunner
from servelab.cli.key_values import parse_key_values
from servelab.cli.main import cli
from servelab.common.errors import ServelabError


def test_items_become_a_dict_later_keys_winning():
    assert parse_key_values([" a = 1", "b=x=y", "a=2"], "--opt") == {"a": "2", "b": "x=y"}
    assert parse_key_values(["max-wait-s=3"], "--set", underscores=True) == {"max_wait_s": "3"}


@pytest.mark.parametrize("item", ["novalue", "=3", " =3"])
def test_a_malformed_item_names_the_option(item):
    with pytest.raises(ServelabError, match=f"^--policy-param expects KEY=VALUE, got '{item}'$"):
        parse_key_values([item], "--policy-param")


def test_an_unknown_key_lists_the_known_ones():
    with pytest.raises(ServelabError, match=r"^--setting expects KEY=VALUE with KEY one of a, b; got 'c=1'$"):
        parse_key_values(["c=1"], "--setting", known=("a", "b"))


def test_replay_refuses_a_malformed_router_param(tmp_path):
    result = CliRunner().invoke(cli, ["replay", "data/azure_conv_2023.arrow", "--router-param", "queue",
                                      "-o", str(tmp_path / "run")])
    assert result.exit_code != 0
    assert str(result.exception) == "--router-param expects KEY=VALUE, got 'queue'"
    assert not (tmp_path / "run").exists()
