"""The multi-rank commit at the store level: real ``RankWriter``s at world 2 and 3, no torch.

Every rank is a thread with its own storage handle (``rank_world``): rank 0 holds the run's
lock and merges, the others prepare parts — the protocol of ``store/commit/ranks.py`` exactly as the
engine drives it across processes, which only ever meet through the storage. Checked:

* a commit holds every rank's arrays bit-exactly, each in its own rank's step file, on the
  memory fake and on a real directory;
* rank 0 waits for a late rank; a missing rank, a rank that drops the step and a vote left by
  another session are refused or waited for — never merged, never half committed;
* a power cut at every write of every rank (``MemoryStorage`` in both durability modes: one
  barrier for every pending write, or only the rank's own files per barrier) and a SIGKILL
  at every write of every rank on a real directory leave the last commit readable and
  bit-exact, and the ranks can commit again at once;
* a rank whose barrier is slow still votes only once its files are durable.
"""

from __future__ import annotations

import random
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from dstt.errors import RankError
from dstt.store import CommitHeader, LocalStorage, Repository, Storage
from dstt.store.format.layout import (
    PARTS_PREFIX,
    STEPS_PREFIX,
    commit_key,
    part_key,
    ref_key,
    side_file_key,
    step_file_key,
)
from dstt.store.format.parts import Part, dump_part
from dstt.store.storage.memory import DelegatingStorage, MemoryStorage

from .._util import same_bits
from .rank_world import (
    WorldStep,
    close_world,
    open_world,
    rank_arrays,
    run_world,
    world_arrays,
    world_objects,
)
from .test_crash import CutAt, PowerCut

CHILD = Path(__file__).with_name("rank_kill_child.py")


def tag(rank: int) -> str:
    return "" if rank == 0 else f"r{rank:05d}"


def handles(mem: MemoryStorage, world: int) -> list[Storage]:
    """One handle per rank: in ``"fsync"`` mode each rank's barrier covers its own writes."""
    return [mem, *(mem.handle() for _ in range(world - 1))]


def check_world(st: Storage, world: int, allowed: set[int]) -> CommitHeader:
    """The head is a step in ``allowed`` holding every rank's arrays and objects bit-exactly,
    each rank's arrays in its own step file; ``verify`` is clean."""
    repo = Repository.open(st)
    rep = repo.verify()
    assert rep.ok, rep.problems
    r = repo.reader()
    h = r.head()
    assert h is not None, (h, allowed)
    assert h.step in allowed, (h, allowed)
    table = r.arrays(h)
    want = world_arrays(h.step, world)
    assert set(table) == set(want)
    for path, a in want.items():
        assert same_bits(r.read_array(h, path), a), path
    for name, obj in world_objects(h.step, world).items():
        assert r.read_object(h, name) == obj, name
    for rank in range(world):
        for path in rank_arrays(h.step, rank):
            assert {c.key for c in table[path].chunks} == {step_file_key(h.slot, tag(rank))}
    return h


def commit_world(mem: MemoryStorage, world: int, step: int, session: str) -> list[Any]:
    """Open ``world`` ranks on ``mem`` (a handle each), commit ``step``, close; every rank's
    result (rank 0's must be the commit's header)."""
    writers = open_world(handles(mem, world), session=session)
    try:
        results = run_world(writers, step)
    finally:
        close_world(writers)
    assert isinstance(results[0], CommitHeader), results
    return results


def world_run(world: int, durability: str = "syncfs") -> MemoryStorage:
    """A run on the memory fake with one step (0) committed by ``world`` ranks."""
    mem = MemoryStorage(durability)  # type: ignore[arg-type]
    Repository.create(mem)
    commit_world(mem, world, 0, "base")
    return mem


def steps_of(st: Storage) -> list[int]:
    return [h.step for h in Repository.open(st).reader().lineage()]


