"""Pure functions from names to storage keys, and the chunk plan of one tensor.

Everything that decides *where* bytes live is here, with no I/O, so the writer, the reader, gc
and docs/format.md agree by construction.

Chunking: axis 0 of every array is the slot; a tensor of shape ``(r, *rest)`` is chunked only
along its own first axis, ``rows`` rows per chunk, so each chunk is one contiguous byte range
of the C-ordered tensor. The engine can therefore copy a tensor chunk by chunk into a host
cache smaller than the tensor. Rejected alternative: zarr's n-d regular chunking of every axis —
a chunk would gather strided pieces and need a gather copy on the hot path.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from ..errors import TimelineError

__all__ = [
    "ARRAYS_PREFIX",
    "COMMITS_PREFIX",
    "DEFAULT_CHUNK_BYTES",
    "FORMAT_VERSION",
    "HEAD_KEY",
    "LOCK_KEY",
    "OBJECTS_PREFIX",
    "PARTS_PREFIX",
    "REFS_PREFIX",
    "STEP_ARRAY",
    "ChunkPlan",
    "array_meta_key",
    "check_array_path",
    "check_timeline_name",
    "chunk_key",
    "commit_arrays_key",
    "commit_key",
    "delta_key",
    "group_meta_key",
    "key_slot",
    "object_key",
    "part_key",
    "plan_chunks",
    "ref_key",
]

FORMAT_VERSION = 1
#: target size of one chunk of a large tensor: large sequential writes, small enough to overlap
DEFAULT_CHUNK_BYTES = 16 * 1024 * 1024

STEP_ARRAY = "step"
ARRAYS_PREFIX = ""  # arrays live under their own group paths (params/..., optim/...)
COMMITS_PREFIX = "_dstt/commits"
OBJECTS_PREFIX = "_dstt/objects"
REFS_PREFIX = "_dstt/refs"
PARTS_PREFIX = "_dstt/parts"  # multi-rank commits: one part manifest per rank (parts.py)
HEAD_KEY = "_dstt/HEAD.json"
LOCK_KEY = "_dstt/lock"

_SEGMENT = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*$")
_TIMELINE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}$")
_RESERVED_TOP = {"_dstt", STEP_ARRAY, "zarr.json"}


def check_array_path(path: str) -> str:
    """Validate an array path such as ``params/layers/0/attn/weight``; return it."""
    parts = path.split("/")
    if not path or any(not _SEGMENT.match(p) or p in ("zarr.json",) or p.startswith(("c.", "d."))
                       for p in parts):
        raise ValueError(
            f"invalid array path {path!r}: use '/'-separated segments of letters, digits, "
            "'_', '-', '.', not starting with 'c.' or 'd.'"
        )
    if parts[0] in _RESERVED_TOP:
        raise ValueError(f"invalid array path {path!r}: {parts[0]!r} is reserved by dstt")
    return path


def check_timeline_name(name: str) -> str:
    if not isinstance(name, str) or not _TIMELINE.match(name):
        raise TimelineError(
            f"invalid timeline name {name!r}: 1-64 characters of letters, digits, '_', '-', '.'"
        )
    return name


def array_meta_key(path: str) -> str:
    return f"{path}/zarr.json"


def group_meta_key(path: str) -> str:
    return f"{path}/zarr.json" if path else "zarr.json"


def chunk_key(path: str, slot: int, index: tuple[int, ...]) -> str:
    """Zarr v3 default chunk key encoding with separator '.': ``c.<slot>.<i>.<j>...``."""
    return f"{path}/c." + ".".join(str(i) for i in (slot, *index))


def delta_key(path: str, slot: int, index: tuple[int, ...]) -> str:
    """A delta chunk: not a Zarr chunk key, so plain readers see the slot as missing."""
    return f"{path}/d." + ".".join(str(i) for i in (slot, *index))


def key_slot(key: str) -> int | None:
    """The slot a chunk or delta file belongs to (``.../c.<slot>...``, ``.../d.<slot>...``);
    a record whose key is in an older slot than its commit is a dedup reference."""
    name = key.rsplit("/", 1)[-1]
    parts = name.split(".")
    if len(parts) < 2 or parts[0] not in ("c", "d") or not parts[1].isdigit():
        return None
    return int(parts[1])


def commit_key(slot: int) -> str:
    return f"{COMMITS_PREFIX}/{slot:012d}.json"


def commit_arrays_key(slot: int) -> str:
    return f"{COMMITS_PREFIX}/{slot:012d}.arrays.json"


def parse_commit_name(name: str) -> int | None:
    """Slot of a commit header file name, or None for other files."""
    m = re.fullmatch(r"(\d{12})\.json", name)
    return int(m.group(1)) if m else None


def object_key(slot: int, name: str) -> str:
    safe = re.sub(r"[^A-Za-z0-9_.\-]", "_", name)
    return f"{OBJECTS_PREFIX}/{slot:012d}/{safe}"


def part_key(slot: int, rank: int) -> str:
    return f"{PARTS_PREFIX}/{slot:012d}/{rank:06d}.json"


def ref_key(timeline: str) -> str:
    return f"{REFS_PREFIX}/{check_timeline_name(timeline)}.json"


@dataclass(frozen=True)
class ChunkPlan:
    """How one tensor (without the slot axis) is cut into chunks along its first axis."""

    shape: tuple[int, ...]
    itemsize: int
    rows: int  # rows of axis 0 per chunk (1 for a 0-d tensor)

    @property
    def chunk_shape(self) -> tuple[int, ...]:
        """Chunk shape of the tensor part (zarr needs every entry >= 1)."""
        if not self.shape:
            return ()
        return (self.rows, *(max(1, s) for s in self.shape[1:]))

    @property
    def row_bytes(self) -> int:
        return self.itemsize * math.prod(self.shape[1:]) if self.shape else self.itemsize

    @property
    def nbytes(self) -> int:
        return self.itemsize * math.prod(self.shape)

    @property
    def n_chunks(self) -> int:
        if not self.shape:
            return 1
        if self.nbytes == 0:
            return 0
        return math.ceil(self.shape[0] / self.rows)

    @property
    def chunk_nbytes(self) -> int:
        """Bytes of one full (padded) chunk."""
        return self.rows * self.row_bytes if self.shape else self.itemsize

    def index(self, i: int) -> tuple[int, ...]:
        """Zarr chunk grid index (tensor part) of linear chunk ``i``."""
        return (i, *([0] * (len(self.shape) - 1))) if self.shape else ()

    def byte_range(self, i: int) -> tuple[int, int]:
        """``(start, stop)`` of chunk ``i`` in the flat C-order bytes of the tensor."""
        if not 0 <= i < self.n_chunks:
            raise IndexError(f"chunk {i} out of range for {self.n_chunks} chunks")
        start = i * self.chunk_nbytes
        return start, min(start + self.chunk_nbytes, self.nbytes)


def plan_chunks(shape: tuple[int, ...], itemsize: int,
                target_bytes: int = DEFAULT_CHUNK_BYTES) -> ChunkPlan:
    """Rows per chunk so that a chunk is about ``target_bytes`` (at least one row)."""
    shape = tuple(int(s) for s in shape)
    if any(s < 0 for s in shape):
        raise ValueError(f"negative dimension in shape {shape}")
    if not shape:
        return ChunkPlan(shape, itemsize, 1)
    row_bytes = itemsize * math.prod(max(1, s) for s in shape[1:])
    rows = max(1, min(max(1, shape[0]), target_bytes // max(1, row_bytes)))
    return ChunkPlan(shape, itemsize, rows)
