"""Commit manifests and refs: frozen dataclasses and their strict, checksummed JSON.

A commit is the small *commit header* (step, timeline, parent, objects, metrics, and where the
*arrays table* sits: a byte range of the step's side file, with its crc32c) plus that table
(every chunk: file, offset, size, crc32c). The header is written last and is the commit point.
Splitting them lets a reader walk a timeline of thousands of steps by reading only headers
(~1 KB each) instead of every chunk table.

Every document is an envelope ``{"crc32c": N, "body": {...}}`` whose crc32c covers the canonical
serialization of the body (sorted keys, no spaces), so a flipped byte anywhere is detected.
Parsing is strict: an unknown ``format`` raises ``FormatVersionError``, unknown or missing fields
raise ``CorruptRunError``. Rejected alternative: a checksum sidecar file — two files to keep
consistent instead of one.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import crc32c as _crc

from ...errors import ChecksumError, CorruptRunError, FormatVersionError
from .layout import FORMAT_VERSION, ChunkPlan
from .zarr_meta import dtype_itemsize

__all__ = [
    "ArrayRecord",
    "ChunkRecord",
    "CommitHeader",
    "FileIds",
    "Location",
    "Metric",
    "ObjectRecord",
    "RefInfo",
    "TableBuilder",
    "TableTemplate",
    "arrays_from_json",
    "arrays_json",
    "checksum",
    "dump_arrays",
    "dump_header",
    "dump_ref",
    "object_from_json",
    "object_json",
    "parse_arrays",
    "parse_arrays_columns",
    "parse_header",
    "parse_ref",
]

Metric = float | int | str | bool


#: the C function itself (``map`` it over many buffers: no Python frame per call)
crc32c_raw = _crc.crc32c


def checksum(data: bytes | memoryview, value: int = 0) -> int:
    """crc32c of ``data``, continuing from ``value`` (so pieces can be checksummed in turn)."""
    return int(_crc.crc32c(data, value))


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
    def content_crc32c(self) -> int:
        """crc32c of the chunk's full raw bytes, whatever its encoding."""
        return self.crc32c if self.raw_crc32c is None else self.raw_crc32c

    @property
    def slots(self) -> tuple[int, ...]:
        """Other slots whose chunks this one is reconstructed from (delta base, inputs)."""
        base = () if self.base is None else (self.base,)
        return base + tuple(s for _, s in self.inputs)

    def as_json(self) -> list[Any]:
        if self.encoding == "raw":
            return [self.key, self.offset, self.nbytes, self.crc32c]
        head = [self.key, self.offset, self.nbytes, self.crc32c, self.encoding, self.base,
                self.raw_crc32c]
        if self.encoding == "xor1":
            return head
        return [*head, self.predictor, [[p, s] for p, s in self.inputs], list(self.coeffs)]

    @classmethod
    def from_json(cls, v: list[Any]) -> ChunkRecord:
        if len(v) == 4:
            return cls(str(v[0]), int(v[2]), int(v[3]), offset=int(v[1]))
        if len(v) == 7 and v[4] == "xor1":
            return cls(str(v[0]), int(v[2]), int(v[3]), "xor1", int(v[5]), int(v[6]),
                       offset=int(v[1]))
        if len(v) == 10 and v[4] == "pred1":
            inputs = tuple((str(p), int(s)) for p, s in v[8])
            return cls(str(v[0]), int(v[2]), int(v[3]), "pred1", int(v[5]), int(v[6]),
                       str(v[7]), inputs, tuple(float(c) for c in v[9]), offset=int(v[1]))
        raise ValueError(f"unknown chunk record {v!r}")


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


# -- envelope -----------------------------------------------------------------------------

def _canonical(body: Any) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def _seal(kind: str, body: dict[str, Any]) -> bytes:
    body = {"kind": kind, "format": FORMAT_VERSION, **body}
    raw = _canonical(body)
    return b'{"crc32c":%d,"body":' % checksum(raw) + raw + b"}\n"


