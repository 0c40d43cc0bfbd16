"""Offline maintenance of a run: ``verify`` every byte, ``gc`` what no kept commit needs.

verify re-derives everything from the refs down and collects *all* problems (it never stops at
the first), each naming the file, so ``dstt verify`` is a complete damage report.

gc works in the safe order: it first turns a commit header into a *tombstone* (durably), which
makes the step invisible and keeps the timeline's parent chain intact, and only then deletes
the step's bytes; it never touches the head of any timeline and holds the writer lock, so it
cannot race a training process. A reader that already holds a pruned step gets a clean
``StepNotFoundError`` on its next chunk read. Rejected alternative: rewriting parent pointers
around pruned commits — it would mutate committed headers.
"""

from __future__ import annotations

import functools
import json
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from ..errors import DsttError
from .layout import (
    LOCK_KEY,
    OBJECTS_PREFIX,
    REFS_PREFIX,
    STEP_ARRAY,
    array_meta_key,
    chunk_key,
    commit_arrays_key,
    commit_key,
)
from .manifest import ArrayRecord, CommitHeader, checksum, dump_header
from .parts import remove_parts
from .reader import Reader
from .zarr_meta import array_document

if TYPE_CHECKING:
    from .repository import Repository

__all__ = ["GcReport", "Problem", "VerifyReport", "gc", "verify"]

Progress = Callable[[int, int], None] | None


@dataclass(frozen=True)
class Problem:
    key: str
    message: str


@dataclass
class VerifyReport:
    problems: list[Problem] = field(default_factory=list)
    commits: int = 0
    chunks: int = 0
    objects: int = 0
    bytes: int = 0

    @property
    def ok(self) -> bool:
        return not self.problems


def verify(repo: Repository, *, progress: Progress = None) -> VerifyReport:
    """Check refs, every reachable header, arrays table, chunk, object and step entry."""
    st = repo.storage
    rep = VerifyReport()

    def problem(key: str, e: BaseException | str) -> None:
        rep.problems.append(Problem(key, str(e)))

    try:
        repo.root_attributes()
        r = Reader(st)
    except DsttError as e:
        problem("zarr.json / refs", e)
        return rep
    for name in st.list(REFS_PREFIX):  # refresh() already parsed them all; re-list names
        if not name.endswith(".json"):
            problem(f"{REFS_PREFIX}/{name}", "unexpected file among refs")
    slots: dict[int, CommitHeader] = {}
    for tl in r.timelines:
        try:  # walk, not lineage: a damaged header keeps the commits above it checked
            for h in r.walk(tl):
                slots[h.slot] = h
        except DsttError as e:
            problem(f"timeline {tl}", e)
    todo = sorted(slots)
    described: dict[str, ArrayRecord] = {}  # every array some commit holds: its zarr.json
    for n, slot in enumerate(todo):
        h = slots[slot]
        rep.commits += 1
        if progress:
            progress(n, len(todo))
        if h.pruned:
            continue
        try:
            table = r.arrays(h)
        except DsttError as e:  # its chunks cannot be located; objects and step entry can
            problem(commit_arrays_key(slot), e)
            table = {}
        for path, rec in table.items():
            described.setdefault(path, rec)
            for i, c in enumerate(rec.chunks):
                rep.chunks += 1
                try:
                    rep.bytes += len(r.read_chunk(h, path, i))
                except (DsttError, OSError) as e:
                    problem(c.key, e)
        for oname, o in h.objects.items():
            rep.objects += 1
            try:
                data = st.read(o.key)
                if len(data) != o.nbytes or checksum(data) != o.crc32c:
                    problem(o.key, f"object {oname!r} of step {h.step}: crc32c/size mismatch")
            except OSError as e:
                problem(o.key, e)
        skey = chunk_key(STEP_ARRAY, slot, ())
        try:
            data = st.read(skey)
            ok = (len(data) == 12 and struct.unpack("<q", data[:8])[0] == h.step
                  and struct.unpack("<I", data[8:])[0] == checksum(data[:8]))
            if not ok:
                problem(skey, f"step coordinate of slot {slot} is damaged (expected {h.step})")
        except OSError as e:
            problem(skey, e)
    _verify_zarr_metadata(repo, described, max(todo, default=-1), problem)
    if progress:
        progress(len(todo), len(todo))
    return rep


