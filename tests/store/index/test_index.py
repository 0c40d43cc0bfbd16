"""The run's index (dstt/store/index/writer.py): gc keeps the scalars of pruned steps, a cut at any
write leaves the index agreeing with the commits (or ignored), damage falls back to headers
and ``reindex`` (``dstt index``) rebuilds, and a trajectory reads only its tensor's bytes."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import dstt
from dstt.store import LocalStorage, Reader, Repository, Storage
from dstt.store.format.layout import INDEX_PREFIX
from dstt.store.index.repair import check
from dstt.store.index.view import GC_MARKER
from dstt.store.storage.memory import DelegatingStorage, MemoryStorage

from ..commit.test_crash import every_cut

N = 40


def _summaries(step: int) -> dict[str, Any]:
    return {
        f"params/l{j}/w": {
            "l2": float(step + j),
            "rms": 1.0,
            "maxabs": 2.0,
            "nan": 0,
            "inf": 0,
            "update_l2": 0.1,
            "update_ratio": 0.01 * (1 + j),
            "probe": [float(step), float(j)],
            "update_exact": False,
        }
        for j in range(3)
    }


def _commit(w: Any, step: int, loss: float) -> None:
    txn = w.begin(step)
    for j in range(3):
        a = np.full((8, 4), step + j, np.float32)
        txn.declare(f"params/l{j}/w", "float32", a.shape)
        txn.put_chunk(f"params/l{j}/w", 0, a.reshape(-1).view(np.uint8))
    txn.put_object("summaries", _summaries(step))
    txn.commit({"loss": loss, "phase": "warm" if step < 5 else "main"})


def _loss(step: int) -> float:
    return 10.0 if step == 23 else 1.0 + 0.001 * (step % 3)  # a spike at 23


def _run(st: Storage, steps: range = range(N), every: int = 8) -> Repository:
    repo = Repository.create(st)
    with repo.writer(index_every=every) as w:
        for s in steps:
            _commit(w, s, _loss(s))
    return repo


def test_metrics_and_summaries_of_pruned_steps_survive_gc() -> None:
    st = MemoryStorage()
    repo = _run(st)
    before_m = dstt.open(repo).metrics()
    before_s = dstt.open(repo).summaries()
    repo.gc(keep_last=5, keep_every=10)
    run = dstt.open(repo)
    assert run.steps == [0, 10, 20, 30, *range(35, N)]
    m = run.metrics()
    assert m["step"].values.tolist() == list(range(N))  # the loss curve has no holes
    assert np.array_equal(m["loss"].values, before_m["loss"].values)
    assert m["phase"].values.tolist() == before_m["phase"].values.tolist()
    assert m["pruned"].values.tolist() == [s not in run.steps for s in range(N)]
    s = run.summaries()
    assert s["step"].values.tolist() == list(range(N))
    for f in ("l2", "update_ratio", "probe"):
        assert np.array_equal(s[f].values, before_s[f].values, equal_nan=True), f
    assert s["pruned"].values.sum() == N - len(run.steps)


def test_a_nan_metric_does_not_fail_the_index_check() -> None:
    """A row equals its header by bytes: NaN (a diverged loss) is not unequal to itself."""
    repo = Repository.create(MemoryStorage())
    with repo.writer(index_every=2) as w:
        for s in range(4):
            _commit(w, s, float("nan") if s % 2 else 1.0)
    assert list(repo.storage.list(INDEX_PREFIX))
    assert check(repo.reader()) == []
    assert repo.verify().ok


def test_spikes_finds_a_spike_inside_a_pruned_range() -> None:
    st = MemoryStorage()
    repo = _run(st)
    repo.gc(keep_last=5, keep_every=10)
    run = dstt.open(repo)
    assert 23 not in run.steps
    (sp,) = run.spikes("loss", window=10, z=5.0)
    assert sp.step == 23
    assert sp.cause == 30  # the committed interval that holds 22 -> 23
    assert sp.tensors  # ranked from the cause commit's summaries


def _agree(st: MemoryStorage) -> None:
    repo = Repository(st)
    r = repo.reader()
    assert check(Repository(st).reader()) == []
    rep = repo.verify()
    assert rep.ok, rep.problems
    raw = Repository(st).reader()
    raw.index.enabled = False
    raw.index.load()
    for tl in r.timelines:
        got = [(h.slot, h.step, h.pruned, dict(h.metrics)) for h in r.lineage(tl)]
        want = [(h.slot, h.step, h.pruned, dict(h.metrics)) for h in raw.lineage(tl)]
        assert got == want


def test_index_agrees_with_the_commits_after_a_cut_at_every_write_of_a_commit() -> None:
    base = MemoryStorage()
    _run(base, range(7), every=100)  # a tail of 7 rows: the next commit writes a segment

    def op(st: Storage) -> None:
        with Repository(st).writer(index_every=8) as w:
            _commit(w, 7, 1.0)

    def check_cut(st: MemoryStorage, done: bool) -> None:
        _agree(st)
        with Repository(st).writer(index_every=8) as w:  # a new writer indexes the tail
            head = w.reader.head()
            _commit(w, (head.step if head else -1) + 1, 1.0)
        _agree(st)

    keys = every_cut(base, op, check_cut)
    assert any(k.startswith(INDEX_PREFIX) for k in keys)


def test_index_agrees_with_the_commits_after_a_cut_at_every_write_of_gc() -> None:
    base = MemoryStorage()
    _run(base, range(12), every=4)

    def check_cut(st: MemoryStorage, done: bool) -> None:
        _agree(st)
        m = dstt.open(Repository(st)).metrics()
        assert m["step"].values.tolist() == list(range(12))  # no scalar lost at any cut
        Repository(st).gc(keep_last=3)
        _agree(st)
        assert not st.exists(GC_MARKER)
        s = dstt.open(Repository(st)).summaries()
        assert s["step"].values.tolist() == list(range(12))

    keys = every_cut(base, lambda st: Repository(st).gc(keep_last=3), check_cut)
    assert keys[0] == GC_MARKER


@pytest.mark.parametrize("damage", ["delete", "flip", "flip-blobs"])
def test_damaged_index_falls_back_to_headers_and_reindex_rebuilds(damage: str) -> None:
    st = MemoryStorage()
    repo = _run(st)
    want = dstt.open(repo).metrics()
    segs = [f"{INDEX_PREFIX}/{n}" for n in st.list(INDEX_PREFIX)]
    assert segs
    for k in segs:
        if damage == "delete":
            st.delete(k)
        else:  # the directory too, or only the blobs after the core columns
            data = bytearray(st.read(k))
            for at in (len(data) // 2, len(data) - 3, *([40] if damage == "flip" else [])):
                data[at] ^= 0xFF
            st.data[k] = st.durable[k] = bytes(data)
    run = dstt.open(repo)
    assert run.steps == list(range(N))
    assert np.array_equal(run.metrics()["loss"].values, want["loss"].values)
    assert run.at(17).to_numpy("l1.w")[0, 0] == 18
    assert run.trajectory("l1.w").values[:, 0, 0].tolist() == [s + 1 for s in range(N)]
    assert run.summaries()["step"].values.tolist() == list(range(N))
    assert repo.verify().ok == (damage == "delete")
    assert repo.reindex() == N
    assert repo.verify().ok
    assert len(Repository(st).reader().index.load().rows) == N


class Counting(DelegatingStorage):
    def __init__(self, inner: Storage) -> None:
        super().__init__(inner)
        self.bytes = 0

    def read(self, key: str) -> bytes:
        data = super().read(key)
        self.bytes += len(data)
        return data

    def read_range(self, key: str, start: int, length: int) -> bytes:
        data = super().read_range(key, start, length)
        self.bytes += len(data)
        return data


def test_trajectory_reads_only_that_tensors_bytes() -> None:
    mem = MemoryStorage()
    repo = Repository.create(mem)
    with repo.writer(index_every=16) as w:
        for s in range(64):
            txn = w.begin(s)
            for j in range(40):
                a = np.full((64, 16), s + j, np.float32)  # 4 KiB each
                txn.declare(f"params/l{j}/w", "float32", a.shape)
                txn.put_chunk(f"params/l{j}/w", 0, a.reshape(-1).view(np.uint8))
            txn.commit({"loss": 1.0})
    st = Counting(mem)
    run = dstt.open(Repository(st))
    assert len(run.steps) == 64
    st.bytes = 0
    values = run.trajectory("l3.w").values
    assert values[:, 0, 0].tolist() == [s + 3 for s in range(64)]
    amplification = st.bytes / values.nbytes
    assert amplification <= 1.1, amplification


def test_trajectory_from_the_index_is_exact_and_checked() -> None:
    """Multi-chunk tensors (edge chunk), indexed rows and the tail alike; a flipped byte in
    one step's chunk is a ChecksumError, not a wrong value."""
    from dstt.errors import ChecksumError
    from dstt.store.format.layout import step_file_key

    mem = MemoryStorage()
    repo = Repository.create(mem)
    want = []
    with repo.writer(index_every=8, chunk_bytes=64) as w:  # 5 rows of 12 B: 5 chunks, 1 edge
        for s in range(19):  # 16 indexed, a tail of 3 (fewer than half a segment)
            a = np.arange(25 * 3, dtype=np.float32).reshape(25, 3) + s
            want.append(a)
            txn = w.begin(s)
            plan = txn.declare("params/w", "float32", a.shape)
            flat = a.reshape(-1).view(np.uint8)
            for i in range(plan.n_chunks):
                lo, hi = plan.byte_range(i)
                txn.put_chunk("params/w", i, flat[lo:hi])
            txn.commit()
    run = dstt.open(repo)
    assert len(Repository(mem).reader().index.load().rows) == 16
    got = run.trajectory("w").values
    assert np.array_equal(got, np.stack(want))
    assert np.array_equal(run.trajectory("w")[3:7, 2:4].values, np.stack(want)[3:7, 2:4])
    key = step_file_key(run.commits()[5].slot)
    rec = run.reader.record(run.commits()[5], "params/w")
    data = bytearray(mem.read(key))
    data[rec.chunks[1].offset + 2] ^= 0xFF
    mem.data[key] = bytes(data)
    with pytest.raises(ChecksumError):
        print(dstt.open(repo).trajectory("w").values)


