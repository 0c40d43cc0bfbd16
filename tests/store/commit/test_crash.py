"""Crash safety: a reader only ever sees complete commits.

Two levels:

* real processes: a child commits in a loop on a real directory and is SIGKILLed at random
  points; after every kill the head is a complete, verified commit whose content is exactly
  that step's. (SIGKILL keeps the page cache, so this proves atomicity and ordering of what
  reaches the filesystem, not durability across a power cut.)
* every write: a storage wrapper cuts the power before or right after the k-th write (or
  delete) of one operation, for every k; ``MemoryStorage.crash()`` keeps only what was made
  durable (and a harsher variant keeps a random part of the non-durable writes too). This is
  what proves the barrier/fsync ordering. In format 2 a commit is four writes (step file,
  side file, header, ref) whatever its size; a multi-rank commit adds each rank's files and
  vote, gc a tombstone per pruned step and a delete per file.

And white-box, on a real directory: what ``LocalStorage`` syncs per commit in each durability
mode, and that a step is at most three new files.
"""

from __future__ import annotations

import io
import os
import random
import signal
import subprocess
import sys
import time
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dstt.errors import NotARunError, StepNotFoundError, StorageError
from dstt.store import Repository, Storage, load
from dstt.store.commit.parts import collect_parts
from dstt.store.format.layout import (
    COMMITS_PREFIX,
    INDEX_PREFIX,
    PARTS_PREFIX,
    STEPS_PREFIX,
    commit_key,
    part_key,
    plan_chunks,
    ref_key,
    side_file_key,
    step_file_key,
)
from dstt.store.index.view import GC_MARKER
from dstt.store.storage.base import Data, Durability
from dstt.store.storage.memory import FaultyStorage, MemoryStorage

from .._util import assert_same_arrays, deep_equal
from .crash_child import CHUNK_BYTES, commit, expected

CHILD = Path(__file__).with_name("crash_child.py")


def check_run(path: Any, allowed_heads: set[int], timeline: str | None = None) -> int:
    """The head is complete and exact, verify() is clean, no step before it is lost."""
    repo = Repository.open(path)
    rep = repo.verify()
    assert rep.ok, rep.problems
    snap = load(path, timeline=timeline)
    step = snap.header.step
    assert step in allowed_heads, (step, allowed_heads)
    arrays, objects = expected(step)
    assert_same_arrays(snap.arrays, arrays)
    assert deep_equal(snap.objects, objects)
    return step


# -- real processes, SIGKILL -----------------------------------------------------------------


