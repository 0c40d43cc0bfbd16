"""Timeline management: rename and delete refs without ever leaving a run half-named.

Both operations hold the writer lock and order their writes so that a power cut between any
two leaves every timeline readable and HEAD naming an existing ref: **rename** writes the new
ref first and deletes the old last (renaming again finishes an interrupted one); **delete**
(refused for the current timeline) makes the ref's deletion durable before ``gc`` frees any
byte. A **release record** (``_dstt/released/<name>.json``) names the commits and debris a
vanished name leaves, so gc and verify do not report them as a lost ref's. Every timeline
change goes through :func:`changing` (``RunLockedError`` while a writer lives, or ``force``).

Rejected alternative: marking a deleted ref instead of removing it — every reader would learn
a new ref state, and the name could not be reused. Write orders: docs/decisions.md.
"""

from __future__ import annotations

import contextlib
import json
import re
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from dstt.errors import CurrentTimelineError, DsttError, RunLockedError, TimelineError
from dstt.store.format.layout import (
    HEAD_KEY,
    LOCK_KEY,
    RELEASED_PREFIX,
    check_timeline_name,
    ref_key,
)
from dstt.store.format.manifest import dump_head, dump_ref
from dstt.store.read.reader import Reader
from dstt.store.storage.base import Storage
from dstt.store.storage.memory import DelegatingStorage

from .gc import GcReport, RunFiles, gc
from .verify import named_timeline, unreached

if TYPE_CHECKING:
    from collections.abc import Iterator

    from dstt.store.format.records import RefInfo
    from dstt.store.storage.base import Storage

__all__ = ["DeleteReport", "changing", "delete_timeline", "rename_timeline"]


@contextlib.contextmanager
def changing(st: Storage, what: str, *, force: bool = False, cli: str = "") -> Iterator[bool]:
    """Hold the run's writer lock while a timeline change (``what``: "roll back", ...) is
    made; yields whether it is held. A live writer holding it: ``RunLockedError`` naming the
    holder and what to do, unless ``force`` (then the change runs without the lock and this
    yields False). ``cli``: the command, for the ``--force`` hint."""
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(st.lock(LOCK_KEY))
        except RunLockedError as e:
            if not force:
                found = re.search(r"\((pid=[^)]*)\)", str(e))
                holder = found.group(1) if found else str(e)
                raise RunLockedError(
                    f"cannot {what}: the run {st.location} is locked by a live writer "
                    f"({holder}): "
                    "training is running on it, and a timeline change under it would make "
                    "its next resume continue from somewhere else. Stop it (or let it "
                    f"finish) first, or pass force=True{f' ({cli} --force)' if cli else ''} "
                    f"to {what} anyway"
                ) from None
            yield False
            return
        yield True


@dataclass(frozen=True)
class DeleteReport:
    """What deleting a timeline removed (or, with ``dry_run``, would remove).

    ``freed_steps``: its commits no other timeline reaches (their files go); ``kept_steps``:
    its commits another timeline shares (its fork ancestry, or a child's), which stay.
    ``gc``: the sweep's report (``None`` when ``gc=False``: the files wait for the next gc).
    """

    timeline: str
    freed_steps: tuple[int, ...]
    kept_steps: tuple[int, ...]
    gc: GcReport | None
    dry_run: bool


def rename_timeline(repo: RunFiles, old: str, new: str, *, force: bool = False) -> RefInfo:
    """Rename ``old`` to ``new`` in the crash-safe order of the module docstring
    (``force``: even under a live writer, see :func:`changing`)."""
    check_timeline_name(new)
    st = repo.storage
    with changing(st, "rename a timeline", force=force, cli="dstt timeline rename"):
        r = Reader(st)
        ref = r.ref(old)
        if new == old:
            raise TimelineError(f"timeline {old!r} already has that name")
        moved = replace(ref, name=new)
        taken = r.timelines.get(new)
        if taken is not None and taken != moved:  # else: an interrupted rename, finished here
            raise TimelineError(
                f"timeline {new!r} already exists; pick another name, or "
                f"delete it first (dstt timeline delete {new})"
            )
        st.write_durable(ref_key(new), dump_ref(moved))
        for child in sorted(r.timelines.values(), key=lambda t: t.name):
            if child.base_timeline == old and child.name not in (old, new):
                st.write_durable(ref_key(child.name), dump_ref(replace(child, base_timeline=new)))
        if r.current_timeline == old:
            st.write_durable(HEAD_KEY, dump_head(new))
        debris = _debris(r, old)
        if debris:
            _release(st, old, debris)
        st.delete(ref_key(old))
        return moved


