"""Rich tables that never cut a cell: wrap between words, else grow wider than the screen.

rich shrinks a table that is wider than its console by cutting cells (``llam…``, ``100.…``). Here
each column gets a fixed width instead: every cell keeps its longest word whole (a column made with
``no_wrap=True`` keeps every cell on one line: names people copy, numbers), headers and longer
sentences wrap between words, a column made with ``overflow="fold"`` may also break long words
over lines (down to its ``min_width``), and when even that does not fit the table is printed wider
than the screen rather than cut. The width available is ``COLUMNS`` when set, else the terminal's; piped
output (no terminal) gets every row on one line.

    from servelab.common.tables import print_table
    print_table(table)                       # to stdout
    print_table(table, console=my_console)   # into another console's file (e.g. a report buffer)
"""

from __future__ import annotations

import os
import shutil
import sys
from typing import IO

from rich import box
from rich.console import Console
from rich.measure import Measurement
from rich.table import Table

_HUGE = 1_000_000


def available_width(file: IO | None = None) -> int | None:
    """``COLUMNS`` if set, else the terminal's width when ``file`` (stdout) is one, else None (no limit)."""
    env = os.environ.get("COLUMNS", "").strip()
    if env.isdigit() and int(env) > 0:
        return int(env)
    file = sys.stdout if file is None else file
    try:
        tty = file.isatty()
    except (AttributeError, ValueError):
        tty = False
    return shutil.get_terminal_size().columns if tty else None


def _plain_console(file: IO, width: int, like: Console | None = None) -> Console:
    """A console that reads cells literally (no markup, no highlighting): a tenant named ``[x]`` stays ``[x]``."""
    return Console(
        file=file, width=max(1, width), markup=False, highlight=False, emoji=False,
        color_system=like.color_system if like is not None else None,
        force_terminal=like.is_terminal if like is not None else False,
    )  # fmt: skip


def fit_table(table: Table, width: int | None, console: Console) -> int:
    """Fix each column's width so that no word is cut, within ``width`` if possible; returns the table's width.

    ``width`` None means no limit: every column gets its widest cell (one line per row).
    """
    opts = console.options.update_width(_HUGE)
    lows, highs, folds = [], [], []
    for column in table.columns:
        foldable = column.overflow == "fold"  # the caller lets long words break (down to min_width)
        one_line = getattr(column, "_one_line", column.no_wrap)  # as made (a second fit finds no_wrap off)
        column.width = None
        titles = ([column.header] if table.show_header else []) + ([column.footer] if table.show_footer else [])
        cells = [Measurement.get(console, opts, c) for c in column.cells] or [Measurement(1, 1)]
        heads = [Measurement.get(console, opts, c) for c in titles] or [Measurement(1, 1)]
        high = max(max(m.maximum for m in cells + heads), 1)
        if foldable:
            low = min(high, max(column.min_width or 1, max(m.minimum for m in heads)))
        else:
            low = max(max(m.maximum if one_line else m.minimum for m in cells), max(m.minimum for m in heads), 1)
        column._one_line = one_line
        column.no_wrap = False  # the width holds every cell of a no_wrap column on one line; headers may wrap
        if column.min_width and not foldable:
            low, high = max(low, column.min_width), max(high, column.min_width)
        lows.append(low)
        folds.append(foldable)
        highs.append(high)
    for column in table.columns:  # measure the padding and borders around width-1 columns
        column.width = 1
    overhead = Measurement.get(console, opts, table).maximum - len(table.columns)
    natural, least = sum(highs) + overhead, sum(lows) + overhead
    if width is None or natural <= width:
        widths = highs
    elif least >= width:
        widths = lows
    else:  # unbreak folded words first, then share the room in proportion to what each column would like
        widths = list(lows)
        room = width - least
        for i in (i for i, fold in enumerate(folds) if fold):
            extra = min(room, highs[i] - widths[i])
            widths[i] += extra
            room -= extra
        wants = [h - w for h, w in zip(highs, widths)]
        total = sum(wants)
        for i, want in enumerate(wants):
            if total:
                widths[i] += min(want, room * want // total)
        left = width - (sum(widths) + overhead)
        for i in range(len(widths)):
            extra = min(left, highs[i] - widths[i])
            widths[i] += extra
            left -= extra
    for column, w in zip(table.columns, widths):
        column.width = w
    return sum(widths) + overhead


# C0/C1 control characters but the newline (a cell may hold several lines): a tenant named with an
# escape sequence would otherwise reach the terminal raw, and recolour or retitle it
_CONTROLS = {c: f"\\x{c:02x}" for c in (*range(0x00, 0x0A), *range(0x0B, 0x20), *range(0x7F, 0xA0))}


def escape_controls(text: str) -> str:
    """``text`` with its control characters (ESC, BEL, CR, ..., not the newline) written as ``\\xNN``."""
    return text.translate(_CONTROLS)


def _escape_cells(table: Table) -> None:
    from rich.text import Text

    for column in table.columns:
        cells = column._cells
        for i, cell in enumerate(cells):
            if isinstance(cell, str):
                cells[i] = escape_controls(cell)
            elif isinstance(cell, Text) and escape_controls(cell.plain) != cell.plain:
                cells[i] = Text(escape_controls(cell.plain), style=cell.style)
    for column in table.columns:
        if isinstance(column.header, str):
            column.header = escape_controls(column.header)


def print_table(table: Table, console: Console | None = None, width: int | None | str = "auto") -> None:
    """Print ``table`` with nothing cut, to ``console``'s file (default stdout); control characters in
    cells (from names in the data) are printed escaped.

    ``width`` is the room to fit in: "auto" takes ``available_width()`` of that file (piped output:
    no limit). A table that does not fit loses its frame (2 spaces between columns); one that still
    cannot fit without cutting a word is printed wider.
    """
    file = console.file if console is not None else sys.stdout
    _escape_cells(table)
    if width == "auto":
        width = available_width(file)
    out = _plain_console(file, _HUGE, console)
    needed = fit_table(table, width, out)
    if width is not None and needed > width:  # switch to the compact layout: no frame, 2 spaces between columns
        table.box, table.show_edge, table.collapse_padding, table.pad_edge = box.SIMPLE_HEAD, False, True, False
        needed = fit_table(table, width, out)
    out.width = max(needed, 1)
    out.print(table)


def table_text(table: Table, width: int | None = None) -> str:
    """The table as text (no colour, trailing spaces stripped), fitted into ``width`` (None: no limit)."""
    import io

    buf = io.StringIO()
    print_table(table, _plain_console(buf, _HUGE), width=width)
    return "\n".join(line.rstrip() for line in buf.getvalue().splitlines()) + "\n"


__all__ = ["available_width", "escape_controls", "fit_table", "print_table", "table_text"]
