"""Several processes on one run: one writer, many readers, gc.

* a second writer (session, ``save``, ``dstt gc``, ``dstt rollback``) is refused while a
  training process holds the run, before it touches anything;
* readers in another process (``dstt.open``, ``at``, ``trajectory``, ``dstt ls``) looping while
  a writer commits see only committed steps, monotonically, every byte as committed — checked
  also at moments the writer is frozen (SIGSTOP) wherever it happens to be;
* gc in another process while a reader holds views: every read returns the committed bytes or
  fails cleanly with ``StepNotFoundError``.
"""

from __future__ import annotations

import hashlib
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

import dstt
from dstt.errors import RunLockedError, StepNotFoundError
from dstt.store import Repository, save
from dstt.store.format.envelope import checksum
from dstt.store.format.layout import key_slot

from ._helpers import (
    assert_params,
    cli,
    env,
    model_and_optimizer,
    params,
    stored_params,
    train,
)
from .soak import child_env

READER = Path(__file__).with_name("reader_child.py")
SOAK = str(Path(__file__).with_name("soak.py"))
TENSOR = "layers.0.qkv.weight"


class Lines:
    """A child process whose stdout lines arrive on a queue (read by a thread)."""

    def __init__(self, cmd: list[str], *, stdin: bool = False, environ: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
            text=True,
            env=environ,
        )
        self.q: queue.Queue[str | None] = queue.Queue()
        self.all: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        with self.proc.stdout:  # closed at the end of the child's output
            for line in self.proc.stdout:
                self.q.put(line.rstrip("\n"))
        self.q.put(None)

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def until(self, pred: Callable[[str], bool], timeout: float = 300) -> str:
        """Consume lines until ``pred(line)``; that line (fails at end of output)."""
        while True:
            line = self.q.get(timeout=timeout)
            if line is None:
                err = self.proc.stderr.read() if self.proc.stderr else ""
                pytest.fail(f"child ended before the expected line: {err[-3000:]}")
            self.all.append(line)
            if pred(line):
                return line

    def finish(self, timeout: float = 300) -> list[str]:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout)
        while (line := self.q.get(timeout=timeout)) is not None:
            self.all.append(line)
        self.close()
        return self.all

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)
        self.close()

    def close(self) -> None:
        """Close stdin and stderr (stdout is the pump thread's: it closes it at the end of the
        child's output)."""
        for f in (self.proc.stdin, self.proc.stderr):
            if f is not None:
                f.close()


@pytest.fixture
def children() -> Iterator[list[Lines]]:
    made: list[Lines] = []
    yield made
    for c in made:
        if c.proc.poll() is None:
            os.kill(c.proc.pid, signal.SIGCONT)
        c.kill()


def writer(run: Path, steps: int, made: list[Lines]) -> Lines:
    """The crash-soak child: trains TinyGPT, a commit every step, announces each commit."""
    w = Lines(
        [sys.executable, SOAK, "child", str(run), str(steps), "3"],
        environ=child_env(),
    )
    made.append(w)
    return w


def reader(mode: str, run: Path, made: list[Lines]) -> Lines:
    r = Lines([sys.executable, str(READER), mode, str(run)], stdin=True, environ=env())
    made.append(r)
    return r


def digest(arrays: dict[str, np.ndarray]) -> str:
    h = hashlib.sha256()
    for _, a in sorted(arrays.items()):
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def truth(run: Path) -> tuple[dict[int, str], dict[int, str]]:
    """Digest of every committed step's parameters, and of ``TENSOR`` alone (row hashes)."""
    steps = [h.step for h in Repository.open(run).reader().lineage() if not h.pruned]
    full, rows = {}, {}
    for s in steps:
        p = stored_params(run, s)
        full[s] = digest(p)
        rows[s] = hashlib.sha256(np.ascontiguousarray(p[TENSOR]).tobytes()).hexdigest()
    return full, rows


