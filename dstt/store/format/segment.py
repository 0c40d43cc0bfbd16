"""Index segments: the columnar rows of many commits in one immutable, checksummed file.

A segment (``_dstt/index/<lo>-<hi>.g<gen>.idx``, docs/format.md §9) caches the commit headers
of slots ``lo..hi``: a magic, a sealed JSON directory of blobs (byte range, crc32c, dtype,
shape), then blobs grouped so one question is one range read (core columns, headers, metrics,
summaries, per-tensor chunk locations). ``RowSet`` is the in-memory form: columns of any
number of rows, concatenated when segments merge, so a merge is numpy work.

Rejected alternatives: one JSON document per segment (~10 MB to parse at 10,000 rows); a row
per file (a run stays <= 3 files per committed step per rank); SQLite (not immutable, not
checksummed per column, a second format for plain readers). Layout in detail:
docs/decisions.md, "Module notes".
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dstt import schema
from dstt.errors import ChecksumError, CorruptRunError

from .envelope import _canonical, checksum

__all__ = [
    "MAGIC",
    "SCALARS",
    "Layout",
    "Locations",
    "RowSet",
    "concat",
    "decode_core",
    "decode_locations",
    "decode_rest",
    "encode",
    "read_directory",
]

MAGIC = b"DSTTIDX1"
#: the scalar fields of a write-time summary, in this order in ``RowSet.s_val``
SCALARS: tuple[str, ...] = schema.SUMMARY_SCALARS
Layout = tuple[str, tuple[int, ...], int, tuple[tuple[int, int, int], ...], tuple[str, ...] | None]
_CORE = (
    ("slot", "<i8"),
    ("step", "<i8"),
    ("parent", "<i8"),
    ("timeline", "<i4"),
    ("pruned", "u1"),
    ("time", "<f8"),
)
_SUMMARY = (("s_has", "u1"), ("s_val", "<f8"), ("s_exact", "u1"), ("s_probe", "<f4"))


@dataclass
class Locations:
    """Where one tensor's chunks sit in each row: ``ids[row]`` indexes ``layouts`` (-1: the
    row has no raw record of it), ``crc[row, chunk]`` its crc32c. A layout is ``(dtype,
    shape, rows per chunk, ((file, offset, nbytes), ...), dimension names or None)``."""

    layouts: list[Layout]
    ids: np.ndarray
    crc: np.ndarray


@dataclass
class RowSet:
    slot: np.ndarray
    step: np.ndarray
    parent: np.ndarray  # -1: no parent
    timeline: np.ndarray  # index into ``timelines``
    pruned: np.ndarray
    time: np.ndarray
    timelines: list[str]
    headers: list[bytes]  # each row's commit header file, byte for byte
    m_names: list[str] = field(default_factory=list)
    m_num: np.ndarray = field(default_factory=lambda: np.zeros((0, 0)))
    m_text: list[dict[str, Any] | None] = field(default_factory=list)  # non-numeric metrics
    m_hist: list[Any] = field(default_factory=list)  # decoded metrics/history object or None
    s_paths: list[str] = field(default_factory=list)
    s_has: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint8))
    s_val: np.ndarray = field(default_factory=lambda: np.zeros((0, 0, len(SCALARS))))
    s_exact: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.uint8))
    s_probe: np.ndarray = field(default_factory=lambda: np.zeros((0, 0, 0), np.float32))
    files: list[str] = field(default_factory=list)  # files named by location layouts
    loc: dict[str, Locations] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.slot)


def _remap(cols: list[str], union: list[str]) -> np.ndarray:
    pos = {c: i for i, c in enumerate(union)}
    return np.array([pos[c] for c in cols], dtype=np.int64)


def concat(sets: list[RowSet]) -> RowSet:
    """One RowSet of every row of ``sets``, in order (columns are unioned)."""
    sets = [s for s in sets if len(s)]
    if len(sets) == 1:
        return sets[0]
    tls = sorted({t for s in sets for t in s.timelines})
    names = sorted({m for s in sets for m in s.m_names})
    paths = sorted({p for s in sets for p in s.s_paths})
    files = sorted({f for s in sets for f in s.files})
    n = sum(len(s) for s in sets)
    k = max((s.s_probe.shape[2] for s in sets), default=0)
    same_m = all(s.m_names == names for s in sets)  # the usual case: one copy, no NaN fill
    same_s = all(s.s_paths == paths and s.s_probe.shape[2] == k for s in sets)
    out = RowSet(
        slot=np.concatenate([s.slot for s in sets]),
        step=np.concatenate([s.step for s in sets]),
        parent=np.concatenate([s.parent for s in sets]),
        timeline=np.concatenate(
            [_remap(s.timelines, tls)[s.timeline] if len(s.timelines) else s.timeline for s in sets]
        ).astype(np.int32),
        pruned=np.concatenate([s.pruned for s in sets]),
        time=np.concatenate([s.time for s in sets]),
        timelines=tls,
        headers=[h for s in sets for h in s.headers],
        m_names=names,
        m_num=np.concatenate([s.m_num for s in sets])
        if same_m
        else np.full((n, len(names)), np.nan),
        m_text=[t for s in sets for t in s.m_text],
        m_hist=[h for s in sets for h in s.m_hist],
        s_paths=paths,
        files=files,
    )
    if same_s:
        for name, _ in _SUMMARY:
            setattr(out, name, np.concatenate([getattr(s, name) for s in sets]))
    else:
        out.s_has = np.zeros(n, np.uint8)
        out.s_val = np.full((n, len(paths), len(SCALARS)), np.nan)
        out.s_exact = np.zeros((n, len(paths)), np.uint8)
        out.s_probe = np.full((n, len(paths), k), np.nan, np.float32)
        at = 0
        for s in sets:
            rows = slice(at, at + len(s))
            out.s_has[rows] = s.s_has
            if s.s_paths:
                cols = _remap(s.s_paths, paths)
                out.s_val[rows, cols] = s.s_val
                out.s_exact[rows, cols] = s.s_exact
                out.s_probe[rows, cols, : s.s_probe.shape[2]] = s.s_probe
            at += len(s)
    if not same_m:
        at = 0
        for s in sets:
            if s.m_names:
                out.m_num[at : at + len(s), _remap(s.m_names, names)] = s.m_num
            at += len(s)
    for path in sorted({p for s in sets for p in s.loc}):
        width = max(s.loc[path].crc.shape[1] for s in sets if path in s.loc)
        seen: dict[Layout, int] = {}  # each layout once, numbered as first met
        ids = np.full(n, -1, np.int32)
        crc = np.zeros((n, width), np.uint32)
        at = 0
        for s in sets:
            got = s.loc.get(path)
            if got is not None:
                fmap = _remap(s.files, files)
                new_ids = []
                for dt, shape, nrows, chunks, dims in got.layouts:
                    lay2 = (
                        dt,
                        shape,
                        nrows,
                        tuple((int(fmap[f]) if f >= 0 else f, o, b) for f, o, b in chunks),
                        dims,
                    )
                    new_ids.append(seen.setdefault(lay2, len(seen)))
                m = np.array([*new_ids, -1], np.int32)
                ids[at : at + len(s)] = m[got.ids]  # -1 indexes the trailing -1
                crc[at : at + len(s), : got.crc.shape[1]] = got.crc
            at += len(s)
        out.loc[path] = Locations(list(seen), ids, crc)
    return out


# -- bytes ----------------------------------------------------------------------------------


def _blob(
    parts: list[bytes], blobs: dict[str, list[Any]], name: str, data: Any, at: list[int]
) -> None:
    if isinstance(data, np.ndarray):
        raw = np.ascontiguousarray(data).tobytes()
        meta: list[Any] = [data.dtype.str, list(data.shape)]
    else:
        raw = bytes(data)
        meta = ["bytes", [len(raw)]]
    blobs[name] = [at[0], len(raw), checksum(raw), *meta]
    parts.append(raw)
    at[0] += len(raw)


def _json(x: Any) -> bytes:
    return json.dumps(x, separators=(",", ":"), allow_nan=True).encode()


def encode(rows: RowSet, gen: int) -> bytes:
    """The bytes of a segment holding ``rows``, generation ``gen`` (newer wins on overlap)."""
    parts: list[bytes] = []
    blobs: dict[str, list[Any]] = {}
    at = [0]
    for name, dt in _CORE:
        _blob(parts, blobs, name, np.asarray(getattr(rows, name), dtype=dt), at)
    offs = np.zeros(len(rows) + 1, np.int64)
    offs[1:] = np.cumsum([len(h) for h in rows.headers])
    _blob(parts, blobs, "hdr_off", offs, at)
    _blob(parts, blobs, "hdr", b"".join(rows.headers), at)
    _blob(parts, blobs, "m_num", np.asarray(rows.m_num, "<f8"), at)
    extra = {
        "text": {str(i): t for i, t in enumerate(rows.m_text) if t},
        "hist": {str(i): h for i, h in enumerate(rows.m_hist) if h is not None},
    }
    _blob(parts, blobs, "m_extra", _json(extra), at)
    for name, dt in _SUMMARY:
        _blob(parts, blobs, name, np.asarray(getattr(rows, name), dtype=dt), at)
    locdir: dict[str, list[Any]] = {}
    for path, lo in rows.loc.items():
        block = np.asarray(lo.ids, "<i4").tobytes() + np.asarray(lo.crc, "<u4").tobytes()
        locdir[path] = [
            at[0],
            len(block),
            checksum(block),
            int(lo.crc.shape[1]),
            [
                [dt, list(sh), r, [list(c) for c in ch], None if dm is None else list(dm)]
                for dt, sh, r, ch, dm in lo.layouts
            ],
        ]
        parts.append(block)
        at[0] += len(block)
    _blob(parts, blobs, "locdir", _json(locdir), at)
    body = {
        "kind": "index-segment",
        "gen": gen,
        "n": len(rows),
        "timelines": rows.timelines,
        "m_names": rows.m_names,
        "s_paths": rows.s_paths,
        "files": rows.files,
        "blobs": blobs,
    }
    raw = _canonical(body)
    directory = b'{"crc32c":%d,"body":' % checksum(raw) + raw + b"}"
    return MAGIC + struct.pack("<Q", len(directory)) + directory + b"".join(parts)


def layout_of(x: list[Any]) -> Layout:
    """A location layout from its JSON form."""
    dt, sh, r, ch, dm = x
    return (
        str(dt),
        tuple(int(s) for s in sh),
        int(r),
        tuple((int(f), int(o), int(b)) for f, o, b in ch),
        None if dm is None else tuple(str(d) for d in dm),
    )


def decode_locations(path: str, ent: list[Any], raw: bytes, n: int, where: str) -> Locations:
    """One tensor's locations in ``n`` rows from its ``locdir`` entry and its bytes."""
    _, nbytes, crc, width, lays = ent
    if len(raw) != nbytes or checksum(raw) != crc:
        raise ChecksumError(f"{where}: index locations of {path!r} fail their crc32c")
    ids = np.frombuffer(raw[: 4 * n], "<i4")
    crcs = np.frombuffer(raw[4 * n :], "<u4").reshape(n, width)
    return Locations([layout_of(x) for x in lays], ids, crcs)