# -- the protocol, step by step --------------------------------------------------------------


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("backend", ["memory", "local"])
def test_a_commit_holds_every_ranks_arrays(tmp_path: Path, world: int, backend: str) -> None:
    if backend == "memory":
        mem = MemoryStorage("fsync")
        Repository.create(mem)
        stores, st = handles(mem, world), mem
    else:  # each rank its own LocalStorage: another process's view of the run
        Repository.create(tmp_path / "run")
        stores = [LocalStorage(tmp_path / "run", durability="fsync") for _ in range(world)]
        st = stores[0]
    writers = open_world(stores, session="s")
    try:
        for step in (3, 4, 5):
            results = run_world(writers, step)
            assert isinstance(results[0], CommitHeader), results
            for rank in range(1, world):
                part = results[rank]
                assert isinstance(part, Part), part
                assert (part.rank, part.world, part.step, part.slot) == (
                    rank,
                    world,
                    step,
                    results[0].slot,
                )
                assert set(part.arrays) == set(rank_arrays(step, rank))
            check_world(st, world, {step})
    finally:
        close_world(writers)
    assert steps_of(st) == [3, 4, 5]
    r = Repository.open(st).reader()
    for h in r.lineage():  # every step, not only the head
        for path, a in world_arrays(h.step, world).items():
            assert same_bits(r.read_array(h, path), a), (h.step, path)
    assert list(st.list(PARTS_PREFIX)) == []  # the votes are gone once merged
    if backend == "memory":
        assert check_world(mem.crash(), world, {5}).step == 5  # all of it durable


def with_a_late_rank(
    mem: MemoryStorage, writers: list[Any], punctual: Callable[[], None] = lambda: None
) -> list[Any]:
    """Step 1 with the last rank held back just before its commit: once ``punctual``
    returned, and 0.3 s more, rank 0 must still be waiting and nothing be visible; then the
    last rank goes on. Returns every rank's result (and closes the writers)."""
    gate = threading.Event()
    try:
        running = WorldStep(writers, 1, hold={len(writers) - 1: gate})
        punctual()
        time.sleep(0.3)  # rank 0 has its own share written and polls for the late vote
        assert not running.done[0].is_set(), running.results
        assert steps_of(mem) == [0]  # nothing visible while a rank is missing
        gate.set()
        return running.join()
    finally:
        gate.set()
        close_world(writers)


@pytest.mark.parametrize("world", [2, 3])
def test_rank_0_waits_for_a_late_rank(world: int) -> None:
    mem = world_run(world)
    writers = open_world(handles(mem, world), session="s")
    slot = writers[0].base_slot

    def punctual() -> None:  # every rank but the last has voted
        deadline = time.monotonic() + 10
        while not all(mem.exists(part_key(slot, r)) for r in range(1, world - 1)):
            assert time.monotonic() < deadline, "the punctual ranks never voted"
            time.sleep(0.005)

    results = with_a_late_rank(mem, writers, punctual)
    assert isinstance(results[0], CommitHeader), results
    check_world(mem, world, {1})
    assert steps_of(mem) == [0, 1]


@pytest.mark.parametrize("world", [2, 3])
def test_a_missing_rank_is_refused_and_nothing_is_committed(world: int) -> None:
    mem = world_run(world)
    writers = open_world(handles(mem, world), session="s", timeout=0.5)
    try:
        # every rank but the last takes part; the last never begins the step
        running = WorldStep(writers[:-1], 1)
        results = running.join()
    finally:
        close_world(writers)
    err = results[0]
    assert isinstance(err, RankError), results
    assert f"ranks [{world - 1}]" in str(err)
    assert "not committed" in str(err)
    assert all(isinstance(p, Part) for p in results[1:])
    check_world(mem, world, {0})
    assert steps_of(mem) == [0]
    # the world commits the next step as if nothing happened; gc sweeps the debris
    commit_world(mem, world, 2, "s2")
    Repository(mem).gc()
    check_world(mem, world, {2})
    assert steps_of(mem) == [0, 2]
    assert list(mem.list(PARTS_PREFIX)) == []


