"""common/atomic.py recognises a destination's temporaries by one precompiled suffix pattern: the same names as the
per-name regex it replaced."""

from __future__ import annotations

import re

from servelab.common.atomic import _temp_match, owner_tag


def _old_pattern(name: str) -> re.Pattern:  # the per-destination regex before issue #31's search work
    return re.compile(
        rf"^\.{re.escape(name)}\.(?:h(?P<host>[0-9a-f]{{8}})p(?P<pid>\d+)s(?P<token>\d+)\.[A-Za-z0-9_]+(?P<old>\.old)?"
        rf"|(?P<legacy>[a-z0-9_]{{8}}))\.tmp(?:\.wal)?$"
    )


def test_temp_names_match_as_before():
    tag = owner_tag()
    dests = ["0007", "run.json", "a.b", "trials.parquet", "x+y(1)", "0007.h"]
    names = []
    for d in dests:
        names += [f".{d}.{tag}.ab_12.tmp", f".{d}.{tag}.ab_12.old.tmp", f".{d}.{tag}.ab.tmp.wal", f".{d}.abcdefgh.tmp",
                  f".{d}.ABCDEFGH.tmp", f".{d}.{tag}.ab.tmpx", f"{d}.{tag}.ab.tmp", f".{d}.{tag}..tmp", f".{d}x.abcdefgh.tmp",
                  f".{d}.hzzzzzzzzp1s2.a.tmp", f".{d}.abcdefgh.tmp\n", d]  # fmt: skip
    matched = 0
    for d in dests:
        old = _old_pattern(d)
        for name in names:
            new, before = _temp_match(d, name), old.match(name)
            assert (new is None) == (before is None), (d, name)
            if new is not None:
                matched += 1
                assert new.group("host", "pid", "token", "old", "legacy") == before.group("host", "pid", "token", "old", "legacy")
    assert matched >= 4 * len(dests)
