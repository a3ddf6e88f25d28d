"""SloTable: command-line and TOML parsing, merging, precedence rows, and every bad-input message."""

from __future__ import annotations

import pytest

from servelab.common.errors import InputError, ServelabError
from servelab.scoring.slo import Slo, SloTable


def test_parse_cli_global_tier_tenant():
    t = SloTable.parse_cli(["ttft=0.5,tpot=0.05", "tier=priority:ttft=0.2,tpot=0.03", "tenant=acme:ttft=1"])
    assert t.global_ == Slo(ttft_s=0.5, tpot_s=0.05)
    assert t.tiers == (("priority", Slo(ttft_s=0.2, tpot_s=0.03)),)
    assert t.tenants == (("acme", Slo(ttft_s=1.0)),)
    assert t.specified_fields() == ("ttft_s", "tpot_s")


def test_parse_cli_units_and_long_names():
    t = SloTable.parse_cli(["ttft=200ms,tpot_s=0.05s,e2e=10,max_stall=1.5"])
    assert t.global_ == Slo(ttft_s=0.2, tpot_s=0.05, e2e_s=10.0, max_stall_s=1.5)


def test_repeated_flags_merge_and_clash():
    t = SloTable.parse_cli(["ttft=0.5", "tpot=0.1", "tier=a:ttft=1", "tier=a:tpot=2"])
    assert t.global_ == Slo(ttft_s=0.5, tpot_s=0.1)
    assert t.tiers == (("a", Slo(ttft_s=1.0, tpot_s=2.0)),)
    with pytest.raises(ServelabError, match="SLO global: 'ttft_s' given twice"):
        SloTable.parse_cli(["ttft=0.5", "ttft=0.6"])
    with pytest.raises(ServelabError, match="SLO tier=a: 'ttft_s' given twice"):
        SloTable.parse_cli(["tier=a:ttft=1", "tier=a:ttft=2"])


@pytest.mark.parametrize(
    "spec, message",
    [
        ("ttft", "--slo 'ttft': 'ttft' is not key=value"),
        ("latency=1", "--slo 'latency=1': unknown SLO field 'latency'"),
        ("ttft=fast", "--slo 'ttft=fast': 'ttft' needs a number of seconds, got 'fast'"),
        ("ttft=-1", "--slo 'ttft=-1': 'ttft' must be a positive number of seconds"),
        ("ttft=0", "--slo 'ttft=0': 'ttft' must be a positive number of seconds"),
        ("ttft=nan", "--slo 'ttft=nan': 'ttft' must be a positive number of seconds"),
        ("tier=:ttft=1", "--slo 'tier=:ttft=1': empty tier name"),
        ("tier=a", "--slo 'tier=a': write 'tier=NAME:' before the fields"),
        ("tenant=a:", "--slo 'tenant=a:': no SLO fields"),
        ("ttft=1,ttft_s=2", "--slo 'ttft=1,ttft_s=2': 'ttft_s' given twice"),
    ],
)
def test_parse_cli_errors(spec, message):
    with pytest.raises(ServelabError) as err:
        SloTable.parse_cli([spec])
    assert str(err.value).startswith(message)


def test_from_toml_nested_and_flat():
    data = {"slo": {"ttft_s": 0.5, "tpot": 0.05, "tier": {"priority": {"ttft_s": 0.2}}, "tenant": {"acme": {"e2e_s": 9}}}}
    t = SloTable.from_toml(data)
    assert t.global_ == Slo(ttft_s=0.5, tpot_s=0.05)
    assert t.tiers == (("priority", Slo(ttft_s=0.2)),)
    assert t.tenants == (("acme", Slo(e2e_s=9.0)),)
    assert SloTable.from_toml(data["slo"]) == t


