"""Disk full and I/O errors while training: a clear error (``error_policy="raise"``) or a
skipped step with a warning (``"skip"``), no committed step damaged, and the run recovers when
space returns.

Three sources of failure, all on real files: ``FaultyStorage`` over a ``LocalStorage`` (errors
at chosen writes: EIO, a ref that cannot be written), a real ``RLIMIT_FSIZE`` in a child
process (the kernel refuses writes past a file size: ``EFBIG``), and a real 3 MiB tmpfs that
fills up (``ENOSPC``). tests/engine/test_faults.py covers ENOSPC from ``FaultyStorage`` over
``MemoryStorage``.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import dstt
from dstt.errors import CaptureError, ReadOnlyRunError, StorageError
from dstt.store import LocalStorage, Repository
from dstt.store.storage.memory import FaultyStorage
from dstt.testing.models import SyntheticBatches
from dstt.training.options import DEFAULT_BUDGET

from ._helpers import (
    assert_params,
    env,
    model_and_optimizer,
    params,
    stored_params,
    train,
)

CHILD = Path(__file__).with_name("fsize_child.py")


def committed(run: Path | Repository) -> list[int]:
    repo = run if isinstance(run, Repository) else Repository.open(run)
    return [h.step for h in repo.reader().lineage() if not h.pruned]


def check_intact(run: Path, after: dict[int, dict[str, np.ndarray]]) -> list[int]:
    """verify passes and every committed step holds exactly the parameters of that step."""
    rep = Repository.open(run).verify()
    assert rep.ok, rep.problems
    steps = committed(run)
    assert steps == sorted(steps)
    for s in steps:
        assert_params(stored_params(run, s), after[s])
    return steps


# -- FaultyStorage over a real directory --------------------------------------------------------


@pytest.mark.filterwarnings("ignore:dstt. step .* was not checkpointed")  # dropped at exit
def test_io_error_raises_then_resume_recovers(tmp_path: Path) -> None:
    run = tmp_path / "run"
    ref_after, ref_losses = train(tmp_path / "reference", 12)
    faulty = FaultyStorage(LocalStorage(run, create=True), errno=errno.EIO)
    model, opt = model_and_optimizer()
    after: dict[int, dict[str, np.ndarray]] = {}
    with (
        pytest.raises(CaptureError) as ei,
        dstt.session(model, opt, run=faulty, budget_bytes=1 << 14) as s,
    ):
        for x, y in s.data(SyntheticBatches(12)):
            if s.step == 4:
                while not {1, 2} <= set(done := {m.step: m.committed for m in s.metrics}):
                    time.sleep(0.001)  # commits are asynchronous: let the first two land
                assert done[1]
                assert done[2]
                faulty.fail_keys = re.compile(r"^steps/\d{12}\.zip$")  # step files fail
            _, loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            after[s.step] = params(model)
    assert isinstance(ei.value.__cause__, StorageError)
    assert ei.value.__cause__.errno == errno.EIO
    assert "Input/output error" in str(ei.value)
    assert s.step < 12  # raised while training, at an optimizer step
    steps = check_intact(run, after)
    assert steps[:2] == [1, 2]
    assert steps[-1] <= 4
    # the device works again: resume continues from the head, bit-exactly
    _, losses = train(run, 12, resume=True)
    assert losses == ref_losses[steps[-1] :]
    assert committed(run) == list(range(1, 13))
    assert_params(stored_params(run, 12), ref_after[12])


def test_unwritable_ref_skips_steps_then_commits_resume(tmp_path: Path) -> None:
    """A commit that fails at its very last write (the ref) leaves an orphan, not a head."""
    run = tmp_path / "run"
    faulty = FaultyStorage(LocalStorage(run, create=True), errno=errno.ENOSPC)
    model, opt = model_and_optimizer()
    after: dict[int, dict[str, np.ndarray]] = {}
    with (
        pytest.warns(RuntimeWarning, match="not checkpointed") as record,
        dstt.session(model, opt, run=faulty, error_policy="skip") as s,
    ):
        for i, (x, y) in enumerate(s.data(SyntheticBatches(14))):
            if i == 3:
                faulty.fail_keys = re.compile(r"_dstt/refs/")
            if i == 9:
                while not any(not m.committed for m in s.metrics):
                    time.sleep(0.001)  # commits are asynchronous: let one fail first
                faulty.heal()
            _, loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            after[s.step] = params(model)
    assert s.step == 14
    assert any("No space left" in str(w.message) for w in record)
    steps = check_intact(run, after)
    assert steps[-1] == 14
    assert len(steps) < 14  # failed ones are gone
    repo = Repository.open(run)
    r = repo.reader()
    orphans = set(r.all_slots()) - {h.slot for h in r.lineage()}
    assert orphans  # complete commits that never became the head
    report = repo.gc()
    assert set(report.orphan_slots) == orphans
    assert repo.verify().ok


# -- a real file-size limit: RLIMIT_FSIZE -------------------------------------------------------


def fsize_child(run: Path, policy: str) -> dict[str, list[str]]:
    out = subprocess.run(
        [sys.executable, str(CHILD), str(run), policy, "1024"],
        capture_output=True,
        text=True,
        env=env(),
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines: dict[str, list[str]] = {}
    for line in out.stdout.splitlines():
        kind, _, rest = line.partition(" ")
        lines.setdefault(kind, []).append(rest)
    return lines


def digest(arrays: dict[str, np.ndarray]) -> str:
    h = hashlib.sha256()
    for _, a in sorted(arrays.items()):
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def check_digests(run: Path, lines: dict[str, list[str]]) -> list[int]:
    rep = Repository.open(run).verify()
    assert rep.ok, rep.problems
    want = dict(x.split() for x in lines["params"])
    steps = committed(run)
    for s in steps:
        assert digest(stored_params(run, s)) == want[str(s)], s
    return steps


@pytest.mark.filterwarnings("ignore:dstt. step .* was not checkpointed")
def test_real_file_size_limit_raises_efbig_then_resume_recovers(tmp_path: Path) -> None:
    run = tmp_path / "run"
    lines = fsize_child(run, "raise")
    kind, cause, err, step = lines["raised"][0].split()
    assert (kind, cause, int(err)) == ("CaptureError", "StorageError", errno.EFBIG)
    steps = check_digests(run, lines)
    assert steps[:2] == [1, 2]
    assert steps == list(range(1, steps[-1] + 1))
    assert steps[-1] < int(step)  # raised at a later step, while training
    # space returns (no limit in this process): the run resumes and commits again
    ref_after, ref_losses = train(tmp_path / "reference", 16)
    _, losses = train(run, 16, resume=True)
    assert losses == ref_losses[steps[-1] :]
    assert committed(run) == list(range(1, 17))
    assert_params(stored_params(run, 16), ref_after[16])
    assert Repository.open(run).verify().ok


def test_real_file_size_limit_skips_steps_until_it_is_lifted(tmp_path: Path) -> None:
    run = tmp_path / "run"
    lines = fsize_child(run, "skip")
    assert "raised" not in lines
    assert int(lines["warned"][0]) >= 1
    assert lines["lifted"][0] != "None"
    lifted, done = int(lines["lifted"][0]), int(lines["done"][0])
    steps = check_digests(run, lines)
    assert set(range(lifted + 1, done + 1)) <= set(steps)  # after it was lifted
    assert set(range(3, lifted)) - set(steps)  # steps under the limit were skipped


# -- a real full filesystem: a small tmpfs ------------------------------------------------------


@contextlib.contextmanager
def small_fs(where: Path, size: str) -> Iterator[Path]:
    where.mkdir()
    res = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
        capture_output=True,
        text=True,
    )
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({res.stderr.strip()}); needs root")
    try:
        yield where
    finally:
        if subprocess.run(["umount", str(where)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(where)], capture_output=True)


def remount(where: Path, size: str) -> None:
    subprocess.run(["mount", "-o", f"remount,size={size}", str(where)], check=True)


def test_full_filesystem_raises_enospc_then_recovers_when_space_returns(tmp_path: Path) -> None:
    with small_fs(tmp_path / "fs", "3m") as fs:
        run = fs / "run"
        ref_after, ref_losses = train(tmp_path / "reference", 20)
        after: dict[int, dict[str, np.ndarray]] = {}
        model, opt = model_and_optimizer()
        with pytest.raises(CaptureError) as ei, warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the in-flight steps dropped at exit
            with dstt.session(model, opt, run=run, budget_bytes=1 << 14) as s:
                for x, y in s.data(SyntheticBatches(20)):
                    _, loss = model(x, y)
                    loss.backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                    after[s.step] = params(model)
        cause = ei.value.__cause__
        assert isinstance(cause, StorageError)
        assert cause.errno == errno.ENOSPC
        assert "No space left on device" in str(ei.value)
        assert str(run) in str(ei.value)
        assert s.step < 20
        steps = check_intact(run, after)
        assert steps == list(range(1, steps[-1] + 1))
        assert steps[-1] >= 1
        # still full: a new session fails at its start, clearly, and not as "read-only"
        filler = fs / "filler"
        with contextlib.suppress(OSError), open(filler, "wb") as f:
            while True:
                f.write(b"\0" * 4096)
        with pytest.raises(StorageError) as ei2:
            train(run, 20, resume=True)
        assert ei2.value.errno == errno.ENOSPC
        assert not isinstance(ei2.value, ReadOnlyRunError)
        assert check_intact(run, after) == steps
        filler.unlink()
        # space returns: the run resumes bit-exactly and commits every further step
        remount(fs, "64m")
        _, losses = train(run, 20, resume=True)
        assert losses == ref_losses[steps[-1] :]
        assert committed(run) == list(range(1, 21))
        assert_params(stored_params(run, 20), ref_after[20])
        repo = Repository.open(run)
        repo.gc()  # the debris of the failed steps
        assert repo.verify().ok
        assert not [p for p in run.rglob("*") if ".tmp." in p.name]


def test_full_filesystem_skip_policy_warns_and_commits_again(tmp_path: Path) -> None:
    with small_fs(tmp_path / "fs", "6m") as fs:
        run = fs / "run"
        filler = fs / "filler"
        filler.write_bytes(b"\0" * (4 << 20))  # 2 MiB left
        model, opt = model_and_optimizer()
        after: dict[int, dict[str, np.ndarray]] = {}
        freed_at = None
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with dstt.session(model, opt, run=run, budget_bytes=1 << 14, error_policy="skip") as s:
                for x, y in s.data(SyntheticBatches(60)):
                    skipped = [w for w in caught if "not checkpointed" in str(w.message)]
                    if skipped and freed_at is None:
                        freed_at = s.step + 2
                    if freed_at is not None and s.step == freed_at:
                        filler.unlink()  # space returns
                        remount(fs, "64m")
                    if freed_at is not None and s.step >= freed_at + 4:
                        break
                    _, loss = model(x, y)
                    loss.backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                    after[s.step] = params(model)
        assert freed_at is not None, "the filesystem never filled up"
        assert all("No space left" in str(w.message) for w in skipped)
        steps = check_intact(run, after)
        assert s.step == freed_at + 4  # training never stopped
        assert set(range(freed_at + 1, s.step + 1)) <= set(steps)  # commits resumed
        assert len(steps) < s.step  # the steps that met a full disk are not in the run
        assert os.statvfs(fs).f_bfree > 0


# -- the defaults (flat lane + flusher process) on a nearly full tmpfs --------------------------


def step_bytes(run: Path) -> int:
    """The disk one committed step takes (its two files and header, in 4 KiB pages)."""
    pages = 0
    for p in [*(run / "steps").glob("000000000001.*"), run / "_dstt/commits/000000000001.json"]:
        pages += -(-p.stat().st_size // 4096)
    return pages * 4096


def leave_room(fs: Path, nbytes: int) -> Path:
    """Fill ``fs`` up to ``nbytes`` free bytes; returns the filler."""
    filler = fs / "filler"
    st = os.statvfs(fs)
    filler.write_bytes(b"\0" * max(0, st.f_bavail * st.f_frsize - nbytes))
    return filler


def default_session(
    run: Path, steps: int, policy: str, at_step: Callable[[Any, int], bool]
) -> tuple[dict[int, dict[str, np.ndarray]], int, BaseException | None, list[str]]:
    """Train TinyGPT under ``dstt.session`` with its defaults (the flat lane and the flusher
    process); ``at_step(session, step)`` runs at the top of every iteration. Returns the
    parameters after each step, the last step taken, the error raised and the warnings."""
    torch.set_num_threads(1)
    model, opt = model_and_optimizer()
    after: dict[int, dict[str, np.ndarray]] = {}
    raised: BaseException | None = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with dstt.session(model, opt, run=run, error_policy=policy) as s:  # type: ignore[arg-type]
                for x, y in s.data(SyntheticBatches(steps)):
                    if s.step == 3:  # the defaults: flat steps, written by the flusher
                        assert s._pipeline is not None
                        assert s._pipeline.sink.flusher is not None
                    if at_step(s, s.step):
                        break
                    _, loss = model(x, y)
                    loss.backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                    after[s.step] = params(model)
        except CaptureError as e:
            raised = e
    return after, s.step, raised, [str(w.message) for w in caught]


def wait_committed(s: Any, steps: set[int]) -> None:
    while not steps <= {m.step for m in s.metrics if m.committed}:
        time.sleep(0.001)  # commits are asynchronous


def test_defaults_room_for_two_steps_commit_the_two_oldest_then_resume(tmp_path: Path) -> None:
    """(a) room for 2 steps: the 2 oldest commit, later ones fail; (d) the committed steps
    are intact, and once space returns the run resumes bit-exactly."""
    with small_fs(tmp_path / "fs", "8m") as fs:
        run = fs / "run"
        room: dict[str, Path] = {}

        def at_step(s: Any, step: int) -> bool:
            if step == 3:  # steps 1 and 2 are on disk (3: unsealed): room for 2.5 more
                wait_committed(s, {1, 2})
                room["filler"] = leave_room(fs, step_bytes(run) * 5 // 2)
            return False

        after, last, raised, caught = default_session(run, 12, "skip", at_step)
        assert raised is None
        assert last == 12  # training never stopped
        skipped = [m for m in caught if "not checkpointed" in m]
        assert skipped
        other = [m for m in skipped if "No space left" not in m and "no room" not in m]
        assert not other  # every skipped step names the full disk
        assert check_intact(run, after) == [1, 2, 3, 4]  # the two that fit: the oldest
        assert not [p for p in run.rglob("*") if ".tmp." in p.name]  # no debris left
        # space returns: the run resumes from step 4 and commits every further step
        room["filler"].unlink()
        ref_after, ref_losses = train(tmp_path / "reference", 12)
        _, losses = train(run, 12, resume=True, budget_bytes=DEFAULT_BUDGET)
        assert losses == ref_losses[4:]
        assert committed(run) == list(range(1, 13))
        assert_params(stored_params(run, 12), ref_after[12])
        assert Repository.open(run).verify().ok


def test_defaults_a_stalled_older_write_keeps_its_room(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Step 4's write stalls (its thread descheduled, as under load) while step 5 is
    staged: step 5 must not take the room step 4 was due, so the oldest still commit. The
    flusher child is not started yet (its first second): two writer threads write here."""
    from dstt.store.storage import posix

    monkeypatch.setenv("DSTT_FLUSHER_START_S", "1000")
    pwrite_all = posix.pwrite_all
    step_5_written = threading.Event()

    def stall_step_4(fd: int, views: Any, offset: int) -> None:
        slot = os.readlink(f"/proc/self/fd/{fd}").rsplit("/", 1)[-1][:12]  # step - 1
        if slot == "000000000003":  # until step 5 wrote, or a second (written in order)
            step_5_written.wait(1.0)
        pwrite_all(fd, views, offset)
        if slot == "000000000004":
            step_5_written.set()

    monkeypatch.setattr(posix, "pwrite_all", stall_step_4)
    with small_fs(tmp_path / "fs", "8m") as fs:
        run = fs / "run"

        def at_step(s: Any, step: int) -> bool:
            if step == 3:
                wait_committed(s, {1, 2})
                leave_room(fs, step_bytes(run) * 5 // 2)
            return False

        after, last, raised, _ = default_session(run, 8, "skip", at_step)
        assert raised is None
        assert last == 8
        assert check_intact(run, after) == [1, 2, 3, 4]


def test_defaults_skip_commits_again_once_there_is_room_for_one(tmp_path: Path) -> None:
    """(b) ``"skip"``: steps fail while the disk is full; once room for one step returns,
    the next steps commit again."""
    with small_fs(tmp_path / "fs", "8m") as fs:
        run = fs / "run"
        seen: dict[str, Any] = {}

        def at_step(s: Any, step: int) -> bool:
            if step == 3:
                wait_committed(s, {1, 2})
                seen["size"] = step_bytes(run)
                seen["filler"] = leave_room(fs, seen["size"] // 2)  # no room for a step
            failed = [m.step for m in s.metrics if not m.committed]
            if failed and "freed" not in seen:
                # room for one step (and a quarter) returns
                filler: Path = seen["filler"]
                st = os.statvfs(fs)
                gone = seen["size"] * 5 // 4 - st.f_bavail * st.f_frsize
                os.truncate(filler, filler.stat().st_size - gone)
                seen["freed"], seen["failed"] = step, failed[0]
            return "freed" in seen and step >= seen["freed"] + 6

        after, last, raised, caught = default_session(run, 40, "skip", at_step)
        assert raised is None
        freed = seen["freed"]
        assert last == freed + 6
        steps = check_intact(run, after)
        # room for one: one step after the failure commits, then the disk is full again
        assert len(steps) == 3, steps
        assert steps[:2] == [1, 2]
        assert steps[2] > seen["failed"]
        assert any(f"step {steps[2] + 1} was not checkpointed" in m for m in caught)


def test_defaults_raise_arrives_at_the_next_step(tmp_path: Path) -> None:
    """(c) ``"raise"``: the typed error arrives at the next optimizer step after the first
    failed write (here step 5's: steps 3 and 4 fit and commit first)."""
    with small_fs(tmp_path / "fs", "8m") as fs:
        run = fs / "run"
        seen: dict[str, int] = {}

        def at_step(s: Any, step: int) -> bool:
            if step == 3:
                wait_committed(s, {1, 2})
                leave_room(fs, step_bytes(run) * 5 // 2)
            if step >= 4 and "failed" not in seen:
                # wait for each staged step to settle: the first failure is then seen
                # before the next optimizer step, which must raise
                while step - 1 not in {m.step for m in s.metrics}:  # (``step``: unsealed)
                    time.sleep(0.001)
                failed = [m.step for m in s.metrics if not m.committed]
                if failed:
                    seen["failed"], seen["at"] = failed[0], step
            return False

        after, last, raised, _ = default_session(run, 20, "raise", at_step)
        assert isinstance(raised, CaptureError)
        cause = raised.__cause__
        assert isinstance(cause, StorageError)
        assert cause.errno == errno.ENOSPC
        assert seen["failed"] == 5
        assert f"step {seen['failed']} could not be checkpointed" in str(raised)
        assert last == seen["at"]  # raised at the very next optimizer step
        assert check_intact(run, after) == [1, 2, 3, 4]
