"""Timeline changes respect a live writer: while a training session (another process, in a
``with dstt.session(...)`` block) holds the run's lock, rollback, switch, rename and delete
are refused with a ``RunLockedError`` naming the holder, in Python and in the CLI; with
``force=True`` (``--force``) they are made, and the session's own commits are kept."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import dstt
from dstt.cli import EXIT_OK, EXIT_RUN, main
from dstt.errors import RunLockedError

ROOT = Path(__file__).resolve().parents[1]

CHILD = """
import sys
import torch
import dstt

torch.manual_seed(0)
m = torch.nn.Linear(4, 4)
opt = torch.optim.SGD(m.parameters(), lr=0.1)
with dstt.session(m, opt, run=sys.argv[1], resume=True) as s:
    m(torch.ones(1, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
    print("ready", flush=True)
    sys.stdin.readline()  # the parent's tests run while this session holds the lock
    m(torch.ones(1, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
print("done", flush=True)
"""


def _train(path: Path, steps: int) -> None:
    torch.manual_seed(0)
    m = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with dstt.session(m, opt, run=path):
        for _ in range(steps):
            m(torch.ones(1, 4)).sum().backward()
            opt.step()
            opt.zero_grad()


@pytest.fixture
def live(tmp_path: Path) -> Iterator[tuple[Path, subprocess.Popen[str]]]:
    """A run with timelines main (steps 1-3, current) and side (from step 1), and a child
    process training on main inside a session, waiting on its stdin."""
    path = tmp_path / "run"
    _train(path, 3)
    run = dstt.open(path)
    run.rollback(1, name="side")
    run.switch("main")
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "ready"
        yield path, child
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        for pipe in (child.stdin, child.stdout):
            if pipe is not None:
                pipe.close()


def _finish(child: subprocess.Popen[str]) -> None:
    assert child.stdin is not None
    assert child.stdout is not None
    child.stdin.write("go\n")
    child.stdin.flush()
    assert child.stdout.readline().strip() == "done"
    assert child.wait(timeout=120) == 0


def test_timeline_changes_under_a_live_writer_are_refused_naming_it(
    live: tuple[Path, subprocess.Popen[str]], capsys: pytest.CaptureFixture[str]
) -> None:
    path, child = live
    run = dstt.open(path)
    before = dict(run.timelines)
    changes = [
        lambda: run.rollback(2),
        lambda: run.switch("side"),
        lambda: run.rename_timeline("side", "other"),
        lambda: run.delete_timeline("side"),
    ]
    for change in changes:
        with pytest.raises(RunLockedError) as e:
            change()
        msg = str(e.value)
        assert f"pid={child.pid}" in msg
        assert f"host={os.uname().nodename}" in msg
        assert "since=" in msg
        assert "force=True" in msg
    for argv in (
        ["rollback", "--to", "2"],
        ["timeline", "switch", "side"],
        ["timeline", "rename", "side", "other"],
        ["timeline", "delete", "side", "--yes"],
    ):
        assert main([*argv, "--run", str(path)]) == EXIT_RUN
        err = capsys.readouterr().err
        assert f"pid={child.pid}" in err
        assert "--force" in err
    assert dict(dstt.open(path).timelines) == before  # nothing moved
    assert dstt.open(path).timeline == "main"
    _finish(child)
    assert dstt.open(path).commits("main")[-1].step == 5  # the session went on: 3 + 2


def test_forced_changes_under_a_live_writer_keep_its_commits(
    live: tuple[Path, subprocess.Popen[str]], capsys: pytest.CaptureFixture[str]
) -> None:
    path, child = live
    run = dstt.open(path)
    assert run.rollback(2, name="forced", skip_samples=[3], force=True) == "forced"
    assert run.timeline == "forced"
    run.rename_timeline("side", "side2", force=True)
    report = run.delete_timeline("side2", force=True)
    assert report.gc is None  # no sweep under a live writer: its files are not orphans
    assert main(["timeline", "switch", "main", "--force", "--run", str(path)]) == EXIT_OK
    capsys.readouterr()
    assert main(["rollback", "--to", "3", "--name", "cli", "--force", "--run", str(path)]) == 0
    _finish(child)
    after = dstt.open(path)
    assert after.timeline == "cli"
    assert sorted(after.timelines) == ["cli", "forced", "main"]
    assert [h.step for h in after.commits("main")] == [1, 2, 3, 4, 5]  # nothing lost
    assert after.skips("forced").samples == {3}
