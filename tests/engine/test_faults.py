"""Background I/O errors surface on the training thread as typed errors; no torn commits."""

from __future__ import annotations

import errno
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from dstt.engine.capture.pipeline import Pipeline
from dstt.errors import CaptureError, StorageError
from dstt.store import Repository
from dstt.store.storage.memory import FaultyStorage, MemoryStorage
from dstt.training import session

from ._helpers import MLP, committed_steps, mlp_batch, same_bits, stored, train_step


def _faulty_run(**faults: object) -> tuple[Repository, FaultyStorage, Repository]:
    inner = MemoryStorage()
    Repository.create(inner)
    faulty = FaultyStorage(inner, errno=errno.ENOSPC, **faults)  # type: ignore[arg-type]
    return Repository(faulty), faulty, Repository(inner)


@pytest.mark.filterwarnings("ignore:dstt. step .* was not checkpointed")  # later steps, at exit
def test_disk_full_raises_capture_error_chained_to_storage_error() -> None:
    repo, faulty, plain = _faulty_run()
    m = MLP()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    after: dict[int, torch.Tensor] = {}
    with pytest.raises(CaptureError) as info, session(m, opt, run=repo) as s:
        for i in range(40):
            if i == 4:
                faulty.fail_after_writes = faulty.writes  # the disk is full from now on
            train_step(m, opt, *mlp_batch(i))
            after[s.step] = m.l1.weight.detach().clone()
    err = info.value
    assert isinstance(err.__cause__, StorageError)
    assert err.__cause__.errno == errno.ENOSPC
    assert "could not be checkpointed" in str(err)
    assert "Free disk space" in str(err)  # the cause is the disk: the hint says so
    assert s.step < 40  # raised on the training thread, at a step, not at exit
    steps = committed_steps(plain)
    assert steps == list(range(1, len(steps) + 1))
    assert len(steps) <= 4
    for step in steps:  # what is committed is whole and correct
        assert same_bits(stored(plain, step, "params/l1/weight"), after[step])
    assert plain.verify().problems == []


@pytest.mark.parametrize(
    ("fault", "hint"),
    [
        (OSError(errno.EIO, "Input/output error"), "Fix the storage problem"),
        (ValueError("a provider returned nonsense"), "Fix the cause named above"),
    ],
)
def test_a_capture_failure_names_its_cause_not_the_disk(fault: BaseException, hint: str) -> None:
    from dstt.engine.capture.flight import Flight
    from dstt.training.checks import capture_error

    f = Flight.__new__(Flight)
    f.step, f.error = 7, fault
    err = capture_error([f])
    assert str(fault) in str(err)
    assert hint in str(err)
    assert err.__cause__ is fault
    assert "disk space" not in str(err)


def test_skip_policy_warns_drops_failed_steps_and_recovers() -> None:
    repo, faulty, plain = _faulty_run()
    m = MLP()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    after: dict[int, torch.Tensor] = {}
    with (
        pytest.warns(RuntimeWarning, match="not checkpointed"),
        session(m, opt, run=repo, error_policy="skip") as s,
    ):
        for i in range(12):
            if i == 3:
                faulty.fail_after_writes = faulty.writes
            if i == 7:
                s.wait()  # let the failing steps finish before the disk "recovers"
                faulty.heal()
            train_step(m, opt, *mlp_batch(i))
            after[s.step] = m.l1.weight.detach().clone()
    assert s.step == 12  # training never stopped
    steps = committed_steps(plain)
    assert steps[-1] == 12
    assert len(steps) < 12  # later steps commit again; failed ones are gone
    assert sorted(steps) == steps
    for step in steps:
        assert same_bits(stored(plain, step, "params/l1/weight"), after[step])
    failed = [x for x in s.metrics if not x.committed]
    assert failed
    assert all("ENOSPC" in (x.error or "") or "No space" in (x.error or "") for x in failed)
    assert plain.verify().problems == []


def test_a_failure_on_the_first_step_surfaces_at_exit_if_training_ends() -> None:
    repo, _, plain = _faulty_run(fail_keys=r"^steps/\d+\.zip$")  # every step file fails
    m = MLP()
    opt = torch.optim.SGD(m.parameters(), lr=1e-2)
    with pytest.raises(CaptureError), session(m, opt, run=repo):
        train_step(m, opt, *mlp_batch(0))  # the only step: its error can only surface at exit
    assert committed_steps(plain) == []


