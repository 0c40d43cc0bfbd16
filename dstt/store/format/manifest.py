"""Commit manifests and refs as documents: the commit header, the columnar arrays table, refs
and HEAD, each sealed in the checksummed envelope (``envelope``) over the dataclasses of
``records``.

A commit is the small *commit header* (step, timeline, parent, objects, metrics, and where the
*arrays table* sits: a byte range of the step's side file, with its crc32c) plus that table
(every chunk: file, offset, size, crc32c). The header is written last and is the commit point.
Splitting them lets a reader walk a timeline of thousands of steps by reading only headers
(~1 KB each) instead of every chunk table. Rejected alternative: one document per commit with
every chunk in it — walking a timeline would parse every chunk of every step.
"""

from __future__ import annotations

from dataclasses import asdict, fields
from typing import TYPE_CHECKING, Any

from dstt.errors import CorruptRunError

from .envelope import _canonical, _fields, _metric_in, _metric_out, _open, _seal, checksum
from .layout import FORMAT_VERSION, ChunkPlan
from .records import ArrayRecord, ChunkRecord, CommitHeader, Location, ObjectRecord, RefInfo
from .zarr_meta import dtype_itemsize

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

__all__ = [
    "FileIds",
    "TableBuilder",
    "TableTemplate",
    "arrays_from_json",
    "arrays_json",
    "chunk_record",
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


# -- headers ------------------------------------------------------------------------------


def dump_header(h: CommitHeader) -> bytes:
    return _seal(
        "commit",
        {
            "slot": h.slot,
            "step": h.step,
            "timeline": h.timeline,
            "parent": h.parent,
            "time": h.time,
            "pruned": h.pruned,
            "metrics": {k: _metric_out(v) for k, v in h.metrics.items()},
            "objects": {k: object_json(o) for k, o in h.objects.items()},
            "arrays": None
            if h.arrays is None
            else [h.arrays.key, h.arrays.offset, h.arrays.nbytes, h.arrays.crc32c],
        },
    )


def object_json(o: ObjectRecord) -> list[Any]:
    return [o.key, o.offset, o.nbytes, o.crc32c, o.encoding]


def object_from_json(o: list[Any]) -> ObjectRecord:
    if len(o) != 5:
        raise ValueError(f"malformed object record {o!r}")
    return ObjectRecord(str(o[0]), int(o[2]), int(o[3]), str(o[4]), int(o[1]))


_HEADER_FIELDS = {f.name for f in fields(CommitHeader)}


def parse_header(data: bytes, where: str) -> CommitHeader:
    b = _open(data, "commit", where)
    _fields(b, _HEADER_FIELDS, set(), where)
    try:
        return CommitHeader(
            slot=int(b["slot"]),
            step=int(b["step"]),
            timeline=str(b["timeline"]),
            parent=None if b["parent"] is None else int(b["parent"]),
            time=float(b["time"]),
            metrics={k: _metric_in(v) for k, v in b["metrics"].items()},
            objects={k: object_from_json(o) for k, o in b["objects"].items()},
            arrays=None
            if b["arrays"] is None
            else Location(
                str(b["arrays"][0]), int(b["arrays"][1]), int(b["arrays"][2]), int(b["arrays"][3])
            ),
            pruned=bool(b["pruned"]),
        )
    except (TypeError, ValueError, KeyError, IndexError) as e:
        raise CorruptRunError(f"{where}: malformed commit header ({e})") from None


# -- arrays tables ------------------------------------------------------------------------


class FileIds:
    """File keys numbered in the order they are first seen: a table's ``files`` column."""

    def __init__(self) -> None:
        self._file_index: dict[str, int] = {}  # insertion-ordered: key -> its number

    def file_id(self, key: str) -> int:
        return self._file_index.setdefault(key, len(self._file_index))

    @property
    def files(self) -> list[str]:
        return list(self._file_index)


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

    def add_array(
        self,
        path: str,
        dtype: str,
        shape: tuple[int, ...],
        rows: int,
        dims: tuple[str, ...] | None = None,
    ) -> None:
        self.path.append(path)
        self.dtype.append(dtype)
        self.shape.append(list(shape))
        self.rows.append(rows)
        self.dims.append(None if dims is None else list(dims))

    def add_chunks(
        self, file_id: int, offsets: list[int], nbytes: list[int], crcs: list[int]
    ) -> None:
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
        arrays: dict[str, Any] = {
            "path": self.path,
            "dtype": self.dtype,
            "shape": self.shape,
            "rows": self.rows,
        }
        if any(d is not None for d in self.dims):  # older tables have no column: readable
            arrays["dims"] = self.dims
        return {
            "files": self.files,
            "arrays": arrays,
            "chunks": {
                "file": self.file,
                "offset": self.offset,
                "nbytes": self.nbytes,
                "crc32c": self.crc32c,
            },
            "codecs": self.codecs,
        }


class TableTemplate:
    """The arrays table of a step whose chunks are all raw and in one file, from fixed
    columns: what a flat step of a steady run writes at every commit.

    ``dump_arrays(slot, builder)`` re-encodes every array's path, dtype, shape and dims at
    every step — Python per array, ~1 µs each on a quiet core and several times that next
    to a training loop. Here the fixed columns are encoded once; a step encodes only its
    offsets and checksums (two lists of ints, the C encoder) and splices the bytes into the
    same canonical form ``_seal`` produces (a test holds the two byte-identical).
    """

    def __init__(
        self,
        paths: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[tuple[int, ...]],
        rows: Sequence[int],
        dims: Sequence[tuple[str, ...] | None],
        nbytes: Sequence[int],
    ) -> None:
        arrays: dict[str, Any] = {
            "path": list(paths),
            "dtype": list(dtypes),
            "shape": [list(s) for s in shapes],
            "rows": list(rows),
        }
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
            raise ValueError(
                f"a table of {len(self.sizes)} chunks got {len(offsets)} offsets "
                f"and {len(crcs)} checksums"
            )
        return self._splice(
            slot, crcs, self._file, self._nbytes, _canonical(offsets), b"{}", _canonical([key])
        )

    def dump_columns(
        self,
        slot: int,
        files: list[str],
        file: Sequence[int],
        nbytes: Sequence[int],
        offsets: Sequence[int],
        crcs: Sequence[int],
        codecs: Mapping[str, Any],
    ) -> bytes:
        """``dump_arrays`` of these arrays with every chunk column given (an encoded step:
        chunks in several files, with codec entries keyed by chunk number)."""
        if not len(file) == len(nbytes) == len(offsets) == len(crcs) == len(self.sizes):
            raise ValueError(
                f"a table of {len(self.sizes)} chunks got columns of "
                f"{[len(file), len(nbytes), len(offsets), len(crcs)]}"
            )
        return self._splice(
            slot,
            crcs,
            _canonical(file),
            _canonical(nbytes),
            _canonical(offsets),
            _canonical(codecs),
            _canonical(files),
        )

    def _splice(
        self,
        slot: int,
        crcs: Sequence[int],
        file: bytes,
        nbytes: bytes,
        offsets: bytes,
        codecs: bytes,
        files: bytes,
    ) -> bytes:
        """The sealed table from the other columns' canonical bytes, keys in sorted order."""
        raw = b"".join(
            (
                b'{"arrays":',
                self._arrays,
                b',"chunks":{"crc32c":',
                _canonical(crcs),
                b',"file":',
                file,
                b',"nbytes":',
                nbytes,
                b',"offset":',
                offsets,
                b'},"codecs":',
                codecs,
                b',"files":',
                files,
                b',"format":%d,"kind":"arrays","slot":%d}' % (FORMAT_VERSION, slot),
            )
        )
        return b'{"crc32c":%d,"body":' % checksum(raw) + raw + b"}\n"


def arrays_json(arrays: Mapping[str, ArrayRecord]) -> dict[str, Any]:
    """The columnar table of ``arrays`` (arrays tables and multi-rank part manifests)."""
    b = TableBuilder()
    for _, a in sorted(arrays.items()):
        b.add(a)
    return b.json()


def chunk_record(
    key: str, offset: int, nbytes: int, crc: int, codec: Sequence[Any] | None
) -> ChunkRecord:
    """A chunk record from a table's chunk columns and its codec entry (None: raw)."""
    if codec is None:
        return ChunkRecord(key, nbytes, crc, offset=offset)
    if codec[0] == "xor1" and len(codec) == 3:
        return ChunkRecord(key, nbytes, crc, "xor1", int(codec[1]), int(codec[2]), offset=offset)
    if codec[0] == "pred1" and len(codec) == 6:
        inputs = tuple((str(p), int(s)) for p, s in codec[4])
        return ChunkRecord(
            key,
            nbytes,
            crc,
            "pred1",
            int(codec[1]),
            int(codec[2]),
            str(codec[3]),
            inputs,
            tuple(float(c) for c in codec[5]),
            offset=offset,
        )
    raise ValueError(f"unknown chunk codec {codec!r}")


def arrays_from_json(doc: Mapping[str, Any]) -> dict[str, ArrayRecord]:
    """Inverse of :func:`arrays_json`; ``TypeError``/``ValueError``/``KeyError`` if malformed."""
    files = [str(f) for f in doc["files"]]
    a, c, codecs = doc["arrays"], doc["chunks"], doc["codecs"]
    file, offset, nbytes, crc = c["file"], c["offset"], c["nbytes"], c["crc32c"]
    if not len(file) == len(offset) == len(nbytes) == len(crc):
        raise ValueError("chunk columns differ in length")
    paths = a["path"]
    dims_col = a.get("dims") or [None] * len(paths)
    if not len(paths) == len(a["dtype"]) == len(a["shape"]) == len(a["rows"]) == len(dims_col):
        raise ValueError("array columns differ in length")
    out: dict[str, ArrayRecord] = {}
    pos = 0
    for path, dtype, shape, rows, dims in zip(
        paths, a["dtype"], a["shape"], a["rows"], dims_col, strict=True
    ):
        shape_t = tuple(int(s) for s in shape)
        plan = ChunkPlan(shape_t, dtype_itemsize(str(dtype)), int(rows))
        n = plan.n_chunks
        if pos + n > len(offset):
            raise ValueError(f"array {path}: {n} chunks expected, the table ends first")
        chunks = tuple(
            chunk_record(
                files[file[k]], int(offset[k]), int(nbytes[k]), int(crc[k]), codecs.get(str(k))
            )
            for k in range(pos, pos + n)
        )
        pos += n
        out[str(path)] = ArrayRecord(
            str(path),
            str(dtype),
            shape_t,
            int(rows),
            chunks,
            None if dims is None else tuple(str(d) for d in dims),
        )
    if pos != len(offset):
        raise ValueError(f"{len(offset) - pos} chunks in the table belong to no array")
    return out


def dump_arrays(slot: int, arrays: Mapping[str, ArrayRecord] | TableBuilder) -> bytes:
    body = arrays.json() if isinstance(arrays, TableBuilder) else arrays_json(arrays)
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
        ok = (
            len(a["dtype"]) == len(a["shape"]) == len(a["rows"]) == n
            and len(a.get("dims") or [None] * n) == n
            and len(c["file"]) == len(c["nbytes"]) == len(c["crc32c"]) == k
            and isinstance(b["codecs"], dict)
            and isinstance(b["files"], list)
        )
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
    return _seal("ref", asdict(r))


def parse_ref(data: bytes, where: str) -> RefInfo:
    b = _open(data, "ref", where)
    _fields(b, {f.name for f in fields(RefInfo)}, set(), where)
    try:
        return RefInfo(
            name=str(b["name"]),
            head=None if b["head"] is None else int(b["head"]),
            base_slot=b["base_slot"],
            base_step=b["base_step"],
            base_timeline=b["base_timeline"],
            skip_data=int(b["skip_data"]),
            created=float(b["created"]),
        )
    except (TypeError, ValueError) as e:
        raise CorruptRunError(f"{where}: malformed ref ({e})") from None


def dump_head(timeline: str) -> bytes:
    return _seal("head", {"timeline": timeline})


def parse_head(data: bytes, where: str) -> str:
    b = _open(data, "head", where)
    _fields(b, {"timeline"}, set(), where)
    return str(b["timeline"])