def read_directory(prefix: bytes, where: str) -> tuple[dict[str, Any], int] | int:
    """The directory and where blobs start, from the first bytes of a segment; or, when
    ``prefix`` is too short, how many bytes are needed."""
    if len(prefix) < 16 or prefix[:8] != MAGIC:
        if len(prefix) >= 8 and prefix[:8] != MAGIC:
            raise CorruptRunError(f"{where}: not a dstt index segment")
        return 16
    n: int
    (n,) = struct.unpack("<Q", prefix[8:16])
    if len(prefix) < 16 + n:
        return 16 + n
    try:
        doc = json.loads(prefix[16 : 16 + n])
        body: dict[str, Any] = doc["body"]
        ok = checksum(_canonical(body)) == doc["crc32c"] and body["kind"] == "index-segment"
    except (ValueError, KeyError, TypeError) as e:
        raise CorruptRunError(f"{where}: damaged index directory ({e})") from None
    if not ok:
        raise ChecksumError(f"{where}: index directory fails its crc32c")
    return body, 16 + n


def blob(d: dict[str, Any], name: str, data: bytes, base: int, where: str) -> Any:
    """Blob ``name`` from ``data`` (bytes of the segment starting at file offset ``base``)."""
    off, nbytes, crc, dt, shape = d["blobs"][name]
    raw = memoryview(data)[off - base : off - base + nbytes]  # no copy of a large blob
    if len(raw) != nbytes or checksum(raw) != crc:
        raise ChecksumError(f"{where}: index blob {name!r} fails its crc32c")
    if dt == "bytes":
        return bytes(raw)
    return np.frombuffer(raw, dtype=dt).reshape(shape)


