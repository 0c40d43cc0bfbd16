"""Timeline management in the store: rename and delete (``dstt/store/maintenance/timelines.py``).

Power cuts at every write (the ``MemoryStorage`` crash model of ``commit/test_crash.py``): after any
cut every timeline left is readable bit-exactly, HEAD names an existing ref, and running the
operation (or gc) again ends where the uninterrupted one ends. Deleting frees the steps only
the deleted timeline had and nothing another timeline reads, deltas included.
"""

from __future__ import annotations

import pytest

from dstt.errors import CurrentTimelineError, StepNotFoundError, TimelineError
from dstt.store import Repository, Storage, load
from dstt.store.codec.xor import DeltaPolicy
from dstt.store.format.layout import (
    HEAD_KEY,
    RELEASED_PREFIX,
    STEPS_PREFIX,
    commit_key,
    ref_key,
)
from dstt.store.storage.memory import MemoryStorage

from .._util import assert_same_arrays
from ..commit.test_crash import (
    _commit_evolving,
    _gc_state,
    copy,
    do_commit,
    every_cut,
    evolving,
)

BRANCH = [0, 1, 2, 3, 4, 5, 6, 7]


def timeline_run(encoded: bool = True) -> tuple[MemoryStorage, str]:
    """main 0..9; ``tl`` forked at 5 (current) with 6, 7 of its own, deltas against main's
    files when ``encoded``."""
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
    return base, tl


def assert_exact(st: Storage, timeline: str, steps: list[int], branch: bool) -> None:
    """Every step of ``timeline`` reads back bit-exactly (arrays and objects)."""
    r = Repository(st).reader()
    assert [h.step for h in r.lineage(timeline)] == steps
    for s in steps:
        snap = load(st, step=s, timeline=timeline)
        assert_same_arrays(snap.arrays, evolving(s, branch and s > 5))
        assert snap.objects == {"meta": {"step": s}}


def slots_on_disk(st: MemoryStorage) -> set[int]:
    return {int(n[:12]) for n in st.list(STEPS_PREFIX)} | set(Repository(st).reader().all_slots())


# -- rename ------------------------------------------------------------------------------------


def test_power_cut_at_every_write_of_a_timeline_rename() -> None:
    """Renaming the current timeline, which another was forked from: at every cut the old or
    the new name (or both, on the same head) is there, HEAD names one of them, every timeline
    reads back, and the same rename again finishes the job."""
    base, tl = timeline_run()
    repo = Repository(base)
    child = repo.rollback(6, timeline=tl).name  # forked from tl: names it as its base
    repo.switch(tl)
    before = repo.reader().ref(tl)

    def check(st: MemoryStorage, done: bool) -> None:
        repo = Repository(st)
        rep = repo.verify()
        assert rep.ok, rep.problems
        r = repo.reader()
        names = set(r.timelines)
        assert names - {"main", child} in ({tl}, {"alt"}, {tl, "alt"})
        assert "main" in names
        assert r.current_timeline in (names & {tl, "alt"})
        for name in names & {tl, "alt"}:
            got = r.ref(name)
            assert (got.head, got.base_slot, got.base_step, got.base_timeline, got.created) == (
                before.head,
                before.base_slot,
                before.base_step,
                before.base_timeline,
                before.created,
            )
            assert_exact(st, name, BRANCH, True)
        assert r.ref(child).base_timeline in (names & {tl, "alt"})
        assert_exact(st, "main", list(range(10)), False)
        if done:
            assert names == {"main", child, "alt"}
            assert r.current_timeline == "alt"
        if tl in names:  # interrupted: the same call finishes it
            repo.rename_timeline(tl, "alt")
        r = repo.reader()
        assert set(r.timelines) == {"main", child, "alt"}
        assert r.current_timeline == "alt"
        assert r.ref(child).base_timeline == "alt"
        assert repo.verify().ok
        do_commit(st, 8, "alt")  # training resumes on the renamed timeline
        assert [h.step for h in repo.reader().lineage("alt")] == [*BRANCH, 8]

    keys = every_cut(base, lambda st: Repository(st).rename_timeline(tl, "alt"), check)
    # the new name durably first, then the child's base and HEAD; the old name goes last
    assert keys == [ref_key("alt"), ref_key(child), HEAD_KEY, f"delete {ref_key(tl)}"]