def _open(data: bytes, kind: str, where: str, *, verified: bool = False) -> dict[str, Any]:
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise CorruptRunError(f"{where}: not valid JSON ({e}); the file is damaged") from None
    if not isinstance(doc, dict) or set(doc) != {"crc32c", "body"} or not isinstance(
            doc.get("body"), dict):
        raise CorruptRunError(f"{where}: not a dstt {kind} document")
    body = doc["body"]
    if body.get("kind") != kind:
        raise CorruptRunError(f"{where}: expected a {kind} document, found {body.get('kind')!r}")
    if not verified:
        try:
            raw = _canonical(body)
        except ValueError as e:
            raise CorruptRunError(f"{where}: {e}") from None
        if checksum(raw) != doc["crc32c"]:
            raise ChecksumError(f"{where}: crc32c mismatch; the file is damaged")
    fmt = body.get("format")
    if fmt != FORMAT_VERSION:
        raise FormatVersionError(
            f"{where}: written by dstt format {fmt!r}; this dstt reads format {FORMAT_VERSION}. "
            "Upgrade dstt to read it."
        )
    return body


def _fields(body: dict[str, Any], required: set[str], optional: set[str], where: str) -> None:
    keys = set(body) - {"kind", "format"}
    missing, unknown = required - keys, keys - required - optional
    if missing or unknown:
        raise CorruptRunError(
            f"{where}: missing fields {sorted(missing)}, unknown fields {sorted(unknown)}"
        )


