"""An encoded flat step written: the batched encoder's decisions made into files and columns.

``codec/flatdelta.py`` decides, for every chunk of a step captured into one flat buffer,
whether it is a dedup, a delta or a keyframe, and encodes the deltas; this writes them: every
delta in one append to the step's side file (payload + crc32c trailer each, not Zarr chunks),
the keyframes as one range of zip entries (their headers built once while the same chunks
keyframe: ``flatdelta.keyframe_image``), dedups as their older records — then records the
step's columns in the transaction and leaves its flat shadow, the next step's base. Kept out of
``commit/transaction.py``, which holds what a step is, not how an encoded one is laid out.
"""

from __future__ import annotations

import itertools
import struct
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from ..codec.flatdelta import DEDUP, KEY, LayoutState
from ..format.envelope import crc32c_raw
from ..format.flat import FlatLayout
from ..format.zipfmt import Entry, crc32_raw, directory_records, local_header

if TYPE_CHECKING:
    from .transaction import Transaction

__all__ = ["write_encoded"]

_PACK = struct.Struct("<I").pack
_HEADER_CRC, _CENTRAL_CRC, _CENTRAL_OFFSET = 14, 16, 42  # field offsets in the zip records
_FOUR = np.arange(4)


def write_encoded(txn: Transaction, layout: FlatLayout, view: memoryview) -> None:
    """``put_flat_chunks`` as one batched encode (``codec/flatdelta.py``): deltas in
    one append to the side file, keyframes in one batch of zip entries, dedups
    pointing at their older records; the step's columns become the next flat base."""
    enc = txn.writer.encoder
    assert enc is not None
    t0 = time.perf_counter()
    buf = np.frombuffer(view[:layout.nbytes], dtype=np.uint8)
    got = enc.encode_step(layout, buf, txn.slot, txn.timeline, txn._predictions)
    if got is None:  # nothing to encode against: a keyframe, written whole
        txn._write_flat(layout, view, None, None)
        txn.stats.raw_fallback = False
        return
    e, base, from_slot = got
    kinds, raw = e.kinds, e.raw_crcs
    n = len(kinds)
    files = np.full(n, txn.zip.key, dtype=object)
    offsets = np.zeros(n, np.int64)
    sizes = np.zeros(n, np.int64)
    crcs = raw.copy()
    d = np.flatnonzero(kinds == DEDUP)
    for col, src in ((files, base.files), (offsets, base.offsets), (sizes, base.nbytes),
                     (crcs, base.crcs)):
        col[d] = src[d]
    written = 0
    if len(e.delta_idx):
        pcrc = list(map(crc32c_raw, e.payloads))
        # one buffer, not a part per delta: ``as_parts`` would make a memoryview of each
        start = txn.side.append(b"".join(itertools.chain.from_iterable(
            zip(e.payloads, map(_PACK, pcrc), strict=True))))
        lens = np.fromiter(map(len, e.payloads), np.int64, len(e.payloads)) + 4
        di = e.delta_idx
        files[di] = txn.side.key
        offsets[di] = start + np.cumsum(lens) - lens
        sizes[di] = lens
        crcs[di] = pcrc
        written += int(lens.sum())
    k = np.flatnonzero(kinds == KEY)
    if len(k):
        offs, ks = _write_keyframes(txn, layout, buf, k, raw[k].tolist())
        offsets[k] = offs
        sizes[k] = ks
        written += int(sum(ks))
    cols = (offsets.tolist(), sizes.tolist(), crcs.tolist())
    keys = files.tolist()
    txn._record_flat(layout, cols, (keys, e.codecs))
    txn.stats.add_counts(layout.raw_nbytes, written, keyframes=len(k),
                         deltas=len(e.delta_idx), dedups=len(d),
                         seconds=time.perf_counter() - t0)
    if from_slot is not None and e.deps:
        with txn._lock:
            txn.deps.add(from_slot)
    txn.flat_pending = txn._flat_shadow(layout, view, keys, *cols,
                                        raw_crcs=raw, depth=e.depth, codecs=e.codecs)


