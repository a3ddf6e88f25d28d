"""What a trace importer returns (`Imported`) and the registry of importers by format name.

Apart from the importers (traces/importers.py, traces/servegen.py) so that each registers itself here
without importing the other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import pyarrow as pa

from servelab.common.registry import Registry


@dataclass(frozen=True)
class Imported:
    """An import's result: the trace table (sorted, ids from 0) plus what the summary reports."""

    table: pa.Table
    source: str
    prefix_block_tokens: int | None
    rows_read: int
    dropped: dict[str, int]
    files: tuple[str, ...]
    read_unit: str = "rows"  # what rows_read counts ("clients" for ServeGen)
    warnings: tuple[str, ...] = ()  # things a user should know (the CLI prints each as "warning: ...")

    @property
    def span_s(self) -> float:
        arrival = self.table.column("arrival_s")
        return float(arrival[-1].as_py() - arrival[0].as_py()) if len(arrival) else 0.0

    def summary(self) -> str:
        dropped = ", ".join(f"{n} {why}" for why, n in self.dropped.items() if n) or "none"
        return (
            f"{self.table.num_rows} requests from {self.rows_read} {self.read_unit} in {len(self.files)} source(s); "
            f"dropped: {dropped}; span {self.span_s:.1f} s"
        )


Importer = Callable[..., Imported]
IMPORTERS: Registry[Importer] = Registry("trace format", package="servelab.traces")


__all__ = ["IMPORTERS", "Imported", "Importer"]