@pytest.mark.parametrize("world", [2, 3])
def test_a_rank_that_drops_the_step_fails_it_at_once(world: int) -> None:
    mem = world_run(world)
    writers = open_world(handles(mem, world), session="s", timeout=10)
    try:
        txn = writers[-1].begin(1)
        txn.abort()  # the last rank cannot write its share: its abort vote
        t0 = time.monotonic()
        results = WorldStep(writers[:-1], 1).join()
        waited = time.monotonic() - t0
    finally:
        close_world(writers)
    assert isinstance(results[0], RankError), results
    assert "could not write its share" in str(results[0])
    assert waited < 5  # told at once, not after the 10 s timeout
    check_world(mem, world, {0})


@pytest.mark.parametrize("world", [2, 3])
def test_a_vote_left_by_another_session_is_not_merged(world: int) -> None:
    """A crashed session's vote for the same slot and step (its files gone) must not stand in
    for the live rank's: rank 0 waits for the live vote and merges that one."""
    mem = world_run(world)
    writers = open_world(handles(mem, world), session="live")
    slot = writers[0].base_slot
    mem.write_durable(
        part_key(slot, world - 1),
        dump_part(Part(slot=slot, step=1, rank=world - 1, world=world, session="crashed")),
    )
    results = with_a_late_rank(mem, writers)
    assert isinstance(results[0], CommitHeader), results
    check_world(mem, world, {1})


# -- a power cut at every write of every rank (memory fake) ------------------------------------


class Grid:
    """The power supply of every rank: it goes once, at one rank's k-th write; what survives
    (``snapshot``) is taken at that instant, and afterwards every call of every rank fails.
    Calls of all ranks are serialised (``mu``), so the instant is well defined."""

    def __init__(self, mem: MemoryStorage, torn: random.Random | None) -> None:
        self.mem, self.torn = mem, torn
        self.mu = threading.Lock()
        self.snapshot: MemoryStorage | None = None

    def cut(self, label: str) -> None:
        keep = None if self.torn is None else (lambda _k: self.torn.random() < 0.5)  # type: ignore[union-attr]
        self.snapshot = self.mem.crash(keep)
        raise PowerCut(label)


class RankCut(CutAt):
    """One rank's storage on the ``Grid``: counts its own writes (deletes too) and cuts the
    power of every rank before, or right after, the ``k``-th (0: never); records them as
    ``keys``."""

    def __init__(self, inner: Storage, grid: Grid, k: int = 0, after: bool = False) -> None:
        super().__init__(inner, k, after=after)
        self.grid = grid

    def _live(self, fn: Callable[[], Any]) -> Any:
        with self.grid.mu:
            if self.grid.snapshot is not None:
                raise PowerCut("no power")
            return fn()

    def _op(self, label: str, fn: Callable[[], None]) -> None:
        with self.grid.mu:
            if self.grid.snapshot is not None:
                raise PowerCut("no power")
            self.keys.append(label)
            hit = len(self.keys) == self.k
            if hit and not self.after:
                self.grid.cut(label)
            fn()
            if hit and self.after:
                self.grid.cut(label)

    def read(self, key: str) -> bytes:
        return self._live(lambda: self.inner.read(key))  # type: ignore[no-any-return]

    def read_range(self, key: str, start: int, length: int) -> bytes:
        return self._live(lambda: self.inner.read_range(key, start, length))  # type: ignore[no-any-return]

    def exists(self, key: str) -> bool:
        return self._live(lambda: self.inner.exists(key))  # type: ignore[no-any-return]

    def size(self, key: str) -> int:
        return self._live(lambda: self.inner.size(key))  # type: ignore[no-any-return]

    def list(self, prefix: str) -> Iterator[str]:
        return iter(self._live(lambda: list(self.inner.list(prefix))))

    def barrier(self) -> None:
        self._live(self.inner.barrier)


