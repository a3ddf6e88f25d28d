"""A trace or run importer is one file that registers itself (issue #27 item 3): registered alone, with its
test of a source's first bytes (``@detects``), it is detected, offered by ``--format``, and takes the
command-line options its signature names, with no edit to the command line or to detection."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers_cli import run_main
from servelab.common.sniff import detects
from servelab.fidelity.base import IMPORTERS as RUN_IMPORTERS
from servelab.fidelity.base import detect_format as detect_run_format
from servelab.traces.imported import IMPORTERS
from servelab.traces.importers import detect_format
from servelab.traces.io import read_trace

FIX = Path(__file__).parent / "fixtures" / "real_runs"


@pytest.fixture
def registries(monkeypatch):
    """Both importer registries, loaded, with what a test registers forgotten after it."""
    for registry in (IMPORTERS, RUN_IMPORTERS):
        registry.load(plugins=True)
        monkeypatch.setattr(registry, "_items", dict(registry._items))


def test_a_trace_importer_registered_alone_is_detected_and_takes_the_options_it_names(tmp_path, capsys, registries):
    @IMPORTERS.register("tiny")
    @detects(lambda probe: probe.line.startswith("#tiny"), order=5)
    def import_tiny(paths, seed=0, limit=None):
        """'#tiny' then PROMPT,OUTPUT pairs: the lengths importer's work, under another header."""
        pairs = tmp_path / "pairs.csv"
        pairs.write_text("num_prefill_tokens,num_decode_tokens\n" + "".join(
            line + "\n" for p in paths for line in p.read_text().splitlines()[1:]))
        return IMPORTERS.get("lengths")([pairs], seed=seed, limit=limit)

    src = tmp_path / "a.tiny"
    src.write_text("#tiny\n5,3\n7,2\n9,4\n")
    assert detect_format([src]) == "tiny"
    code, out, err = run_main(["trace", "import", src, "-o", tmp_path / "t.arrow", "--limit", "2", "--seed", "1"], capsys)
    assert code == 0, err
    assert "format: tiny (detected" in err and read_trace(tmp_path / "t.arrow").num_rows == 2
    code, _, err = run_main(["trace", "import", "--format", "tiny", src, "-o", tmp_path / "u.arrow", "--drop-zero"],
                            capsys)
    assert code == 1 and "--drop-zero does not apply to --format tiny" in err
    code, out, _ = run_main(["trace", "import", "--help"], capsys)
    assert "tiny" in out


def test_a_run_importer_registered_alone_is_detected_and_offered(tmp_path, capsys, registries):
    timestamps = RUN_IMPORTERS.get("timestamps-jsonl")

    @RUN_IMPORTERS.register("tiny-run")
    @detects(lambda probe: probe.path.suffix == ".tinyrun", order=1)
    def import_tiny_run(paths):
        return timestamps(paths)

    src = tmp_path / "requests.tinyrun"
    src.write_text((FIX / "rtx4090" / "requests.jsonl").read_text())
    assert detect_run_format([src]) == "tiny-run"
    assert detect_run_format([FIX / "rtx4090" / "requests.jsonl"]) == "timestamps-jsonl"
    code, _, err = run_main(["run", "import", "--format", "tiny-run", src, "-o", tmp_path / "run",
                             "--setting", "gpu=rtx-4090", "--setting", "model=llama-3.1-8b"], capsys)
    assert code == 0, err
    assert (tmp_path / "run" / "run.json").is_file()
