"""A step's commit run elsewhere (the flusher process) and, where that process dies at any
point of it, finished here: the same committed step, byte for byte (``commit/job.py``)."""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dstt.errors import StorageError
from dstt.store import Repository
from dstt.store.commit.job import CommitJob, NotHandedOff, run_commit
from dstt.store.flusher.parent import Flusher, flusher_supported
from dstt.store.format.layout import side_file_key, step_file_key
from dstt.store.format.records import CommitHeader
from dstt.store.format.stepfile import SideFile, StepFile, StepState
from dstt.store.storage.base import Blob, Data
from dstt.store.storage.local import LocalStorage
from dstt.store.storage.memory import DelegatingStorage

from .._util import same_bits

ARRAYS = [
    ("params/a/w", "float32", (6, 5)),
    ("params/a/b", "float32", (5,)),
    ("optim/a/m", "float16", (3, 3)),
    ("params/n", "int64", ()),
]


def _values(step: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(step)
    return {p: (rng.standard_normal(shape) * 10).astype(dt) for p, dt, shape in ARRAYS}


def _commit_step(repo: Repository, committer: Any, step: int) -> CommitHeader:
    """One flat step (``put_flat``) with objects written before and at the commit."""
    w = repo.writer()
    w.committer = committer
    try:
        layout = w.flat_layout(ARRAYS)
        buf = bytearray(max(layout.nbytes, 1))
        for a in layout.arrays:
            buf[a.offset : a.offset + a.nbytes] = _values(step)[a.path].tobytes()
        txn = w.begin(step)
        txn.put_flat(layout, buf)
        txn.put_object("early", {"written": "before the commit"})
        txn.defer_object("rng", {"seed": step, "words": list(range(40))})
        txn.defer_object("opaque", {1, 2, step}, or_pickle=True)  # a set: JSON cannot
        return txn.commit(metrics={"loss": 0.5})
    finally:
        w.close()


def _files(run: Path, slot: int) -> tuple[bytes, bytes]:
    return (
        (run / step_file_key(slot, "")).read_bytes(),
        (run / side_file_key(slot, "")).read_bytes(),
    )


def _check(run: Path, header: CommitHeader, step: int) -> None:
    repo = Repository.open(run)
    r = repo.reader()
    assert r.head() is not None
    assert r.head().slot == header.slot
    for path, want in _values(step).items():
        assert same_bits(r.read_array(header, path), want), path
    assert r.read_object(header, "rng") == {"seed": step, "words": list(range(40))}
    assert r.read_object(header, "opaque", trusted=True) == {1, 2, step}
    assert header.objects["opaque"].encoding == "pickle"
    assert r.read_object(header, "early") == {"written": "before the commit"}
    assert repo.verify().problems == []
    assert not [f for _, _, fs in os.walk(run) for f in fs if ".tmp." in f]


class _Cut(Exception):
    pass


class _CuttingStorage(DelegatingStorage):
    """Counts the writes of a commit (storage calls and blob writes) and raises at the
    ``at``-th: the process running the commit dies there."""

    def __init__(self, inner: LocalStorage, at: int) -> None:
        super().__init__(inner)
        self.local, self.at, self.n = inner, at, 0

    def tick(self) -> None:
        self.n += 1
        if self.n == self.at:
            raise _Cut(self.n)

    def write(self, key: str, data: Data) -> None:
        self.tick()
        super().write(key, data)

    def write_durable(self, key: str, data: Data) -> None:
        self.tick()
        super().write_durable(key, data)

    def barrier(self) -> None:
        self.tick()
        super().barrier()

    def evict(self, keys: Sequence[str]) -> None:
        self.tick()
        self.local.evict(keys)

    def adopt_blob(self, key: str, tmp: str) -> Blob:
        return _CuttingBlob(self, self.local.adopt_blob(key, tmp))


class _CuttingBlob(Blob):
    def __init__(self, st: _CuttingStorage, inner: Blob) -> None:
        self.st, self.inner, self.key = st, inner, inner.key

    def write_at(self, offset: int, data: Data, *, raw: bool = False) -> None:
        self.st.tick()
        self.inner.write_at(offset, data, raw=raw)

    def publish(self, *, durable: bool = False) -> None:
        self.st.tick()
        self.inner.publish(durable=durable)

    def discard(self) -> None:
        self.inner.discard()


class _DyingCommitter:
    """Runs a job as the flusher's commit thread does (its own storage, the files adopted),
    dying at the ``at``-th write (0: never)."""

    def __init__(self, at: int = 0) -> None:
        self.dead, self.at, self.writes = False, at, 0

    def commit(
        self,
        root: str,
        durability: str,
        zip_state: StepState,
        side_state: StepState,
        job: CommitJob,
    ) -> CommitHeader:
        st = _CuttingStorage(LocalStorage(root, durability=durability), self.at)  # type: ignore[arg-type]
        try:
            return run_commit(
                st, StepFile.adopt(st, zip_state), SideFile.adopt(st, side_state), job
            )
        except _Cut:
            self.dead = True
            raise StorageError(errno.EPIPE, "the flusher process died") from None
        finally:
            self.writes = st.n


def test_a_commit_run_elsewhere_writes_what_one_run_here_writes(tmp_path: Path) -> None:
    here = _commit_step(Repository.create(tmp_path / "here"), None, 3)
    remote = _DyingCommitter()
    there = _commit_step(Repository.create(tmp_path / "there"), remote, 3)
    assert remote.writes > 5  # the commit's writes did happen over there
    assert _files(tmp_path / "here", here.slot) == _files(tmp_path / "there", there.slot)
    _check(tmp_path / "there", there, 3)


def test_a_committer_dying_anywhere_in_a_commit_leaves_it_to_finish_here(tmp_path: Path) -> None:
    """Cut the commit at each of its writes in turn: every time the writer finishes it
    itself, and the step is the one a commit that never failed writes."""
    want = _files(
        tmp_path / "clean", _commit_step(Repository.create(tmp_path / "clean"), None, 4).slot
    )
    full = _DyingCommitter()
    _commit_step(Repository.create(tmp_path / "count"), full, 4)
    assert full.writes >= 8
    for at in range(1, full.writes + 1):
        run = tmp_path / f"cut{at}"
        c = _DyingCommitter(at)
        header = _commit_step(Repository.create(run), c, 4)
        assert c.dead, at
        assert _files(run, header.slot) == want, at
        _check(run, header, 4)


def test_a_job_that_cannot_travel_is_committed_here(tmp_path: Path) -> None:
    class Refuses:
        dead = False
        calls = 0

        def commit(self, *a: Any) -> CommitHeader:
            Refuses.calls += 1
            raise NotHandedOff("cannot pickle")

    header = _commit_step(Repository.create(tmp_path / "run"), Refuses(), 2)
    assert Refuses.calls == 1
    _check(tmp_path / "run", header, 2)


def test_a_commit_that_fails_over_there_fails_the_step(tmp_path: Path) -> None:
    """A failure of the disk (the process lives on) is the step's failure, as here."""

    class Full:
        dead = False

        def commit(self, *a: Any) -> CommitHeader:
            raise StorageError(errno.ENOSPC, "no space left on device")

    repo = Repository.create(tmp_path / "run")
    with pytest.raises(StorageError, match="no space"):
        _commit_step(repo, Full(), 2)
    assert Repository.open(tmp_path / "run").reader().head() is None


@pytest.mark.skipif(not flusher_supported(), reason="the flusher needs Linux memfd")
def test_the_flusher_process_commits_a_step(tmp_path: Path) -> None:
    fl = Flusher(1 << 16, 2)
    try:
        header = _commit_step(Repository.create(tmp_path / "run"), fl, 5)
        assert not fl.dead
    finally:
        fl.close()
    here = _commit_step(Repository.create(tmp_path / "here"), None, 5)
    assert _files(tmp_path / "run", header.slot) == _files(tmp_path / "here", here.slot)
    _check(tmp_path / "run", header, 5)


@pytest.mark.skipif(not flusher_supported(), reason="the flusher needs Linux memfd")
def test_the_flusher_forgets_old_constants_and_keeps_committing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each commit here sends three new constants (a fresh writer's table template, document
    block, consolidated metadata): past ``_SENT_KEPT`` the parent tells the child to forget
    them all and sends what the next request names again."""
    from dstt.store.flusher import parent as flusher_mod

    monkeypatch.setattr(flusher_mod, "_SENT_KEPT", 4)
    fl = Flusher(1 << 16, 2)
    try:
        repo = Repository.create(tmp_path / "run")
        headers = [_commit_step(repo, fl, step) for step in range(1, 6)]
        assert not fl.dead
        assert len(fl._sent) <= 4
    finally:
        fl.close()
    r = Repository.open(tmp_path / "run").reader()
    for h in headers:
        for path, want in _values(h.step).items():
            assert same_bits(r.read_array(h, path), want), (h.step, path)
    assert [h.step for h in r.lineage()] == [1, 2, 3, 4, 5]
    assert Repository.open(tmp_path / "run").verify().problems == []


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


@pytest.mark.skipif(not flusher_supported(), reason="the flusher needs Linux memfd")
def test_a_killed_trainer_leaves_no_flusher_behind_to_commit_what_it_handed_over(
    tmp_path: Path,
) -> None:
    """The trainer dies with a commit request in its (stopped) flusher's pipe. Once the
    flusher may run again, it must not serve it: a resumed run would race it for the ref.
    (Before the flusher died with its parent, it committed the step after the trainer's
    death, then exited at the pipe's end.)"""
    import signal
    import subprocess
    import sys
    import time

    run = tmp_path / "run"
    env = dict(os.environ)
    env["PYTHONPATH"] = (
        str(Path(__file__).resolve().parents[3]) + os.pathsep + env.get("PYTHONPATH", "")
    )
    proc = subprocess.Popen(
        [sys.executable, str(Path(__file__).with_name("orphan_child.py")), str(run)],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    pid, lines = 0, []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("flusher "):
                pid = int(line.split()[1])
            elif line == "sent\n":
                break
        assert pid, lines
        assert lines[-1] == "sent\n", lines
    finally:
        proc.kill()
        proc.wait(30)
        if proc.stdout:
            proc.stdout.close()
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGCONT)
    deadline = time.monotonic() + 30
    while not _gone(pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _gone(pid), "the flusher outlived the trainer"
    assert Repository.open(run).reader().head() is None
    assert Repository.open(run).verify().problems == []
