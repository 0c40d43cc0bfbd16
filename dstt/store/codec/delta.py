"""The writer's delta state: the last committed copy of every chunk, and the encode decision.

``DeltaEncoder`` keeps a *shadow* — the raw bytes of each chunk as of the newest commit this
writer made — and turns a new chunk into one of: a dedup reference (bytes identical), a
prediction (``predict.py``: Adam(W) state, when the step says how), an XOR delta against the
base (when the chain is short enough and the delta pays), or a keyframe (a plain Zarr chunk).
The base is the newest copy: the shadow (``promote`` runs after the commit point) or, with
``Writer(inflight_bases=True)``, a step still in flight — then the step records that slot in
its ``deps`` and ``check_deps`` refuses its commit unless the base committed first, so a
delta's base is always a committed ancestor on the same timeline even when the engine overlaps
steps or a step fails. A writer on a new timeline (after rollback) starts with an empty
shadow, so deltas never chain across timelines.

A step written whole from one flat layout (``flatdelta.py``) is encoded against a *flat
shadow* of that layout instead of chunk shadows: the encoder's last section picks the newest
one before the step (in flight, else committed), checks the budget and recycles the copy.
Kept in this class (it was a mixin in a module of its own, which bought nothing): in-flight
bases, discards and promotes must see both kinds of step under one lock.

Rejected alternative: reading the base back from disk at encode time — it costs read
bandwidth on the hot flush path; the shadow costs host memory (bounded by
``DeltaPolicy.shadow_bytes``; chunks beyond the budget are always keyframes).
"""

from __future__ import annotations

import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from dstt.errors import DsttError
from dstt.store.format.envelope import checksum
from dstt.store.format.layout import ChunkPlan, key_slot
from dstt.store.format.records import ChunkRecord

from .buffers import Scratch, ShadowPool
from .flatdelta import FlatEncoded, FlatShadow, encode_flat
from .layout_state import LayoutState, LayoutStates
from .predict import CUR, PRED, Prediction, predict
from .xor import XOR, DeltaPolicy, chain_limit, xor_encode

__all__ = ["DeltaEncoder", "EncodeStats", "Shadow"]


@dataclass(frozen=True)
class Shadow:
    record: ChunkRecord
    data: np.ndarray  # raw bytes of the chunk (without edge padding)
    depth: int  # deltas since the keyframe (0 = keyframe)
    slot: int  # a slot whose copy of this chunk has these bytes


@dataclass
class EncodeStats:
    """Per-step accounting of what the encoder did (reported in engine metrics)."""

    raw_bytes: int = 0
    written_bytes: int = 0
    keyframes: int = 0
    deltas: int = 0
    dedups: int = 0
    encode_seconds: float = 0.0
    raw_fallback: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, raw: int, written: int, kind: str, seconds: float = 0.0) -> None:
        with self._lock:
            self.raw_bytes += raw
            self.written_bytes += written
            self.encode_seconds += seconds
            if kind == "key":
                self.keyframes += 1
            elif kind == "delta":
                self.deltas += 1
            else:
                self.dedups += 1

    def add_many(self, raw: int, written: int, *, keyframes: int) -> None:
        with self._lock:
            self.raw_bytes += raw
            self.written_bytes += written
            self.keyframes += keyframes

    def add_counts(
        self, raw: int, written: int, *, keyframes: int, deltas: int, dedups: int, seconds: float
    ) -> None:
        with self._lock:
            self.raw_bytes += raw
            self.written_bytes += written
            self.keyframes += keyframes
            self.deltas += deltas
            self.dedups += dedups
            self.encode_seconds += seconds

    @property
    def ratio(self) -> float:
        return self.raw_bytes / self.written_bytes if self.written_bytes else float("inf")


Lookup = Callable[[str, int], "Shadow | None"]


@dataclass
class _Inflight:
    """A step being written whose chunks may serve as bases before it commits."""

    timeline: str
    lookup: Lookup  # (path, chunk index) → its Shadow once written
    deps: set[int]  # in-flight slots its own deltas are based on
    #: its flat shadow once written (a step written whole from one flat layout)
    flat: Callable[[], FlatShadow | None] = lambda: None