@pytest.mark.parametrize("remote", [True, False], ids=["commits-there", "commits-here"])
def test_flat_steps_are_committed_by_the_flusher_process(
    tmp_path: Path, remote: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The commit's Python runs in the flusher child, off this process (none of it here,
    once the child is ready: the first step's may commit here while it starts);
    ``DSTT_FLUSHER_COMMIT=0`` keeps it in the committer thread. The same steps either way."""
    from dstt.store.commit import writer as writer_mod

    here: list[int] = []
    real = writer_mod.run_commit

    def counted(storage: object, zf: object, side: object, job: object) -> object:
        here.append(job.step)  # type: ignore[attr-defined]
        return real(storage, zf, side, job)  # type: ignore[arg-type]

    monkeypatch.setattr(writer_mod, "run_commit", counted)
    monkeypatch.setenv("DSTT_FLUSHER_COMMIT", "1" if remote else "0")
    m = MLP()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    after: dict[int, torch.Tensor] = {}
    with session(m, opt, run=tmp_path / "run", every=1) as s:
        for i in range(6):
            train_step(m, opt, *mlp_batch(i))
            after[s.step] = m.l1.weight.detach().clone()
            if i == 0:
                s.wait()  # step 1 copied: the flusher is started
                pipe = s._pipeline
                assert pipe is not None
                assert pipe.sink.flusher is not None
                assert pipe.sink.flusher.wait_ready(120)
        assert not pipe.sink.flusher.dead
    assert (set(here) <= {1}) if remote else (here == list(range(1, 7)))
    repo = Repository.open(tmp_path / "run")
    assert committed_steps(repo) == list(range(1, 7))
    for step, w in after.items():
        assert same_bits(stored(repo, step, "params/l1/weight"), w), step
    assert repo.verify().problems == []


def test_a_killed_flusher_process_loses_no_step(tmp_path: Path) -> None:
    """SIGKILL the flusher child mid-run: the writes it had in flight are done again from
    the engine's threads (their ranges are still the steps' own), later steps are written
    from threads, and every step is committed bit-exactly."""
    m = MLP()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    after: dict[int, torch.Tensor] = {}
    with (
        pytest.warns(RuntimeWarning, match="flusher process died"),
        session(m, opt, run=tmp_path / "run", every=1) as s,
    ):
        for i in range(12):
            train_step(m, opt, *mlp_batch(i))
            after[s.step] = m.l1.weight.detach().clone()
            if i == 5:
                pipe = s._pipeline
                assert pipe is not None
                assert pipe.sink.flusher is not None  # the child is used
                assert pipe.sink.flusher.wait_ready(120)
                os.kill(pipe.sink.flusher.proc.pid, signal.SIGKILL)
    repo = Repository.open(tmp_path / "run")
    assert committed_steps(repo) == list(range(1, 13))
    for step, w in after.items():
        assert same_bits(stored(repo, step, "params/l1/weight"), w), step
    assert repo.verify().problems == []


class _FullDiskHandle:
    """A real step handle whose write finds a full disk. The committer stores a sealed
    step's objects while its write runs: here it comes just after the write failed, while the
    abort lingers, so it meets an aborted handle if the flight learns why only later."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.step, self.commit = inner.step, inner.commit

    def put_object(self, name: str, obj: object) -> None:
        if name == "late":  # the committer, once sealed: let the write fail first
            time.sleep(0.2)
        self._inner.put_object(name, obj)

    @property
    def stats(self) -> Any:
        return self._inner.stats

    def write(self, segment: Any) -> None:
        raise StorageError(errno.ENOSPC, "No space left on device")

    def abort(self) -> None:
        self._inner.abort()
        time.sleep(0.5)  # the committer's turn


def test_a_failed_write_keeps_its_cause_not_the_aborted_handle(tmp_path: Path) -> None:
    """A step whose write failed reports the disk, never "step N is aborted" (the skip
    policy's warning once named the aborted handle, racing the committer)."""
    writer = Repository.create(tmp_path / "run").writer()
    pipe = Pipeline(writer, budget_bytes=1 << 20, writers=1, flusher=False)
    begin = pipe.sink.begin
    pipe.sink.begin = lambda *a, **k: _FullDiskHandle(begin(*a, **k))  # type: ignore[method-assign]
    try:
        f = pipe.stage(1, {"params/w": torch.ones(64)}, {})
        pipe.wait_copied(f)
        pipe.seal(f, {"late": {"n": 1}})  # stored by the committer while the write runs
        f.done.wait()
        assert isinstance(f.error, StorageError), repr(f.error)
        assert f.error.errno == errno.ENOSPC
        assert not f.committed
    finally:
        pipe.close()
        writer.close()
