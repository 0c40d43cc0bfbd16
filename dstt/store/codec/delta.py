"""The writer's delta state: the last committed copy of each flat layout, and in-flight bases.

Every encoded step is a flat step, encoded by ``flatdelta.py`` (a step fed by ``put_chunk`` is
staged by its transaction and encoded at commit with a layout cached here, ``layout``).
``DeltaEncoder`` keeps a *flat shadow* per layout, the next step's base, and with
``Writer(inflight_bases=True)`` those of steps still in flight: a step based on one records
that slot in its ``deps``, and ``check_deps`` refuses its commit unless the base committed
first. A new timeline drops the shadows: deltas never chain across timelines.

Rejected: a second, chunk-by-chunk encoder with chunk shadows (it drifted: one step had other
bytes per lane; it lives on as the tests' reference), and reading the base back from disk at
encode time (read bandwidth on the hot path; a shadow costs host memory, ``shadow_bytes``).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from dstt.errors import DsttError

from .buffers import Scratch, ShadowPool
from .flatdelta import FlatEncoded, FlatShadow, encode_flat
from .layout_state import LayoutState, LayoutStates

if TYPE_CHECKING:
    from collections.abc import Callable

    import numpy as np

    from dstt.store.format.flat import FlatLayout

    from .predict import Prediction
    from .xor import DeltaPolicy

__all__ = ["DeltaEncoder", "EncodeStats"]


@dataclass
class EncodeStats:
    """Per-step accounting of what the encoder did (reported in engine metrics)."""

    raw_bytes: int = 0
    written_bytes: int = 0
    keyframes: int = 0
    deltas: int = 0
    dedups: int = 0
    raw_fallback: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add_many(
        self, raw: int, written: int, *, keyframes: int, deltas: int = 0, dedups: int = 0
    ) -> None:
        with self._lock:
            self.raw_bytes += raw
            self.written_bytes += written
            self.keyframes += keyframes
            self.deltas += deltas
            self.dedups += dedups

    @property
    def ratio(self) -> float:
        return self.raw_bytes / self.written_bytes if self.written_bytes else float("inf")


@dataclass
class _Inflight:
    """A step being written whose flat shadow may serve as a base before it commits."""

    timeline: str
    deps: set[int]  # in-flight slots its own deltas are based on
    flat: Callable[[], FlatShadow | None]  # its flat shadow, once written


#: (path, dtype, shape, dims) of each array of a layout, in order
Specs = tuple[tuple[str, str, tuple[int, ...], "tuple[str, ...] | None"], ...]


class DeltaEncoder:
    def __init__(self, policy: DeltaPolicy) -> None:
        self.policy = policy
        self._timeline: str | None = None
        self._mu = threading.Lock()
        self._inflight: dict[int, _Inflight] = {}
        self._dead: set[int] = set()  # in-flight slots that were aborted
        self._scratch = Scratch()
        self._pool = ShadowPool(policy.shadow_bytes // 4)
        #: the newest committed flat shadow of each layout (by id; ``flatdelta.py``)
        self._flat: dict[int, FlatShadow] = {}
        self._flat_states = LayoutStates()
        self._layouts: dict[Specs, FlatLayout] = {}  # staged steps' layouts (``layout``)

    # -- steps in flight -------------------------------------------------------------------
    def open(
        self, slot: int, timeline: str, deps: set[int], flat: Callable[[], FlatShadow | None]
    ) -> None:
        """Let later slots use this slot's flat shadow (``flat``, once written) as their
        base before it commits; every slot based on it then records it in its ``deps`` and
        must not commit unless this one did (``check_deps``)."""
        with self._mu:
            self._inflight[slot] = _Inflight(timeline, deps, flat)

    def discard(self, slot: int) -> None:
        """``slot`` will not commit: stop basing on it, and on everything based on it."""
        with self._mu:
            self._dead.add(slot)
            self._inflight.pop(slot, None)
            changed = True
            while changed:
                changed = False
                for s, f in list(self._inflight.items()):
                    if f.deps & self._dead:
                        self._dead.add(s)
                        del self._inflight[s]
                        changed = True

    def check_deps(self, slot: int, deps: set[int]) -> None:
        """Raise unless every in-flight slot ``slot``'s deltas are based on has committed."""
        with self._mu:
            bad = sorted(d for d in deps if d in self._dead or d in self._inflight)
        if bad:
            raise DsttError(
                f"slot {slot} is delta-encoded against slot(s) {bad}, which did not commit "
                "(failed, aborted, or not committed yet: commit steps in order); it cannot "
                "commit either — the next steps start from keyframes"
            )

    def promote(self, slot: int, timeline: str, flat: FlatShadow | None = None) -> None:
        """After a commit: its flat shadow becomes the base of the next step of its layout."""
        with self._mu:
            self._inflight.pop(slot, None)
            retired = []
            if timeline != self._timeline:
                self._timeline = timeline
                retired += [s.data for s in self._flat.values()]
                self._flat.clear()
            if flat is not None:
                old_flat = self._flat.get(id(flat.layout))
                if old_flat is not None:
                    retired.append(old_flat.data)
                if len(self._flat) >= 8 and old_flat is None:  # layouts that come and go
                    retired += [s.data for s in self._flat.values()]
                    self._flat.clear()
                self._flat[id(flat.layout)] = flat
        self._pool.retire(retired)  # after the swap: no encode that starts now can see them

    # -- flat steps ------------------------------------------------------------------------
    def layout(self, specs: Specs, build: Callable[[Specs], FlatLayout]) -> FlatLayout:
        """The layout of a staged step's arrays: one object while they do not change, so
        consecutive steps find each other's flat shadows (``build`` makes a new one)."""
        with self._mu:
            got = self._layouts.get(specs)
        if got is None:
            got = build(specs)
            with self._mu:
                if len(self._layouts) >= 8:
                    self._layouts.clear()
                self._layouts[specs] = got
        return got

    def flat_room(self, nbytes: int, layout: object) -> bool:
        with self._mu:
            old = self._flat.get(id(layout))
            held = sum(s.data.nbytes for s in self._flat.values()) - (
                old.data.nbytes if old is not None else 0
            )
            return held + nbytes <= self.policy.shadow_bytes

    def layout_state(self, layout: FlatLayout) -> LayoutState:
        return self._flat_states.get(layout)

    def flat_copy(self, buf: np.ndarray) -> np.ndarray:
        """A copy of a step buffer to become a flat shadow (recycled memory)."""
        return self._pool.copy(buf)

    def encode_step(
        self,
        layout: FlatLayout,
        buf: np.ndarray,
        slot: int,
        timeline: str,
        predictions: dict[str, Prediction],
    ) -> tuple[FlatEncoded, FlatShadow, int | None] | None:
        """The step in flat buffer ``buf`` encoded against the newest flat shadow of its
        layout before ``slot`` (with the in-flight slot it came from, or None: committed);
        None when there is none (the step is a keyframe)."""
        epoch = self._pool.enter()
        try:
            with self._mu:
                flights = sorted(
                    (
                        (s, f)
                        for s, f in self._inflight.items()
                        if s < slot and f.timeline == timeline
                    ),
                    reverse=True,
                )
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
            out = encode_flat(
                self.policy,
                self._flat_states.get(layout),
                buf,
                base,
                slot,
                predictions,
                self._scratch,
            )
            return out, base, from_slot
        finally:
            self._pool.leave(epoch)