def test_rename_refuses_taken_bad_and_unknown_names() -> None:
    base, tl = timeline_run(False)
    repo = Repository(base)
    with pytest.raises(TimelineError, match="'main' already exists"):
        repo.rename_timeline(tl, "main")
    with pytest.raises(TimelineError, match="invalid timeline name"):
        repo.rename_timeline(tl, "a/b")
    with pytest.raises(TimelineError, match="no timeline 'nope'"):
        repo.rename_timeline("nope", "x")
    assert set(repo.reader().timelines) == {"main", tl}
    repo.rename_timeline("main", "first")  # not the current one: HEAD stays
    r = repo.reader()
    assert set(r.timelines) == {"first", tl}
    assert r.current_timeline == tl
    assert r.ref(tl).base_timeline == "first"  # the child follows
    assert_exact(base, "first", list(range(10)), False)
    # commit headers keep the name they were written under: history, not a ref
    assert {h.timeline for h in r.lineage("first")} == {"main"}


# -- delete ------------------------------------------------------------------------------------


@pytest.mark.parametrize("encoded", [False, True], ids=["raw", "deltas"])
def test_power_cut_at_every_write_of_a_timeline_delete(encoded: bool) -> None:
    """Deleting main (not current) after a rollback at 5: the ref goes, durably, before any
    byte; then gc frees main's own steps 6..9. At every cut the other timeline reads back
    bit-exactly (its steps 0..5 are main's commits and files), HEAD is valid, main is whole or
    gone, and a gc afterwards ends where the uninterrupted delete ends."""
    base, tl = timeline_run(encoded)
    r = Repository(base).reader()
    own = {h.slot for h in r.lineage("main")} - {h.slot for h in r.lineage(tl)}
    assert len(own) == 4
    if encoded:  # tl's own steps really read main's files
        assert any(
            c.base is not None
            for h in r.lineage(tl)[6:]
            for rec in r.arrays(h).values()
            for c in rec.chunks
        )

    ref = copy(base)
    rep = Repository(ref).delete_timeline("main")
    assert (rep.freed_steps, rep.kept_steps) == ((6, 7, 8, 9), (0, 1, 2, 3, 4, 5))
    assert rep.gc is not None
    assert rep.gc.files_removed >= 8
    assert not rep.dry_run
    want = _gc_state(ref)
    assert not own & slots_on_disk(ref)  # main's own step files and headers are gone
    assert_exact(ref, tl, BRANCH, True)

    def check(st: MemoryStorage, done: bool) -> None:
        repo = Repository(st)
        rep = repo.verify()
        assert rep.ok, rep.problems
        r = repo.reader()
        assert r.current_timeline == tl
        assert set(r.timelines) in ({"main", tl}, {tl})
        assert_exact(st, tl, BRANCH, True)
        if "main" in r.timelines:  # the cut came before the ref went: main is untouched
            assert_exact(st, "main", list(range(10)), False)
            repo.delete_timeline("main")
        if done:
            assert _gc_state(st) == want
        repo.gc()  # finishes an interrupted sweep
        assert _gc_state(st) == want
        assert not own & slots_on_disk(st)
        assert_exact(st, tl, BRANCH, True)

    keys = every_cut(base, lambda st: Repository(st).delete_timeline("main"), check)
    # first the record of what the delete releases (gc keeps a timeline without a ref
    # otherwise); the ref's delete made durable (a rewrite in its folder) before gc deletes
    # a byte; the record goes once swept
    assert keys[:3] == [f"{RELEASED_PREFIX}/main.json", f"delete {ref_key('main')}", ref_key(tl)]
    assert keys[-1] == f"delete {RELEASED_PREFIX}/main.json"
    assert any(k.startswith(f"delete {STEPS_PREFIX}/") for k in keys[2:])


