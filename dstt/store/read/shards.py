"""Logical arrays assembled from pieces of stored flat arrays (ZeRO partitions, sharded state).

Sharded buffers are stored as they are (each rank writes only its own chunks) and described by
**shard maps**, objects ``shards/<anything>`` of the commit: per logical path a dtype, a shape
and either **pieces** (ranges of 1-d flat sources: ZeRO) or **boxes** (an offset and size per
dim of a source stored with the box's shape: FSDP2, TP). A reader merges every rank's map, so
a logical tensor looks the same whatever parallelism wrote it; pieces and boxes must tile it
exactly (``CorruptRunError``). Boxes are DCP's chunk model, so resharding is one rule
(:func:`read_region`).

Rejected alternative: gathering full tensors at save time — a collective and a full copy on
the training path, and rank 0 would write everything. Map format: docs/decisions.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from dstt import schema
from dstt.errors import CorruptRunError
from dstt.store.format.zarr_meta import numpy_dtype

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping, Sequence

    from dstt.store.format.records import CommitHeader

    from .reader import Reader

__all__ = [
    "SHARDS_PREFIX",
    "Box",
    "LogicalArray",
    "Piece",
    "logical_arrays",
    "merge_shard_maps",
    "read_logical",
    "read_region",
    "shard_map",
]

SHARDS_PREFIX = f"{schema.SHARDS_OBJECT}/"
SHARDS_FORMATS = (1, 2)


@dataclass(frozen=True)
class Piece:
    """``length`` elements of ``source`` from ``src_start`` are logical elements from
    ``dst_start``."""

    source: str
    src_start: int
    dst_start: int
    length: int


@dataclass(frozen=True)
class Box:
    """The stored array ``source`` (of shape ``sizes``) is the logical elements from
    ``offsets`` on, per dimension."""

    source: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    def overlap(
        self, offsets: Sequence[int], sizes: Sequence[int]
    ) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
        """The intersection with the region ``offsets``/``sizes`` as (start, stop) per
        dimension, in logical coordinates; None when they do not meet."""
        lo = tuple(max(a, b) for a, b in zip(self.offsets, offsets, strict=True))
        hi = tuple(
            min(a + n, b + m)
            for a, n, b, m in zip(self.offsets, self.sizes, offsets, sizes, strict=True)
        )
        if any(h <= ll for ll, h in zip(lo, hi, strict=True)):
            return None
        return lo, hi


@dataclass(frozen=True)
class LogicalArray:
    """A tensor that exists only as pieces of stored flat arrays (``pieces``) or as boxes of
    stored arrays (``boxes``): one of the two."""

    path: str
    dtype: str
    shape: tuple[int, ...]
    pieces: tuple[Piece, ...] = ()
    boxes: tuple[Box, ...] = ()

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def sources(self) -> tuple[str, ...]:
        """The stored arrays that hold it."""
        return tuple(p.source for p in self.pieces) + tuple(b.source for b in self.boxes)


def _entry(a: LogicalArray) -> dict[str, Any]:
    out: dict[str, Any] = {"dtype": a.dtype, "shape": list(a.shape)}
    if a.boxes:
        out["boxes"] = [[b.source, list(b.offsets), list(b.sizes)] for b in a.boxes]
    else:
        out["pieces"] = [[p.source, p.src_start, p.dst_start, p.length] for p in a.pieces]
    return out


def shard_map(arrays: Iterable[LogicalArray]) -> dict[str, Any]:
    """The object to store (as ``shards/<name>``) describing ``arrays``' pieces and boxes
    (format 1 while none has boxes, which older readers know)."""
    entries = {a.path: _entry(a) for a in arrays}
    boxed = any("boxes" in e for e in entries.values())
    return {"format": 2 if boxed else 1, "arrays": entries}


def merge_shard_maps(maps: Iterable[tuple[str, Any]]) -> dict[str, LogicalArray]:
    """Merge ``(where, shard map)`` pairs into logical arrays (pieces sorted, not checked)."""
    dtypes: dict[str, tuple[str, tuple[int, ...]]] = {}
    pieces: dict[str, list[Piece]] = {}
    boxes: dict[str, list[Box]] = {}
    for where, m in maps:
        if not isinstance(m, dict) or m.get("format") not in SHARDS_FORMATS:
            raise CorruptRunError(f"{where}: not a shard map of format 1 or 2")
        try:
            for path, a in m["arrays"].items():
                kind = (str(a["dtype"]), tuple(int(s) for s in a["shape"]))
                if dtypes.setdefault(path, kind) != kind:
                    raise CorruptRunError(
                        f"{where}: logical array {path!r} is {kind} here and "
                        f"{dtypes[path]} in another shard map"
                    )
                if "boxes" in a:
                    boxes.setdefault(path, []).extend(
                        Box(str(b[0]), tuple(int(o) for o in b[1]), tuple(int(n) for n in b[2]))
                        for b in a["boxes"]
                    )
                else:
                    pieces.setdefault(path, []).extend(
                        Piece(str(p[0]), int(p[1]), int(p[2]), int(p[3])) for p in a["pieces"]
                    )
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
            raise CorruptRunError(f"{where}: malformed shard map ({e!r})") from None
    both = set(pieces) & set(boxes)
    if both:
        raise CorruptRunError(f"logical array {sorted(both)[0]!r} has both pieces and boxes")
    return {
        path: LogicalArray(
            path,
            dtypes[path][0],
            dtypes[path][1],
            tuple(sorted(pieces.get(path, ()), key=lambda p: p.dst_start)),
            tuple(sorted(boxes.get(path, ()), key=lambda b: b.offsets)),
        )
        for path in dtypes
    }


def _boxes_problem(a: LogicalArray, table: Mapping[str, Any]) -> str | None:
    total = 0
    for i, b in enumerate(a.boxes):
        src = table.get(b.source)
        if src is None:
            return f"{a.path!r} has a box in {b.source!r}, which this commit does not hold"
        shape = tuple(src.shape)
        if src.dtype != a.dtype or shape != b.sizes:
            return f"box source {b.source!r} is {src.dtype}{shape}, not {a.dtype}{b.sizes}"
        if len(b.offsets) != len(a.shape) or any(
            o < 0 or n <= 0 or o + n > s
            for o, n, s in zip(b.offsets, b.sizes, a.shape, strict=True)
        ):
            return f"box {b} of {a.path!r} is out of its bounds {a.shape}"
        for other in a.boxes[:i]:
            if b.overlap(other.offsets, other.sizes) is not None:
                return f"boxes {other.source!r} and {b.source!r} of {a.path!r} overlap"
        total += math.prod(b.sizes)
    if total != a.numel:
        return f"the boxes of {a.path!r} cover {total} of its {a.numel} elements"
    return None


def _problem(a: LogicalArray, table: Mapping[str, Any]) -> str | None:
    """What keeps ``a`` from tiling its logical tensor with arrays of ``table`` (None:
    nothing)."""
    if a.path in table:
        return f"{a.path!r} is both a stored and a logical array"
    if a.boxes:
        return _boxes_problem(a, table)
    pos = 0
    for p in a.pieces:
        src = table.get(p.source)
        if src is None:
            return f"{a.path!r} has a piece in {p.source!r}, which this commit does not hold"
        if src.dtype != a.dtype or len(src.shape) != 1:
            return (
                f"piece source {p.source!r} is {src.dtype}"
                f"{tuple(src.shape)}, not a 1-d {a.dtype} array"
            )
        if p.length <= 0 or p.src_start < 0 or p.src_start + p.length > src.shape[0]:
            return (
                f"piece {p} of {a.path!r} is out of its source's bounds ({src.shape[0]} elements)"
            )
        if p.dst_start != pos:
            return (
                f"the pieces of {a.path!r} leave a gap or overlap at "
                f"element {min(pos, p.dst_start)}"
            )
        pos += p.length
    if pos != a.numel:
        return f"the pieces of {a.path!r} cover {pos} of its {a.numel} elements"
    return None


def logical_arrays(
    reader: Reader, header: CommitHeader, table: Mapping[str, Any] | None = None
) -> dict[str, LogicalArray]:
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
        problem = _problem(a, table)
        if problem is not None:
            raise CorruptRunError(f"{where}: {problem}")
    return out


def read_logical(
    reader: Reader, header: CommitHeader, a: LogicalArray, start: int = 0, stop: int | None = None
) -> np.ndarray:
    """Elements ``[start, stop)`` of the flattened logical array, reading only the chunks of
    the pieces (or boxes) that hold them (numpy, the stored dtype; bfloat16 as
    ``ml_dtypes``)."""
    stop = a.numel if stop is None else min(stop, a.numel)
    start = max(0, start)
    if a.boxes:
        if stop <= start:
            return np.empty(0, dtype=numpy_dtype(a.dtype))
        shape = a.shape or (1,)
        row = math.prod(shape[1:])
        r0, r1 = start // row, -(-stop // row)
        rows = _read_boxes(
            reader, header, a, (r0, *(0,) * (len(shape) - 1)), (r1 - r0, *shape[1:])
        ).reshape(-1)
        return rows[start - r0 * row : stop - r0 * row]
    out = np.empty(max(0, stop - start), dtype=numpy_dtype(a.dtype))
    for p in a.pieces:
        lo, hi = max(start, p.dst_start), min(stop, p.dst_start + p.length)
        if lo >= hi:
            continue
        s = p.src_start + (lo - p.dst_start)
        out[lo - start : hi - start] = reader.read_rows(header, p.source, s, s + (hi - lo))
    return out


def _read_boxes(
    reader: Reader,
    header: CommitHeader,
    a: LogicalArray,
    offsets: Sequence[int],
    sizes: Sequence[int],
) -> np.ndarray:
    out = np.empty(tuple(sizes), dtype=numpy_dtype(a.dtype))
    filled = 0
    for b in a.boxes:
        hit = b.overlap(offsets, sizes)
        if hit is None:
            continue
        lo, hi = hit
        # the overlap in the box's own coordinates: its rows, then a cut along the other axes
        cut = [slice(ll - o, h - o) for ll, h, o in zip(lo, hi, b.offsets, strict=True)]
        rows = reader.read_rows(header, b.source, cut[0].start, cut[0].stop)
        src = rows[(slice(None), *cut[1:])]
        out[tuple(slice(ll - o, h - o) for ll, h, o in zip(lo, hi, offsets, strict=True))] = src
        filled += src.size
    if filled != out.size:
        raise CorruptRunError(
            f"step {getattr(header, 'step', '?')}: the boxes of {a.path!r} "
            f"cover {filled} of the {out.size} elements asked for"
        )
    return out


def read_region(
    reader: Reader,
    header: CommitHeader,
    path: str,
    offsets: Sequence[int],
    sizes: Sequence[int],
    logical: Mapping[str, LogicalArray] | None = None,
) -> np.ndarray:
    """The box ``offsets``/``sizes`` of the tensor ``path`` of a commit, whether it is stored
    whole or as a logical array of ``logical`` (``logical_arrays(reader, header)``): a rank's
    local shard on resume, reading only the chunks that overlap it (numpy, stored dtype).
    A 0-d tensor takes ``offsets == sizes == ()``."""
    a = (logical or {}).get(path)
    sizes = tuple(int(n) for n in sizes)
    offsets = tuple(int(o) for o in offsets)
    # the box within its rows: cut along the other axes
    inner = (slice(None), *(slice(o, o + n) for o, n in zip(offsets[1:], sizes[1:], strict=True)))
    if a is None:
        if not sizes:
            return np.asarray(reader.read_array(header, path))
        box: np.ndarray = reader.read_rows(header, path, offsets[0], offsets[0] + sizes[0])
        return box[inner]
    if a.boxes:
        return _read_boxes(reader, header, a, offsets, sizes)
    shape = a.shape
    if not shape:
        return read_logical(reader, header, a).reshape(())
    row = math.prod(shape[1:])
    block = read_logical(reader, header, a, offsets[0] * row, (offsets[0] + sizes[0]) * row)
    return block.reshape(sizes[0], *shape[1:])[inner]
