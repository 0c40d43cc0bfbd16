"""The stored (uncompressed) ZIP container of a step file, written by hand.

A step file is zarr-python's ``ZipStore`` layout (one stored entry per Zarr key), written in
one pass from the host cache: entries at offsets reserved under a lock, written with
``pwritev``, the central directory last; zip64 where a count, size or offset needs it. The
ZIP CRC-32 comes from ``isal`` (~19 GB/s here) when installed, else zlib (~4.5 GB/s).

Rejected alternative: Python's ``zipfile`` in write mode — 64 ms for a 1,200-entry step (a
Python object and a seek per entry) against ~5 ms here, and it cannot take entries from
several writer threads at once. Details: docs/decisions.md, "Module notes".
"""

from __future__ import annotations

import struct
import zlib
from typing import TYPE_CHECKING, NamedTuple

from dstt.errors import CorruptRunError

if TYPE_CHECKING:
    from collections.abc import Sequence

try:  # ISA-L: the same CRC-32, 4x faster; optional
    from isal.isal_zlib import crc32 as _crc32
except ImportError:  # pragma: no cover - isal is a dependency, but keep the fallback honest
    _crc32 = zlib.crc32

__all__ = [
    "Entry",
    "crc32",
    "directory_records",
    "end_records",
    "header_size",
    "local_data_offset",
    "local_header",
    "parse_directory",
]

_LOCAL = struct.Struct("<IHHHHHIIIHH")  # 30 bytes
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")  # 46 bytes
_EOCD = struct.Struct("<IHHHHIIH")  # 22 bytes
_EOCD64 = struct.Struct("<IQHHIIQQQQ")  # 56 bytes
_LOC64 = struct.Struct("<IIQI")  # 20 bytes
_SIG_LOCAL, _SIG_CENTRAL, _SIG_EOCD = 0x04034B50, 0x02014B50, 0x06054B50
_SIG_EOCD64, _SIG_LOC64 = 0x06064B50, 0x07064B50
_MAX32, _MAX16 = 0xFFFFFFFF, 0xFFFF
_UTF8 = 0x0800  # general purpose flag bit 11: names are UTF-8
_DOS_DATE = (1 << 5) | 1  # 1980-01-01: step files carry no time (the manifest does)
_MADE_BY = (3 << 8) | 45  # Unix, ZIP 4.5
_ATTRS = 0o100644 << 16  # a regular file, rw-r--r--


#: the C function itself (``map`` it over many buffers: no Python frame per call)
crc32_raw = _crc32


def crc32(data: bytes | memoryview, value: int = 0) -> int:
    """The ZIP CRC-32 of ``data``, continuing from ``value``."""
    return int(_crc32(data, value))


class Entry(NamedTuple):
    """One stored entry: its name, where its local header starts, its size and CRC-32."""

    name: str
    offset: int  # of the local header
    size: int
    crc32: int


def _needs64(size: int, offset: int) -> bool:
    return size >= _MAX32 or offset >= _MAX32


_PAD_ID = 0xD935  # zipalign's padding extra field: a 2-byte alignment, then zero bytes


def _pad_len(at: int, align: int) -> int:
    """Bytes of a padding extra field starting at file offset ``at`` that ends on a multiple
    of ``align`` (0: no field)."""
    return 0 if align <= 1 else 6 + (-(at + 6)) % align


def header_size(name: str, size: int, offset: int, *, align: int = 0) -> int:
    """Bytes of the local header that :func:`local_header` writes for such an entry."""
    fixed = _LOCAL.size + len(name.encode()) + (20 if _needs64(size, offset) else 0)
    return fixed + _pad_len(offset + fixed, align)


def local_header(name: str, size: int, crc: int, offset: int, *, align: int = 0) -> bytes:
    """The local file header of a stored entry whose header starts at ``offset``; with
    ``align``, a padding extra field (id 0xD935, as zipalign writes) makes the entry's data
    start at a multiple of ``align`` in the file."""
    raw = name.encode()
    big = _needs64(size, offset)
    extra = struct.pack("<HHQQ", 0x0001, 16, size, size) if big else b""
    pad = _pad_len(offset + _LOCAL.size + len(raw) + len(extra), align)
    if pad:
        extra += struct.pack("<HHH", _PAD_ID, pad - 4, align) + bytes(pad - 6)
    return (
        _LOCAL.pack(
            _SIG_LOCAL,
            45 if big else 20,
            _UTF8,
            0,
            0,
            _DOS_DATE,
            crc,
            _MAX32 if big else size,
            _MAX32 if big else size,
            len(raw),
            len(extra),
        )
        + raw
        + extra
    )


