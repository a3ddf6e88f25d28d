"""Atomic writes: all or nothing, ordinary permissions."""

from __future__ import annotations

import os
import stat

import pytest

from servelab.common.atomic import atomic_dir, atomic_path


def test_atomic_path_leaves_nothing_on_failure(tmp_path):
    dest = tmp_path / "out.txt"
    with pytest.raises(RuntimeError):
        with atomic_path(dest) as tmp:
            tmp.write_text("half")
            raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []


def test_atomic_path_gives_umask_permissions(tmp_path):
    dest = tmp_path / "out.txt"
    with atomic_path(dest) as tmp:
        tmp.write_text("whole")
    mask = os.umask(0)
    os.umask(mask)
    assert dest.read_text() == "whole"
    assert stat.S_IMODE(dest.stat().st_mode) == 0o666 & ~mask


def test_atomic_dir_replaces_only_on_success(tmp_path):
    dest = tmp_path / "run"
    with atomic_dir(dest) as tmp:
        (tmp / "a").write_text("1")
    with pytest.raises(RuntimeError):
        with atomic_dir(dest) as tmp:
            (tmp / "a").write_text("2")
            raise RuntimeError("boom")
    assert (dest / "a").read_text() == "1"
    assert [p.name for p in tmp_path.iterdir()] == ["run"]


def test_parse_fields_names_the_option_on_bad_input():
    from servelab.common.errors import ServelabError
    from servelab.common.fields import parse_fields

    assert parse_fields(" a=1, b = x ,", ("a", "b"), "opt") == {"a": "1", "b": "x"}
    with pytest.raises(ServelabError, match=r"opt: unknown field 'c=2' \(fields: a, b\)"):
        parse_fields("a=1,c=2", ("a", "b"), "opt")
    with pytest.raises(ServelabError, match="opt: 'a' given twice"):
        parse_fields("a=1,a=2", ("a", "b"), "opt")
