"""Multi-writer commits (parts), without torch (``commit/parts.py``; the logical arrays they
describe: ``read/test_shards.py``).

Ranks are simulated by writers in one process over one run directory: the exclusive writer is
rank 0, part writers (``exclusive=False``) are the other ranks. That is what the engine does
across processes; the protocol only goes through the storage.
"""

from __future__ import annotations

import itertools
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import zarr
from zarr.storage import ZipStore

from dstt.errors import DsttError, RankError
from dstt.store import CommitHeader, DeltaPolicy, Repository
from dstt.store.commit.parts import abort_vote, collect_parts
from dstt.store.format.layout import PARTS_PREFIX, STEPS_PREFIX, side_file_key, step_file_key

from .._util import put_array, same_bits


def _two_rank_commit(
    repo: Repository,
    step: int,
    *,
    slot: int | None = None,
    session: str = "s1",
    chunk_bytes: int = 64,
) -> tuple[CommitHeader, dict[str, np.ndarray]]:
    a0 = np.arange(10, dtype=np.float32) + step
    a1 = np.arange(7, dtype=np.float32) * -1 - step
    with (
        repo.writer(chunk_bytes=chunk_bytes) as w0,
        repo.writer(chunk_bytes=chunk_bytes, exclusive=False, rank=1) as w1,
    ):
        slot = w0.next_slot if slot is None else slot
        t1 = w1.begin(step, slot=slot)
        put_array(t1, "zero/r1/flat", a1)
        t1.put_object("rng/r1", {"seed": 1})
        t1.prepare(rank=1, world=2, session=session, metrics={"loss": 9.0})
        t0 = w0.begin(step, slot=slot)
        put_array(t0, "zero/r0/flat", a0)
        t0.put_object("rng/r0", {"seed": 0})
        parts = collect_parts(
            repo.storage, slot=slot, step=step, ranks=[1], world=2, session=session, timeout=5
        )
        h = t0.commit({"loss": 1.0}, parts=parts)
    return h, {"zero/r0/flat": a0, "zero/r1/flat": a1}


def test_merged_commit_is_a_plain_commit(tmp_path: Path) -> None:
    repo = Repository.create(tmp_path / "run")
    h, want = _two_rank_commit(repo, 3)
    r = repo.reader()
    assert [x.step for x in r.lineage()] == [3]
    assert set(r.arrays(h)) == set(want)
    for p, a in want.items():
        assert same_bits(r.read_array(h, p), a)
    assert r.read_object(h, "rng/r1") == {"seed": 1}
    assert h.metrics == {"loss": 1.0}  # rank 0's metrics
    assert list(repo.storage.list(PARTS_PREFIX)) == []  # votes removed once merged
    assert repo.verify().ok
    # each rank's share is in its own files of the slot: rank 0's step file is the plain one
    table = r.arrays(h)
    files = {p: {c.key for c in rec.chunks} for p, rec in table.items()}
    assert files == {
        "zero/r0/flat": {step_file_key(h.slot)},
        "zero/r1/flat": {step_file_key(h.slot, "r00001")},
    }
    assert h.objects["rng/r1"].key == side_file_key(h.slot, "r00001")
    assert h.objects["rng/r0"].key == side_file_key(h.slot)
    assert h.arrays is not None
    assert h.arrays.key == side_file_key(h.slot)
    # plain Zarr sees each rank's arrays in that rank's step file (a Zarr v3 hierarchy each)
    for rank, path in ((0, "zero/r0/flat"), (1, "zero/r1/flat")):
        zkey = step_file_key(h.slot, "r00001" if rank else "")
        store = ZipStore(tmp_path / "run" / zkey, mode="r")
        arr = zarr.open_array(store, path=path, mode="r", zarr_format=3)
        assert same_bits(np.asarray(arr[...]), want[path])
        g = zarr.open_group(store, mode="r", zarr_format=3)
        other = "zero/r1/flat" if rank == 0 else "zero/r0/flat"
        with pytest.raises(KeyError):
            g[other]


