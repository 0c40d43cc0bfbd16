"""The part manifest of a multi-rank commit: a rank's prepared share of a slot, as a record,
as bytes and as files (``_dstt/parts/<slot>/<rank>.json``).

``commit/parts.py`` collects and merges the votes (the protocol, ``docs/format.md`` §8); this
is what they are on disk, so gc (``maintenance/gc.py``), which sweeps the part files a crashed
session left, needs nothing of the commit room. An envelope of kind ``part`` (``envelope.py``)
holds the step, rank, world size, session id, the rank's arrays table and object records, or
an *abort vote*'s error.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from dstt.errors import CorruptRunError

from .envelope import _fields, _metric_in, _metric_out, _open, _seal
from .layout import PARTS_PREFIX
from .manifest import arrays_from_json, arrays_json, object_from_json, object_json

if TYPE_CHECKING:
    from collections.abc import Mapping

    from dstt.store.storage.base import Storage

    from .records import ArrayRecord, Metric, ObjectRecord

__all__ = ["Part", "dump_part", "parse_part", "remove_parts"]


@dataclass(frozen=True)
class Part:
    """One rank's prepared share of a slot."""

    slot: int
    step: int
    rank: int
    world: int
    session: str
    arrays: Mapping[str, ArrayRecord] = field(default_factory=dict)
    objects: Mapping[str, ObjectRecord] = field(default_factory=dict)
    metrics: Mapping[str, Metric] = field(default_factory=dict)
    #: set in an *abort vote*: the rank could not write its share of this step
    error: str | None = None


_PART_FIELDS = {"slot", "step", "rank", "world", "session", "arrays", "objects", "metrics"}


def dump_part(p: Part) -> bytes:
    return _seal(
        "part",
        {
            "slot": p.slot,
            "step": p.step,
            "rank": p.rank,
            "world": p.world,
            "session": p.session,
            "arrays": arrays_json(p.arrays),
            "objects": {k: object_json(o) for k, o in p.objects.items()},
            "metrics": {k: _metric_out(v) for k, v in p.metrics.items()},
            **({"error": p.error} if p.error is not None else {}),
        },
    )


def parse_part(data: bytes, where: str) -> Part:
    b = _open(data, "part", where)
    _fields(b, _PART_FIELDS, {"error"}, where)
    try:
        return Part(
            slot=int(b["slot"]),
            step=int(b["step"]),
            rank=int(b["rank"]),
            world=int(b["world"]),
            session=str(b["session"]),
            arrays=arrays_from_json(b["arrays"]),
            objects={k: object_from_json(o) for k, o in b["objects"].items()},
            metrics={k: _metric_in(v) for k, v in b["metrics"].items()},
            error=None if b.get("error") is None else str(b["error"]),
        )
    except (TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
        raise CorruptRunError(f"{where}: malformed part manifest ({e})") from None


def remove_parts(storage: Storage, slot: int | None = None) -> int:
    """Delete the part files of ``slot`` (all slots when None); returns folders named."""
    names = [f"{slot:012d}"] if slot is not None else list(storage.list(PARTS_PREFIX))
    for name in names:
        storage.delete(f"{PARTS_PREFIX}/{name}")
    return len(names)
