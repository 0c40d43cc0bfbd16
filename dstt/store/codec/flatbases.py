"""The writer's flat bases: which flat shadow a step is encoded against, and their budget.

``DeltaEncoder`` (``delta.py``) owns the delta state of a writer: the shadows of committed
chunks, the steps in flight, the timeline, the budget. A step written whole from one flat
layout (``flatdelta.py``) is encoded against a *flat shadow* of that layout instead of chunk
shadows; these are the encoder's methods for it — the newest shadow before the step (in
flight, else committed), the budget check, the recycled copy — as a mixin of ``DeltaEncoder``
(as ``read/chunks.py`` is of the reader), which provides the attributes. Rejected
alternative: a second encoder object for flat steps — in-flight bases, discards and promotes
must see both kinds of step under one lock.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from .flatdelta import FlatEncoded, FlatShadow, LayoutState, LayoutStates, encode_flat
from .predict import Prediction

if TYPE_CHECKING:
    from .buffers import Scratch, ShadowPool
    from .xor import DeltaPolicy

__all__ = ["FlatBasesMixin"]


class FlatBasesMixin:
    """Methods :class:`~dstt.store.codec.delta.DeltaEncoder` gets from this module."""

    policy: DeltaPolicy
    _mu: threading.Lock
    _flat: dict[int, FlatShadow]
    _flat_states: LayoutStates
    _bytes: int
    _pool: ShadowPool
    _scratch: Scratch
    _inflight: dict[int, Any]
    _timeline: str | None

    def flat_room(self, nbytes: int, layout: object) -> bool:
        """Whether a flat shadow of ``nbytes`` fits the shadow budget."""
        with self._mu:
            old = self._flat.get(id(layout))
            held = sum(s.data.nbytes for s in self._flat.values()) - (
                old.data.nbytes if old is not None else 0)
            return self._bytes + held + nbytes <= self.policy.shadow_bytes

    def layout_state(self, layout: object) -> LayoutState:
        return self._flat_states.get(layout)  # type: ignore[arg-type]

    def flat_copy(self, buf: np.ndarray) -> np.ndarray:
        """A copy of a step buffer to become a flat shadow (recycled memory)."""
        return self._pool.copy(buf)

    def encode_step(self, layout: object, buf: np.ndarray, slot: int, timeline: str,
                    predictions: dict[str, Prediction],
                    ) -> tuple[FlatEncoded, FlatShadow, int | None] | None:
        """The step in flat buffer ``buf`` encoded against the newest flat shadow of its
        layout before ``slot`` (with the in-flight slot it came from, or None: committed);
        None when there is none (the step is a keyframe)."""
        epoch = self._pool.enter()
        try:
            with self._mu:
                flights = sorted(((s, f) for s, f in self._inflight.items()
                                  if s < slot and f.timeline == timeline), reverse=True)
                committed = self._flat.get(id(layout)) if timeline == self._timeline else None
            base, from_slot = None, None
            for s, f in flights:
                sh = f.flat()
                if sh is not None and sh.layout is layout:
                    base, from_slot = sh, s
                    break
            if base is None and committed is not None and committed.layout is layout:
                base = committed
            if base is None:
                return None
            t0 = time.perf_counter()
            out = encode_flat(self.policy, self._flat_states.get(layout),  # type: ignore[arg-type]
                              buf, base, slot, predictions, self._scratch)
            out.seconds = time.perf_counter() - t0
            return out, base, from_slot
        finally:
            self._pool.leave(epoch)
