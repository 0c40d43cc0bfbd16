"""Logical arrays assembled from pieces of stored flat arrays (ZeRO partitions, sharded state).

Sharded training keeps a tensor as slices of per-rank flat buffers (ZeRO: a parameter is a
range of a rank's flat fp32 partition, or spans two ranks' partitions). dstt stores those flat
buffers as they are — one 1-d array per rank and buffer, so every rank writes only its own
chunks — and describes how to put the tensors back together in **shard maps**: objects named
``shards/<anything>`` (tagged JSON) of the commit::

    {"format": 1, "arrays": {"<logical path>": {"dtype": "float32", "shape": [16, 8],
        "pieces": [[<source array path>, <source start>, <logical start>, <length>], ...]}}}

Offsets and lengths count elements of the flat C-order tensor. Each rank writes its own map
(the pieces it holds); a reader merges every map of the commit, so the logical tensor
``params/layers/0/attn/weight`` looks the same whatever the parallelism that wrote it. The
pieces of a logical array must tile it exactly (no gap, no overlap) and sources must be 1-d
arrays of the same dtype in the same commit (``CorruptRunError`` otherwise).
Rejected alternative: gathering full tensors at save time — a collective and a full copy on
the training path, and rank 0 would write everything (two ranks' bytes through one disk queue).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import CorruptRunError
from .format.zarr_meta import numpy_dtype

__all__ = [
    "SHARDS_PREFIX",
    "LogicalArray",
    "Piece",
    "logical_arrays",
    "merge_shard_maps",
    "read_logical",
    "shard_map",
]

SHARDS_PREFIX = "shards/"
SHARDS_FORMAT = 1


@dataclass(frozen=True)
class Piece:
    """``length`` elements of ``source`` from ``src_start`` are logical elements from
    ``dst_start``."""

    source: str
    src_start: int
    dst_start: int
    length: int


@dataclass(frozen=True)
class LogicalArray:
    """A tensor that exists only as pieces of stored flat arrays."""

    path: str
    dtype: str
    shape: tuple[int, ...]
    pieces: tuple[Piece, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def shard_map(arrays: Iterable[LogicalArray]) -> dict[str, Any]:
    """The object to store (as ``shards/<name>``) describing ``arrays``' pieces."""
    return {"format": SHARDS_FORMAT, "arrays": {
        a.path: {"dtype": a.dtype, "shape": list(a.shape),
                 "pieces": [[p.source, p.src_start, p.dst_start, p.length] for p in a.pieces]}
        for a in arrays}}


def merge_shard_maps(maps: Iterable[tuple[str, Any]]) -> dict[str, LogicalArray]:
    """Merge ``(where, shard map)`` pairs into logical arrays (pieces sorted, not checked)."""
    dtypes: dict[str, tuple[str, tuple[int, ...]]] = {}
    pieces: dict[str, list[Piece]] = {}
    for where, m in maps:
        if not isinstance(m, dict) or m.get("format") != SHARDS_FORMAT:
            raise CorruptRunError(f"{where}: not a shard map of format {SHARDS_FORMAT}")
        try:
            for path, a in m["arrays"].items():
                kind = (str(a["dtype"]), tuple(int(s) for s in a["shape"]))
                if dtypes.setdefault(path, kind) != kind:
                    raise CorruptRunError(f"{where}: logical array {path!r} is {kind} here and "
                                          f"{dtypes[path]} in another shard map")
                pieces.setdefault(path, []).extend(
                    Piece(str(p[0]), int(p[1]), int(p[2]), int(p[3])) for p in a["pieces"])
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
            raise CorruptRunError(f"{where}: malformed shard map ({e!r})") from None
    return {path: LogicalArray(path, dtypes[path][0], dtypes[path][1],
                               tuple(sorted(ps, key=lambda p: p.dst_start)))
            for path, ps in pieces.items()}


def _check(a: LogicalArray, table: Mapping[str, Any], where: str) -> None:
    pos = 0
    for p in a.pieces:
        src = table.get(p.source)
        if src is None:
            raise CorruptRunError(f"{where}: {a.path!r} has a piece in {p.source!r}, which this "
                                  "commit does not hold")
        if src.dtype != a.dtype or len(src.shape) != 1:
            raise CorruptRunError(f"{where}: piece source {p.source!r} is {src.dtype}"
                                  f"{tuple(src.shape)}, not a 1-d {a.dtype} array")
        if p.length <= 0 or p.src_start < 0 or p.src_start + p.length > src.shape[0]:
            raise CorruptRunError(f"{where}: piece {p} of {a.path!r} is out of its source's "
                                  f"bounds ({src.shape[0]} elements)")
        if p.dst_start != pos:
            raise CorruptRunError(f"{where}: the pieces of {a.path!r} leave a gap or overlap at "
                                  f"element {min(pos, p.dst_start)}")
        pos += p.length
    if pos != a.numel:
        raise CorruptRunError(f"{where}: the pieces of {a.path!r} cover {pos} of its "
                              f"{a.numel} elements")


def logical_arrays(reader: Any, header: Any,
                   table: Mapping[str, Any] | None = None) -> dict[str, LogicalArray]:
    """Every logical array of a commit (empty when it has no shard maps), validated against
    the commit's arrays ``table`` (default: ``reader.arrays(header)``)."""
    names = sorted(n for n in header.objects if n.startswith(SHARDS_PREFIX))
    if not names:
        return {}
    where = f"{reader.storage.location} step {header.step}"
    maps = [(f"{where} object {n!r}", reader.read_object(header, n)) for n in names]
    out = merge_shard_maps(maps)
    table = reader.arrays(header) if table is None else table
    for a in out.values():
        if a.path in table:
            raise CorruptRunError(f"{where}: {a.path!r} is both a stored and a logical array")
        _check(a, table, where)
    return out


def read_logical(reader: Any, header: Any, a: LogicalArray, start: int = 0,
                 stop: int | None = None) -> np.ndarray:
    """Elements ``[start, stop)`` of the flattened logical array, reading only the chunks of
    the pieces that hold them (numpy, the stored dtype; bfloat16 as ``ml_dtypes``)."""
    stop = a.numel if stop is None else min(stop, a.numel)
    start = max(0, start)
    out = np.empty(max(0, stop - start), dtype=numpy_dtype(a.dtype))
    for p in a.pieces:
        lo, hi = max(start, p.dst_start), min(stop, p.dst_start + p.length)
        if lo >= hi:
            continue
        s = p.src_start + (lo - p.dst_start)
        out[lo - start: hi - start] = reader.read_rows(header, p.source, s, s + (hi - lo))
    return out