def test_index_agrees_with_the_commits_after_sigkill_at_every_write_of_a_commit(
    tmp_path: Path,
) -> None:
    """A real process, killed (SIGKILL) just before each write of a commit that also writes an
    index segment: the index agrees with the headers (verify compares every row), the run
    reads the same with and without it, and the next writer indexes the tail."""
    import shutil
    import subprocess
    import sys

    child = Path(__file__).with_name("index_kill_child.py")
    base = tmp_path / "base"
    with Repository.create(base).writer(index_every=100) as w:  # a tail of 3, no index
        for s in range(3):
            _commit(w, s, 1.0)

    def run_child(path: Path, k: int) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, str(child), str(path), str(k)],
            capture_output=True,
            text=True,
            timeout=60,
        )

    probe = tmp_path / "probe"
    shutil.copytree(base, probe)
    done = run_child(probe, 0)
    assert done.returncode == 0, done.stderr[-2000:]
    writes = int(done.stdout)
    assert writes >= 5  # step file, side file, header, ref, index segment
    assert list((probe / INDEX_PREFIX).glob("*.idx"))
    for k in range(1, writes + 1):
        path = tmp_path / f"cut{k}"
        shutil.copytree(base, path)
        got = run_child(path, k)
        assert got.returncode == -signal.SIGKILL, (k, got.stderr[-2000:])
        st = LocalStorage(path)
        rep = Repository(st).verify()
        assert rep.ok, (k, rep.problems)
        line = [(h.slot, h.step) for h in Repository(st).reader().lineage()]
        raw = Reader(st, use_index=False)
        assert line == [(h.slot, h.step) for h in raw.lineage()]
        assert dstt.open(path).metrics()["step"].values.tolist() == [s for _, s in line]
        with Repository(st).writer(index_every=4) as w:
            _commit(w, line[-1][1] + 1, 1.0)
        assert Repository(st).verify().ok