class SlowBarrier(DelegatingStorage):
    """A rank whose barrier takes a while (a loaded disk, a shared filesystem's sync)."""

    def barrier(self) -> None:
        time.sleep(0.3)
        self.inner.barrier()


def cut_step(
    base: MemoryStorage,
    world: int,
    rank: int,
    k: int,
    after: bool,
    torn: random.Random | None = None,
    slow: bool = False,
) -> tuple[MemoryStorage | None, list[list[str]]]:
    """Open a world on a copy of ``base`` and commit step 1, cutting the power at rank
    ``rank``'s ``k``-th write; returns what survived (None: no cut) and each rank's writes.
    ``slow``: the part writers' barriers are slow."""
    mem = base.crash()  # every write of the base is durable: a full copy
    grid = Grid(mem, torn)
    stores: list[Storage] = [
        RankCut(h, grid, k if r == rank else 0, after) for r, h in enumerate(handles(mem, world))
    ]
    cuts = list(stores)
    if slow:
        stores = [stores[0], *(SlowBarrier(s) for s in stores[1:])]
    try:
        writers = open_world(stores, session="cut", timeout=30)
    except PowerCut:
        writers = []
    if writers:
        results = run_world(writers, 1)
        close_world(writers)
        odd = [x for x in results if not isinstance(x, (CommitHeader, Part, PowerCut))]
        assert not odd, odd  # a rank ends with its share done, or with the power gone
    return grid.snapshot, [c.keys for c in cuts]  # type: ignore[attr-defined]


def check_after_cut(st: MemoryStorage, world: int, committed: bool) -> None:
    """After the cut: the previous head (or, once rank 0's ref was written, the new step)
    whole and exact; the ranks commit again at once; gc then leaves no debris."""
    check_world(st, world, {1} if committed else {0})
    commit_world(st, world, 2, "again")
    check_world(st, world, {2})
    assert steps_of(st) == [0, *([1] if committed else []), 2]
    repo = Repository(st)
    repo.gc()
    check_world(st, world, {2})
    assert list(st.list(PARTS_PREFIX)) == []
    kept = {h.slot for h in repo.reader().lineage()}
    assert {int(name[:12]) for name in st.list(STEPS_PREFIX)} == kept


@pytest.mark.parametrize("durability", ["syncfs", "fsync"])
@pytest.mark.parametrize("world", [2, 3])
def test_power_cut_at_every_write_of_every_rank(world: int, durability: str) -> None:
    base = world_run(world, durability)
    snap, labels = cut_step(base, world, 0, 0, False)
    assert snap is None
    slot = Repository(base).reader().max_slot() + 1
    # each part writer: its step file, its side file, then its vote; rank 0: its own two
    # files, the header, the ref (the commit point), then the merged votes
    for rank in range(1, world):
        assert labels[rank] == [
            step_file_key(slot, tag(rank)),
            side_file_key(slot, tag(rank)),
            part_key(slot, rank),
        ]
    assert labels[0] == [
        step_file_key(slot),
        side_file_key(slot),
        commit_key(slot),
        ref_key("main"),
        f"delete {PARTS_PREFIX}/{slot:012d}",
    ]
    ref_at = labels[0].index(ref_key("main")) + 1
    rng = random.Random(f"{world}-{durability}")
    trials = 0
    for rank in range(world):
        for k in range(1, len(labels[rank]) + 1):
            for after in (False, True):
                for torn in (None, rng):
                    snap, _ = cut_step(base, world, rank, k, after, torn)
                    assert snap is not None, (rank, k, after)
                    committed = rank == 0 and (k > ref_at or (k == ref_at and after))
                    try:
                        check_after_cut(snap, world, committed)
                    except AssertionError as e:
                        raise AssertionError(
                            f"cut {'after' if after else 'before'} rank "
                            f"{rank}'s write {k} ({labels[rank][k - 1]}), "
                            f"torn={torn is not None}: {e}"
                        ) from e
                    trials += 1
    assert trials == 4 * sum(len(x) for x in labels)


