"""An encoded flat step written: the batched encoder's decisions made into files and columns.

``codec/flatdelta.py`` decides, for every chunk of a step captured into one flat buffer,
whether it is a dedup, a delta or a keyframe, and encodes the deltas; this writes them: every
delta in one append to the step's side file (payload + crc32c trailer each, not Zarr chunks),
the keyframes as one range of zip entries (their headers built once while the same chunks
keyframe: ``flatdelta.keyframe_image``), dedups as their older records — then records the
step's columns in the transaction and leaves its flat shadow, the next step's base. Kept out of
``transaction.py``, which holds what a step is, not how an encoded one is laid out.
"""

from __future__ import annotations

import itertools
import struct
import time
from typing import TYPE_CHECKING

import numpy as np

from .codec.flatdelta import DEDUP, KEY, keyframe_image
from .format.envelope import crc32c_raw
from .format.flat import FlatLayout

if TYPE_CHECKING:
    from .transaction import Transaction

__all__ = ["write_encoded"]

_PACK = struct.Struct("<I").pack


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
        offs, ks = _write_keyframes(txn, layout, view, k.tolist())
        offsets[k] = offs
        sizes[k] = ks
        written += int(sum(ks))
    cols = (offsets.tolist(), sizes.tolist(), crcs.tolist())
    txn._record_flat(layout, cols, (files.tolist(), e.codecs))
    txn.stats.add_counts(layout.raw_nbytes, written, keyframes=len(k),
                         deltas=len(e.delta_idx), dedups=len(d),
                         seconds=time.perf_counter() - t0)
    if from_slot is not None and e.deps:
        with txn._lock:
            txn.deps.add(from_slot)
    txn.flat_pending = txn._flat_shadow(layout, view, files.tolist(), *cols,
                                        raw_crcs=raw, depth=e.depth, codecs=e.codecs)


def _write_keyframes(txn: Transaction, layout: FlatLayout, view: memoryview, chunks: list[int]
                     ) -> tuple[list[int], list[int]]:
    """Chunks of an encoded step written raw, as zip entries: one range of the step file
    (``flatdelta.keyframe_image``: headers built once while the same chunks keyframe)."""
    enc = txn.writer.encoder
    assert enc is not None
    st = enc.layout_state(layout)
    key = tuple(chunks)
    names = frozenset(layout.chunks[j][4] for j in chunks)
    start = txn.zip.reserve(names, lambda s: keyframe_image(st, key, s, view).nbytes)
    im = keyframe_image(st, key, start, view)
    im.fill()
    txn.zip.write_at(start, im.iov)
    txn.zip.add_directory(bytes(im.directory), len(chunks))
    return im.offsets, im.sizes