def test_ranks_out_of_step_are_refused(tmp_path: Path) -> None:
    repo = Repository.create(tmp_path / "run")
    with repo.writer(chunk_bytes=64) as w0, repo.writer(exclusive=False) as w1:
        slot = w0.next_slot
        t1 = w1.begin(8, slot=slot)  # rank 1 thinks this slot is step 8
        put_array(t1, "zero/r1/flat", np.ones(3, np.float32))
        t1.prepare(rank=1, world=2, session="s")
        with pytest.raises(RankError, match="out of step"):
            collect_parts(
                repo.storage, slot=slot, step=7, ranks=[1], world=2, session="s", timeout=5
            )
        # a leftover of another session is ignored (and then the wait times out)
        with pytest.raises(RankError, match="did not prepare"):
            collect_parts(
                repo.storage, slot=slot, step=7, ranks=[1], world=2, session="other", timeout=0.05
            )
    assert repo.reader().head() is None
    assert list(repo.storage.list(PARTS_PREFIX)) == [f"{slot:012d}"]
    # rank 1's prepared share: its step file (no objects, so no side file), named by a
    # random tag as the writer was given no rank
    assert list(repo.storage.list(STEPS_PREFIX)) == [f"{slot:012d}.{w1.file_tag}.zip"]
    report = repo.gc(keep_last=1)
    assert report.files_removed == 1  # the folder of votes
    assert list(repo.storage.list(PARTS_PREFIX)) == []
    # the step file stays: nothing committed after it proves its slot abandoned (gc never
    # deletes a slot at the run's tip; the next writer numbers its slots past it)
    assert list(repo.storage.list(STEPS_PREFIX)) == [f"{slot:012d}.{w1.file_tag}.zip"]
    assert repo.verify().ok


def test_abort_vote_fails_the_step_at_once(tmp_path: Path) -> None:
    repo = Repository.create(tmp_path / "run")
    abort_vote(repo.storage, slot=0, step=1, rank=2, world=3, session="s", error="disk full")
    t0 = time.monotonic()
    with pytest.raises(RankError, match=r"rank 2 could not write.*disk full"):
        collect_parts(repo.storage, slot=0, step=1, ranks=[1, 2], world=3, session="s", timeout=30)
    assert time.monotonic() - t0 < 5


def test_collect_can_be_cancelled(tmp_path: Path) -> None:
    repo = Repository.create(tmp_path / "run")
    stop = threading.Event()
    threading.Timer(0.05, stop.set).start()
    with pytest.raises(RankError, match="stopped"):
        collect_parts(repo.storage, slot=0, step=1, ranks=[1, 2], world=3, session="s", cancel=stop)


def test_lost_ranks_are_asked_about_at_most_every_half_second(tmp_path: Path) -> None:
    """``lost`` asks the ranks' heartbeats: at most every 0.5 s, not at every poll of the
    parts (which goes down to every 0.5 ms)."""
    repo = Repository.create(tmp_path / "run")
    asked: list[float] = []

    def lost(missing: object) -> dict[int, str]:
        asked.append(time.monotonic())
        return {}

    t0 = time.monotonic()
    with pytest.raises(RankError, match="did not prepare"):
        collect_parts(
            repo.storage, slot=0, step=1, ranks=[1], world=2, session="s", timeout=1.2, lost=lost
        )
    waited = time.monotonic() - t0
    assert asked
    assert len(asked) <= 2 + waited / 0.5, (len(asked), waited)
    assert all(b - a >= 0.5 for a, b in itertools.pairwise(asked))


def test_two_ranks_never_write_one_array(tmp_path: Path) -> None:
    repo = Repository.create(tmp_path / "run")
    with repo.writer(chunk_bytes=64) as w0, repo.writer(exclusive=False) as w1:
        slot = w0.next_slot
        t1 = w1.begin(1, slot=slot)
        put_array(t1, "params/w", np.ones(3, np.float32))
        t1.prepare(rank=1, world=2, session="s")
        t0 = w0.begin(1, slot=slot)
        put_array(t0, "params/w", np.ones(3, np.float32))
        parts = collect_parts(repo.storage, slot=slot, step=1, ranks=[1], world=2, session="s")
        with pytest.raises(RankError, match="exactly one owner"):
            t0.commit(parts=parts)
    assert repo.reader().head() is None


def test_part_writer_limits(tmp_path: Path) -> None:
    repo = Repository.create(tmp_path / "run")
    with pytest.raises(ValueError, match="cannot encode"):
        repo.writer(exclusive=False, encoding=DeltaPolicy())
    with repo.writer(exclusive=False) as w1:
        t = w1.begin(1, slot=0)
        with pytest.raises(DsttError, match="cannot commit"):
            t.commit()
    with repo.writer() as w0, pytest.raises(ValueError, match="already used"):
        w0.begin(1, slot=-1)  # (the part writer above took no lock)