@dataclass
class Seen:
    full: dict[int, set[str]] = field(default_factory=dict)
    rows: dict[int, set[str]] = field(default_factory=dict)
    gone: set[int] = field(default_factory=set)
    iters: list[int] = field(default_factory=list)
    ls: list[int] = field(default_factory=list)
    bad: list[str] = field(default_factory=list)


def parse(lines: list[str]) -> Seen:
    out = Seen()
    for line in lines:
        kind, *rest = line.split(" ", 2)
        if kind == "seen":
            out.full.setdefault(int(rest[0]), set()).add(rest[1])
        elif kind == "row":
            out.rows.setdefault(int(rest[0]), set()).add(rest[1])
        elif kind == "gone":
            out.gone.add(int(rest[0]))
        elif kind == "iter":
            out.iters.append(int(rest[0]))
        elif kind == "ls":
            out.ls.append(int(rest[0]))
        elif kind == "bad":
            out.bad.append(line)
    return out


# -- one writer ----------------------------------------------------------------------------------


def test_a_second_writer_is_refused_while_training_runs(
    tmp_path: Path, children: list[Lines]
) -> None:
    run = tmp_path / "run"
    w = writer(run, 400, children)
    w.until(lambda s: s == "committed 2")
    model, opt = model_and_optimizer(seed=9)
    before = params(model)
    with pytest.raises(RunLockedError) as ei:
        dstt.session(model, opt, run=run, resume=True).start()
    assert isinstance(ei.value, BlockingIOError)
    assert f"pid={w.proc.pid}" in str(ei.value)
    assert_params(params(model), before)  # refused before restoring anything
    with pytest.raises(RunLockedError):
        save(run, 10_000, {"params/x": np.zeros(3, np.float32)})
    for args in (["gc", "--keep-last", "1"], ["rollback", "--to", "1"]):
        code, _, err = cli(*args, "--run", str(run))
        assert code == 3, (args, err)
        # gc: "locked by another writer"; rollback names the holder ("locked by a live writer")
        assert "locked by another writer" in err or "locked by a live writer" in err, (args, err)
    assert w.proc.poll() is None  # the training process was not disturbed
    w.until(lambda s: s.startswith("committed"))  # and keeps committing
    w.kill()  # the kernel releases the lock with the process
    assert Repository.open(run).verify().ok
    head = Repository.open(run).reader().head()
    assert head is not None
    assert head.step >= 2
    _, losses = train(run, 400, resume=True, until=head.step + 2)
    assert len(losses) == 2  # a new writer takes over
    assert Repository.open(run).reader().head().step == head.step + 2  # type: ignore[union-attr]


# -- readers while a writer commits --------------------------------------------------------------


def test_readers_in_another_process_see_only_committed_steps(
    tmp_path: Path, children: list[Lines]
) -> None:
    run = tmp_path / "run"
    steps = 28
    w = writer(run, steps, children)
    w.until(lambda s: s == "committed 2")
    r = reader("follow", run, children)
    frozen = []
    # freeze the writer wherever it is, several times: a reader pass made entirely while it
    # is frozen must see exactly the steps whose ref is written, however far the next commit
    # had got
    for target in (5, 10, 16):
        w.until(f"committed {target}".__eq__)
        os.kill(w.proc.pid, signal.SIGSTOP)
        wait_stopped(w.proc.pid)
        head = Repository.open(run).reader().head()
        assert head is not None
        r.send("sync")
        r.until(lambda s: s == "sync")  # this pass began after the freeze
        n = int(r.until(lambda s: s.startswith("iter")).split()[1])
        frozen.append((head.step, n))
        os.kill(w.proc.pid, signal.SIGCONT)
    w.until(lambda s: s.startswith("final"))
    w.finish()
    assert w.proc.returncode == 0
    seen = parse(r.finish())
    assert seen.bad == []
    assert all(head == n and head >= t for (head, n), t in zip(frozen, (5, 10, 16), strict=True)), (
        frozen
    )
    assert seen.iters == sorted(seen.iters)
    assert seen.iters[-1] == steps  # monotone, complete
    assert seen.ls
    assert seen.ls == sorted(seen.ls)
    full, rows = truth(run)
    assert sorted(full) == list(range(1, steps + 1))
    assert len(seen.full) >= 3
    assert len(seen.rows) >= 3  # it really read while training ran
    for s, hashes in seen.full.items():
        assert hashes == {full[s]}, s  # every step it saw reads back exactly as committed
    for s, hashes in seen.rows.items():
        assert hashes == {rows[s]}, s