def test_delete_refuses_the_current_timeline_and_keeps_what_children_need() -> None:
    base, tl = timeline_run()
    repo = Repository(base)
    with pytest.raises(CurrentTimelineError, match="switch") as ei:
        repo.delete_timeline(tl)
    assert isinstance(ei.value, TimelineError)
    assert "'main'" in str(ei.value)
    # a timeline forked from tl at 6: deleting tl keeps 6 (the child reads it), frees 7
    child = repo.rollback(6, timeline=tl).name
    dry = repo.delete_timeline(tl, dry_run=True)
    assert dry.dry_run
    assert (dry.freed_steps, dry.kept_steps) == ((7,), (0, 1, 2, 3, 4, 5, 6))
    assert dry.gc is not None
    assert dry.gc.files_removed == 2
    assert dry.gc.dry_run
    assert set(repo.reader().timelines) == {"main", tl, child}  # a dry run deletes nothing
    rep = repo.delete_timeline(tl)
    assert rep.freed_steps == (7,)
    assert rep.gc is not None
    assert rep.gc.files_removed == dry.gc.files_removed
    r = repo.reader()
    assert set(r.timelines) == {"main", child}
    assert r.ref(child).base_timeline == tl  # history: where it forked, by the name it had
    assert_exact(base, child, BRANCH[:7], True)
    assert_exact(base, "main", list(range(10)), False)
    assert repo.verify().ok
    # without gc only the ref goes; the next gc sweeps the files
    repo.switch(child)
    kept = repo.delete_timeline("main", gc=False)
    assert kept.gc is None
    assert kept.freed_steps == (6, 7, 8, 9)
    with pytest.raises(StepNotFoundError):
        load(base, step=9, timeline=child)
    before = slots_on_disk(base)
    assert Repository(base).gc().files_removed == 8
    assert len(slots_on_disk(base)) == len(before) - 4
    assert_exact(base, child, BRANCH[:7], True)


# -- gc and fork points ------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["offline", "live-writer"])
def test_gc_keeps_the_step_a_timeline_forks_from(how: str) -> None:
    """main 0..9, ``tl`` forked at 5 with 6 and 7: ``keep_last=2`` keeps 8, 9 on main and 6, 7
    on ``tl`` — and 5, which no policy rule keeps but ``tl`` starts from: pruning it would
    leave ``tl``'s first parent a tombstone (its history cut, the fork not restorable)."""
    from dstt.store import Retention

    base, tl = timeline_run(encoded=False)  # raw steps: no delta base keeps 5 by chance
    repo = Repository(base)
    fork = repo.reader().ref(tl).base_slot
    assert fork is not None
    assert repo.reader().header(fork).step == 5
    if how == "offline":
        report = repo.gc(keep_last=2)
    else:  # a session's background retention, under its own writer
        with repo.writer(chunk_bytes=256) as w:
            report = w.gc(Retention(keep_last=2))
    r = repo.reader()
    live = {t: [h.step for h in r.lineage(t) if not h.pruned] for t in ("main", tl)}
    assert live == {"main": [5, 8, 9], tl: [5, 6, 7]}, live
    assert sorted(report.pruned_steps) == [("main", s) for s in (0, 1, 2, 3, 4, 6, 7)]
    assert_same_arrays(load(base, step=5, timeline=tl).arrays, evolving(5))
    assert_same_arrays(load(base, step=5, timeline="main").arrays, evolving(5))
    assert repo.verify().ok