def test_located_records_equal_the_arrays_tables() -> None:
    """What the index says of a tensor is what the step's arrays table says (dims included),
    for every row, after merges."""
    mem = MemoryStorage()
    repo = Repository.create(mem)
    with repo.writer(index_every=2) as w:  # 8 segments of 2 rows merge into one
        for s in range(16):
            txn = w.begin(s)
            a = np.full((4, 3), s, np.float32)
            txn.declare("params/w", "float32", a.shape, dims=("out", "in"))
            txn.put_chunk("params/w", 0, a.reshape(-1).view(np.uint8))
            txn.commit()
    r = Repository(mem).reader()
    assert len(r.index.load().rows) == 16
    assert len(r.index.segments) < 8
    for h in r.lineage():
        got = r.index.located(h.slot, "params/w")
        assert got is not None
        assert got == r.arrays(h)["params/w"]
        assert got.dims == ("out", "in")


def test_a_writer_does_not_write_rows_an_index_rewrite_made_newer() -> None:
    """Rows a writer still holds pending, once the index was rewritten with those slots (gc
    running under the writer marks some pruned), are not written again over the new rows."""
    from dstt.store.index.repair import rebuild

    mem = MemoryStorage()
    repo = Repository.create(mem)
    with repo.writer(index_every=100) as w:
        for s in range(6):
            _commit(w, s, 1.0)
        rebuild(w.reader)  # what gc's rewrite does, under the writer's lock
        assert w.index is not None
        assert len(w.index.pending) == 6
        before = sorted(mem.list(INDEX_PREFIX))
        w.index.flush()
        assert sorted(mem.list(INDEX_PREFIX)) == before
        assert not w.index.pending
    assert check(Repository(mem).reader()) == []