@pytest.mark.parametrize("durability", ["syncfs", "fsync"])
def test_sigkill_at_random_points(tmp_path: Path, durability: str) -> None:
    path = tmp_path / "run"
    with Repository.create(path, durability=durability).writer(chunk_bytes=CHUNK_BYTES) as w:
        commit(w, 0)
    rng = random.Random(f"kill-{durability}")
    kills, mid_loop = 16, 0
    for k in range(kills):
        proc = subprocess.Popen(
            [sys.executable, str(CHILD), str(path), durability],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert proc.stdout is not None
        first = proc.stdout.readline()
        if not first.startswith("ready"):
            proc.kill()
            pytest.fail(f"child did not start: {first!r} {proc.communicate()[1][-2000:]}")
        ready = int(first.split()[1])
        lines = []
        if k % 2:  # kill somewhere in the steady commit loop
            lines.append(proc.stdout.readline())
            time.sleep(rng.uniform(0, 0.03))
        else:  # kill anywhere from writer start-up on
            time.sleep(rng.uniform(0, 0.1))
        proc.send_signal(signal.SIGKILL)
        # not communicate(): with two pipes it reads the descriptors, skipping the lines
        # readline() already buffered (a "committed" line went missing that way)
        out, err = proc.stdout.read(), proc.stderr.read() if proc.stderr else ""
        proc.wait(60)
        proc.stdout.close()
        if proc.stderr:
            proc.stderr.close()
        assert proc.returncode == -signal.SIGKILL, err[-2000:]
        announced = [
            int(x.split()[1]) for x in [*lines, *out.splitlines()] if x.startswith("committed ")
        ]
        assert announced == list(range(ready, ready + len(announced)))
        mid_loop += bool(announced)
        last = announced[-1] if announced else ready - 1
        # killed after commit() returned but before the print: the head is one ahead
        head = check_run(path, {last, last + 1})
        r = Repository.open(path).reader()
        assert [h.step for h in r.lineage()] == list(range(head + 1))  # nothing lost
    assert mid_loop >= kills // 2  # the odd kills always land after a commit
    # the run stays usable: gc removes the debris, a new writer continues
    Repository.open(path).gc()
    head = check_run(path, set(range(10**6)))
    with Repository.open(path).writer(chunk_bytes=CHUNK_BYTES) as w:
        commit(w, head + 1)
    assert check_run(path, {head + 1}) == head + 1


# -- power cut at every write ----------------------------------------------------------------


class PowerCut(Exception):
    """Raised by ``CutAt`` where the power goes."""


class CutAt(FaultyStorage):
    """Passes writes through and raises ``PowerCut`` before, or right after, the k-th one.

    A delete counts as a write (``MemoryStorage`` makes it durable at once), so the power can
    also go between any two of gc's deletes; it is recorded as ``"delete <key>"``.
    """

    def __init__(self, inner: Storage, k: int = 0, *, after: bool = False) -> None:
        super().__init__(inner)
        self.k, self.after, self.n = k, after, 0
        self.keys: list[str] = []

    def _op(self, label: str, fn: Callable[[], None]) -> None:
        self.n += 1
        self.keys.append(label)
        if self.n == self.k and not self.after:
            raise PowerCut(label)
        fn()
        if self.n == self.k and self.after:
            raise PowerCut(label)

    def write(self, key: str, data: Data) -> None:
        self._op(key, lambda: self.inner.write(key, data))

    def write_durable(self, key: str, data: Data) -> None:
        self._op(key, lambda: self.inner.write_durable(key, data))

    def delete(self, key: str) -> None:
        self._op(f"delete {key}", lambda: self.inner.delete(key))

    def handle(self) -> CutAt:
        """Another process's handle on the same keys (``MemoryStorage.handle``: its own
        barrier), counted and cut together with this one's writes."""
        sib = CutAt(self.inner.handle())  # type: ignore[attr-defined]
        sib._op = self._op  # type: ignore[method-assign]
        return sib


def torn_crash(mem: MemoryStorage, rng: random.Random) -> MemoryStorage:
    """Power cut where the page cache had written back a random part of the pending writes."""
    return mem.crash(lambda _key: rng.random() < 0.5)


def base_run(steps: list[int], durability: str = "syncfs") -> MemoryStorage:
    mem = MemoryStorage(durability)  # type: ignore[arg-type]
    repo = Repository.create(mem)
    with repo.writer(chunk_bytes=CHUNK_BYTES) as w:
        for s in steps:
            commit(w, s)
    return mem


def copy(mem: MemoryStorage) -> MemoryStorage:
    return mem.crash()  # every write of a finished operation is durable: a full copy


def put_tensor(txn: Any, path: str, a: np.ndarray) -> None:
    """Declare ``a`` (0-d too) and write its chunks, last chunk first."""
    plan = txn.declare(path, "bfloat16" if a.dtype.name == "bfloat16" else a.dtype.name, a.shape)
    flat = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
    for i in reversed(range(plan.n_chunks)):
        start, stop = plan.byte_range(i)
        txn.put_chunk(path, i, flat[start:stop])


def do_commit(storage: Storage, step: int, timeline: str | None = None) -> None:
    with Repository(storage).writer(chunk_bytes=CHUNK_BYTES) as w:
        arrays, objects = expected(step)
        txn = w.begin(step, timeline=timeline)
        for path, a in arrays.items():
            put_tensor(txn, path, a)
        for name, obj in objects.items():
            txn.put_object(name, obj)
        txn.commit()


def every_cut(
    base: MemoryStorage, op: Callable[[Storage], None], check: Callable[[MemoryStorage, bool], None]
) -> list[str]:
    """Run ``op`` on copies of ``base`` cutting the power at each write; ``check`` each result.

    ``check(storage, done)``: ``done`` tells whether the operation's last write happened.
    Returns the keys ``op`` writes, in order (deletes as ``"delete <key>"``).
    """
    probe = CutAt(copy(base))
    op(probe)
    total = probe.n
    assert total > 0
    rng = random.Random(total)
    for k in range(1, total + 1):
        for after in (False, True):
            for torn in (False, True):
                mem = copy(base)
                cut = CutAt(mem, k, after=after)
                with pytest.raises(PowerCut):
                    op(cut)
                assert cut.keys == probe.keys[:k]  # the same writes in the same order
                crashed = torn_crash(mem, rng) if torn else mem.crash()
                check(crashed, after and k == total)
    return probe.keys


def commit_check(
    prev: int | None, new: int, timeline: str | None = None, older: tuple[int, ...] = ()
) -> Callable[[MemoryStorage, bool], None]:
    def check(st: MemoryStorage, done: bool) -> None:
        allowed = {new} if done else ({prev} if prev is not None else set())
        if prev is None and not done:
            assert Repository.open(st).reader().head(timeline) is None
        else:
            check_run(st, allowed, timeline)
        for s in older:  # earlier commits are untouched
            snap = load(st, step=s, timeline=timeline)
            assert_same_arrays(snap.arrays, expected(s)[0])
        assert Repository(st).verify().ok
        # a new writer continues from whatever is visible
        nxt = new + 1
        do_commit(st, nxt, timeline)
        check_run(st, {nxt}, timeline)
        r = Repository.open(st).reader()
        line = [h.step for h in r.lineage(timeline)]
        assert line[-1] == nxt
        assert (len(line) > 1 and line[-2] == new) == done

    return check


def test_power_cut_at_every_write_of_the_first_commit() -> None:
    base = MemoryStorage()
    Repository.create(base)
    keys = every_cut(copy(base), lambda st: do_commit(st, 0), commit_check(None, 0))
    # format 2: the step file (chunks + Zarr metadata), the side file (objects, arrays table),
    # then the commit point and the ref — whatever the number of tensors and objects
    assert keys == [step_file_key(0), side_file_key(0), commit_key(0), ref_key("main")]


def test_power_cut_at_every_write_of_a_later_commit() -> None:
    base = base_run([0, 1, 2])
    keys = every_cut(base, lambda st: do_commit(st, 3), commit_check(2, 3, older=(0, 1)))
    assert keys == [step_file_key(3), side_file_key(3), commit_key(3), ref_key("main")]


# a step of many tensors: one zip of ~3 x 300 entries, still four writes
MANY = 300


def many_arrays(step: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1000 + step)
    out = dict(expected(step)[0])
    for i in range(MANY):
        out[f"params/blocks/{i}/w"] = rng.standard_normal((5, 3)).astype(np.float32)
    return out


def commit_many(storage: Storage, step: int) -> None:
    with Repository(storage).writer(chunk_bytes=24) as w:  # 2 rows a chunk: 3 chunks each
        txn = w.begin(step)
        for path, a in many_arrays(step).items():
            put_tensor(txn, path, a)
        txn.put_object("meta", expected(step)[1]["meta"])
        txn.commit()


def test_power_cut_at_every_write_of_a_step_of_many_tensors() -> None:
    """Format 1 had one file per chunk (and grew the slot axis of every array); format 2
    writes a step of any size as one step file + one side file, published atomically. Each
    must be all-or-nothing across a power cut, even with a part of the page cache written
    back (``torn``)."""
    base = MemoryStorage()
    Repository.create(base)
    for s in (0, 1):
        commit_many(base, s)
    chunks = sum(
        plan_chunks(a.shape, a.dtype.itemsize, 24).n_chunks for a in many_arrays(0).values()
    )
    assert chunks > 3 * MANY
    names = zipfile.ZipFile(io.BytesIO(base.read(step_file_key(1)))).namelist()
    assert len(names) > chunks

    def check(st: MemoryStorage, done: bool) -> None:
        repo = Repository.open(st)
        rep = repo.verify()
        assert rep.ok, rep.problems
        assert rep.chunks == chunks * (3 if done else 2)
        snap = load(st)
        assert snap.header.step == (2 if done else 1)
        assert_same_arrays(snap.arrays, many_arrays(snap.header.step))
        assert_same_arrays(load(st, step=0).arrays, many_arrays(0))
        commit_many(st, 3)  # a new writer continues from whatever is visible
        assert [h.step for h in repo.reader().lineage()] == [0, 1, *([2] if done else []), 3]
        assert_same_arrays(load(st).arrays, many_arrays(3))

    keys = every_cut(base, lambda st: commit_many(st, 2), check)
    assert keys == [step_file_key(2), side_file_key(2), commit_key(2), ref_key("main")]


def two_rank_commit(storage: Storage, step: int) -> None:
    """Rank 1 (a part writer, on its own handle of the storage where it has them: its own
    barrier) prepares its share of the slot, rank 0 merges it and commits."""
    arrays, objects = expected(step)
    mine = {p: a for p, a in arrays.items() if p.startswith("params/")}
    theirs = {p: a for p, a in arrays.items() if not p.startswith("params/")}
    repo = Repository(storage)
    other = storage.handle() if hasattr(storage, "handle") else storage
    with (
        repo.writer(chunk_bytes=CHUNK_BYTES) as w0,
        Repository(other).writer(chunk_bytes=CHUNK_BYTES, exclusive=False, rank=1) as w1,
    ):
        slot = w0.next_slot
        t1 = w1.begin(step, slot=slot)
        for p, a in theirs.items():
            put_tensor(t1, p, a)
        t1.put_object("rank1", {"step": step})
        t1.prepare(rank=1, world=2, session=f"s{step}")
        t0 = w0.begin(step, slot=slot)
        for p, a in mine.items():
            put_tensor(t0, p, a)
        for name, obj in objects.items():
            t0.put_object(name, obj)
        parts = collect_parts(
            storage, slot=slot, step=step, ranks=[1], world=2, session=f"s{step}", timeout=5
        )
        t0.commit(parts=parts)


@pytest.mark.parametrize("durability", ["syncfs", "fsync"])
def test_power_cut_at_every_write_of_a_multi_rank_commit(durability: str) -> None:
    """A merged commit is visible only with every rank's bytes: a cut anywhere — in rank 1's
    files, its vote, rank 0's files, the header, the ref or the removal of the votes — leaves
    the previous head or the whole new step; the ranks can commit again at once, and gc then
    sweeps every leftover. In ``"fsync"`` mode each rank's barrier covers only its own files
    (``MemoryStorage.handle``), so rank 0's barrier cannot stand in for rank 1's."""
    base = base_run([0, 1], durability)

    def check_step(st: MemoryStorage, allowed: set[int]) -> int:
        repo = Repository.open(st)
        rep = repo.verify()
        assert rep.ok, rep.problems
        snap = load(st)
        step = snap.header.step
        assert step in allowed, (step, allowed)
        arrays, objects = expected(step)
        assert_same_arrays(snap.arrays, arrays)
        if step >= 2:  # a merged commit: rank 1's arrays live in rank 1's step file
            objects = {**objects, "rank1": {"step": step}}
            table = repo.reader().arrays(snap.header)
            assert {c.key for c in table["optim/step"].chunks} == {
                step_file_key(snap.header.slot, "r00001")
            }
            assert {c.key for c in table["params/layers/0/w"].chunks} == {
                step_file_key(snap.header.slot)
            }
        assert deep_equal(snap.objects, objects)
        return step

    def check(st: MemoryStorage, done: bool) -> None:
        got = check_step(st, {2} if done else {1, 2})
        two_rank_commit(st, 3)  # the leftovers of the interrupted commit are in no one's way
        check_step(st, {3})
        repo = Repository.open(st)
        assert [h.step for h in repo.reader().lineage()] == [0, 1, *([2] if got == 2 else []), 3]
        repo.gc()  # step files of a slot that never committed, orphans, votes
        check_step(st, {3})
        assert list(st.list(PARTS_PREFIX)) == []
        kept = {h.slot for h in repo.reader().lineage()}
        assert {int(name[:12]) for name in st.list(STEPS_PREFIX)} == kept
        assert set(repo.reader().all_slots()) == kept

    keys = every_cut(base, lambda st: two_rank_commit(st, 2), check)
    assert keys == [
        step_file_key(2, "r00001"),
        side_file_key(2, "r00001"),
        part_key(2, 1),
        step_file_key(2),
        side_file_key(2),
        commit_key(2),
        ref_key("main"),
        f"delete {PARTS_PREFIX}/{2:012d}",
    ]


def test_power_cut_at_every_write_on_a_rolled_back_timeline() -> None:
    base = base_run([0, 1, 2, 3])
    tl = Repository(base).rollback(1).name
    inner = commit_check(1, 2, tl, older=(0,))

    def check(st: MemoryStorage, done: bool) -> None:
        # the old timeline is untouched by whatever happened on the new one
        main = Repository(st).reader().lineage("main")
        assert [h.step for h in main] == [0, 1, 2, 3]
        assert_same_arrays(load(st, step=3, timeline="main").arrays, expected(3)[0])
        inner(st, done)

    every_cut(base, lambda st: do_commit(st, 2, tl), check)


def test_power_cut_while_creating_a_run() -> None:
    def check(st: MemoryStorage, done: bool) -> None:
        try:
            Repository.open(st)
            opened = True
        except NotARunError:
            opened = False
        assert opened or not done
        # creating again must always work, whatever an interrupted create left behind
        repo = Repository.create(st)
        assert repo.verify().ok
        do_commit(st, 0)
        check_run(st, {0})

    every_cut(MemoryStorage(), lambda st: Repository.create(st), check)


def test_power_cut_during_gc() -> None:
    base = base_run(list(range(8)))
    tl = Repository(base).rollback(5).name
    do_commit(base, 6, tl)

    def op(st: Storage) -> None:
        Repository(st).gc(keep_last=2)

    def check(st: MemoryStorage, done: bool) -> None:
        repo = Repository(st)
        assert repo.verify().ok
        r = repo.reader()
        for timeline, want in (("main", list(range(8))), (tl, [0, 1, 2, 3, 4, 5, 6])):
            line = r.lineage(timeline)
            assert [h.step for h in line] == want  # tombstones keep the chain
            for h in line:
                try:
                    snap = load(st, step=h.step, timeline=timeline)
                except StepNotFoundError as e:
                    assert "pruned" in str(e)
                    continue
                assert_same_arrays(snap.arrays, expected(h.step)[0])
        kept = {h.step for h in r.lineage("main") if not h.pruned}
        assert {6, 7} <= kept
        if done:  # all of gc's writes happened
            assert kept == {5, 6, 7}  # 5 is kept by the other timeline's keep_last
        # gc can simply be run again after the crash
        repo.gc(keep_last=2)
        assert repo.verify().ok
        assert {h.step for h in repo.reader().lineage("main") if not h.pruned} == {5, 6, 7}

    every_cut(base, op, check)


def evolving(step: int, branch: bool = False) -> dict[str, np.ndarray]:
    """Slowly changing weights (XOR deltas), a frozen tensor (dedup) and a 0-d counter."""
    rng = np.random.default_rng(8 if branch else 7)
    w = rng.standard_normal((32, 16)).astype(np.float32)
    frozen = rng.standard_normal(300).astype(np.float32)
    return {
        "params/w": w * np.float32(1 + 1e-4 * step),
        "params/frozen": frozen,
        "optim/step": np.array(step, dtype=np.int64),
    }


def _commit_evolving(w: Any, step: int, timeline: str | None = None) -> Any:
    txn = w.begin(step, timeline=timeline)
    for path, a in evolving(step, timeline is not None).items():
        put_tensor(txn, path, a)
    txn.put_object("meta", {"step": step})
    return txn.commit()


def _gc_state(st: MemoryStorage) -> tuple[set[str], dict[str, list[tuple[int, bool]]]]:
    r = Repository(st).reader()
    # an index segment's generation counts rewrites (a re-run gc after a cut makes one more)
    files = {k.rsplit(".g", 1)[0] if k.startswith(INDEX_PREFIX) else k for k in st.data}
    return files, {tl: [(h.step, h.pruned) for h in r.lineage(tl)] for tl in r.timelines}


@pytest.mark.parametrize("encoded", [False, True], ids=["raw", "deltas"])
def test_power_cut_between_any_two_gc_deletes(encoded: bool) -> None:
    """gc deletes whole step files now; a power cut between any two deletes (and at each
    tombstone) must leave every kept step readable bit-exactly and verify clean, and running
    gc again must end where an uninterrupted gc ends. With deltas and dedup, kept steps read
    chunks from the step files of pruned ones: those files must survive every cut."""
    from dstt.store.codec.xor import DeltaPolicy

    base = MemoryStorage()
    repo = Repository.create(base)
    enc = {"encoding": DeltaPolicy(keyframe_every=4)} if encoded else {}
    with repo.writer(chunk_bytes=256, **enc) as w:
        for step in range(10):
            _commit_evolving(w, step)
    tl = repo.rollback(5).name
    with repo.writer(chunk_bytes=256, **enc) as w:
        for step in (6, 7):
            _commit_evolving(w, step, tl)
    # debris gc must also remove: a complete commit whose ref never moved (an orphan) ...
    with (
        pytest.raises(StorageError),
        Repository(FaultyStorage(base, fail_keys="_dstt/refs/")).writer() as w,
    ):
        _commit_evolving(w, 10)
    # ... and the published step files of a commit that died before its header
    with (
        pytest.raises(StorageError),
        Repository(FaultyStorage(base, fail_keys="_dstt/commits/")).writer() as w,
    ):
        _commit_evolving(w, 10)
    r = repo.reader()
    if encoded:  # kept steps really depend on older steps' files
        older = [
            c
            for h in r.lineage()
            for rec in r.arrays(h).values()
            for c in rec.chunks
            if c.base is not None or int(c.key.split("/")[1][:12]) < h.slot
        ]
        assert older
    lines = {"main": list(range(10)), tl: [0, 1, 2, 3, 4, 5, 6, 7]}

    ref = copy(base)
    Repository(ref).gc(keep_last=2)
    want = _gc_state(ref)
    kept_at_end = {t: {s for s, pruned in line if not pruned} for t, line in want[1].items()}
    assert kept_at_end["main"] >= {8, 9}
    assert kept_at_end["main"] != set(lines["main"])

    def check(st: MemoryStorage, done: bool) -> None:
        repo = Repository(st)
        rep = repo.verify()
        assert rep.ok, rep.problems
        r = repo.reader()
        for timeline, steps in lines.items():
            line = r.lineage(timeline)
            assert [h.step for h in line] == steps  # tombstones keep the chain
            for h in line:
                if h.pruned:
                    with pytest.raises(StepNotFoundError, match="pruned"):
                        load(st, step=h.step, timeline=timeline)
                    continue
                snap = load(st, step=h.step, timeline=timeline)
                assert_same_arrays(snap.arrays, evolving(h.step, timeline == tl and h.step > 5))
                assert snap.objects == {"meta": {"step": h.step}}
            assert {h.step for h in line if not h.pruned} >= kept_at_end[timeline]
        if done:
            assert _gc_state(st) == want
        repo.gc(keep_last=2)  # gc can simply be run again after the crash
        assert repo.verify().ok
        assert _gc_state(st) == want

    keys = every_cut(base, lambda st: Repository(st).gc(keep_last=2), check)
    deletes = [k for k in keys if k.startswith("delete ")]
    first = keys.index(deletes[0])
    # the index's marker, the tombstones, the new index, the old index and the marker gone:
    # then the files
    assert keys[0] == GC_MARKER
    assert all(k.startswith(COMMITS_PREFIX) for k in keys[1 : first - 1])
    assert keys[first - 1].startswith(INDEX_PREFIX)
    gone = keys.index(f"delete {GC_MARKER}")
    assert all(k.startswith(f"delete {INDEX_PREFIX}/") for k in keys[first:gone])
    assert keys[first:] == deletes
    assert len(deletes) >= 6
    assert any(k.endswith(".zip") for k in deletes)
    assert any(k.endswith(".dstt") for k in deletes)


def test_fsync_mode_syncs_the_parents_of_new_folders(tmp_path: Path) -> None:
    """White-box (a power cut cannot be staged here): a file in a folder that the write had to
    create — a rank's vote in a slot's new parts folder — is durable only once every folder
    that gained an entry is fsynced as well."""
    from dstt.store import LocalStorage

    st = LocalStorage(tmp_path, durability="fsync")
    st.write(part_key(1, 1), b"x")
    slot_dir = tmp_path / PARTS_PREFIX / f"{1:012d}"
    assert st._dirty_dirs == {
        str(slot_dir),
        str(tmp_path / PARTS_PREFIX),
        str(tmp_path / "_dstt"),
        str(tmp_path),
    }
    st.barrier()
    assert not st._dirty_dirs
    st.write(part_key(1, 2), b"y")  # folder known: only it changes
    assert st._dirty_dirs == {str(slot_dir)}


# -- what LocalStorage syncs per commit --------------------------------------------------------


def _fd_path(fd: int) -> str:
    """The file an fd is open on, with an in-flight temporary's suffix removed."""
    return os.readlink(f"/proc/self/fd/{fd}").split(".tmp.", 1)[0]


@pytest.mark.parametrize("durability", ["fsync", "syncfs", "none"])
def test_each_commit_syncs_its_step_files_before_the_header(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, durability: Durability
) -> None:
    """White-box, on a real directory (a power cut cannot be staged here): count what
    ``LocalStorage`` syncs per commit. The step file, side file and header are written
    without a sync and made durable by ONE barrier — an fsync of each and of every folder that
    gained an entry (``"fsync"``) or one ``syncfs`` (``"syncfs"``) — strictly before the ref,
    the commit point, is written and fsynced with its folder. With ``lazy_refs`` the ref is
    written without a sync and made durable by the next barrier (the next commit's, or the
    writer's close). A no-op barrier fails this test."""
    from dstt.store import LocalStorage
    from dstt.store.storage import local as backend

    run = tmp_path / "run"
    repo = Repository.create(LocalStorage(run, durability=durability, create=True))
    events: list[tuple[str, str]] = []
    real_fsync, real_syncfs = os.fsync, backend._syncfs

    def fsync(fd: int) -> None:
        events.append(("fsync", _fd_path(fd)))
        real_fsync(fd)

    def syncfs(fd: int) -> None:
        # what the kernel is asked to flush: the step's files and header are in place
        slot = len(list((run / STEPS_PREFIX).glob("*.zip"))) - 1
        events.append(("syncfs", _fd_path(fd)))
        assert (run / step_file_key(slot)).is_file()
        assert (run / side_file_key(slot)).is_file()
        assert (run / commit_key(slot)).is_file()
        real_syncfs(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(backend, "_syncfs", syncfs)
    root = str(run)
    steps, commits, refs = (f"{root}/{d}" for d in (STEPS_PREFIX, COMMITS_PREFIX, "_dstt/refs"))
    ref = f"{root}/{ref_key('main')}"
    for step in range(4):
        events.clear()
        with repo.writer(chunk_bytes=CHUNK_BYTES) as w:
            commit(w, step)
        slot = step
        zip_, side = f"{root}/{step_file_key(slot)}", f"{root}/{side_file_key(slot)}"
        header = f"{root}/{commit_key(slot)}"
        if durability == "none":
            assert events == []
            continue
        # the commit point: the ref file, then its folder — after everything else
        assert events[-2:] == [("fsync", ref), ("fsync", refs)]
        before = events[:-2]
        if durability == "fsync":
            # the step's three files and every folder that gained an entry, each exactly once
            grown = [root, f"{root}/_dstt"] if step == 0 else []  # steps/, commits/ are new
            assert sorted(before) == sorted(
                ("fsync", p) for p in [zip_, side, header, steps, commits, *grown]
            )
        else:
            assert before == [("syncfs", root)]  # one syncfs for the whole step
    # lazy refs: the commit syncs nothing after its barrier; close() makes the ref durable
    events.clear()
    with repo.writer(chunk_bytes=CHUNK_BYTES, lazy_refs=True) as w:
        commit(w, 4)
        after_commit = list(events)
        commit(w, 5)
        after_second = list(events)
    if durability == "fsync":
        assert ("fsync", ref) not in after_commit
        # the second commit's barrier carries the first one's ref (and its folder)
        assert ("fsync", ref) in after_second[len(after_commit) :]
        assert events[-2:] == [("fsync", ref), ("fsync", refs)]  # close: the last ref
    elif durability == "syncfs":
        assert after_commit == [("syncfs", root)]
        assert after_second == [("syncfs", root)] * 2
        assert events == [("syncfs", root)] * 3  # close: one more barrier
    else:
        assert events == []
    assert Repository.open(run).verify().ok
    assert Repository.open(run).reader().head().step == 5  # type: ignore[union-attr]


def _run_files(run: Path) -> set[str]:
    """Files of a run, without the ones that do not grow with the steps (refs, HEAD, lock)."""
    skip = ("_dstt/refs/", "_dstt/HEAD.json", "_dstt/lock")
    return {
        str(p.relative_to(run))
        for p in run.rglob("*")
        if p.is_file() and not str(p.relative_to(run)).startswith(skip)
    }


@pytest.mark.parametrize("tensors", [5, 500])
def test_a_committed_step_is_at_most_three_files(tmp_path: Path, tensors: int) -> None:
    """Format 2's point: files per step do not grow with the tensor count (format 1 wrote one
    file per chunk). A step of 5 or of 500 tensors, each of several chunks, plus objects, is
    its step file, its side file and its commit header."""
    run = tmp_path / "run"
    repo = Repository.create(run)
    rng = np.random.default_rng(tensors)
    before = _run_files(run)
    for step in (1, 2):
        with repo.writer(chunk_bytes=16) as w:
            txn = w.begin(step)
            for i in range(tensors):
                put_tensor(
                    txn, f"params/layers/{i}/w", rng.standard_normal((3, 4)).astype(np.float32)
                )
            txn.put_object("rng", {"seed": step})
            txn.put_object("data", {"batch": step})
            h = txn.commit()
        now = _run_files(run)
        new = now - before
        assert len(new) <= 3
        assert new == {step_file_key(h.slot), side_file_key(h.slot), commit_key(h.slot)}
        with zipfile.ZipFile(run / step_file_key(h.slot)) as zf:  # all 3 * N chunks inside
            assert sum("/c/" in n for n in zf.namelist()) == 3 * tensors
        before = now
    assert repo.verify().ok