def wait_stopped(pid: int) -> None:
    """Until every thread of ``pid`` is stopped (SIGSTOP is delivered asynchronously)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        states = []
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/stat") as f:
                states.append(f.read().rsplit(")", 1)[1].split()[0])
        if all(st in ("T", "t") for st in states):
            return
        time.sleep(0.001)
    pytest.fail(f"process {pid} did not stop")


# -- gc while readers read -----------------------------------------------------------------------


def test_gc_from_another_process_never_hands_a_reader_wrong_bytes(
    tmp_path: Path, children: list[Lines]
) -> None:
    run = tmp_path / "run"
    train(run, 16)
    full, rows = truth(run)
    r = reader("random", run, children)
    r.until(lambda s: s.startswith("iter"))
    for keep in ("8", "3", "1"):
        r.until(lambda s: s.startswith("iter"))  # the reader is mid-loop
        code, _, err = cli("gc", "--run", str(run), "--keep-last", keep)
        assert code == 0, err
    r.until(lambda s: s.startswith("iter"))
    seen = parse(r.finish())
    assert seen.bad == []
    kept = {h.step for h in Repository.open(run).reader().lineage() if not h.pruned}
    assert kept == {16}
    for s, hashes in seen.full.items():
        assert hashes == {full[s]}, s
    for s, hashes in seen.rows.items():
        assert hashes == {rows[s]}, s
    assert seen.gone <= set(full) - kept  # only pruned steps are ever refused
    print(
        f"reads: {sum(map(len, seen.full.values()))} snapshots, "
        f"{sum(map(len, seen.rows.values()))} trajectory rows, {len(seen.gone)} refused"
    )
    assert Repository.open(run).verify().ok


def test_views_held_across_gc_fail_cleanly(tmp_path: Path) -> None:
    """Deterministic: a snapshot, a trajectory and a chunk being read are held while gc runs
    in another process; afterwards the pruned ones raise ``StepNotFoundError``, the kept ones
    read exactly as before, and a file a reader had open stays readable (POSIX unlink)."""
    run = tmp_path / "run"
    after, _ = train(run, 8)
    view = dstt.open(run)
    old = view.at(2)
    head = view.at(8)
    traj = view.trajectory(TENSOR)  # lazy: nothing read yet
    h2 = Repository.open(run).reader().find(2)
    chunk = Repository.open(run).reader().arrays(h2)[f"params/{TENSOR.replace('.', '/')}"].chunks[0]
    assert key_slot(chunk.key) == h2.slot  # in step 2's own step file
    f = open(run / chunk.key, "rb")  # noqa: SIM115 - held across gc on purpose
    try:
        code, doc, err = cli("gc", "--run", str(run), "--keep-last", "2")
        assert code == 0, err
        assert doc["pruned"], err
        assert not (run / chunk.key).exists()  # the whole step file is gone
        f.seek(chunk.offset)
        data = f.read(chunk.nbytes)  # the open file still reads whole
        assert len(data) == chunk.nbytes
        assert checksum(data[:-4]) == chunk.crc32c
    finally:
        f.close()
    with pytest.raises(StepNotFoundError, match="pruned"):
        old.to_numpy(TENSOR)
    with pytest.raises(StepNotFoundError, match="pruned"):
        traj.values  # noqa: B018
    assert_params({n: head.to_numpy(n) for n in head.names()}, after[8])
    fresh = view.refresh()
    assert fresh.steps == [7, 8]
    np.testing.assert_array_equal(
        fresh.trajectory(TENSOR).values, np.stack([after[7][TENSOR], after[8][TENSOR]])
    )
