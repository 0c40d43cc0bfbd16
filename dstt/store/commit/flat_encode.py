"""An encoded flat step written: the batched encoder's decisions made into files and columns.

``codec/flatdelta.py`` decides, for every chunk of a step captured into one flat buffer,
whether it is a dedup, a delta or a keyframe, and encodes the deltas; this writes them: every
delta in one append to the step's side file (payload + crc32c trailer each, not Zarr chunks),
the keyframes as one range of zip entries (their headers built once while the same chunks
keyframe: ``_write_keyframes``), dedups as their older records — then records the
step's columns, which the transaction records (with its flat shadow, the next step's base).
Kept out of ``transaction.py``, which holds what a step is, not how an encoded one is laid
out; it is handed the step's files, encoder and predictions and returns what it wrote
(rejected: reaching into the transaction, a back-reference that made the two modules a
cycle).
"""

from __future__ import annotations

import itertools
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from dstt.store.codec.flatdelta import DEDUP, KEY
from dstt.store.format.envelope import crc32c_raw
from dstt.store.format.zipfmt import Entry, crc32_raw, directory_records, local_header

if TYPE_CHECKING:
    from dstt.store.codec.delta import DeltaEncoder
    from dstt.store.codec.layout_state import LayoutState
    from dstt.store.codec.predict import Prediction
    from dstt.store.format.flat import FlatLayout
    from dstt.store.format.stepfile import SideFile, StepFile

__all__ = ["EncodedWrite", "write_encoded"]

_PACK = struct.Struct("<I").pack
_HEADER_CRC, _CENTRAL_CRC, _CENTRAL_OFFSET = 14, 16, 42  # field offsets in the zip records
_FOUR = np.arange(4)


@dataclass(frozen=True)
class EncodedWrite:
    """What ``write_encoded`` wrote: the step's columns (offsets, sizes, crc32c), each chunk's
    file and its codec entries, the counts for ``EncodeStats`` and what the step's flat
    shadow needs (its raw crc32c and chain depths)."""

    cols: tuple[list[int], list[int], list[int]]
    keys: list[str]
    codecs: dict[int, tuple[Any, ...]]
    written: int
    keyframes: int
    deltas: int
    dedups: int
    #: the in-flight slot the deltas are based on (None: a committed base)
    dep: int | None
    raw_crcs: np.ndarray
    depth: np.ndarray


def write_encoded(
    enc: DeltaEncoder,
    zf: StepFile,
    side: SideFile,
    layout: FlatLayout,
    view: memoryview,
    slot: int,
    timeline: str,
    predictions: dict[str, Prediction],
) -> EncodedWrite | None:
    """``put_flat_chunks`` as one batched encode (``codec/flatdelta.py``) into the step's
    files ``zf`` and ``side``: deltas in one append to the side file, keyframes in one batch
    of zip entries, dedups pointing at their older records. None: nothing to encode against
    (the step is a keyframe, to be written whole)."""
    buf = np.frombuffer(view[: layout.nbytes], dtype=np.uint8)
    got = enc.encode_step(layout, buf, slot, timeline, predictions)
    if got is None:
        return None
    e, base, from_slot = got
    kinds, raw = e.kinds, e.raw_crcs
    n = len(kinds)
    files = np.full(n, zf.key, dtype=object)
    offsets = np.zeros(n, np.int64)
    sizes = np.zeros(n, np.int64)
    crcs = raw.copy()
    d = np.flatnonzero(kinds == DEDUP)
    for col, src in (
        (files, base.files),
        (offsets, base.offsets),
        (sizes, base.nbytes),
        (crcs, base.crcs),
    ):
        col[d] = src[d]
    written = 0
    if len(e.delta_idx):
        pcrc = list(map(crc32c_raw, e.payloads))
        # one buffer, not a part per delta: ``as_parts`` would make a memoryview of each
        start = side.append(
            b"".join(itertools.chain.from_iterable(zip(e.payloads, map(_PACK, pcrc), strict=True)))
        )
        lens = np.fromiter(map(len, e.payloads), np.int64, len(e.payloads)) + 4
        di = e.delta_idx
        files[di] = side.key
        offsets[di] = start + np.cumsum(lens) - lens
        sizes[di] = lens
        crcs[di] = pcrc
        written += int(lens.sum())
    k = np.flatnonzero(kinds == KEY)
    if len(k):
        offs, ks = _write_keyframes(enc, zf, layout, buf, k, raw[k].tolist())
        offsets[k] = offs
        sizes[k] = ks
        written += int(sum(ks))
    return EncodedWrite(
        cols=(offsets.tolist(), sizes.tolist(), crcs.tolist()),
        keys=files.tolist(),
        codecs=e.codecs,
        written=written,
        keyframes=len(k),
        deltas=len(e.delta_idx),
        dedups=len(d),
        dep=from_slot if from_slot is not None and e.deps else None,
        raw_crcs=raw,
        depth=e.depth,
    )