def _write_keyframes(txn: Transaction, layout: FlatLayout, buf: np.ndarray, idx: np.ndarray,
                     raw: list[int]) -> tuple[list[int], list[int]]:
    """Chunks ``idx`` of an encoded step written raw (``raw``: their crc32c, the encoder's),
    as zip entries: one range of the step file, its headers and directory records sliced
    from per-chunk templates built once per layout and their CRC-32 and offset fields
    patched with numpy (no Python per entry; the set of keyframes changes from step to
    step). Returns each chunk's data offset and size."""
    enc = txn.writer.encoder
    assert enc is not None
    st = enc.layout_state(layout)
    t = _templates(st)
    chunks = idx.tolist()
    data: list[Any] = list(map(st.views(buf, "b").__getitem__, chunks))
    if st.pads:  # edge chunks (the last of a multi-chunk array): their zero padding, copied
        for j in np.flatnonzero(np.isin(idx, t.pad_idx)).tolist():
            data[j] = bytes(data[j]) + bytes(st.pads[chunks[j]])
    trailers = list(map(_PACK, raw))
    zips = list(map(crc32_raw, trailers, map(crc32_raw, data)))
    hlen, size = t.hlen[idx], t.size[idx]
    total = int(hlen.sum() + size.sum())
    if txn.zip.cursor + total >= 0xFFFFFFFF:  # zip64 fields: headers depend on the offset
        names = list(map(t.names.__getitem__, chunks))
        offs = txn.zip.add_many(names, [[d, tr] for d, tr in zip(data, trailers, strict=True)],
                                size.tolist(), zips)
        return offs, size.tolist()
    start = txn.zip.reserve(frozenset(map(t.names.__getitem__, chunks)), lambda s: total)
    heads = np.frombuffer(bytearray(b"".join(map(t.heads.__getitem__, chunks))), np.uint8)
    hat = np.cumsum(hlen) - hlen
    entry = start + np.cumsum(hlen + size) - (hlen + size)  # each local header's offset
    z4 = np.asarray(zips, "<u4").view(np.uint8).reshape(-1, 4)
    heads[(hat + _HEADER_CRC)[:, None] + _FOUR] = z4
    cds = np.frombuffer(bytearray(b"".join(map(t.cds.__getitem__, chunks))), np.uint8)
    cat = np.cumsum(t.cdlen[idx]) - t.cdlen[idx]
    cds[(cat + _CENTRAL_CRC)[:, None] + _FOUR] = z4
    cds[(cat + _CENTRAL_OFFSET)[:, None] + _FOUR] = (
        entry.astype("<u4").view(np.uint8).reshape(-1, 4))
    hv = memoryview(heads.data).cast("B")
    hviews = list(map(hv.__getitem__, map(slice, hat.tolist(), (hat + hlen).tolist())))
    txn.zip.write_at(start, list(itertools.chain.from_iterable(
        zip(hviews, data, trailers, strict=True))))
    txn.zip.add_directory(cds.tobytes(), len(chunks))
    return (entry + hlen).tolist(), size.tolist()


class _Templates:
    """Per chunk of a layout: its zip entry's local header and central directory record
    with zero CRC-32 and offset (below 4 GiB neither depends on where the entry is)."""

    def __init__(self, st: LayoutState) -> None:
        ch = st.layout.chunks
        self.names = [c[4] for c in ch]
        sizes = [c[5] + 4 for c in ch]
        self.heads = [local_header(n, sz, 0, 0) for n, sz in zip(self.names, sizes, strict=True)]
        self.cds = [directory_records([Entry(n, 0, sz, 0)])
                    for n, sz in zip(self.names, sizes, strict=True)]
        self.hlen = np.fromiter(map(len, self.heads), np.int64, len(ch))
        self.cdlen = np.fromiter(map(len, self.cds), np.int64, len(ch))
        self.size = np.asarray(sizes, np.int64)
        self.pad_idx = np.asarray(sorted(st.pads), np.int64)


def _templates(st: LayoutState) -> _Templates:
    t = st.cache.get("zip_templates")
    if t is None:
        t = st.cache["zip_templates"] = _Templates(st)
    return t  # type: ignore[no-any-return]