def local_data_offset(head: bytes, entry: Entry) -> int | None:
    """Where ``entry``'s data starts, from the first ``30 + len(name)`` bytes of its local
    header, or None if they are not a local header of that entry (damaged). Any extra field
    (zip64 sizes, alignment padding) is allowed: its length is read from the header."""
    raw = entry.name.encode()
    if len(head) < _LOCAL.size + len(raw):
        return None
    f = _LOCAL.unpack_from(head)
    sizes_ok = (f[7], f[8]) in ((entry.size, entry.size), (_MAX32, _MAX32))
    if (
        f[0] != _SIG_LOCAL
        or f[3] != 0
        or f[6] != entry.crc32
        or not sizes_ok
        or f[9] != len(raw)
        or head[_LOCAL.size : _LOCAL.size + len(raw)] != raw
    ):
        return None
    extra: int = f[10]
    return entry.offset + _LOCAL.size + len(raw) + extra


def directory_records(entries: Sequence[Entry]) -> bytes:
    """The central directory records of ``entries`` (without the end records)."""
    parts: list[bytes] = []
    for e in entries:
        raw = e.name.encode()
        size32 = off32 = 0
        fields: list[int] = []
        if e.size >= _MAX32:
            fields += [e.size, e.size]
            size32 = _MAX32
        if e.offset >= _MAX32:
            fields.append(e.offset)
            off32 = _MAX32
        n = len(fields)
        extra = struct.pack(f"<HH{n}Q", 0x0001, 8 * n, *fields) if fields else b""
        need = 45 if fields else 20
        parts.append(
            _CENTRAL.pack(
                _SIG_CENTRAL,
                _MADE_BY,
                need,
                _UTF8,
                0,
                0,
                _DOS_DATE,
                e.crc32,
                size32 or e.size,
                size32 or e.size,
                len(raw),
                len(extra),
                0,
                0,
                0,
                _ATTRS,
                off32 or e.offset,
            )
            + raw
            + extra
        )
    return b"".join(parts)


def end_records(n: int, cd_size: int, start: int) -> bytes:
    """The end of central directory record(s) of ``n`` entries whose directory of
    ``cd_size`` bytes starts at ``start`` (zip64 records where a field overflows)."""
    if n >= _MAX16 or start >= _MAX32 or cd_size >= _MAX32:
        tail = _EOCD64.pack(_SIG_EOCD64, 44, _MADE_BY, 45, 0, 0, n, n, cd_size, start)
        tail += _LOC64.pack(_SIG_LOC64, 0, start + cd_size, 1)
        return tail + _EOCD.pack(
            _SIG_EOCD,
            0,
            0,
            min(n, _MAX16),
            min(n, _MAX16),
            min(cd_size, _MAX32),
            min(start, _MAX32),
            0,
        )
    return _EOCD.pack(_SIG_EOCD, 0, 0, n, n, cd_size, start, 0)


def parse_directory(data: bytes, file_size: int, where: str) -> dict[str, Entry]:
    """Entries of a step file from its tail (``data`` = the last bytes of the file, at least
    the whole central directory and end records); ``CorruptRunError`` if malformed."""
    base = file_size - len(data)
    i = data.rfind(struct.pack("<I", _SIG_EOCD))
    if i < 0 or len(data) - i < _EOCD.size:
        raise CorruptRunError(f"{where}: no ZIP end of central directory record")
    _, _, _, _, n, cd_size, cd_start, _ = _EOCD.unpack_from(data, i)
    if (n == _MAX16 or cd_start == _MAX32 or cd_size == _MAX32) and i >= _LOC64.size:
        sig, _, eocd64, _ = _LOC64.unpack_from(data, i - _LOC64.size)
        if sig != _SIG_LOC64 or eocd64 - base < 0:
            raise CorruptRunError(f"{where}: zip64 locator missing or outside the read tail")
        rec = _EOCD64.unpack_from(data, eocd64 - base)
        if rec[0] != _SIG_EOCD64:
            raise CorruptRunError(f"{where}: zip64 end of central directory record damaged")
        n, cd_size, cd_start = rec[7], rec[8], rec[9]
    pos = cd_start - base
    if pos < 0:
        raise CorruptRunError(f"{where}: central directory starts outside the read tail")
    out: dict[str, Entry] = {}
    for _ in range(n):
        if pos + _CENTRAL.size > len(data):
            raise CorruptRunError(f"{where}: central directory truncated")
        f = _CENTRAL.unpack_from(data, pos)
        if f[0] != _SIG_CENTRAL or f[4] != 0:
            raise CorruptRunError(f"{where}: central directory entry damaged or compressed")
        nlen, xlen, clen = f[10], f[11], f[12]
        try:
            name = data[pos + 46 : pos + 46 + nlen].decode()
        except UnicodeDecodeError:
            raise CorruptRunError(f"{where}: an entry name is not UTF-8 (damaged)") from None
        size, offset = f[9], f[16]
        x = pos + 46 + nlen
        xend = x + xlen
        while x + 4 <= xend:
            tag, ln = struct.unpack_from("<HH", data, x)
            if tag == 0x0001:
                vals = list(struct.unpack_from(f"<{ln // 8}Q", data, x + 4))
                if size == _MAX32:
                    size = vals.pop(0)
                    vals.pop(0)
                if offset == _MAX32:
                    offset = vals.pop(0)
            x += 4 + ln
        out[name] = Entry(name, offset, size, f[7])
        pos = xend + clen
    return out
