"""ZIP records written by hand: aligned entry data (zipalign's padding extra field) reads in
Python's zipfile, and the local header tells where any entry's data starts."""

from __future__ import annotations

import io
import os
import zipfile

import pytest

from dstt.store.format.zipfmt import (
    Entry,
    crc32,
    directory_records,
    end_records,
    header_size,
    local_data_offset,
    local_header,
    parse_directory,
)


def _zip(items: list[tuple[str, bytes]], align: int) -> tuple[bytes, list[Entry], list[int]]:
    out, entries, data_at = bytearray(), [], []
    for name, data in items:
        head = local_header(name, len(data), crc32(data), len(out), align=align)
        assert len(head) == header_size(name, len(data), len(out), align=align)
        entries.append(Entry(name, len(out), len(data), crc32(data)))
        out += head
        data_at.append(len(out))
        out += data
    cd = directory_records(entries)
    start = len(out)
    out += cd + end_records(len(entries), len(cd), start)
    return bytes(out), entries, data_at


@pytest.mark.parametrize("align", [0, 64, 4096])
def test_aligned_entries_read_in_zipfile_and_say_where_their_data_is(align: int) -> None:
    items = [(f"params/l{i}/weight/c/0/0", os.urandom(3 + 97 * i)) for i in range(7)]
    items.append(("zarr.json", b'{"zarr_format": 3}'))
    blob, entries, data_at = _zip(items, align)
    if align:
        assert all(a % align == 0 for a in data_at)
    with zipfile.ZipFile(io.BytesIO(blob)) as z:
        assert z.testzip() is None  # every CRC-32 checks
        for name, data in items:
            assert z.read(name) == data
    listed = parse_directory(blob, len(blob), "mem")
    for e, at in zip(entries, data_at, strict=True):
        got = listed[e.name]
        assert local_data_offset(blob[got.offset : got.offset + 30 + len(e.name)], got) == at


def test_local_data_offset_refuses_a_damaged_header() -> None:
    blob, entries, _ = _zip([("a/c/0", b"xyz")], 64)
    e = entries[0]
    head = bytearray(blob[: 30 + len(e.name)])
    assert local_data_offset(bytes(head), e) is not None
    for pos in (0, 14, 26, 31):  # signature, CRC-32, name length, the name
        bad = bytearray(head)
        bad[pos] ^= 0xFF
        assert local_data_offset(bytes(bad), e) is None
    assert local_data_offset(bytes(head[:20]), e) is None


def test_unaligned_headers_are_unchanged() -> None:
    """Runs written before alignment existed have these exact bytes: verify reads them."""
    h = local_header("params/w/c/0", 16, 0xDEADBEEF, 1234)
    assert len(h) == 30 + len("params/w/c/0")
    assert h[28:30] == b"\0\0"


def test_a_moved_block_is_the_block_built_there() -> None:
    """``Block.moved`` patches the directory's offsets instead of rebuilding the entries
    (an encoded step's metadata lands after a varying number of keyframes)."""
    from dstt.store.format.stepfile import Block

    names = [f"a/{i}/zarr.json" for i in range(5)] + ["b/ü/zarr.json"]
    datas = [bytes([i]) * (10 + 7 * i) for i in range(len(names))]
    built = Block(0, names, datas)
    for start in (0, 1, 4096, 123_457):
        moved, fresh = built.moved(start), Block(start, names, datas)
        assert moved.directory == fresh.directory
        assert moved.entries == fresh.entries
        assert moved.iov == fresh.iov
        assert (moved.start, moved.nbytes, moved.names) == (fresh.start, fresh.nbytes, fresh.names)
        assert moved.moved(7).directory == Block(7, names, datas).directory