def test_a_slot_far_ahead_names_every_ranks_files(tmp_path: Path) -> None:
    """Format 1 grew every array's slot axis for such a slot; format 2 only names files by
    it: both ranks' step files of slot 40 are complete Zarr hierarchies, the slots between
    stay unused, and the next commit continues after it."""
    run = tmp_path / "run"
    repo = Repository.create(run)
    _two_rank_commit(repo, 1, slot=0)
    h, want = _two_rank_commit(repo, 2, slot=40)
    assert h.slot == 40
    assert sorted(repo.storage.list(STEPS_PREFIX)) == sorted(
        k.split("/")[1]
        for s in (0, 40)
        for k in (
            step_file_key(s),
            side_file_key(s),
            step_file_key(s, "r00001"),
            side_file_key(s, "r00001"),
        )
    )
    for tag, p in (("", "zero/r0/flat"), ("r00001", "zero/r1/flat")):
        store = ZipStore(run / step_file_key(40, tag), mode="r")
        a = zarr.open_array(store, path=p, mode="r", zarr_format=3)
        assert same_bits(np.asarray(a[...]), want[p])
        attrs = zarr.open_group(store, mode="r", zarr_format=3).attrs.asdict()
        assert attrs["dstt"] == {"format": 2, "step": 2, "timeline": "main", "slot": 40}
    assert repo.verify().ok
    with repo.writer() as w:
        assert w.next_slot == 41
    h3, want3 = _two_rank_commit(repo, 3)
    assert h3.slot == 41
    assert h3.parent == 40
    assert [x.step for x in repo.reader().lineage()] == [1, 2, 3]
    assert same_bits(repo.reader().read_array(h3, "zero/r1/flat"), want3["zero/r1/flat"])


def test_part_writers_without_a_rank_never_share_files(tmp_path: Path) -> None:
    """A part writer opened without ``rank=`` names its files with a random tag, so two of
    them writing one slot cannot overwrite each other's step files."""
    repo = Repository.create(tmp_path / "run")
    with (
        repo.writer(chunk_bytes=64) as w0,
        repo.writer(exclusive=False) as wa,
        repo.writer(exclusive=False) as wb,
    ):
        slot = w0.next_slot
        ta, tb = wa.begin(1, slot=slot), wb.begin(1, slot=slot)
        put_array(ta, "zero/r1/flat", np.arange(5, dtype=np.float32))
        put_array(tb, "zero/r2/flat", np.arange(6, dtype=np.float32) * 2)
        ta.prepare(rank=1, world=3, session="s")
        tb.prepare(rank=2, world=3, session="s")
        t0 = w0.begin(1, slot=slot)
        put_array(t0, "zero/r0/flat", np.ones(4, np.float32))
        parts = collect_parts(
            repo.storage, slot=slot, step=1, ranks=[1, 2], world=3, session="s", timeout=5
        )
        h = t0.commit(parts=parts)
    table = repo.reader().arrays(h)
    keys = {p: {c.key for c in rec.chunks} for p, rec in table.items()}
    assert len({k for ks in keys.values() for k in ks}) == 3  # three different step files
    assert keys["zero/r0/flat"] == {step_file_key(slot)}
    for p, want in (
        ("zero/r1/flat", np.arange(5, dtype=np.float32)),
        ("zero/r2/flat", np.arange(6, dtype=np.float32) * 2),
    ):
        assert same_bits(repo.reader().read_array(h, p), want)
    assert repo.verify().ok


def test_parts_folder_is_not_a_zarr_node_problem(tmp_path: Path) -> None:
    repo = Repository.create(tmp_path / "run")
    _two_rank_commit(repo, 1)
    assert not (tmp_path / "run" / PARTS_PREFIX / "000000000000").exists()


def test_deferred_objects_of_both_ranks_are_in_the_merged_commit(tmp_path: Path) -> None:
    """Objects stored at commit (``defer_object``) are written with a part's vote and with
    the merging rank's commit, once each, and stay listed (for the engine's warnings)."""
    repo = Repository.create(tmp_path / "run")
    a = np.arange(6, dtype=np.float32)
    with (
        repo.writer(chunk_bytes=64) as w0,
        repo.writer(chunk_bytes=64, exclusive=False, rank=1) as w1,
    ):
        slot = w0.next_slot
        t1 = w1.begin(2, slot=slot)
        put_array(t1, "zero/r1/flat", a)
        t1.defer_object("opaque/r1", {1, 2}, or_pickle=True)
        part = t1.prepare(rank=1, world=2, session="s")
        assert part.objects["opaque/r1"].encoding == "pickle"
        assert [d.name for d in t1.deferred] == ["opaque/r1"]
        t0 = w0.begin(2, slot=slot)
        put_array(t0, "zero/r0/flat", a)
        t0.defer_object("rng/r0", {"seed": 0})
        parts = collect_parts(
            repo.storage, slot=slot, step=2, ranks=[1], world=2, session="s", timeout=5
        )
        h = t0.commit(parts=parts)
        assert t0.bytes_written == t0.stats.written_bytes + h.objects["rng/r0"].nbytes  # once
    r = repo.reader()
    assert r.read_object(h, "rng/r0") == {"seed": 0}
    assert r.read_object(h, "opaque/r1", trusted=True) == {1, 2}
    assert repo.verify().ok