def core_span(d: dict[str, Any]) -> tuple[int, int]:
    """Byte range (relative to the blobs' start) of the core columns and header offsets."""
    b = d["blobs"]
    return b["slot"][0], b["hdr_off"][0] + b["hdr_off"][1]


def decode_core(d: dict[str, Any], data: bytes, base: int, where: str) -> dict[str, np.ndarray]:
    return {name: blob(d, name, data, base, where) for name, _ in (*_CORE, ("hdr_off", ""))}


def decode_rest(d: dict[str, Any], core: dict[str, np.ndarray], data: bytes, where: str) -> RowSet:
    """Every column (``data``: the whole blob area) as a RowSet (merges, gc, rebuild)."""
    offs = core["hdr_off"]
    hdr = blob(d, "hdr", data, 0, where)
    extra = json.loads(blob(d, "m_extra", data, 0, where))
    n = int(d["n"])
    text = [extra["text"].get(str(i)) for i in range(n)]
    hist = [extra["hist"].get(str(i)) for i in range(n)]
    locdir = json.loads(blob(d, "locdir", data, 0, where))
    loc = {
        path: decode_locations(path, ent, data[ent[0] : ent[0] + ent[1]], n, where)
        for path, ent in locdir.items()
    }
    return RowSet(
        **{name: core[name] for name, _ in _CORE},
        timelines=list(d["timelines"]),
        headers=[bytes(hdr[offs[i] : offs[i + 1]]) for i in range(n)],
        m_names=list(d["m_names"]),
        m_num=blob(d, "m_num", data, 0, where),
        m_text=text,
        m_hist=hist,
        s_paths=list(d["s_paths"]),
        **{name: blob(d, name, data, 0, where) for name, _ in _SUMMARY},
        files=list(d["files"]),
        loc=loc,
    )