@pytest.mark.parametrize("world", [2, 3])
def test_a_rank_votes_only_once_its_own_files_are_durable(world: int) -> None:
    """Every barrier covers only its own rank's files (``"fsync"``), and the part writers'
    barriers are slow: a vote cast before its rank's barrier returned would let rank 0
    commit while that rank's files are still in its page cache. The power goes right after
    rank 0 writes the ref: the new step must be whole."""
    base = world_run(world, "fsync")
    _, labels = cut_step(base, world, 0, 0, False)
    ref_at = labels[0].index(ref_key("main")) + 1
    snap, _ = cut_step(base, world, 0, ref_at, True, slow=True)
    assert snap is not None
    check_after_cut(snap, world, committed=True)


# -- SIGKILL at every write of every rank (real directory) ----------------------------------


class KillServer:
    """``rank_kill_child.py``: forks one process per trial and SIGKILLs it at a write."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(CHILD)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=CHILD.parent,
        )

    def trial(self, run: Path, world: int, rank: int, k: int, after: bool, step: int) -> list[str]:
        assert self.proc.stdin is not None
        assert self.proc.stdout is not None
        self.proc.stdin.write(f"{run} {world} {rank} {k} {int(after)} {step}\n")
        self.proc.stdin.flush()
        lines = []
        while True:
            line = self.proc.stdout.readline()
            assert line, "the kill server died"
            lines.append(line.rstrip("\n"))
            if line.startswith(("killed", "exit")):
                return lines

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(30)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


@pytest.fixture(scope="module")
def kill_server() -> Iterator[KillServer]:
    server = KillServer()
    try:
        yield server
    finally:
        server.close()


@pytest.mark.parametrize("world", [2, 3])
def test_sigkill_at_every_write_of_every_rank(
    tmp_path: Path, world: int, kill_server: KillServer
) -> None:
    base = tmp_path / "base"
    Repository.create(base)
    server = kill_server
    out = server.trial(base, world, 0, 0, False, 0)  # step 0, no kill: the base run
    assert out[-1] == "exit 0", out
    labels = [line.split(" ", 2)[2].split("|") for line in out if line.startswith("ops ")]
    assert len(labels) == world
    assert all(labels)
    probe = tmp_path / "probe"
    shutil.copytree(base, probe)
    out = server.trial(probe, world, 0, 0, False, 1)
    assert out[-1] == "exit 0", out
    labels = [line.split(" ", 2)[2].split("|") for line in out if line.startswith("ops ")]
    ref_at = labels[0].index(ref_key("main")) + 1
    n = 0
    for rank in range(world):
        for k in range(1, len(labels[rank]) + 1):
            for after in (False, True):
                run = tmp_path / f"t{n}"
                n += 1
                shutil.copytree(base, run)
                out = server.trial(run, world, rank, k, after, 1)
                assert out[-1] == "killed", (rank, k, after, out)
                committed = rank == 0 and (k > ref_at or (k == ref_at and after))
                try:
                    check_world(LocalStorage(run), world, {1} if committed else {0})
                    # the ranks continue at once; gc sweeps what the kill left
                    out = server.trial(run, world, 0, 0, False, 2)
                    assert out[-1] == "exit 0", out
                    Repository.open(run).gc()
                    check_world(LocalStorage(run), world, {2})
                    assert steps_of(LocalStorage(run)) == [0, *([1] if committed else []), 2]
                    assert [p for p in run.rglob("*") if ".tmp." in p.name] == []
                    assert list(LocalStorage(run).list(PARTS_PREFIX)) == []
                except AssertionError as e:
                    raise AssertionError(
                        f"killed {'after' if after else 'before'} rank "
                        f"{rank}'s write {k} ({labels[rank][k - 1]}): "
                        f"{e}"
                    ) from e
                shutil.rmtree(run)
    assert n == 2 * sum(len(x) for x in labels) >= 2 * (5 + 3 * (world - 1))