@pytest.mark.parametrize("header", [True, False], ids=["header", "header-lost"])
@pytest.mark.parametrize("op", ["rename", "delete"])
def test_debris_of_a_renamed_or_deleted_name_is_released(op: str, header: bool) -> None:
    """A commit a power cut stopped before its ref moved is debris of its timeline's name.
    Renaming or deleting that timeline releases the debris with the name, so verify does not
    take it for a lost timeline (the hypothesis model found: cut commit, gc, rename)."""
    from ..commit.test_crash import CutAt, PowerCut

    mem = MemoryStorage()
    repo = Repository.create(mem)
    with repo.writer(chunk_bytes=256) as w:
        _commit_evolving(w, 0)
    cut = CutAt(mem, 4)  # step file, side file and header written; the ref never moved
    with pytest.raises(PowerCut), Repository(cut).writer(chunk_bytes=256) as w:
        _commit_evolving(w, 1)
    mem = mem.crash()
    if not header:  # a torn crash lost the header: only the step zip names the debris
        mem.delete(commit_key(max(Repository.open(mem).reader().all_slots())))
    repo = Repository.open(mem)
    with repo.writer(chunk_bytes=256) as w:
        _commit_evolving(w, 1)
    assert repo.verify().ok
    if op == "rename":
        repo.rename_timeline("main", "a")
    else:
        repo.rollback(0)
        repo.delete_timeline("main")
    rep = repo.verify()
    assert rep.ok, rep.problems
    assert "main" not in repo.reader().timelines
    repo.gc()
    assert not [k for k in mem.list(RELEASED_PREFIX)]
    assert repo.verify().ok


def test_a_renamed_then_deleted_timeline_is_not_taken_for_a_lost_one() -> None:
    """Commit headers keep the name a commit was written under. After ``main`` is renamed to
    ``a`` and ``a`` deleted (cut before gc swept it), the release record names ``a`` while its
    commits' headers say ``main``: verify must go by the released slots, not the name."""
    from ..commit.test_crash import CutAt, PowerCut

    mem = MemoryStorage()
    repo = Repository.create(mem)
    with repo.writer(chunk_bytes=256) as w:
        _commit_evolving(w, 0)
    repo.rollback(0)
    with repo.writer(chunk_bytes=256) as w:
        _commit_evolving(w, 1, timeline="main")
    repo.rename_timeline("main", "a")
    with pytest.raises(PowerCut):
        Repository(CutAt(mem, 3)).delete_timeline("a")  # record and ref delete, no gc
    mem = mem.crash()
    repo = Repository.open(mem)
    assert set(repo.reader().timelines) == {"main-from-0"}
    rep = repo.verify()
    assert rep.ok, rep.problems
    repo.gc()
    assert not list(mem.list(RELEASED_PREFIX))
    assert repo.verify().ok


def test_a_deleted_name_reused_before_gc_keeps_its_release() -> None:
    """``b`` is deleted (cut before gc swept it), then another timeline is renamed to ``b``:
    the commits the delete released stay released though the name has a ref again, and a
    second delete of ``b`` adds to the record instead of replacing it."""
    from ..commit.test_crash import CutAt, PowerCut

    mem = MemoryStorage()
    repo = Repository.create(mem)
    with repo.writer(chunk_bytes=256) as w:
        _commit_evolving(w, 0)
        _commit_evolving(w, 1)
    repo.rename_timeline("main", "b")
    repo.rollback(0, timeline="b")
    with pytest.raises(PowerCut):
        Repository(CutAt(mem, 3)).delete_timeline("b")  # record and ref delete, no gc
    mem = mem.crash()
    repo = Repository.open(mem)
    repo.rename_timeline("b-from-0", "b")
    rep = repo.verify()
    assert rep.ok, rep.problems
    with repo.writer(chunk_bytes=256) as w:
        _commit_evolving(w, 1, timeline="b")
    repo.rollback(0, timeline="b")
    with pytest.raises(PowerCut):
        Repository(CutAt(Repository.open(mem).storage, 3)).delete_timeline("b")
    rep = Repository.open(mem).verify()
    assert rep.ok, rep.problems
    Repository.open(mem).gc()
    assert not list(mem.list(RELEASED_PREFIX))
    assert Repository.open(mem).verify().ok
