"""A whole run on the loopback S3 server: training with a checkpoint every step straight to the
bucket, inspection, rollback, bit-exact resume, verify, gc; a SIGKILL mid-upload; a second
writer; two gloo ranks writing one run."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import dstt
from dstt import session
from dstt.cli import main as cli_main
from dstt.errors import RunLockedError
from dstt.store import Repository
from dstt.store.format.layout import ref_key, step_file_key
from dstt.store.storage.s3 import S3Storage

from ._helpers import MLP, mlp_batch, same_bits, train_step
from .conftest import S3Server, _free_port, child_env

ROOT = Path(__file__).resolve().parents[2]


def _train(run: str, n: int, *, resume: bool = False, seed: int = 0) -> tuple[MLP, list[float]]:
    torch.manual_seed(seed)
    m = MLP()
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    losses: list[float] = []
    with session(m, opt, run=run, resume=resume) as s:
        for i in s.data(range(100)):
            losses.append(train_step(m, opt, *mlp_batch(i)))
            s.log(loss=losses[-1])
            if len(losses) == n:
                break
    return m, losses


def test_train_inspect_rollback_resume_verify_gc(
    s3_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    m, _ = _train(s3_url, 6)
    run = dstt.open(s3_url)
    assert list(run.steps) == [1, 2, 3, 4, 5, 6]
    w = run.at(6).tensor("l1.weight").values
    assert np.array_equal(w, m.l1.weight.detach().numpy())
    traj = run.trajectory("l1.weight")
    assert traj.shape[0] == 6
    assert np.array_equal(traj.values[-1], w)
    assert cli_main(["log", s3_url]) == 0
    assert "loss" in capsys.readouterr().out
    assert cli_main(["ls", "--run", s3_url]) == 0
    assert cli_main(["show", s3_url, "--step", "6"]) == 0

    # the uninterrupted continuation of steps 4-6 from step 3, for the bit-exact resume below
    assert cli_main(["rollback", s3_url, "--to", "3"]) == 0
    m2, _ = _train(s3_url, 3, resume=True, seed=123)
    for p, q in zip(m.parameters(), m2.parameters(), strict=True):
        assert same_bits(p, q)
    run = dstt.open(s3_url)
    assert list(run.steps) == [1, 2, 3, 4, 5, 6]
    assert run.timeline == "main-from-3"

    repo = Repository.open(s3_url)
    assert repo.verify().ok
    assert cli_main(["verify", s3_url]) == 0
    assert cli_main(["gc", s3_url, "--keep-last", "2", "--dry-run"]) == 0
    report = repo.gc(keep_last=2)
    assert report.files_removed > 0
    assert report.pruned_steps
    assert [h.step for h in repo.reader().lineage() if not h.pruned][-2:] == [5, 6]
    assert repo.verify().ok


def test_a_second_writer_is_refused(s3_url: str) -> None:
    m = MLP()
    opt = torch.optim.SGD(m.parameters(), lr=1e-2)
    with session(m, opt, run=s3_url) as s:
        for i in s.data(range(2)):
            train_step(m, opt, *mlp_batch(i))
        with pytest.raises(RunLockedError, match="locked by another writer"):
            Repository.create(s3_url).writer()
        with pytest.raises(RunLockedError):
            Repository.open(s3_url).rollback(to_step=1)


LEASE_S = 5.0  # the child's lease (tests.s3.children.kill): long enough for a busy machine


def test_sigkill_mid_upload_leaves_the_previous_commit(s3_url: str, s3_server: S3Server) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "tests.s3.children", "kill", s3_url],
        cwd=ROOT,
        env=child_env(s3_server),
        capture_output=True,
        text=True,
        timeout=60,
    )
    killed = time.monotonic()
    assert proc.returncode == -9, proc.stdout + proc.stderr
    assert "committed 2" in proc.stdout
    assert "uploading" in proc.stdout.split("committed 2")[1]
    st = S3Storage(s3_url, lease_ttl=LEASE_S)
    repo = Repository.open(st)
    with pytest.raises(RunLockedError):  # the dead writer's lease is still live ...
        repo.gc()
    assert st.multipart_uploads(), "the kill left an unfinished multipart upload"
    r = repo.reader()
    assert [h.step for h in r.lineage()] == [1, 2]
    assert np.all(r.read_array(r.head(), "params/w") == 2)
    assert repo.verify().ok
    time.sleep(max(0.0, killed + LEASE_S + 0.2 - time.monotonic()))  # ... until it expires
    repo.gc()
    assert st.multipart_uploads() == ()
    assert repo.verify().ok


def test_two_gloo_ranks_write_one_run(s3_url: str, s3_server: S3Server) -> None:
    port = _free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.s3.children", "rank", str(r), "2", str(port), s3_url],
            cwd=ROOT,
            env=child_env(s3_server),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in (0, 1)
    ]
    outs = [p.communicate(timeout=80)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    repo = Repository.open(s3_url)
    r = repo.reader()
    assert [h.step for h in r.lineage()] == [1, 2, 3]
    for rank in (0, 1):
        got = r.read_array(r.head(), f"zero/r{rank}/flat")
        assert np.array_equal(got, np.arange(1000 + rank, dtype=np.float32) * (rank + 1) + 3)
        assert r.read_object(r.head(), f"rng/r{rank}") == {"seed": rank, "step": 3}
    assert repo.verify().ok
    assert not list(repo.storage.list("_dstt/parts"))


def test_a_writer_whose_lease_was_taken_over_cannot_commit(s3_url: str) -> None:
    def commit(w: object, step: int, value: float) -> None:
        t = w.begin(step)  # type: ignore[attr-defined]
        plan = t.declare("params/w", "float32", (4,))
        t.put_chunk("params/w", 0, np.full(4, value, np.float32).view(np.uint8))
        assert plan.n_chunks == 1
        try:
            t.commit({"loss": value})
        except BaseException:
            t.abort()  # what every caller does: its spool file goes (no leaked file)
            raise

    a = Repository.create(s3_url, lease_ttl=1.0).writer(chunk_bytes=64)
    lease = a.storage._lease
    lease._stop.set()  # a stalled writer: no heartbeat
    lease._thread.join()
    time.sleep(1.2)
    with Repository.open(s3_url, lease_ttl=1.0).writer(chunk_bytes=64) as b:
        commit(b, 1, 2.0)
    with pytest.raises(RunLockedError, match="lost its lease"):
        commit(a, 1, 1.0)
    a.close()
    r = Repository.open(s3_url).reader()
    assert [h.step for h in r.lineage()] == [1]
    assert np.all(r.read_array(r.head(), "params/w") == 2.0)


def test_a_writer_frozen_past_its_lease_cannot_move_the_ref_over_the_new_holders(
    s3_url: str,
) -> None:
    """The lease is checked before each write, but a writer can stall between that check and
    its PUT (a GC pause, SIGSTOP) for longer than the lease. Here it stalls there at its ref
    write — its step's files and header are in the bucket already — and meanwhile another
    writer takes the lease over and commits. When the first one's PUT goes out it must fail
    on the ETag it last saw (``If-Match``), not move the ref over the new holder's commit."""

    def commit(w: object, step: int, value: float) -> None:
        t = w.begin(step)  # type: ignore[attr-defined]
        t.declare("params/w", "float32", (4,))
        t.put_chunk("params/w", 0, np.full(4, value, np.float32).view(np.uint8))
        t.commit({"loss": value})

    a = Repository.create(s3_url, lease_ttl=1.0).writer(chunk_bytes=64)
    commit(a, 1, 1.0)
    st, lease = a.storage, a.storage._lease
    write = st.write

    def stalled(key: str, data: object) -> None:
        if key == ref_key("main") and not lease._stop.is_set():
            st._check_lease()  # the check passes ...
            lease._stop.set()  # ... then the process stalls: no heartbeat, the lease lapses
            lease._thread.join()
            time.sleep(1.2)
            with Repository.open(s3_url, lease_ttl=1.0).writer(chunk_bytes=64) as b:
                commit(b, 2, 2.0)  # another writer takes over and commits
            lease.valid_until = time.monotonic() + 3600  # what the stalled one still trusts
        write(key, data)  # type: ignore[arg-type]

    st.write = stalled  # type: ignore[method-assign]
    with pytest.raises(RunLockedError, match="changed by another writer"):
        commit(a, 2, 9.0)
    lease.valid_until = 0.0
    a.close()
    repo = Repository.open(s3_url)
    r = repo.reader()
    assert [h.step for h in r.lineage()] == [1, 2]
    assert np.all(r.read_array(r.head(), "params/w") == 2.0)  # the new holder's step stands
    assert repo.verify().ok
    assert Repository.open(s3_url).gc().orphan_slots == (1,)  # the stalled step: an orphan


