"""Pure functions from names to storage keys, and the chunk plan of one tensor.

Everything that decides *where* bytes live is here, with no I/O, so the writer, the reader, gc
and docs/format.md agree by construction. Format 2 stores each step of each rank as one
stored zip (``steps/<slot>.zip``), one side file (``steps/<slot>.dstt``) and one commit
header; a tensor ``(r, *rest)`` is chunked along its first axis only, so each chunk is one
contiguous byte range the engine can copy through a host cache smaller than the tensor.

Rejected alternatives: format 1's file per chunk per step (~1,200 files and 0.3-0.9 s of
kernel time per step for a 1,200-tensor model); zarr's n-d chunking of every axis (a chunk
would gather strided pieces, a gather copy on the hot path). History: docs/decisions.md,
"Module notes".
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from dstt.errors import TimelineError

__all__ = [
    "COMMITS_PREFIX",
    "DEFAULT_CHUNK_BYTES",
    "FORMAT_VERSION",
    "HEAD_KEY",
    "INDEX_PREFIX",
    "LOCK_KEY",
    "PARTS_PREFIX",
    "REFS_PREFIX",
    "RELEASED_PREFIX",
    "STEPS_PREFIX",
    "ChunkPlan",
    "array_meta_key",
    "check_array_path",
    "check_timeline_name",
    "commit_key",
    "group_meta_key",
    "index_key",
    "key_slot",
    "parse_index_name",
    "part_key",
    "plan_chunks",
    "ref_key",
    "side_file_key",
    "step_file_key",
    "zarr_chunk_key",
]

FORMAT_VERSION = 2
#: target size of one chunk of a large tensor: large sequential writes, small enough to overlap
DEFAULT_CHUNK_BYTES = 16 * 1024 * 1024

STEPS_PREFIX = "steps"  # one zip (a Zarr v3 hierarchy) + one side file per step per rank
COMMITS_PREFIX = "_dstt/commits"
REFS_PREFIX = "_dstt/refs"
PARTS_PREFIX = "_dstt/parts"  # multi-rank commits: one part manifest per rank (commit/parts.py)
INDEX_PREFIX = "_dstt/index"  # the index's segments (index/writer.py, format/segment.py)
HEAD_KEY = "_dstt/HEAD.json"
#: one record per deleted timeline whose commits gc has not swept yet (maintenance/timelines.py)
RELEASED_PREFIX = "_dstt/released"
LOCK_KEY = "_dstt/lock"

_SEGMENT = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*$")
_TIMELINE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}$")
_RESERVED_TOP = {"_dstt", "zarr.json", STEPS_PREFIX}
_STEP_FILE = re.compile(r"^(\d{12})(?:\.([A-Za-z0-9]+))?\.(zip|dstt)$")


#: the folders every commit writes into (a read-only one would fail the first commit)
WRITTEN_PREFIXES = ("_dstt", COMMITS_PREFIX, REFS_PREFIX, STEPS_PREFIX)


def check_array_path(path: str) -> str:
    """Validate an array path such as ``params/layers/0/attn/weight``; return it."""
    parts = path.split("/")
    if not path or any(not _SEGMENT.match(p) or p in ("zarr.json", "c") for p in parts):
        raise ValueError(
            f"invalid array path {path!r}: use '/'-separated segments of letters, digits, "
            "'_', '-', '.' (a segment may not be 'c' or 'zarr.json')"
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


def zarr_chunk_key(path: str, index: tuple[int, ...]) -> str:
    """Zarr v3 default chunk key encoding ('/'): ``c/<i>/<j>...`` (``c`` for a 0-d array)."""
    return f"{path}/c" + "".join(f"/{i}" for i in index)


def step_file_key(slot: int, writer: str = "") -> str:
    """The step file (stored zip, a Zarr v3 hierarchy) of ``slot``; ``writer`` names the
    rank's file in a multi-rank commit (``r00001``), empty for the committing writer."""
    return f"{STEPS_PREFIX}/{slot:012d}{'.' + writer if writer else ''}.zip"


def side_file_key(slot: int, writer: str = "") -> str:
    """The side file of a step: objects, delta payloads and (committer) the arrays table."""
    return f"{STEPS_PREFIX}/{slot:012d}{'.' + writer if writer else ''}.dstt"


def parse_step_file(name: str) -> tuple[int, str] | None:
    """``(slot, writer)`` of a step or side file name, None for other names."""
    m = _STEP_FILE.match(name)
    return (int(m.group(1)), m.group(2) or "") if m else None


def key_slot(key: str) -> int | None:
    """The slot whose step a file belongs to (``steps/<slot>...``); a record whose file is
    in an older slot than its commit is a dedup reference."""
    folder, _, name = key.rpartition("/")
    if folder != STEPS_PREFIX:
        return None
    got = parse_step_file(name)
    return None if got is None else got[0]


def commit_key(slot: int) -> str:
    return f"{COMMITS_PREFIX}/{slot:012d}.json"


def parse_commit_name(name: str) -> int | None:
    """Slot of a commit header file name, or None for other files."""
    m = re.fullmatch(r"(\d{12})\.json", name)
    return int(m.group(1)) if m else None


_INDEX = re.compile(r"^(\d{12})-(\d{12})\.g(\d{6,})\.idx$")


def index_key(lo: int, hi: int, gen: int) -> str:
    """An index segment holding rows of slots ``lo..hi``, generation ``gen`` (newer wins)."""
    return f"{INDEX_PREFIX}/{lo:012d}-{hi:012d}.g{gen:06d}.idx"


def parse_index_name(name: str) -> tuple[int, int, int] | None:
    """``(lo, hi, gen)`` of an index segment's file name, None for other names."""
    m = _INDEX.match(name)
    return (int(m.group(1)), int(m.group(2)), int(m.group(3))) if m else None


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


def plan_chunks(
    shape: tuple[int, ...], itemsize: int, target_bytes: int = DEFAULT_CHUNK_BYTES
) -> ChunkPlan:
    """Rows per chunk so that a chunk is about ``target_bytes`` (at least one row)."""
    shape = tuple(int(s) for s in shape)
    if any(s < 0 for s in shape):
        raise ValueError(f"negative dimension in shape {shape}")
    if not shape:
        return ChunkPlan(shape, itemsize, 1)
    row_bytes = itemsize * math.prod(max(1, s) for s in shape[1:])
    rows = max(1, min(max(1, shape[0]), target_bytes // max(1, row_bytes)))
    return ChunkPlan(shape, itemsize, rows)