def delete_timeline(
    repo: RunFiles, name: str, *, sweep: bool = True, dry_run: bool = False, force: bool = False
) -> DeleteReport:
    """Delete the ref ``name``, then (``sweep``) gc what only it referenced (``force``: even
    under a live writer, without the sweep, see :func:`changing`)."""
    st = repo.storage
    with changing(st, "delete a timeline", force=force, cli="dstt timeline delete") as held:
        r = Reader(st)
        r.ref(name)  # TimelineError naming the timelines there are
        if r.current_timeline == name:
            others = sorted(t for t in r.timelines if t != name)
            hint = (
                f"make another one current first: run.switch({others[0]!r}) or dstt "
                f"timeline switch {others[0]}"
                if others
                else "it is the run's only timeline; delete the run's folder instead"
            )
            raise CurrentTimelineError(
                f"timeline {name!r} is the current one (what training resumes) and cannot be "
                f"deleted; {hint}"
            )
        shared = {h.slot for t in r.timelines if t != name for h in r.walk(t)}
        line = [h for h in r.lineage(name) if not h.pruned]
        freed = tuple(h.step for h in line if h.slot not in shared)
        # its own commits, tombstones too: proven abandoned once the ref is gone
        released = {h.slot for h in r.lineage(name) if h.slot not in shared} | _debris(r, name)
        kept = tuple(h.step for h in line if h.slot in shared)
        if not dry_run:
            # first, durably, which commits the delete releases: gc keeps the commits of a
            # timeline without a ref (a lost ref is not a deleted one) unless released
            _release(st, name, released)
            st.delete(ref_key(name))
            # LocalStorage does not sync a delete; a durable write into the same folder syncs
            # that folder, and with it the unlink, before gc may delete a byte the ref named
            current = ref_key(r.current_timeline)
            st.write_durable(current, st.read(current))
    if not sweep or not held:
        return DeleteReport(name, freed, kept, None, dry_run)
    run = repo if not dry_run else _Run(_HiddenRef(st, ref_key(name)))
    report = gc(run, dry_run=dry_run, released=released)
    return DeleteReport(name, freed, kept, report, dry_run)


def _debris(r: Reader, name: str) -> set[int]:
    """Commits written under ``name`` that no ref reaches (a commit cut before its ref
    moved): abandoned once ``name`` loses its ref, so released with it."""
    reached: set[int] = set()
    for t in r.timelines:
        with contextlib.suppress(DsttError):
            reached |= {h.slot for h in r.walk(t)}
    return {  # (an unreadable header or zip: nothing proves it abandoned)
        slot
        for slot, _, what in unreached(r, reached)
        if what is not None and not isinstance(what, DsttError) and named_timeline(what) == name
    }


def _release(st: Storage, name: str, slots: set[int]) -> None:
    """Durably record ``slots`` as abandoned with ``name``'s ref, with what an older record of
    the same name (the name reused before gc swept it) released: gc deletes a record only once
    it swept its slots, and never touches a slot a ref reaches."""
    key = f"{RELEASED_PREFIX}/{name}.json"
    with contextlib.suppress(OSError, ValueError, TypeError, KeyError):
        slots = slots | {int(x) for x in json.loads(st.read(key))["slots"]}
    st.write_durable(key, json.dumps({"timeline": name, "slots": sorted(slots)}).encode())


class _HiddenRef(DelegatingStorage):
    """The run as it will be once a ref is deleted (for a dry run's gc report)."""

    def __init__(self, inner: Storage, key: str) -> None:
        super().__init__(inner)
        self.hidden = key

    def read(self, key: str) -> bytes:
        if key == self.hidden:
            raise FileNotFoundError(key)
        return self.inner.read(key)

    def exists(self, key: str) -> bool:
        return key != self.hidden and self.inner.exists(key)

    def list(self, prefix: str) -> Iterator[str]:
        head, _, leaf = self.hidden.rpartition("/")
        return (n for n in self.inner.list(prefix) if not (prefix == head and n == leaf))


@dataclass(frozen=True)
class _Run:
    """A run as gc sees it (``gc.RunFiles``)."""

    storage: Storage
