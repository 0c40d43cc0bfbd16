"""Data attribution's records: batch fingerprints per step, and timelines' skip sets.

The session side (what is fingerprinted, how skipping works) is :mod:`dstt.training.data`;
this module holds the records both it and inspection need, without torch: :class:`Batch`,
the commit object ``data/batches`` (:func:`read_batches`) and the skip set a rollback
records for its new timeline (:func:`write_skips`, :func:`read_skips`), stored under
``_dstt/skips/`` and keyed by the timeline's fork slot and creation time, which a rename
keeps.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dstt.schema import BATCHES_OBJECT

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, Sequence

    from dstt.store.storage.base import Storage

    from .records import RefInfo

__all__ = [
    "Batch",
    "SkipSet",
    "batches_of",
    "read_batches",
    "read_skips",
    "write_skips",
]

SKIPS_PREFIX = "_dstt/skips"


@dataclass(frozen=True)
class Batch:
    """One batch's fingerprint: its sample ``indices`` (when the loader exposed them) or a
    ``hash`` of its contents (``partial`` when only shapes were hashed)."""

    indices: tuple[int, ...] | None = None
    hash: str | None = None
    partial: bool = False

    @classmethod
    def from_plain(cls, fp: Mapping[str, Any]) -> Batch:
        if fp.get("indices") is not None:
            return cls(indices=tuple(int(i) for i in fp["indices"]))
        return cls(hash=str(fp.get("hash")), partial=bool(fp.get("partial", False)))

    def plain(self) -> dict[str, Any]:
        if self.indices is not None:
            return {"indices": list(self.indices)}
        return {"hash": self.hash, "partial": self.partial}

    @property
    def samples(self) -> list[int]:
        """The sample indices ([] when only a hash is known)."""
        return list(self.indices or ())

    def __str__(self) -> str:
        if self.indices is not None:
            shown = ", ".join(map(str, self.indices[:8]))
            more = f", ... ({len(self.indices)})" if len(self.indices) > 8 else ""
            return f"samples [{shown}{more}]"
        return f"hash {str(self.hash)[:12]}{' (shapes only)' if self.partial else ''}"


@dataclass(frozen=True)
class SkipSet:
    """What sessions resumed on a timeline drop: sample indices and batch fingerprints."""

    samples: frozenset[int] = frozenset()
    batches: tuple[Batch, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.samples or self.batches)

    def __or__(self, other: SkipSet) -> SkipSet:
        return SkipSet(
            self.samples | other.samples,
            self.batches + tuple(b for b in other.batches if b not in self.batches),
        )


def _skip_key(ref: RefInfo) -> str:
    if ref.base_slot is None:  # the first timeline: no rollback made it, it skips nothing
        raise TypeError(f"timeline {ref.name!r} has no base slot")
    return f"{SKIPS_PREFIX}/{int(ref.base_slot):012d}-{round(float(ref.created) * 1e6)}.json"


def write_skips(storage: Storage, ref: RefInfo, skips: SkipSet) -> None:
    """Record ``skips`` for the timeline ``ref`` (a fresh rollback's ``RefInfo``)."""
    doc = {
        "timeline": ref.name,
        "samples": sorted(skips.samples),
        "batches": [b.plain() for b in skips.batches],
    }
    storage.write_durable(_skip_key(ref), json.dumps(doc, sort_keys=True).encode())


def read_skips(storage: Storage, refs: Mapping[str, RefInfo], timeline: str) -> SkipSet:
    """The skip set that applies on ``timeline``: its own and its ancestors' (``refs``:
    ``{name: RefInfo}``, as ``Reader.timelines``)."""
    out, seen = SkipSet(), set()
    ref = refs.get(timeline)
    while ref is not None and ref.base_slot is not None and ref.name not in seen:
        seen.add(ref.name)
        key = _skip_key(ref)
        if storage.exists(key):
            doc = json.loads(storage.read(key))
            out = out | SkipSet(
                frozenset(int(i) for i in doc.get("samples", ())),
                tuple(Batch.from_plain(b) for b in doc.get("batches", ())),
            )
        ref = refs.get(ref.base_timeline) if ref.base_timeline else None
    return out


def batches_of(obj: Mapping[str, Any]) -> dict[int, list[Batch]]:
    """A ``data/batches`` object as ``{step: [Batch, ...]}``."""
    return {
        int(k): [Batch.from_plain(fp) for fp in fps]
        for k, fps in zip(obj["steps"], obj["batches"], strict=True)
    }


def read_batches(headers: Sequence[Any], read: Callable[[Any, str], Any]) -> dict[int, list[Batch]]:
    """``{step: [Batch, ...]}`` over the commits ``headers`` (one timeline, in step order);
    a step met twice along the lineage keeps the newer commit's batches."""
    out: dict[int, list[Batch]] = {}
    for h in headers:
        if BATCHES_OBJECT in h.objects:
            out.update(batches_of(read(h, BATCHES_OBJECT)))
    return dict(sorted(out.items()))