def test_a_writer_frozen_past_its_lease_cannot_overwrite_the_new_holders_step_file(
    s3_url: str,
) -> None:
    """Writer A passes its lease check before its step file's PUT, then stalls past the
    lease; B takes the lease over and commits the same slot. A's PUT must not overwrite B's
    committed step file (create-only: ``If-None-Match: *``)."""

    def commit(w: object, step: int, value: float) -> None:
        t = w.begin(step)  # type: ignore[attr-defined]
        t.declare("params/w", "float32", (4,))
        t.put_chunk("params/w", 0, np.full(4, value, np.float32).view(np.uint8))
        try:
            t.commit({"loss": value})
        except BaseException:
            t.abort()
            raise

    a = Repository.create(s3_url, lease_ttl=1.0).writer(chunk_bytes=64)
    st, lease = a.storage, a.storage._lease
    check = st._check_lease
    slots: list[int] = []

    def stalled() -> None:
        check()  # the check passes ...
        if not lease._stop.is_set():
            lease._stop.set()  # ... then the process stalls: no heartbeat, the lease lapses
            lease._thread.join()
            time.sleep(1.2)
            with Repository.open(s3_url, lease_ttl=1.0).writer(chunk_bytes=64) as b:
                slots.append(b.next_slot)
                commit(b, 1, 2.0)  # another writer takes over and commits the same slot
            lease.valid_until = time.monotonic() + 3600  # what the stalled one still trusts

    st._check_lease = stalled  # type: ignore[method-assign]
    want = a.next_slot
    with pytest.raises(RunLockedError, match="already written by another writer"):
        commit(a, 1, 9.0)
    assert slots == [want]  # B took A's slot: A's PUT went for B's committed file
    lease.valid_until = 0.0
    a.close()
    repo = Repository.open(s3_url)
    r = repo.reader()
    assert [h.step for h in r.lineage()] == [1]
    assert np.all(r.read_array(r.head(), "params/w") == 2.0)  # the new holder's step stands
    assert repo.verify().ok


def test_a_new_writer_numbers_its_slots_past_a_dead_writers_step_files(s3_url: str) -> None:
    """A writer that died after uploading its step file but before its header leaves a step
    file no commit names; the next writer's create-only PUTs must not run into it."""
    repo = Repository.create(s3_url)
    orphan = step_file_key(0)
    repo.storage.write(orphan, b"a dead writer's upload")
    with repo.writer(chunk_bytes=64) as w:
        assert w.next_slot == 1
        t = w.begin(1)
        t.declare("params/w", "float32", (4,))
        t.put_chunk("params/w", 0, np.full(4, 3.0, np.float32).view(np.uint8))
        t.commit({"loss": 3.0})
    r = Repository.open(s3_url).reader()
    assert np.all(r.read_array(r.head(), "params/w") == 3.0)
    assert r.head().slot == 1  # type: ignore[union-attr]