class DeltaEncoder:
    def __init__(self, policy: DeltaPolicy) -> None:
        self.policy = policy
        self._shadow: dict[tuple[str, int], Shadow] = {}
        self._timeline: str | None = None
        self._ratios: dict[str, float] = {}
        self._skips: dict[str, int] = {}  # steps an unprofitable array skipped encoding
        self._bytes = 0
        self._mu = threading.Lock()
        self._inflight: dict[int, _Inflight] = {}
        self._dead: set[int] = set()  # in-flight slots that were aborted
        self._limits: dict[tuple[str, ...], int] = {}  # K per predicted group (at promote)
        self._members: dict[str, tuple[str, ...]] = {}  # predicted array → its group
        self._scratch = Scratch()
        self._pool = ShadowPool(policy.shadow_bytes // 4)
        #: the newest committed flat shadow of each layout (by id; ``flatdelta.py``)
        self._flat: dict[int, FlatShadow] = {}
        self._flat_states = LayoutStates()

    # -- steps in flight -------------------------------------------------------------------
    def open(
        self,
        slot: int,
        timeline: str,
        lookup: Lookup,
        deps: set[int],
        flat: Callable[[], FlatShadow | None] | None = None,
    ) -> None:
        """Let later slots use this slot's chunks as bases before it commits; every slot
        whose chunk is based on it then records it in its ``deps`` and must not commit
        unless this one did (``check_deps``). ``flat``: its flat shadow, once written."""
        with self._mu:
            self._inflight[slot] = _Inflight(
                timeline, lookup, deps, flat if flat is not None else (lambda: None)
            )

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

    def _base(
        self,
        path: str,
        index: int,
        slot: int,
        timeline: str,
    ) -> tuple[Shadow | None, int | None]:
        """The newest copy of a chunk before ``slot``: from a step still in flight (with its
        slot, a dependency) or the last committed one (slot None)."""
        with self._mu:
            flights = sorted(
                ((s, f) for s, f in self._inflight.items() if s < slot and f.timeline == timeline),
                reverse=True,
            )
            committed = self._shadow.get((path, index)) if timeline == self._timeline else None
        for s, f in flights:
            sh = f.lookup(path, index)
            if sh is not None:
                return sh, s
        return committed, None

    def _at(self, path: str, index: int, base_slot: int | None, timeline: str) -> Shadow | None:
        """The copy of a chunk as of the step a base came from (in flight or committed)."""
        if base_slot is None:
            with self._mu:
                return self._shadow.get((path, index)) if timeline == self._timeline else None
        with self._mu:
            f = self._inflight.get(base_slot)
        return f.lookup(path, index) if f is not None else None

    # -- chain limits ----------------------------------------------------------------------
    def chain_limit(self, path: str) -> int:
        return chain_limit(self.policy, self._ratios.get(path))

    def group_limit(self, group: tuple[str, ...]) -> int:
        """K of a predicted group: restoring all its arrays at the worst slot reads at most
        ``read_amplification`` times their raw bytes (a step of the group costs ``u`` raw
        arrays' worth, the sum of 1/ratio over its members)."""
        if self.policy.keyframe_every is not None:
            return self.policy.keyframe_every
        u = 0.0
        for path in group:
            r = self._ratios.get(path)
            u += 1.0 / r if r is not None and r >= self.policy.min_ratio else 1.0
        k = int(1 + (self.policy.read_amplification - 1) * len(group) / max(u, 1e-9))
        return max(2, min(self.policy.max_chain, k))

    # -- encoding --------------------------------------------------------------------------
    def encode(
        self,
        storage_write: object,
        *,
        path: str,
        index: int,
        plan: ChunkPlan,
        slot: int,
        timeline: str,
        data: memoryview,
        raw_crc: int,
        stats: EncodeStats,
        prediction: Prediction | None = None,
        pending: Lookup | None = None,
        deps: set[int] | None = None,
    ) -> tuple[ChunkRecord | None, Shadow | None]:
        """A dedup or delta record (already written), or ``(None, pending)`` for a keyframe.

        The returned ``Shadow`` is what this chunk contributes if its step commits.
        ``prediction``: encode as ``pred1`` when its inputs are at hand (``pending`` looks up
        chunks this step already wrote), else fall back to an XOR delta. ``deps`` collects
        the in-flight slots the record is based on.
        """
        epoch = self._pool.enter()  # shadows read from here on are not recycled under us
        try:
            return self._encode(
                storage_write,
                path,
                index,
                plan,
                slot,
                timeline,
                data,
                raw_crc,
                stats,
                prediction,
                pending,
                deps if deps is not None else set(),
            )
        finally:
            self._pool.leave(epoch)

    def _encode(
        self,
        storage_write: object,
        path: str,
        index: int,
        plan: ChunkPlan,
        slot: int,
        timeline: str,
        data: memoryview,
        raw_crc: int,
        stats: EncodeStats,
        prediction: Prediction | None,
        pending: Lookup | None,
        deps: set[int],
    ) -> tuple[ChunkRecord | None, Shadow | None]:
        cur = np.frombuffer(data, dtype=np.uint8)
        sh, from_slot = self._base(path, index, slot, timeline)
        with self._mu:
            room = sh is not None or self._bytes + cur.nbytes <= self.policy.shadow_bytes
            if prediction is not None:
                self._members[path] = prediction.group
        if sh is not None:
            if (
                self.policy.dedup
                and sh.record.content_crc32c == raw_crc
                and np.array_equal(cur, sh.data)
            ):
                self._depend(deps, from_slot, *sh.record.slots, key_slot(sh.record.key))
                stats.add(cur.nbytes, 0, "dedup")
                return sh.record, sh
            keyframe = False
            worth = self.policy.delta and self._worth(path, index)
            if prediction is not None and worth:
                limit = self._limit(prediction.group)
                out = self._predicted(
                    storage_write,
                    path,
                    index,
                    plan,
                    slot,
                    timeline,
                    cur,
                    raw_crc,
                    stats,
                    sh,
                    from_slot,
                    prediction,
                    pending,
                    deps,
                    limit,
                )
                if isinstance(out, tuple):
                    return out
                keyframe = out
            if not keyframe and worth and sh.depth + 1 < self.chain_limit(path):
                t0 = time.perf_counter()
                payload = xor_encode(
                    cur,
                    sh.data,
                    plan.itemsize,
                    self.policy,
                    out=self._scratch.get("out", cur.nbytes),
                )
                xor = self._emit(
                    storage_write,
                    path,
                    index,
                    plan,
                    slot,
                    cur,
                    raw_crc,
                    stats,
                    payload,
                    time.perf_counter() - t0,
                    ChunkRecord("", 0, 0, XOR, sh.slot, raw_crc),
                    sh.depth + 1,
                )
                if xor is not None:
                    self._depend(deps, from_slot)
                    return xor
        pending_sh = None
        if room:
            pending_sh = Shadow(ChunkRecord("", 0, raw_crc), self._pool.copy(cur), 0, slot)
        return None, pending_sh

    def keep(
        self, path: str, index: int, timeline: str, data: memoryview, raw_crc: int, slot: int
    ) -> Shadow | None:
        """A chunk written raw without encoding (a raw-fallback step): it still becomes the
        base of the next step's deltas — it is a keyframe — if the shadow has room."""
        cur = np.frombuffer(data, dtype=np.uint8)
        with self._mu:
            known = timeline == self._timeline and (path, index) in self._shadow
            room = known or self._bytes + cur.nbytes <= self.policy.shadow_bytes
        if not room:
            return None
        return Shadow(ChunkRecord("", 0, raw_crc), self._pool.copy(cur), 0, slot)

    def _limit(self, group: tuple[str, ...]) -> int:
        with self._mu:
            k = self._limits.get(group)
        return k if k is not None else self.group_limit(group)

    def _depend(self, deps: set[int], *slots: int | None) -> None:
        with self._mu:  # ``discard`` and ``check_deps`` read the set from other threads
            deps.update(s for s in slots if s is not None)

    def _predicted(
        self,
        storage_write: object,
        path: str,
        index: int,
        plan: ChunkPlan,
        slot: int,
        timeline: str,
        cur: np.ndarray,
        raw_crc: int,
        stats: EncodeStats,
        sh: Shadow,
        from_slot: int | None,
        prediction: Prediction,
        pending: Lookup | None,
        deps: set[int],
        limit: int,
    ) -> tuple[ChunkRecord, Shadow] | bool:
        """The written prediction, or whether to write a keyframe instead (False: try an
        XOR delta). Keyframes of a group stay aligned: a member starts a new chain when its
        own chain is full or when a same-step input of the group (``exp_avg_sq`` for the
        parameter) just did; the members' chains then share their keyframes."""
        if sh.depth + 1 >= limit:
            return True
        if plan.itemsize != 4:
            return False
        inputs: list[tuple[str, int, np.ndarray, int | None]] = []
        for role, src in prediction.inputs:
            if role == CUR:
                x = pending(src, index) if pending is not None else None
                if x is None:  # not written yet (another writer thread): no prediction
                    return False
                if x.depth == 0 and src in self._members:
                    return True  # a predicted input restarted its chain: so does this one
                inputs.append((src, slot, x.data, None))
            else:  # the input as of the step this chunk's base comes from
                x = self._at(src, index, from_slot, timeline)
                if x is None:
                    return False
                inputs.append((src, x.slot, x.data, from_slot))
        if any(d.nbytes != cur.nbytes for _, _, d, _ in inputs):
            return False
        t0 = time.perf_counter()
        n = cur.nbytes
        guess = predict(
            prediction.fn,
            sh.data,
            [d for _, _, d, _ in inputs],
            prediction.coeffs,
            out=self._scratch.get("out", n),
            tmp=self._scratch.get("tmp", n),
        )
        payload = xor_encode(
            cur, guess, plan.itemsize, self.policy, cname=self.policy.residual_cname, out=guess
        )
        rec = ChunkRecord(
            "",
            0,
            0,
            PRED,
            sh.slot,
            raw_crc,
            prediction.fn,
            tuple((p, s) for p, s, _, _ in inputs),
            prediction.coeffs,
        )
        out = self._emit(
            storage_write,
            path,
            index,
            plan,
            slot,
            cur,
            raw_crc,
            stats,
            payload,
            time.perf_counter() - t0,
            rec,
            sh.depth + 1,
        )
        if out is None:
            return False
        self._depend(deps, from_slot, *(f for _, _, _, f in inputs))
        return out

    def _emit(
        self,
        storage_write: object,
        path: str,
        index: int,
        plan: ChunkPlan,
        slot: int,
        cur: np.ndarray,
        raw_crc: int,
        stats: EncodeStats,
        payload: bytes,
        seconds: float,
        template: ChunkRecord,
        depth: int,
    ) -> tuple[ChunkRecord, Shadow] | None:
        """Write ``payload`` as a delta file if it pays (``min_ratio``); None: a keyframe."""
        ratio = cur.nbytes / max(1, len(payload))
        with self._mu:
            old = self._ratios.get(path)
            self._ratios[path] = ratio if old is None else 0.7 * old + 0.3 * ratio
        if ratio < self.policy.min_ratio:
            return None
        crc = checksum(payload)
        # appended to the step's side file (not the zip: plain readers see a missing chunk)
        key, offset = storage_write([payload, struct.pack("<I", crc)])  # type: ignore[operator]
        rec = replace(template, key=key, offset=offset, nbytes=len(payload) + 4, crc32c=crc)
        stats.add(cur.nbytes, len(payload) + 4, "delta", seconds)
        return rec, Shadow(rec, self._pool.copy(cur), depth, slot)

    def _worth(self, path: str, index: int) -> bool:
        """False while an array's deltas do not pay; every ``retry_every`` steps, try again."""
        r = self._ratios.get(path)
        if r is None or r >= self.policy.min_ratio:
            return True
        if index == 0:
            with self._mu:
                self._skips[path] = self._skips.get(path, 0) + 1
        return self._skips.get(path, 0) % self.policy.retry_every == 0

    def promote(
        self,
        slot: int,
        timeline: str,
        pending: dict[tuple[str, int], Shadow],
        flat: FlatShadow | None = None,
    ) -> None:
        """After a commit: its chunks become the bases of the next step's deltas (``flat``:
        the flat shadow of a step written whole from one layout)."""
        with self._mu:
            self._inflight.pop(slot, None)
            retired = []
            if timeline != self._timeline:
                self._shadow.clear()
                self._bytes = 0
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
            groups = set()
            for k, sh in pending.items():
                old = self._shadow.get(k)
                self._bytes += sh.data.nbytes - (old.data.nbytes if old else 0)
                self._shadow[k] = sh
                if old is not None and old.data is not sh.data:
                    retired.append(old.data)
                group = self._members.get(k[0])
                if group is not None:
                    groups.add(group)
        self._pool.retire(retired)  # after the swap: no encode that starts now can see them
        for group in groups:  # K changes between steps only, so a step's members agree
            limit = self.group_limit(group)
            with self._mu:
                self._limits[group] = limit

    # -- flat bases: a step written whole from one flat layout (``flatdelta.py``) ----------
    def flat_room(self, nbytes: int, layout: object) -> bool:
        """Whether a flat shadow of ``nbytes`` fits the shadow budget."""
        with self._mu:
            old = self._flat.get(id(layout))
            held = sum(s.data.nbytes for s in self._flat.values()) - (
                old.data.nbytes if old is not None else 0
            )
            return self._bytes + held + nbytes <= self.policy.shadow_bytes

    def layout_state(self, layout: object) -> LayoutState:
        return self._flat_states.get(layout)  # type: ignore[arg-type]

    def flat_copy(self, buf: np.ndarray) -> np.ndarray:
        """A copy of a step buffer to become a flat shadow (recycled memory)."""
        return self._pool.copy(buf)

    def encode_step(
        self,
        layout: object,
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
            t0 = time.perf_counter()
            out = encode_flat(
                self.policy,
                self._flat_states.get(layout),  # type: ignore[arg-type]
                buf,
                base,
                slot,
                predictions,
                self._scratch,
            )
            out.seconds = time.perf_counter() - t0
            return out, base, from_slot
        finally:
            self._pool.leave(epoch)
