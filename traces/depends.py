"""Validation of a trace's request dependencies (schema v2 ``depends_on``): every parent exists, no
request waits for itself through a cycle, and no parent arrives after its child.

A row's ``depends_on`` lists the ``request_id``s it waits for (null or empty: none). The checks run
on whole columns with numpy; only a trace whose rows are out of dependency order (a parent on a
later row, possible when arrivals tie) is walked in Python to look for a cycle.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from servelab.common.errors import InputError

COLUMN = "depends_on"


def edges(table: pa.Table, path: object = "<trace>") -> tuple[np.ndarray, np.ndarray]:
    """(child rows, parent ids) of every dependency, 0-based rows, in row order; a null inside a
    list is an error."""
    import pyarrow.compute as pc

    col = table.column(COLUMN).combine_chunks()
    if isinstance(col, pa.ChunkedArray):  # (an empty chunked array stays chunked)
        col = pa.concat_arrays(col.chunks) if col.num_chunks else pa.array([], col.type)
    flat = pc.list_flatten(col)
    rows = pc.list_parent_indices(col).to_numpy(zero_copy_only=False).astype(np.int64)
    if flat.null_count:
        bad = int(rows[np.flatnonzero(flat.is_null().to_numpy(zero_copy_only=False))[0]])
        raise InputError(path, "a null inside the list (list the request ids it waits for)", column=COLUMN, row=bad + 1)
    return rows, flat.to_numpy(zero_copy_only=False).astype(np.int64)


def check(table: pa.Table, path: object) -> None:
    """Raise InputError naming the file, ``depends_on`` and the first offending row, or return."""
    if COLUMN not in table.column_names or table.column(COLUMN).null_count == table.num_rows:
        return
    child, parent_id = edges(table, path)
    if not child.size:
        return
    ids = table.column("request_id").to_numpy(zero_copy_only=False).astype(np.int64)
    order = np.argsort(ids, kind="stable")
    pos = np.searchsorted(ids[order], parent_id)
    known = pos < ids.size
    known[known] = ids[order][pos[known]] == parent_id[known]
    if not known.all():
        k = int(np.flatnonzero(~known)[0])
        raise InputError(path, f"depends on request {parent_id[k]}, which is not in the trace", column=COLUMN,
                         row=int(child[k]) + 1)
    parent = order[pos]
    self_loop = np.flatnonzero(parent == child)
    if self_loop.size:
        raise InputError(path, "depends on itself (a cycle)", column=COLUMN, row=int(child[self_loop[0]]) + 1)
    pairs = np.lexsort((parent, child))
    twice = np.flatnonzero((child[pairs][1:] == child[pairs][:-1]) & (parent[pairs][1:] == parent[pairs][:-1]))
    if twice.size:
        k = pairs[twice[0]]
        raise InputError(path, f"lists request {parent_id[k]} twice", column=COLUMN, row=int(child[k]) + 1)
    arrival = table.column("arrival_s").to_numpy(zero_copy_only=False).astype(np.float64)
    late = np.flatnonzero(arrival[parent] > arrival[child])
    if late.size:
        k = late[np.argmin(child[late])]
        raise InputError(path, f"depends on request {parent_id[k]}, which arrives later ({arrival[parent[k]]:g} s > "
                               f"{arrival[child[k]]:g} s): a parent's arrival_s must be <= its child's",
                         column=COLUMN, row=int(child[k]) + 1)  # fmt: skip
    if (parent > child).any():  # a parent on a later row (arrivals tie): the row order is no topological order
        _check_acyclic(child, parent, ids, table.num_rows, path)


def _check_acyclic(child: np.ndarray, parent: np.ndarray, ids: np.ndarray, n: int, path: object) -> None:
    """Kahn's algorithm over the dependency graph; a cycle is reported at its first row."""
    kids: dict[int, list[int]] = {}
    indegree = np.zeros(n, dtype=np.int64)
    for c, p in zip(child.tolist(), parent.tolist()):
        kids.setdefault(p, []).append(c)
        indegree[c] += 1
    ready = np.flatnonzero(indegree == 0).tolist()
    while ready:
        row = ready.pop()
        for c in kids.get(row, ()):
            indegree[c] -= 1
            if not indegree[c]:
                ready.append(c)
    stuck = np.flatnonzero(indegree > 0)
    if not stuck.size:
        return
    # walk parents inside the stuck set from its first row until a row repeats: that loop is a cycle
    parents: dict[int, int] = {}
    stuck_set = set(stuck.tolist())
    for c, p in zip(child.tolist(), parent.tolist()):
        if c in stuck_set and p in stuck_set:
            parents.setdefault(c, p)
    seen: list[int] = []
    row = int(stuck[0])
    while row not in seen:
        seen.append(row)
        row = parents[row]
    loop = seen[seen.index(row):]
    names = " waits for ".join(str(int(ids[r])) for r in [*loop, loop[0]])
    raise InputError(path, f"dependency cycle: request {names}", column=COLUMN, row=min(loop) + 1)


__all__ = ["COLUMN", "check", "edges"]