@pytest.mark.parametrize(
    "data, message",
    [
        ({"slo": {"ttft_s": "fast"}}, "slo.toml, column 'slo.ttft_s': needs a number of seconds, got 'fast'"),
        ({"ttft_s": -2}, "slo.toml, column 'ttft_s': must be a positive number of seconds, got -2"),
        ({"ttft_s": True}, "slo.toml, column 'ttft_s': needs a number of seconds, got True"),
        ({"latency": 1}, "slo.toml, column 'latency': unknown SLO field"),
        ({"tier": 3}, "slo.toml, column 'tier': 'tier' must be a table of names"),
        ({"tier": {"gold": 1}}, "slo.toml, column 'tier.gold': must be a table of SLO fields"),
        ({"tenant": {"acme": {"tpot_s": 0}}}, "slo.toml, column 'tenant.acme.tpot_s': must be a positive number"),
        ({"ttft": 1, "ttft_s": 2}, "slo.toml, column 'ttft_s': 'ttft_s' given twice"),
    ],
)
def test_from_toml_errors(data, message):
    with pytest.raises(InputError) as err:
        SloTable.from_toml(data, "slo.toml")
    assert str(err.value).startswith(message)


def test_from_toml_file(tmp_path):
    path = tmp_path / "slo.toml"
    path.write_text('ttft_s = 0.5\n[tier.priority]\nttft_s = 0.1\n')
    assert SloTable.from_toml_file(str(path)).tiers == (("priority", Slo(ttft_s=0.1)),)
    path.write_text("ttft_s = = 1\n")
    with pytest.raises(InputError, match=f"^{path}: not valid TOML"):
        SloTable.from_toml_file(str(path))
    with pytest.raises(InputError, match="file not found"):
        SloTable.from_toml_file(str(tmp_path / "none.toml"))


def test_cli_overrides_file_field_by_field():
    file = SloTable.from_toml({"ttft_s": 0.5, "tpot_s": 0.05, "tier": {"p": {"ttft_s": 0.2}}})
    flags = SloTable.parse_cli(["ttft=1", "tier=p:tpot=0.01"])
    t = file.overridden_by(flags)
    assert t.global_ == Slo(ttft_s=1.0, tpot_s=0.05)
    assert t.tiers == (("p", Slo(ttft_s=0.2, tpot_s=0.01)),)


def test_rows_and_frozen():
    t = SloTable.parse_cli(["ttft=0.5", "tenant=b:tpot=1", "tier=a:ttft=0.1"])
    rows = t.rows().to_pylist()
    assert [(r["scope"], r["name"]) for r in rows] == [("global", None), ("tier", "a"), ("tenant", "b")]
    assert rows[2]["tpot_s"] == 1.0 and rows[2]["ttft_s"] is None
    assert SloTable().rows().num_rows == 0 and SloTable().is_empty
    with pytest.raises(AttributeError):
        t.global_ = Slo()  # type: ignore[misc]
    assert hash(t) == hash(SloTable.parse_cli(["tier=a:ttft=0.1", "ttft=0.5", "tenant=b:tpot=1"]))


def test_slo_keys_beside_an_slo_table_are_refused_not_dropped(tmp_path):
    path = tmp_path / "slo_mixed.toml"
    path.write_text('[slo]\nttft = "500ms"\n[tenant.a]\ne2e = "30s"\n[whatever]\nx = 1\n')
    with pytest.raises(InputError, match=r"slo_mixed.toml, column 'tenant': 'tenant' is outside the \[slo\] table.*"
                                         r"put it under \[slo\] \(e.g. \[slo.tenant.a\]\)"):
        SloTable.from_toml_file(str(path))
    path.write_text('ttft = "1s"\n[slo]\ntpot = "50ms"\n')
    with pytest.raises(InputError, match="'ttft' is outside the \\[slo\\] table"):
        SloTable.from_toml_file(str(path))
    # other sections of a config or spec file are not ours to read
    path.write_text('[slo]\nttft = "500ms"\n[slo.tenant.a]\ne2e = "30s"\n[whatever]\nx = 1\n')
    t = SloTable.from_toml_file(str(path))
    assert t.global_ == Slo(ttft_s=0.5) and t.tenants == (("a", Slo(e2e_s=30.0)),)
