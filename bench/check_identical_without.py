"""check_identical.py, with steps.parquet fingerprinted by content without one column: to show that
a change which adds a steps column leaves every other byte of every case's outputs as it was.

    .venv/bin/python bench/check_identical_without.py tier_bytes > after.txt     # on the new code
    (the same script, on the old code, gives before.txt; a column it lacks is simply not there)
    diff before.txt after.txt

requests.parquet and tokens.parquet keep check_identical's file digests.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import check_identical  # noqa: E402


def content_digest(path: Path, drop: str) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    if drop in table.column_names:
        table = table.drop([drop])
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table.combine_chunks())
    return hashlib.sha256(sink.getvalue().to_pybytes()).hexdigest()[:16]


def main() -> None:
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    drop = sys.argv[1]

    def report(name: str, run_dir: Path) -> None:
        parts = []
        for f in ("requests.parquet", "steps.parquet", "tokens.parquet"):
            path = Path(run_dir) / f
            if path.exists():
                value = content_digest(path, drop) if f == "steps.parquet" else check_identical.digest(path)
                parts.append(f"{f.split('.')[0]}={value}")
        print(f"{name}: {' '.join(parts)}", flush=True)

    check_identical.report = report
    sys.argv = sys.argv[:1]
    check_identical.main()


if __name__ == "__main__":
    main()
