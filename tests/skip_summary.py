"""A pytest plugin (loaded by conftest.py): one line that says why tests were skipped.

Without ``-rs`` pytest only counts skips ("40 skipped"); this adds, before pytest's own closing
line, e.g. ``40 skipped: 31 shared trace data not available, 9 needs a CUDA GPU (-rs lists each)``.
Reasons that differ only in the path after a colon count as one.
"""

from __future__ import annotations

from collections import Counter


def skip_reason(report) -> str:
    longrepr = report.longrepr
    text = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    text = text.removeprefix("Skipped: ").strip()
    head, sep, _ = text.partition(": /")  # "shared trace data not available: /path/x" -> one reason
    return head if sep else text


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    skipped = [r for r in terminalreporter.stats.get("skipped", []) if getattr(r, "longrepr", None) is not None]
    if not skipped or "s" in getattr(terminalreporter, "reportchars", "").lower():
        return  # -rs / -ra already list every skip
    counts = Counter(skip_reason(r) for r in skipped)
    reasons = ", ".join(f"{n} {why}" for why, n in counts.most_common())
    terminalreporter.write_line(f"{len(skipped)} skipped: {reasons} (-rs lists each)")