#: the fields of an array's zarr.json a plain Zarr reader needs to find and decode the chunks
_READ_FIELDS = ("zarr_format", "node_type", "data_type", "chunk_grid", "chunk_key_encoding",
                "fill_value", "codecs", "dimension_names")


def _array_document(rec: ArrayRecord, capacity: int) -> dict[str, Any]:
    return array_document(rec.path, rec.dtype, rec.plan, capacity)


def _verify_zarr_metadata(repo: Repository, arrays: dict[str, ArrayRecord], top_slot: int,
                          problem: Callable[[str, str], None]) -> None:
    """The Zarr documents must still describe the committed chunks: zarr-python, xarray and
    tensorstore read them without dstt (and a resumed writer trusts them)."""
    from .repository import _step_document

    docs: dict[str, Callable[[int], dict[str, Any]]] = {STEP_ARRAY: _step_document}
    for path, rec in sorted(arrays.items()):
        docs[path] = functools.partial(_array_document, rec)
    for path, expected in docs.items():
        key = array_meta_key(path)
        try:
            doc = json.loads(repo.storage.read(key))
            cap = int(doc["shape"][0])
            want = expected(cap)
            wrong = [f for f in (*_READ_FIELDS, "shape") if doc.get(f) != want[f]]
        except (OSError, ValueError, TypeError, KeyError, IndexError) as e:
            problem(key, f"Zarr metadata unreadable ({type(e).__name__}: {e})")
            continue
        if wrong:
            problem(key, f"Zarr metadata does not match the committed array: {wrong}")
        elif cap <= top_slot:
            problem(key, f"Zarr shape holds {cap} slots, but slot {top_slot} is committed")


def _delta_bases(r: Reader, reachable: dict[int, CommitHeader], keep: set[int]) -> set[int]:
    """Slots that kept delta chunks need to be reconstructed (transitively)."""
    todo, bases = list(keep), set()
    while todo:
        h = reachable.get(todo.pop())
        if h is None or h.pruned:
            continue
        for rec in r.arrays(h).values():
            for c in rec.chunks:
                for slot in c.slots:
                    if slot not in keep and slot not in bases:
                        bases.add(slot)
                        todo.append(slot)
    return bases


def _sweep(repo: Repository, committed: set[int]) -> int:
    """Delete chunk files of slots without a commit header (aborted or crashed steps)."""
    st, n = repo.storage, 0
    for path, _ in repo.iter_array_documents():
        for name in st.list(path):
            if name.startswith(("c.", "d.")):
                slot = name.split(".")[1]
                if slot.isdigit() and int(slot) not in committed:
                    st.delete(f"{path}/{name}")
                    n += 1
    for name in st.list(STEP_ARRAY):
        if name.startswith("c.") and name[2:].isdigit() and int(name[2:]) not in committed:
            st.delete(f"{STEP_ARRAY}/{name}")
            n += 1
    for name in st.list(OBJECTS_PREFIX):
        if name.isdigit() and int(name) not in committed:
            st.delete(f"{OBJECTS_PREFIX}/{name}")
            n += 1
    # part manifests of multi-rank commits: gc holds the lock, so no commit is in flight and
    # every part left is either merged already or from a crashed session
    n += remove_parts(st)
    return n


@dataclass(frozen=True)
class GcReport:
    pruned_steps: tuple[tuple[str, int], ...]
    orphan_slots: tuple[int, ...]
    files_removed: int
    bytes_freed: int
    dry_run: bool