def test_a_local_run_writes_segments_from_background_jobs(tmp_path: Path) -> None:
    """On local files the committer hands the rows to a job process (index/job.py): the
    segments it writes hold exactly the committed rows, merges included."""
    from dstt.store.index.writer import IndexWriter

    jobs: list[Any] = []
    real_start = IndexWriter._start_job

    def spy(self: IndexWriter) -> None:
        real_start(self)
        jobs.append(self.job)

    st = LocalStorage(tmp_path / "run", create=True)
    IndexWriter._start_job = spy  # type: ignore[method-assign]
    try:
        repo = _run(st, range(N), every=4)  # 10 segments' worth: jobs and a merge
    finally:
        IndexWriter._start_job = real_start  # type: ignore[method-assign]
    assert jobs, [j.error for j in jobs if j]
    assert all(j is not None and j.ok for j in jobs), [j.error for j in jobs if j]
    r = repo.reader()
    index = r.index.load()
    slots = sorted(h.slot for h in r.lineage())
    # every commit but a tail of fewer than ``every``: the close leaves those to the next
    # writer (no seconds of Python at the end of a session)
    assert set(index.rows) <= set(slots)
    assert len(set(slots) - set(index.rows)) < 4
    assert len(jobs) >= 2  # the commits' jobs, and the close's
    assert not check(r)  # and the rows agree with the headers
    assert len(index.segments) < N // 4  # the job merged
    got = dstt.open(tmp_path / "run").metrics()["loss"].values
    np.testing.assert_array_equal(got, [_loss(s) for s in range(N)])


