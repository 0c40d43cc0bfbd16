"""The writer's delta state: the last committed copy of every chunk, and the encode decision.

``DeltaEncoder`` keeps a *shadow* — the raw bytes of each chunk as of the newest commit this
writer made — and turns a new chunk into one of: a dedup reference (bytes identical), an XOR
delta against the shadow (when the chain is short enough and the delta pays), or a keyframe
(a plain Zarr chunk). Only *committed* chunks enter the shadow (``promote`` runs after the
commit point), so a delta's base is always a committed ancestor on the same timeline even when
the engine overlaps steps or skips a failed one; a writer on a new timeline (after rollback)
starts with an empty shadow, so deltas never chain across timelines.

Rejected alternative: reading the base back from disk at encode time — it costs read
bandwidth on the hot flush path; the shadow costs host memory (bounded by
``DeltaPolicy.shadow_bytes``; chunks beyond the budget are always keyframes).
"""

from __future__ import annotations

import struct
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from .codec import XOR, DeltaPolicy, chain_limit, xor_encode
from .layout import ChunkPlan, delta_key
from .manifest import ChunkRecord, checksum

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

    @property
    def ratio(self) -> float:
        return self.raw_bytes / self.written_bytes if self.written_bytes else float("inf")


class DeltaEncoder:
    def __init__(self, policy: DeltaPolicy) -> None:
        self.policy = policy
        self._shadow: dict[tuple[str, int], Shadow] = {}
        self._timeline: str | None = None
        self._ratios: dict[str, float] = {}
        self._skips: dict[str, int] = {}  # steps an unprofitable array skipped encoding
        self._bytes = 0
        self._mu = threading.Lock()

    def chain_limit(self, path: str) -> int:
        return chain_limit(self.policy, self._ratios.get(path))

    def encode(self, storage_write: object, *, path: str, index: int, plan: ChunkPlan,
               slot: int, timeline: str, data: memoryview, raw_crc: int,
               stats: EncodeStats) -> tuple[ChunkRecord | None, Shadow | None]:
        """A dedup or delta record (already written), or ``(None, pending)`` for a keyframe.

        The returned ``Shadow`` is what this chunk contributes if its step commits.
        """
        cur = np.frombuffer(data, dtype=np.uint8)
        with self._mu:
            sh = self._shadow.get((path, index)) if timeline == self._timeline else None
            room = sh is not None or self._bytes + cur.nbytes <= self.policy.shadow_bytes
        if sh is not None:
            if (self.policy.dedup and sh.record.content_crc32c == raw_crc
                    and np.array_equal(cur, sh.data)):
                stats.add(cur.nbytes, 0, "dedup")
                return sh.record, sh
            if self.policy.delta and sh.depth + 1 < self.chain_limit(path) and self._worth(
                    path, index):
                t0 = time.perf_counter()
                payload = xor_encode(cur, sh.data, plan.itemsize, self.policy)
                dt = time.perf_counter() - t0
                ratio = cur.nbytes / max(1, len(payload))
                with self._mu:
                    old = self._ratios.get(path)
                    self._ratios[path] = ratio if old is None else 0.7 * old + 0.3 * ratio
                if ratio >= self.policy.min_ratio:
                    crc = checksum(payload)
                    key = delta_key(path, slot, plan.index(index))
                    storage_write(key, [payload, struct.pack("<I", crc)])  # type: ignore[operator]
                    rec = ChunkRecord(key, len(payload) + 4, crc, XOR, sh.slot, raw_crc)
                    stats.add(cur.nbytes, len(payload) + 4, "delta", dt)
                    return rec, Shadow(rec, cur.copy(), sh.depth + 1, slot)
        pending = None
        if room:
            pending = Shadow(ChunkRecord("", 0, raw_crc), cur.copy(), 0, slot)
        return None, pending

    def _worth(self, path: str, index: int) -> bool:
        """False while an array's deltas do not pay; every ``retry_every`` steps, try again."""
        r = self._ratios.get(path)
        if r is None or r >= self.policy.min_ratio:
            return True
        if index == 0:
            with self._mu:
                self._skips[path] = self._skips.get(path, 0) + 1
        return self._skips.get(path, 0) % self.policy.retry_every == 0

    def promote(self, timeline: str, pending: dict[tuple[str, int], Shadow]) -> None:
        """After a commit: its chunks become the bases of the next step's deltas."""
        with self._mu:
            if timeline != self._timeline:
                self._shadow.clear()
                self._bytes = 0
                self._timeline = timeline
            for k, sh in pending.items():
                old = self._shadow.get(k)
                self._bytes += sh.data.nbytes - (old.data.nbytes if old else 0)
                self._shadow[k] = sh
