"""What the flat encoder needs of a layout at every step, built once per layout.

``LayoutState`` holds a flat layout's chunk sizes, paddings, cached per-chunk views of the
buffers it cycles through, and the compression ratios measured so far; ``LayoutStates`` keeps
one per layout a writer encodes. Used by the flat encoder (``flatdelta.py``), the grouped
predictions (``flatpredict.py``) and the encoded-step writer (``commit/flat_encode.py``).
Its own module because the first two import each other's halves otherwise (rejected: a
``TYPE_CHECKING`` back-reference from ``flatpredict`` into ``flatdelta``).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

import numpy as np

from dstt.store.format.envelope import checksum, crc32c_raw

if TYPE_CHECKING:
    from dstt.store.format.flat import FlatLayout

__all__ = ["LayoutState", "LayoutStates"]

_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


class LayoutState:
    """What a layout needs at every step, built once: sizes, paddings, chunk views, and
    the per-chunk compression ratios measured so far."""

    def __init__(self, layout: FlatLayout) -> None:
        ch = layout.chunks
        arrays = layout.arrays
        self.layout = layout
        self.starts = np.fromiter((c[2] for c in ch), np.int64, len(ch))
        self.stops = np.fromiter((c[3] for c in ch), np.int64, len(ch))
        self.size = self.stops - self.starts
        self.itemsize = np.fromiter((arrays[c[0]].plan.itemsize for c in ch), np.int64, len(ch))
        self.pads = {j: c[5] - (c[3] - c[2]) for j, c in enumerate(ch) if c[5] > c[3] - c[2]}
        #: (path, chunk index) -> position in ``chunks``
        self.where = {(arrays[c[0]].path, c[1]): j for j, c in enumerate(ch)}
        self.ratio = np.full(len(ch), np.nan)
        self.skips = np.zeros(len(ch), np.int64)
        self._views: dict[tuple[int, int, str], list[Any]] = {}
        self.mu = threading.Lock()
        self.cache: dict[Any, Any] = {}

    def views(self, buf: np.ndarray, kind: str) -> list[Any]:
        """Per-chunk views of ``buf`` (``"b"``: memoryviews of bytes, ``"t"``: numpy arrays
        typed by element size, for Blosc's shuffle), cached by the buffer's address for the
        few buffers a layout cycles through (the engine's step buffers, a scratch array;
        the views keep their buffer alive, so an address names one buffer while cached)."""
        key = (buf.ctypes.data, buf.nbytes, kind)
        with self.mu:
            v = self._views.pop(key, None)
            if v is not None:
                self._views[key] = v  # most recent last
                return v
        v = self.make_views(buf, kind)
        with self.mu:
            self._views[key] = v
            while len(self._views) > 8:
                del self._views[next(iter(self._views))]
        return v

    def make_views(self, buf: np.ndarray, kind: str) -> list[Any]:
        if kind == "b":
            mv = memoryview(buf.data).cast("B")
            return list(map(mv.__getitem__, map(slice, self.starts.tolist(), self.stops.tolist())))
        return [
            buf[s:e].view(_UINT[int(k)]) if (e - s) % k == 0 else buf[s:e]
            for s, e, k in zip(
                self.starts.tolist(), self.stops.tolist(), self.itemsize.tolist(), strict=True
            )
        ]

    def raw_crcs(self, views: list[Any]) -> np.ndarray:
        crcs = list(map(crc32c_raw, views))
        for j, pad in self.pads.items():  # edge chunks: the crc32c covers their zero padding
            crcs[j] = checksum(bytes(pad), crcs[j])
        return np.asarray(crcs, dtype=np.int64)


class LayoutStates:
    """A writer's ``LayoutState`` of each flat layout it encodes (a few: the engine keeps
    one layout while shapes do not change)."""

    def __init__(self) -> None:
        self._mu = threading.Lock()
        self._states: dict[int, LayoutState] = {}

    def get(self, layout: FlatLayout) -> LayoutState:
        with self._mu:
            st = self._states.get(id(layout))
            if st is None or st.layout is not layout:
                if len(self._states) >= 8:
                    self._states.clear()
                st = self._states[id(layout)] = LayoutState(layout)
            return st
