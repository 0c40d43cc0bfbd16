"""The records of a commit: frozen dataclasses of chunks, arrays, objects, the commit header
and refs, and nothing of how they are sealed into documents (what a commit is: ``manifest``).

Their strict, checksummed JSON is ``manifest`` (the documents) over ``envelope`` (the
checksummed wrapper), which import this module and not the other way. Rejected alternative:
the dataclasses in ``manifest`` next to their serialization — two jobs, and every module that
only passes records around would import the document codecs too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .layout import ChunkPlan
from .zarr_meta import dtype_itemsize

if TYPE_CHECKING:
    from collections.abc import Mapping

__all__ = [
    "ArrayRecord",
    "ChunkRecord",
    "CommitHeader",
    "Location",
    "Metric",
    "ObjectRecord",
    "RefInfo",
]

Metric = float | int | str | bool


@dataclass(frozen=True)
class ChunkRecord:
    """One chunk: the file that holds it, where its bytes start, their size (data + the
    4-byte crc32c trailer) and the crc32c of its data part.

    ``encoding`` is ``"raw"`` (a plain Zarr chunk), ``"xor1"`` (a delta against the same
    chunk of slot ``base``) or ``"pred1"`` (the XOR of the chunk and what ``predictor``
    computes from the chunk of slot ``base`` and the same chunk of the ``inputs`` arrays at
    their slots, with ``coeffs``: ``predict.py``). ``raw_crc32c`` is the crc32c of the
    reconstructed full chunk. A record whose key lies in an older slot is a dedup reference.
    """

    key: str
    nbytes: int
    crc32c: int
    encoding: str = "raw"
    base: int | None = None
    raw_crc32c: int | None = None
    predictor: str | None = None
    inputs: tuple[tuple[str, int], ...] = ()
    coeffs: tuple[float, ...] = ()
    offset: int = 0

    @property
    def slots(self) -> tuple[int, ...]:
        """Other slots whose chunks this one is reconstructed from (delta base, inputs)."""
        base = () if self.base is None else (self.base,)
        return base + tuple(s for _, s in self.inputs)


@dataclass(frozen=True)
class ArrayRecord:
    """One tensor of one commit."""

    path: str
    dtype: str
    shape: tuple[int, ...]
    rows: int
    chunks: tuple[ChunkRecord, ...]
    #: ``dimension_names`` as declared (None: declared without, ``<name>_<i>`` in zarr.json)
    dims: tuple[str, ...] | None = None

    @property
    def plan(self) -> ChunkPlan:
        return ChunkPlan(self.shape, dtype_itemsize(self.dtype), self.rows)


@dataclass(frozen=True)
class ObjectRecord:
    """One object: a byte range ``[offset, offset + nbytes)`` of the step's side file."""

    key: str
    nbytes: int
    crc32c: int
    encoding: str
    offset: int = 0


@dataclass(frozen=True)
class Location:
    """A checksummed byte range of a file of the run (e.g. the arrays table of a commit)."""

    key: str
    offset: int
    nbytes: int
    crc32c: int


@dataclass(frozen=True)
class CommitHeader:
    """The commit point of one slot. ``pruned`` headers are tombstones left by gc."""

    slot: int
    step: int
    timeline: str
    parent: int | None
    time: float
    metrics: Mapping[str, Metric] = field(default_factory=dict)
    objects: Mapping[str, ObjectRecord] = field(default_factory=dict)
    arrays: Location | None = None  # the arrays table (None only in tombstones)
    pruned: bool = False


@dataclass(frozen=True)
class RefInfo:
    """A timeline: its head slot and where it branched off (``None`` for the first one)."""

    name: str
    head: int | None
    base_slot: int | None = None
    base_step: int | None = None
    base_timeline: str | None = None
    skip_data: int = 0
    created: float = 0.0
