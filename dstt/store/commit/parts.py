"""A rank's vote in a multi-rank commit (its *part*), and collecting and merging votes.

Each rank writes only the arrays it owns into its own step file of the slot, makes them
durable, then writes its part manifest ``_dstt/parts/<slot>/<rank>.json`` (``format/parts.py``):
its "prepared" vote. Rank 0, the only lock holder and ref writer, waits for every rank's part,
checks they vote for the same step of the same session, merges them into one ordinary arrays
table and header, and commits. Readers never look at parts; a step is visible only once every
rank's bytes are durable. Who calls these, and when: ``ranks.py``.

Rejected alternative: a per-rank arrays table referenced from the header — every reader would
have to learn a second table kind.
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING

from dstt.errors import RankError, RankLostError
from dstt.store.format.layout import part_key
from dstt.store.format.parts import Part, dump_part, parse_part

if TYPE_CHECKING:
    import threading
    from collections.abc import Callable, Mapping, Sequence

    from dstt.store.format.records import ArrayRecord, ObjectRecord
    from dstt.store.storage.base import Storage

__all__ = ["abort_vote", "collect_parts", "merge_parts"]

#: how often a waiting committer asks whether the ranks it waits for are still there
_LOST_EVERY_S = 0.5


def collect_parts(
    storage: Storage,
    *,
    slot: int,
    step: int,
    ranks: Sequence[int],
    world: int,
    session: str,
    timeout: float = 600.0,
    cancel: threading.Event | None = None,
    lost: Callable[[Sequence[int]], Mapping[int, str]] | None = None,
) -> list[Part]:
    """Wait until every rank in ``ranks`` has prepared ``slot``; return their parts by rank.

    A part for this slot from another step, world size or session is a ``RankError`` at once
    (ranks out of step, or a leftover of a crashed session that was not cleaned); so is a rank
    that has not prepared within ``timeout`` seconds, or ``cancel`` being set (shutdown).
    ``lost(missing)`` (asked at most every ``_LOST_EVERY_S``) names the missing ranks known to
    be gone (left their session, no heartbeat): their absence is a ``RankLostError`` after one
    last look for their parts, without waiting for ``timeout``.
    """
    found: dict[int, Part] = {}
    deadline = time.monotonic() + timeout
    asked = -math.inf  # the first poll asks (a rank already known lost fails at once)
    delay = 0.0005
    gone: Mapping[int, str] = {}
    while True:
        for r in ranks:
            if r in found:
                continue
            key = part_key(slot, r)
            try:
                data = storage.read(key)
            except FileNotFoundError:
                continue
            p = parse_part(data, f"{storage.location}/{key}")
            if p.session != session:
                continue  # a leftover of an earlier session; ours will replace it
            if (p.slot, p.step, p.rank, p.world) != (slot, step, r, world):
                raise RankError(
                    f"rank {r} prepared step {p.step} (slot {p.slot}, world {p.world}) where "
                    f"rank 0 commits step {step} (slot {slot}, world {world}): the ranks are "
                    "out of step; the step is not committed"
                )
            if p.error is not None:
                raise RankError(
                    f"rank {r} could not write its share of step {step} "
                    f"({p.error}); the step is not committed"
                )
            found[r] = p
        if len(found) == len(ranks):
            return [found[r] for r in sorted(found)]
        missing = sorted(set(ranks) - set(found))
        if gone:  # the last look (after they were found gone) found no part either
            why = "; ".join(f"rank {r}: {gone[r]}" for r in sorted(gone))
            raise RankLostError(
                f"step {step}: ranks {sorted(gone)} are gone ({why}); the step is not "
                "committed (the steps every rank prepared before stay committed)",
                ranks=tuple(sorted(gone)),
            )
        if cancel is not None and cancel.is_set():
            raise RankError(f"step {step}: stopped while waiting for ranks {missing}")
        if time.monotonic() > deadline:
            raise RankLostError(
                f"step {step}: ranks {missing} did not prepare slot {slot} within "
                f"{timeout:.0f} s (crashed or stalled); the step is not committed",
                ranks=tuple(missing),
            )
        if lost is not None and time.monotonic() - asked >= _LOST_EVERY_S:
            asked = time.monotonic()
            gone = {r: why for r, why in lost(missing).items() if r in missing}
            if gone:
                continue  # one more look for their parts before giving up
        if cancel is not None:
            cancel.wait(delay)
        else:
            time.sleep(delay)
        delay = min(delay * 2, 0.05)


def abort_vote(
    storage: Storage, *, slot: int, step: int, rank: int, world: int, session: str, error: str
) -> None:
    """Tell the committing rank at once that this rank dropped ``step`` (best effort: without
    it, the committer waits for the part until its timeout)."""
    storage.write(
        part_key(slot, rank),
        dump_part(Part(slot=slot, step=step, rank=rank, world=world, session=session, error=error)),
    )


def merge_parts(
    arrays: Mapping[str, ArrayRecord], objects: Mapping[str, ObjectRecord], parts: Sequence[Part]
) -> tuple[dict[str, ArrayRecord], dict[str, ObjectRecord]]:
    """Union of rank 0's arrays/objects and the parts'; ``RankError`` if two ranks wrote one
    array or object (ownership must be disjoint)."""
    out_a, out_o = dict(arrays), dict(objects)
    for p in parts:
        for path, rec in p.arrays.items():
            if path in out_a:
                raise RankError(
                    f"array {path!r} was written by rank {p.rank} and another rank; "
                    "each array must have exactly one owner"
                )
            out_a[path] = rec
        for name, orec in p.objects.items():
            if name in out_o:
                raise RankError(
                    f"object {name!r} was written by rank {p.rank} and another "
                    "rank; per-rank objects need per-rank names"
                )
            out_o[name] = orec
    return out_a, out_o