def _metric_out(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return {"float": repr(v)}
    if isinstance(v, (bool, int, float, str)):
        return v
    raise TypeError(f"metric values must be numbers, strings or bools, got {type(v).__name__}")


def _metric_in(v: Any) -> Metric:
    if isinstance(v, dict):
        return float(v["float"])
    return v  # type: ignore[no-any-return]


# -- headers ------------------------------------------------------------------------------

def dump_header(h: CommitHeader) -> bytes:
    return _seal("commit", {
        "slot": h.slot, "step": h.step, "timeline": h.timeline, "parent": h.parent,
        "time": h.time, "pruned": h.pruned,
        "metrics": {k: _metric_out(v) for k, v in h.metrics.items()},
        "objects": {k: object_json(o) for k, o in h.objects.items()},
        "arrays": None if h.arrays is None else [h.arrays.key, h.arrays.offset,
                                                  h.arrays.nbytes, h.arrays.crc32c],
    })


def object_json(o: ObjectRecord) -> list[Any]:
    return [o.key, o.offset, o.nbytes, o.crc32c, o.encoding]


def object_from_json(o: list[Any]) -> ObjectRecord:
    if len(o) != 5:
        raise ValueError(f"malformed object record {o!r}")
    return ObjectRecord(str(o[0]), int(o[2]), int(o[3]), str(o[4]), int(o[1]))


_HEADER_FIELDS = {"slot", "step", "timeline", "parent", "time", "pruned", "metrics", "objects",
                  "arrays"}


def parse_header(data: bytes, where: str) -> CommitHeader:
    b = _open(data, "commit", where)
    _fields(b, _HEADER_FIELDS, set(), where)
    try:
        return CommitHeader(
            slot=int(b["slot"]), step=int(b["step"]), timeline=str(b["timeline"]),
            parent=None if b["parent"] is None else int(b["parent"]), time=float(b["time"]),
            metrics={k: _metric_in(v) for k, v in b["metrics"].items()},
            objects={k: object_from_json(o) for k, o in b["objects"].items()},
            arrays=None if b["arrays"] is None else Location(
                str(b["arrays"][0]), int(b["arrays"][1]), int(b["arrays"][2]),
                int(b["arrays"][3])),
            pruned=bool(b["pruned"]),
        )
    except (TypeError, ValueError, KeyError, IndexError) as e:
        raise CorruptRunError(f"{where}: malformed commit header ({e})") from None


# -- arrays tables ------------------------------------------------------------------------

class FileIds:
    """File keys numbered in the order they are first seen: a table's ``files`` column."""

    def __init__(self) -> None:
        self.files: list[str] = []
        self._file_index: dict[str, int] = {}

    def file_id(self, key: str) -> int:
        i = self._file_index.get(key)
        if i is None:
            i = self._file_index[key] = len(self.files)
            self.files.append(key)
        return i


class TableBuilder(FileIds):
    """The columnar arrays table of one commit, built array by array (``arrays_json``).

    Columns, not a record per chunk: a 1,200-tensor step is a few lists of integers, which
    the C JSON encoder writes in a millisecond, and a reader can locate any tensor's bytes
    without parsing per-chunk objects. Layout (docs/format.md §3)::

        {"files": [key, ...],                       # files the chunks live in
         "arrays": {"path": [...], "dtype": [...], "shape": [[...], ...], "rows": [...],
                    "dims": [[name, ...] or null, ...]},   # only when some array has dims
         "chunks": {"file": [...], "offset": [...], "nbytes": [...], "crc32c": [...]},
         "codecs": {"<chunk number>": [encoding, base, raw_crc32c, (predictor, inputs,
                                                                      coeffs)]}}

    Chunks are listed array by array, each array's ``n_chunks`` in order.
    """

    def __init__(self) -> None:
        super().__init__()
        self.path: list[str] = []
        self.dtype: list[str] = []
        self.shape: list[list[int]] = []
        self.rows: list[int] = []
        self.dims: list[list[str] | None] = []
        self.file: list[int] = []
        self.offset: list[int] = []
        self.nbytes: list[int] = []
        self.crc32c: list[int] = []
        self.codecs: dict[str, list[Any]] = {}

    def add_array(self, path: str, dtype: str, shape: tuple[int, ...], rows: int,
                  dims: tuple[str, ...] | None = None) -> None:
        self.path.append(path)
        self.dtype.append(dtype)
        self.shape.append(list(shape))
        self.rows.append(rows)
        self.dims.append(None if dims is None else list(dims))

    def add_chunks(self, file_id: int, offsets: list[int], nbytes: list[int],
                   crcs: list[int]) -> None:
        """Raw chunks, all in one file (the hot path: three list extends)."""
        self.file.extend([file_id] * len(offsets))
        self.offset.extend(offsets)
        self.nbytes.extend(nbytes)
        self.crc32c.extend(crcs)

    def add_record(self, c: ChunkRecord) -> None:
        if c.encoding != "raw":
            head: list[Any] = [c.encoding, c.base, c.raw_crc32c]
            if c.encoding != "xor1":
                head += [c.predictor, [[p, s] for p, s in c.inputs], list(c.coeffs)]
            self.codecs[str(len(self.offset))] = head
        self.file.append(self.file_id(c.key))
        self.offset.append(c.offset)
        self.nbytes.append(c.nbytes)
        self.crc32c.append(c.crc32c)

    def add(self, a: ArrayRecord) -> None:
        self.add_array(a.path, a.dtype, a.shape, a.rows, a.dims)
        for c in a.chunks:
            self.add_record(c)

    def json(self) -> dict[str, Any]:
        arrays: dict[str, Any] = {"path": self.path, "dtype": self.dtype, "shape": self.shape,
                                  "rows": self.rows}
        if any(d is not None for d in self.dims):  # older tables have no column: readable
            arrays["dims"] = self.dims
        return {"files": self.files,
                "arrays": arrays,
                "chunks": {"file": self.file, "offset": self.offset, "nbytes": self.nbytes,
                           "crc32c": self.crc32c},
                "codecs": self.codecs}


class TableTemplate:
    """The arrays table of a step whose chunks are all raw and in one file, from fixed
    columns: what a flat step of a steady run writes at every commit.

    ``dump_arrays(slot, builder)`` re-encodes every array's path, dtype, shape and dims at
    every step — Python per array, ~1 µs each on a quiet core and several times that next
    to a training loop. Here the fixed columns are encoded once; a step encodes only its
    offsets and checksums (two lists of ints, the C encoder) and splices the bytes into the
    same canonical form ``_seal`` produces (a test holds the two byte-identical).
    """

    def __init__(self, paths: Sequence[str], dtypes: Sequence[str],
                 shapes: Sequence[tuple[int, ...]], rows: Sequence[int],
                 dims: Sequence[tuple[str, ...] | None], nbytes: Sequence[int]) -> None:
        arrays: dict[str, Any] = {"path": list(paths), "dtype": list(dtypes),
                                  "shape": [list(s) for s in shapes], "rows": list(rows)}
        if any(d is not None for d in dims):
            arrays["dims"] = [None if d is None else list(d) for d in dims]
        self.sizes = list(nbytes)
        self._arrays = _canonical(arrays)
        self._file = _canonical([0] * len(nbytes))
        self._nbytes = _canonical(list(nbytes))

    def dump(self, slot: int, key: str, offsets: Sequence[int], crcs: Sequence[int]) -> bytes:
        """``dump_arrays(slot, ...)`` of these arrays with chunk ``offsets`` and ``crcs``,
        all in file ``key``."""
        if not len(offsets) == len(crcs) == len(self.sizes):
            raise ValueError(f"a table of {len(self.sizes)} chunks got {len(offsets)} offsets "
                             f"and {len(crcs)} checksums")
        raw = b"".join((
            b'{"arrays":', self._arrays, b',"chunks":{"crc32c":', _canonical(crcs),
            b',"file":', self._file, b',"nbytes":', self._nbytes, b',"offset":',
            _canonical(offsets), b'},"codecs":{},"files":', _canonical([key]),
            b',"format":%d,"kind":"arrays","slot":%d}' % (FORMAT_VERSION, slot)))
        return b'{"crc32c":%d,"body":' % checksum(raw) + raw + b"}\n"


def arrays_json(arrays: Mapping[str, ArrayRecord]) -> dict[str, Any]:
    """The columnar table of ``arrays`` (arrays tables and multi-rank part manifests)."""
    b = TableBuilder()
    for _, a in sorted(arrays.items()):
        b.add(a)
    return b.json()


def _codec_record(key: str, offset: int, nbytes: int, crc: int, codec: list[Any] | None,
                  ) -> ChunkRecord:
    if codec is None:
        return ChunkRecord(key, nbytes, crc, offset=offset)
    if codec[0] == "xor1" and len(codec) == 3:
        return ChunkRecord(key, nbytes, crc, "xor1", int(codec[1]), int(codec[2]),
                           offset=offset)
    if codec[0] == "pred1" and len(codec) == 6:
        inputs = tuple((str(p), int(s)) for p, s in codec[4])
        return ChunkRecord(key, nbytes, crc, "pred1", int(codec[1]), int(codec[2]),
                           str(codec[3]), inputs, tuple(float(c) for c in codec[5]),
                           offset=offset)
    raise ValueError(f"unknown chunk codec {codec!r}")


def arrays_from_json(doc: Mapping[str, Any]) -> dict[str, ArrayRecord]:
    """Inverse of :func:`arrays_json`; ``TypeError``/``ValueError``/``KeyError`` if malformed."""
    files = [str(f) for f in doc["files"]]
    a, c, codecs = doc["arrays"], doc["chunks"], doc["codecs"]
    file, offset, nbytes, crc = c["file"], c["offset"], c["nbytes"], c["crc32c"]
    if not len(file) == len(offset) == len(nbytes) == len(crc):
        raise ValueError("chunk columns differ in length")
    paths = a["path"]
    if not len(paths) == len(a["dtype"]) == len(a["shape"]) == len(a["rows"]):
        raise ValueError("array columns differ in length")
    dims_col = a.get("dims") or [None] * len(paths)
    if len(dims_col) != len(paths):
        raise ValueError("array columns differ in length")
    out: dict[str, ArrayRecord] = {}
    pos = 0
    for path, dtype, shape, rows, dims in zip(paths, a["dtype"], a["shape"], a["rows"],
                                              dims_col, strict=True):
        shape_t = tuple(int(s) for s in shape)
        plan = ChunkPlan(shape_t, dtype_itemsize(str(dtype)), int(rows))
        n = plan.n_chunks
        if pos + n > len(offset):
            raise ValueError(f"array {path}: {n} chunks expected, the table ends first")
        chunks = tuple(_codec_record(files[file[k]], int(offset[k]), int(nbytes[k]),
                                     int(crc[k]), codecs.get(str(k)))
                       for k in range(pos, pos + n))
        pos += n
        out[str(path)] = ArrayRecord(str(path), str(dtype), shape_t, int(rows), chunks,
                                     None if dims is None else tuple(str(d) for d in dims))
    if pos != len(offset):
        raise ValueError(f"{len(offset) - pos} chunks in the table belong to no array")
    return out


def dump_arrays(slot: int, arrays: Mapping[str, ArrayRecord] | TableBuilder) -> bytes:
    table = arrays if isinstance(arrays, TableBuilder) else None
    body = table.json() if table is not None else arrays_json(arrays)  # type: ignore[arg-type]
    return _seal("arrays", {"slot": slot, **body})


def parse_arrays_columns(data: bytes, where: str, *, verified: bool = False) -> dict[str, Any]:
    """An arrays table as its parsed columns (``TableBuilder``'s layout), checked for its
    fields and column lengths but not turned into records: for callers that read many
    tables and want the columns (the index's rows)."""
    b = _open(data, "arrays", where, verified=verified)
    _fields(b, {"slot", "files", "arrays", "chunks", "codecs"}, set(), where)
    try:
        a, c = b["arrays"], b["chunks"]
        n, k = len(a["path"]), len(c["offset"])
        ok = (len(a["dtype"]) == len(a["shape"]) == len(a["rows"]) == n
              and len(a.get("dims") or [None] * n) == n
              and len(c["file"]) == len(c["nbytes"]) == len(c["crc32c"]) == k
              and isinstance(b["codecs"], dict) and isinstance(b["files"], list))
    except (TypeError, KeyError, AttributeError) as e:
        raise CorruptRunError(f"{where}: malformed arrays table ({e})") from None
    if not ok:
        raise CorruptRunError(f"{where}: malformed arrays table (columns differ in length)")
    return b


def parse_arrays(data: bytes, where: str, *, verified: bool = False) -> dict[str, ArrayRecord]:
    """Parse an arrays table; ``verified``: the caller already checked the file's crc32c."""
    b = _open(data, "arrays", where, verified=verified)
    _fields(b, {"slot", "files", "arrays", "chunks", "codecs"}, set(), where)
    try:
        return arrays_from_json(b)
    except (TypeError, ValueError, KeyError, AttributeError, IndexError) as e:
        raise CorruptRunError(f"{where}: malformed arrays table ({e})") from None


# -- refs ---------------------------------------------------------------------------------

def dump_ref(r: RefInfo) -> bytes:
    return _seal("ref", {"name": r.name, "head": r.head, "base_slot": r.base_slot,
                         "base_step": r.base_step, "base_timeline": r.base_timeline,
                         "skip_data": r.skip_data, "created": r.created})


def parse_ref(data: bytes, where: str) -> RefInfo:
    b = _open(data, "ref", where)
    _fields(b, {"name", "head", "base_slot", "base_step", "base_timeline", "skip_data",
                "created"}, set(), where)
    try:
        return RefInfo(name=str(b["name"]), head=None if b["head"] is None else int(b["head"]),
                       base_slot=b["base_slot"], base_step=b["base_step"],
                       base_timeline=b["base_timeline"], skip_data=int(b["skip_data"]),
                       created=float(b["created"]))
    except (TypeError, ValueError) as e:
        raise CorruptRunError(f"{where}: malformed ref ({e})") from None


def dump_head(timeline: str) -> bytes:
    return _seal("head", {"timeline": timeline})


def parse_head(data: bytes, where: str) -> str:
    b = _open(data, "head", where)
    _fields(b, {"timeline"}, set(), where)
    return str(b["timeline"])