def _keep_set(line: list[CommitHeader], keep_last: int | None, keep_every: int | None,
              keep_steps: set[int]) -> set[int]:
    live = [h for h in line if not h.pruned]
    keep = {h.slot for h in live if h.step in keep_steps}
    if keep_last:  # max(0, ...): keep_last larger than the timeline keeps all of it
        keep |= {h.slot for h in live[max(0, len(live) - keep_last):]}
    if keep_every:
        keep |= {h.slot for h in live if h.step % keep_every == 0}
    if live:
        keep.add(live[-1].slot)  # the head is never pruned
    return keep


def gc(repo: Repository, *, keep_last: int | None = None, keep_every: int | None = None,
       keep_steps: Iterable[int] = (), dry_run: bool = False,
       progress: Progress = None) -> GcReport:
    """Prune commits outside the retention policy and remove orphaned files.

    With no policy given nothing committed is pruned; only orphans (slots that crashed
    before their ref moved, aborted steps) are removed.
    """
    if keep_last is not None and keep_last < 0:
        raise ValueError(f"keep_last must be >= 0, got {keep_last}")
    if keep_every is not None and keep_every < 1:  # 0 would prune everything but the heads
        raise ValueError(f"keep_every must be >= 1 (or None), got {keep_every}")
    st = repo.storage
    policy = keep_last is not None or keep_every is not None or bool(keep_steps)
    with st.lock(LOCK_KEY):
        r = Reader(st)
        reachable: dict[int, CommitHeader] = {}
        keep: set[int] = set()
        for tl in r.timelines:
            line = r.lineage(tl)
            for h in line:
                reachable[h.slot] = h
            keep |= (_keep_set(line, keep_last, keep_every, set(keep_steps)) if policy
                     else {h.slot for h in line})
            head = r.ref(tl).head
            if head is not None:
                keep.add(head)
        keep |= _delta_bases(r, reachable, keep)
        prune = sorted(s for s, h in reachable.items() if not h.pruned and s not in keep)
        orphans = [s for s in r.all_slots() if s not in reachable]
        # chunk keys still needed by kept commits (a future dedup may share chunks)
        needed: set[str] = set()
        for s in keep:
            kept = reachable.get(s)
            if kept is not None and not kept.pruned:
                needed |= {c.key for rec in r.arrays(kept).values() for c in rec.chunks}
        removed = freed = 0
        pruned_steps = []
        doomed = prune + orphans
        for n, slot in enumerate(doomed):
            if progress:
                progress(n, len(doomed))
            dead: CommitHeader | None = reachable.get(slot)
            keys: list[str] = []
            try:
                hh = dead or r.header(slot)
                if not hh.pruned:
                    keys = [c.key for rec in r.arrays(hh).values() for c in rec.chunks]
            except DsttError:
                pass  # a damaged orphan: its stray chunks are swept below
            keys = [k for k in keys if k not in needed]
            if dead is not None:
                pruned_steps.append((dead.timeline, dead.step))
            sizes = []
            for k in keys:
                try:
                    sizes.append(st.size(k))
                except OSError:
                    sizes.append(-1)
            removed += sum(1 for z in sizes if z >= 0)
            freed += sum(z for z in sizes if z > 0)
            if dry_run:
                continue
            if dead is not None:  # reachable: a durable tombstone first hides the step
                st.write_durable(commit_key(slot), dump_header(replace(dead, pruned=True)))
            for k in keys:
                st.delete(k)
            st.delete(commit_arrays_key(slot))
            st.delete(f"{OBJECTS_PREFIX}/{slot:012d}")
            st.delete(chunk_key(STEP_ARRAY, slot, ()))
            if dead is None:  # an orphan's header goes last, so a crash leaves it findable
                st.delete(commit_key(slot))
        if not dry_run:
            committed = set(r.all_slots())
            removed += _sweep(repo, committed)
            removed += st.remove_temporaries()
        if progress:
            progress(len(doomed), len(doomed))
        return GcReport(tuple(pruned_steps), tuple(orphans), removed, freed, dry_run)