def _write_keyframes(
    enc: DeltaEncoder,
    zf: StepFile,
    layout: FlatLayout,
    buf: np.ndarray,
    idx: np.ndarray,
    raw: list[int],
) -> tuple[list[int], list[int]]:
    """Chunks ``idx`` of an encoded step written raw (``raw``: their crc32c, the encoder's),
    as zip entries: one range of the step file, its headers and directory records sliced
    from per-chunk templates built once per layout and their CRC-32 and offset fields
    patched with numpy (no Python per entry; the set of keyframes changes from step to
    step). Returns each chunk's data offset and size."""
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
    if zf.cursor + total >= 0xFFFFFFFF:  # zip64 fields: headers depend on the offset
        names = list(map(t.names.__getitem__, chunks))
        offs = zf.add_many(
            names, [[d, tr] for d, tr in zip(data, trailers, strict=True)], size.tolist(), zips
        )
        return offs, size.tolist()
    start = zf.reserve(frozenset(map(t.names.__getitem__, chunks)), lambda s: total)
    heads = np.frombuffer(bytearray(b"".join(map(t.heads.__getitem__, chunks))), np.uint8)
    hat = np.cumsum(hlen) - hlen
    entry = start + np.cumsum(hlen + size) - (hlen + size)  # each local header's offset
    z4 = np.asarray(zips, "<u4").view(np.uint8).reshape(-1, 4)
    heads[(hat + _HEADER_CRC)[:, None] + _FOUR] = z4
    cds = np.frombuffer(bytearray(b"".join(map(t.cds.__getitem__, chunks))), np.uint8)
    cat = np.cumsum(t.cdlen[idx]) - t.cdlen[idx]
    cds[(cat + _CENTRAL_CRC)[:, None] + _FOUR] = z4
    cds[(cat + _CENTRAL_OFFSET)[:, None] + _FOUR] = (
        entry.astype("<u4").view(np.uint8).reshape(-1, 4)
    )
    hv = memoryview(heads.data).cast("B")
    hviews = list(map(hv.__getitem__, map(slice, hat.tolist(), (hat + hlen).tolist())))
    zf.write_at(
        start, list(itertools.chain.from_iterable(zip(hviews, data, trailers, strict=True)))
    )
    zf.add_directory(cds.tobytes(), len(chunks))
    return (entry + hlen).tolist(), size.tolist()


class _Templates:
    """Per chunk of a layout: its zip entry's local header and central directory record
    with zero CRC-32 and offset (below 4 GiB neither depends on where the entry is)."""

    def __init__(self, st: LayoutState) -> None:
        ch = st.layout.chunks
        self.names = [c[4] for c in ch]
        sizes = [c[5] + 4 for c in ch]
        self.heads = [local_header(n, sz, 0, 0) for n, sz in zip(self.names, sizes, strict=True)]
        self.cds = [
            directory_records([Entry(n, 0, sz, 0)]) for n, sz in zip(self.names, sizes, strict=True)
        ]
        self.hlen = np.fromiter(map(len, self.heads), np.int64, len(ch))
        self.cdlen = np.fromiter(map(len, self.cds), np.int64, len(ch))
        self.size = np.asarray(sizes, np.int64)
        self.pad_idx = np.asarray(sorted(st.pads), np.int64)


def _templates(st: LayoutState) -> _Templates:
    t = st.cache.get("zip_templates")
    if t is None:
        t = st.cache["zip_templates"] = _Templates(st)
    return t
