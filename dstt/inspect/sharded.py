"""Logical tensors of sharded commits (ZeRO partitions) as ordinary arrays-table records.

A ZeRO commit stores flat per-rank buffers plus shard maps (``dstt.store.read.shards``). For
inspection its arrays table is augmented: every logical tensor gets a ``LogicalRecord``, an
``ArrayRecord`` whose chunk ``i`` is virtual and assembled from the pieces on read, so every
view built on records and ``read_chunk`` works unchanged and lazily, whatever the
parallelism. The flat sources stay in the table (``shard_sources`` names them for hiding).

Rejected alternative: a second kind of backend array for logical tensors — every view
(tensor, layer, trajectory, diff, export) would need a branch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from dstt.store._internal import (
    DEFAULT_CHUNK_BYTES,
    ArrayRecord,
    LogicalArray,
    dtype_itemsize,
    logical_arrays,
    plan_chunks,
    read_logical,
)

if TYPE_CHECKING:
    from collections.abc import Mapping

    from dstt.store._internal import CommitHeader, Reader

__all__ = ["LogicalRecord", "read_logical_chunk", "shard_sources", "with_logical"]


@dataclass(frozen=True)
class LogicalRecord(ArrayRecord):
    """An arrays-table record of a logical tensor (no chunk files of its own)."""

    logical: LogicalArray | None = None


def with_logical(reader: Reader, header: CommitHeader, table: dict[str, Any]) -> dict[str, Any]:
    """``table`` plus a ``LogicalRecord`` per logical tensor of the commit."""
    found = logical_arrays(reader, header, table)
    if not found:
        return table  # unsharded: the table as it is
    out = dict(table)
    for path, a in found.items():
        rows = plan_chunks(a.shape, dtype_itemsize(a.dtype), DEFAULT_CHUNK_BYTES).rows
        # a box source has the tensor's own dims (its local shape); flat ZeRO pieces have none
        src = table.get(a.boxes[0].source) if a.boxes else None
        dims = getattr(src, "dims", None)
        out[path] = LogicalRecord(
            path, a.dtype, a.shape, rows, (), logical=a, **({"dims": dims} if dims else {})
        )
    return out


def read_logical_chunk(
    reader: Reader, header: CommitHeader, rec: LogicalRecord, index: int
) -> memoryview:
    """Bytes of virtual chunk ``index`` of a logical tensor (no padding), like ``read_chunk``."""
    assert rec.logical is not None
    plan = rec.plan
    start, stop = plan.byte_range(index)
    data = read_logical(reader, header, rec.logical, start // plan.itemsize, stop // plan.itemsize)
    return data.reshape(-1).view(np.uint8).data


def shard_sources(table: Mapping[str, Any]) -> set[str]:
    """Stored arrays that only serve as pieces of logical tensors (hidden in layer views)."""
    return {
        src
        for rec in table.values()
        if isinstance(rec, LogicalRecord) and rec.logical is not None
        for src in rec.logical.sources
    }
