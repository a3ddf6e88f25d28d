"""Importers: the bundled fixture slices, the full shared samples, and one test per bad-row rule."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner
from helpers_traces import FIXTURES, assert_input_error, no_files_like, shared
from helpers_traces import strings as _strings

from servelab.cli.main import cli
from servelab.common.errors import InputError, ServelabError
from servelab.traces import transforms
from servelab.traces.arrivals import ArrivalConfig
from servelab.traces.importers import import_trace
from servelab.traces.info import trace_info
from servelab.traces.io import read_trace, write_trace

AZURE_HEAD = FIXTURES / "azure_conv_2023_head300.csv"
VIDUR_HEAD = FIXTURES / "vidur_splitwise_conv_head300.csv"


# ---- fixture slices (always run)


def test_azure_2023_matches_vidur_preparse():
    a = import_trace("azure", [AZURE_HEAD]).table
    v = import_trace("vidur", [VIDUR_HEAD]).table
    assert a.num_rows == v.num_rows == 300
    np.testing.assert_allclose(a.column("arrival_s").to_numpy(), v.column("arrival_s").to_numpy(), atol=1e-6)
    assert a.column("prompt_tokens").equals(v.column("prompt_tokens"))
    assert a.column("output_tokens").equals(v.column("output_tokens"))
    assert a.column("arrival_s")[1].as_py() == pytest.approx(4.314579, abs=1e-9)  # 7-digit fractions kept


def test_azure_2024_form_with_zone_and_simultaneous_arrivals():
    r = import_trace("azure", [FIXTURES / "azure_2024_form.csv"])
    arrival = r.table.column("arrival_s").to_numpy()
    assert r.table.num_rows == 40 and arrival[0] == 0.0
    # rows 2..: first is 00:00:00.501726, second 00:00:01.108173 (microsecond precision)
    assert arrival[1] == pytest.approx(1.108173 - 0.501726, abs=1e-9)
    assert (np.diff(arrival) == 0).sum() == 3
    assert np.all(np.diff(arrival) >= 0)


def test_azure_general_csv_forms(tmp_path):
    """Quoted headers in another order, extra columns, a 'T' separator, 'Z' zone and unsorted rows."""
    src = tmp_path / "other.csv"
    src.write_text(
        '"GeneratedTokens","TIMESTAMP","ContextTokens","Extra"\n'
        '5,2024-01-01T00:00:02Z,10,x\n'
        '"7",2024-01-01T00:00:00.5Z,"20",y\n'
        '9,2024-01-01 00:00:01.000000+00:00,30,z\n'
    )
    t = import_trace("azure", [src]).table
    assert t.column("arrival_s").to_pylist() == [0.0, 0.5, 1.5]
    assert t.column("prompt_tokens").to_pylist() == [20, 30, 10]
    assert t.column("request_id").to_pylist() == [0, 1, 2]


def test_azure_zone_offsets_convert_to_utc(tmp_path):
    src = tmp_path / "tz.csv"
    src.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2024-01-01 01:00:00+01:00,1,1\n2024-01-01 00:00:10+00:00,1,1\n")
    assert import_trace("azure", [src]).table.column("arrival_s").to_pylist() == [0.0, 10.0]


def test_multiple_sources_merge_renumbered_and_tagged(tmp_path):
    r = import_trace("azure", [AZURE_HEAD, FIXTURES / "azure_2024_form.csv"], tenant_from_file=True)
    t = r.table
    assert t.num_rows == 340 and t.column("request_id").to_pylist() == list(range(340))
    assert set(_strings(t, "tenant")) == {"azure_conv_2023_head300", "azure_2024_form"}
    assert np.all(np.diff(t.column("arrival_s").to_numpy()) >= 0)
    # Wall-clock sources share one clock: the 2024 rows come months after the 2023 ones.
    assert t.column("arrival_s")[300].as_py() > 100 * 86400


def test_mooncake_keeps_prefix_hashes(tmp_path):
    r = import_trace("mooncake", [FIXTURES / "mooncake_synthetic_head200.jsonl"])
    assert r.prefix_block_tokens == 512 and r.table.num_rows == 200
    first = json.loads((FIXTURES / "mooncake_synthetic_head200.jsonl").read_text().splitlines()[0])
    row0 = r.table.slice(0, 1).to_pylist()[0]
    assert row0["prefix_hashes"] == first["hash_ids"]
    assert row0["prompt_tokens"] == first["input_length"]
    out = write_trace(r.table, tmp_path / "m.arrow", r.source, r.prefix_block_tokens)
    back = read_trace(out)
    assert back.column("prefix_hashes").equals(r.table.column("prefix_hashes"))
    # Ideal reuse, recomputed by hand: tokens in blocks whose id appeared earlier / all prompt tokens.
    seen, reused, total = set(), 0, 0
    for line in (FIXTURES / "mooncake_synthetic_head200.jsonl").read_text().splitlines():
        rec = json.loads(line)
        total += rec["input_length"]
        for i, h in enumerate(rec["hash_ids"]):
            if h in seen:
                reused += min(512, rec["input_length"] - 512 * i)
            seen.add(h)
    assert reused > 0
    assert trace_info(back)["prefix_reuse_share"] == pytest.approx(reused / total, rel=1e-12)


def test_burstgpt_drops_failed_rows_and_maps_columns():
    src = FIXTURES / "burstgpt_head54.csv"
    r = import_trace("burstgpt", [src])
    assert r.rows_read == 54 and r.table.num_rows == 51
    assert r.dropped == {"failed (0 response tokens)": 3}
    assert set(_strings(r.table, "model")) == {"ChatGPT", "GPT-4"}
    assert set(_strings(r.table, "tenant")) == {"conversation", "api"}
    assert "3 failed" in r.summary()
    as_tier = import_trace("burstgpt", [src], log_type_as="tier").table
    assert set(_strings(as_tier, "tier")) == {"conversation", "api"} and "tenant" not in as_tier.column_names
    # Timestamps are seconds since the trace start; the import rebases them to the first request.
    assert as_tier.column("arrival_s")[0].as_py() == 0.0 and as_tier.column("arrival_s")[1].as_py() == 40.0


def test_lengths_with_generated_arrivals_is_seeded():
    src = FIXTURES / "sharegpt_lengths_head300.csv"
    cfg = ArrivalConfig(process="gamma", rate_per_s=4.0, cv=2.0)
    a = import_trace("lengths", [src], arrival=cfg, seed=7).table
    b = import_trace("lengths", [src], arrival=cfg, seed=7).table
    c = import_trace("lengths", [src], arrival=cfg, seed=8).table
    assert a.equals(b) and not a.equals(c)
    assert a.num_rows == 300 and a.column("prompt_tokens")[0].as_py() == 74  # file order kept
    shuffled = import_trace("lengths", [src], arrival=cfg, seed=7, shuffle=True, limit=50).table
    assert shuffled.num_rows == 50 and shuffled.column("prompt_tokens").to_pylist() != a.column("prompt_tokens").to_pylist()[:50]


# ---- bad rows: file, column, 1-based data row, rule


def _csv(tmp_path, text, name="bad.csv"):
    p = tmp_path / name
    p.write_text(text)
    return p


AZ_HEAD = "TIMESTAMP,ContextTokens,GeneratedTokens\n"
OK_ROW = "2023-11-16 18:15:46.6805900,374,44\n"

BAD_CSV = [
    ("azure", AZ_HEAD + OK_ROW + "2023-11-16 18:15:47.0,abc,44\n", "not an integer: 'abc'", "ContextTokens", 2),
    ("azure", AZ_HEAD + OK_ROW * 2 + "2023-11-16 18:15:47.0,12.5,44\n", "not an integer", "ContextTokens", 3),
    ("azure", AZ_HEAD + OK_ROW + "2023-11-16 18:15:47.0,5,0\n", "token count must be >= 1", "GeneratedTokens", 2),
    ("azure", AZ_HEAD + "2023-11-16 18:15:47.0,-5,3\n", "token count must be >= 1", "ContextTokens", 1),
    ("azure", AZ_HEAD + OK_ROW + "16/11/2023 18:15,5,3\n", "unparsable timestamp", "TIMESTAMP", 2),
    ("azure", AZ_HEAD + OK_ROW + ",5,3\n", "missing value", "TIMESTAMP", 2),
    ("azure", AZ_HEAD + OK_ROW + "2023-11-16 18:15:47.680590+02:00,5,3\n",
     "has a zone offset but the file's first timestamp has none", "TIMESTAMP", 2),
    ("azure", AZ_HEAD + "2023-11-16 18:15:46+00:00,5,3\n" + OK_ROW,
     "has no zone offset but the file's first timestamp has one", "TIMESTAMP", 2),
    ("azure", "TIMESTAMP,ContextTokens\n" + "2023-11-16 18:15:47.0,5\n", "required column is missing", "GeneratedTokens", None),
    ("azure", AZ_HEAD, "file has no data rows", None, None),
    ("azure", "", "file is empty", None, None),
    ("vidur", "arrived_at,num_prefill_tokens,num_decode_tokens\n0,1,1\n-1,1,1\n", "negative arrival time", "arrived_at", 2),
    ("vidur", "arrived_at,num_prefill_tokens,num_decode_tokens\n0,1,1\nnan,1,1\n", "not a number", "arrived_at", 2),
    ("burstgpt", "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n1,GPT-4,0,5,5,API log\n",
     "token count must be >= 1", "Request tokens", 1),
    ("burstgpt", "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n1,GPT-4,3,-1,5,API log\n",
     "token count must be >= 0", "Response tokens", 1),
    ("lengths", "num_prefill_tokens,num_decode_tokens\n5,5\n5,0\n", "token count must be >= 1", "num_decode_tokens", 2),
]


def _cli_leaves_nothing(tmp_path, fmt, src, rule):
    """The CLI fails with the same message and writes no output, not even a temporary file."""
    out = tmp_path / "out.arrow"
    result = CliRunner().invoke(cli, ["trace", "import", "--format", fmt, str(src), "-o", str(out)])
    assert result.exit_code == 1 and isinstance(result.exception, InputError)
    assert rule in str(result.exception)
    assert no_files_like(tmp_path, out.name)


@pytest.mark.parametrize("fmt,text,rule,column,row", BAD_CSV)
def test_bad_csv_rows(tmp_path, fmt, text, rule, column, row):
    src = _csv(tmp_path, text)
    with pytest.raises(InputError) as err:
        import_trace(fmt, [src])
    assert_input_error(err, src, rule, column, row)
    _cli_leaves_nothing(tmp_path, fmt, src, rule)


def test_azure_drop_zero_counts_rows(tmp_path):
    src = _csv(tmp_path, AZ_HEAD + OK_ROW + "2023-11-16 18:15:47.0,5,0\n" + "2023-11-16 18:15:48.0,0,3\n")
    r = import_trace("azure", [src], drop_zero=True)
    assert r.table.num_rows == 1 and r.dropped == {"zero-token rows": 2}


def test_every_row_dropped_is_an_error(tmp_path):
    src = _csv(tmp_path, "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n1,GPT-4,0,0,0,API log\n")
    with pytest.raises(InputError, match="every row was dropped"):
        import_trace("burstgpt", [src])


MOONCAKE_BAD = [
    ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]}\n{"timestamp": 1, "input_length": 5,\n',
     "not valid JSON", None, 2),
    ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]}\n{"timestamp": 1, "output_length": 1, "hash_ids": [1]}\n',
     "missing value", "input_length", 2),
    ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]}\n{"timestamp": 1, "input_length": "x", "output_length": 1, "hash_ids": [1]}\n',
     "not a number", "input_length", 2),
    ('{"timestamp": 0, "input_length": 5, "output_length": 0, "hash_ids": [1]}\n', "token count must be >= 1", "output_length", 1),
    ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": "abc"}\n', "list of integers", "hash_ids", 1),
    ('{"timestamp": -5, "input_length": 5, "output_length": 1, "hash_ids": [1]}\n', "negative timestamp", "timestamp", 1),
    ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [9223372036854775808]}\n',
     "block id 9223372036854775808 is outside the signed 64-bit range (-2^63 .. 2^63 - 1)", "hash_ids", 1),
]


@pytest.mark.parametrize("text,rule,column,row", MOONCAKE_BAD)
def test_bad_mooncake_rows(tmp_path, text, rule, column, row):
    src = _csv(tmp_path, text, "bad.jsonl")
    with pytest.raises(InputError) as err:
        import_trace("mooncake", [src])
    assert_input_error(err, src, rule, column, row)
    _cli_leaves_nothing(tmp_path, "mooncake", src, rule)


def test_unknown_format_and_missing_file(tmp_path):
    with pytest.raises(ServelabError, match="unknown trace format 'nope'"):
        import_trace("nope", [AZURE_HEAD])
    with pytest.raises(InputError, match="file not found"):
        import_trace("azure", [tmp_path / "absent.csv"])


# ---- the full shared samples (skipped where shared/ is absent)


def test_full_azure_conv_and_vidur_cross_check():
    a = import_trace("azure", [shared("azure_llm_2023/AzureLLMInferenceTrace_conv.csv")]).table
    v = import_trace("vidur", [shared("vidur/splitwise_conv.csv")]).table
    assert a.num_rows == v.num_rows == 19366
    np.testing.assert_allclose(a.column("arrival_s").to_numpy(), v.column("arrival_s").to_numpy(), atol=1e-6)
    assert a.column("prompt_tokens").equals(v.column("prompt_tokens"))
    assert a.column("output_tokens").equals(v.column("output_tokens"))


def test_full_mooncake():
    r = import_trace("mooncake", [shared("mooncake/synthetic_trace.jsonl")])
    assert r.table.num_rows == 3993
    share = trace_info(r.table.replace_schema_metadata({"prefix_block_tokens": "512"}))["prefix_reuse_share"]
    assert share == pytest.approx(0.65, abs=0.02)


def test_full_burstgpt_and_lengths():
    r = import_trace("burstgpt", [shared("burstgpt/BurstGPT_1_head54_via_fnstggl-energy2.csv")])
    assert r.table.num_rows == 51 and sum(r.dropped.values()) == 3
    for name, rows in [("sharegpt_8k_filtered_stats_llama2_tokenizer.csv", 30731),
                       ("arxiv_summarization_stats_llama2_tokenizer_filtered_v2.csv", 28257)]:
        assert import_trace("lengths", [shared(f"lengths/{name}")]).table.num_rows == rows


def test_a_source_given_twice_is_refused(tmp_path):
    # Every request would be imported twice: double the load.
    copy_link = tmp_path / "again.csv"
    copy_link.symlink_to(AZURE_HEAD)
    for second in (AZURE_HEAD, copy_link):
        with pytest.raises(InputError) as err:
            import_trace("azure", [AZURE_HEAD, second])
        assert_input_error(err, second, f"given twice (also as {AZURE_HEAD}): each source file once")
    r = CliRunner().invoke(cli, ["trace", "import", str(AZURE_HEAD), str(AZURE_HEAD), "-o", str(tmp_path / "t.arrow")])
    assert r.exit_code == 1 and "given twice" in str(r.exception)
    assert no_files_like(tmp_path, "t.arrow")


def test_gzipped_sources_are_detected_through_the_compression(tmp_path):
    import gzip

    from servelab.traces.importers import detect_format

    cases = [(AZURE_HEAD, "azure"), (FIXTURES / "mooncake_synthetic_head200.jsonl", "mooncake")]
    for src, fmt in cases:
        packed = tmp_path / (src.name + ".gz")
        packed.write_bytes(gzip.compress(src.read_bytes()))
        assert detect_format([packed]) == fmt
        r = CliRunner().invoke(cli, ["trace", "import", str(packed), "-o", str(tmp_path / f"{fmt}.arrow")])
        assert r.exit_code == 0, r.output
        got, plain = read_trace(tmp_path / f"{fmt}.arrow"), import_trace(fmt, [src]).table
        assert got.column("arrival_s").equals(plain.column("arrival_s"))
        assert got.column("prompt_tokens").equals(plain.column("prompt_tokens"))


def test_mooncake_files_keep_their_block_ids_apart_as_merge_does(tmp_path):
    # Each Mooncake file numbers its hash_ids from 0: the same id in two files is two blocks.
    src = FIXTURES / "mooncake_synthetic_head200.jsonl"
    other = tmp_path / "other.jsonl"
    other.write_text(src.read_text())
    both = import_trace("mooncake", [src, other])
    one = import_trace("mooncake", [src])
    merged = transforms.merge([one.table, import_trace("mooncake", [other]).table])
    assert both.table.column("prefix_hashes").equals(merged.column("prefix_hashes"))
    block = {"prefix_block_tokens": "512"}
    share = trace_info(both.table.replace_schema_metadata(block))["prefix_reuse_share"]
    assert share == pytest.approx(trace_info(one.table.replace_schema_metadata(block))["prefix_reuse_share"], rel=1e-9)

    def block_ids(table):
        return {h for row in table.column("prefix_hashes").to_pylist() for h in row}

    chains_one = block_ids(import_trace("mooncake-chains", [src]).table)
    assert len(block_ids(import_trace("mooncake-chains", [src, other]).table)) == 2 * len(chains_one)


def _mooncake_lines(tmp_path, pairs, name="m.jsonl"):
    src = tmp_path / name
    src.write_text("".join(json.dumps({"timestamp": i, "input_length": length, "output_length": 3,
                                       "hash_ids": list(range(ids))}) + "\n" for i, (length, ids) in enumerate(pairs)))
    return src


def test_mooncake_block_size_that_most_rows_disagree_with_is_an_error_naming_the_one_that_fits(tmp_path):
    src = FIXTURES / "mooncake_synthetic_head200.jsonl"
    for wrong in (256, 1024):
        with pytest.raises(InputError) as err:
            import_trace("mooncake", [src], block_tokens=wrong)
        assert_input_error(err, src, f"rows have len(hash_ids) != ceil(input_length / {wrong})", "hash_ids", 1)
        assert err.value.rule.endswith(f"the block size is not {wrong}; they fit --block-tokens 512")
    assert import_trace("mooncake", [src]).warnings == ()
    # 100 tokens in 5 blocks and 3,000 in 1 fit no single size
    bad = _mooncake_lines(tmp_path, [(1000, 2), (100, 5), (3000, 1)])
    with pytest.raises(InputError) as err:
        import_trace("mooncake", [bad])
    assert_input_error(err, bad, "2 of 3 rows have len(hash_ids) != ceil(input_length / 512) (this one: 100 tokens, "
                       "5 ids): the block size is not 512; no single block size fits them", "hash_ids", 2)
    odd = _mooncake_lines(tmp_path, [(1000, 10), (950, 10), (901, 10)])
    with pytest.raises(InputError, match=r"they fit --block-tokens 100$"):  # only 100 fits all three
        import_trace("mooncake", [odd])
    with pytest.raises(InputError, match=r"they fit --block-tokens 91 to 99$"):  # no power of two among them
        import_trace("mooncake", [_mooncake_lines(tmp_path, [(900, 10), (901, 10)], "range.jsonl")])


def test_mooncake_rows_a_few_of_which_disagree_with_the_block_size_warn_naming_the_first(tmp_path):
    src = _mooncake_lines(tmp_path, [(1000, 2)] * 5 + [(100, 5)] + [(600, 2)])
    r = import_trace("mooncake", [src])
    assert r.table.num_rows == 7
    assert r.warnings == (f"{src}, column 'hash_ids', row 6: 1 of 7 rows have len(hash_ids) != ceil(input_length / "
                          "512) (this one: 100 tokens, 5 ids); their prefix reuse follows the ids",)
    out = CliRunner().invoke(cli, ["trace", "import", str(src), "-o", str(tmp_path / "m.arrow")])
    assert out.exit_code == 0 and "warning: " + r.warnings[0] in out.output


def test_mooncake_chains_check_the_block_size_as_mooncake_does(tmp_path):
    src = FIXTURES / "mooncake_synthetic_head200.jsonl"
    with pytest.raises(InputError) as err:  # before: imported with the wrong size, its reuse off
        import_trace("mooncake-chains", [src], block_tokens=256)
    assert err.value.rule.endswith("the block size is not 256; they fit --block-tokens 512")
    assert import_trace("mooncake-chains", [src]).warnings == ()
    few = _mooncake_lines(tmp_path, [(1000, 2)] * 5 + [(100, 5)] + [(600, 2)])
    assert import_trace("mooncake-chains", [few]).warnings == (
        f"{few}, column 'hash_ids', row 6: 1 of 7 rows have len(hash_ids) != ceil(input_length / 512) "
        "(this one: 100 tokens, 5 ids); their prefix reuse follows the ids",)