def test_a_failed_index_job_leaves_the_rows_to_the_writer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import subprocess
    import sys

    from dstt.store.index.job import IndexJob

    def failing(location: str, slots: list[int], every: int) -> IndexJob:
        return IndexJob(
            subprocess.Popen(
                [sys.executable, "-c", "import sys; sys.exit(3)"], stderr=subprocess.PIPE
            )
        )

    monkeypatch.setattr(IndexJob, "start", staticmethod(failing))
    st = LocalStorage(tmp_path / "run", create=True)
    repo = _run(st, range(20), every=4)
    r = repo.reader()
    rows = r.index.load().rows
    slots = sorted(h.slot for h in r.lineage())
    # the failed job's rows (the first four) were written here; only a tail of fewer than
    # CLOSE_MIN commits is left to the headers, as after any session
    assert set(slots[:4]) <= set(rows)
    assert len(set(slots) - set(rows)) < 8
    assert not check(r)


def test_background_jobs_are_rate_limited_but_the_tail_stays_bounded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job is an interpreter start: a fast loop starts one at its first segment's worth,
    then at most one per ``JOB_INTERVAL_S`` — unless ``JOB_MAX_TAIL`` segments' worth are
    pending — and the close indexes what is left; every commit ends up with a row."""
    from dstt.store.index import writer as index_mod
    from dstt.store.index.writer import IndexWriter

    def count_jobs(max_tail: int) -> tuple[int, Reader]:
        starts: list[int] = []
        real_start = IndexWriter._start_job

        def spy(self: IndexWriter) -> None:
            starts.append(len(self.pending))
            real_start(self)
            self.wait()  # done before the next commit: only the rate limit holds jobs back

        monkeypatch.setattr(IndexWriter, "_start_job", spy)
        monkeypatch.setattr(index_mod, "JOB_MAX_TAIL", max_tail)
        st = LocalStorage(tmp_path / f"run{max_tail}", create=True)
        repo = _run(st, range(N), every=4)
        monkeypatch.setattr(IndexWriter, "_start_job", real_start)
        assert starts[0] == 4  # the first segment's worth goes at once
        return len(starts), repo.reader()

    few, r = count_jobs(max_tail=1000)  # N commits in well under JOB_INTERVAL_S
    assert few == 2  # the first, and the close's
    assert set(r.index.load().rows) == {h.slot for h in r.lineage()}
    more, r = count_jobs(max_tail=2)  # a job whenever 8 rows are pending
    assert more >= N // 8
    assert set(r.index.load().rows) == {h.slot for h in r.lineage()}


def test_a_view_opened_before_gc_merged_the_index_still_finds_light_steps(
    tmp_path: Path,
) -> None:
    """A view holds the index segments it loaded; a gc elsewhere merges them into a new
    generation and deletes them. The view's search of header bytes (light steps, batches)
    must then answer from the headers, not fail on the vanished segment, and a step the gc
    pruned is refused as pruned (the CI race of test_gc_from_another_process_…)."""
    from dstt.engine.capture.light import LIGHT_OBJECT
    from dstt.errors import StepNotFoundError

    path = tmp_path / "run"
    repo = Repository.create(path)
    with repo.writer() as w:
        for step in (*range(1, 7), 8):
            txn = w.begin(step)
            txn.declare("params/w", "float32", (2,))
            txn.put_chunk("params/w", 0, np.full(2, step, np.float32).view(np.uint8))
            if step == 8:
                txn.put_object(LIGHT_OBJECT, {"steps": [7], "loss": [None]})
            txn.commit({"loss": float(step)})
    repo.reindex()
    held = dstt.open(path)
    loaded = {s.key for s in held.reader.index.ensure().segments}
    assert loaded
    Repository.open(path).gc(keep_last=1)
    assert not any((path / k).exists() for k in loaded)  # merged away under the view
    assert held.reader.index.slots_mentioning(b'"light/steps"')  # a superset, no error
    assert sorted(held.light_steps()) == [7]
    with pytest.raises(StepNotFoundError, match="pruned"):
        held.at(2)
    assert sorted(dstt.open(path).light_steps()) == [7]
