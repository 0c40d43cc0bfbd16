"""SIGKILL a training process at random steps; the resumed run must match an uninterrupted one.

The child checkpoints every step (``train_child.py``). The parent kills it with SIGKILL right
after it reports step k — wherever the background copy/flush/commit threads happen to be — then
resumes in a fresh process. The losses after the resume, and the final parameters, must be
bit-identical to a run that was never interrupted (and never used dstt at all).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from dstt.errors import NotARunError
from dstt.store import Repository

CHILD = Path(__file__).with_name("train_child.py")
STEPS = 30
SEED = 7


def _env() -> dict[str, str]:
    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ)
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    return env


def _parse(lines: list[str]) -> tuple[int, dict[int, str], str | None]:
    start, losses, final = -1, {}, None
    for line in lines:
        kind, *rest = line.split()
        if kind == "start":
            start = int(rest[0])
        elif kind == "step":
            losses[int(rest[0])] = rest[1]
        elif kind == "final":
            final = rest[0]
    return start, losses, final


def _run(mode: str, run: Path) -> tuple[int, dict[int, str], str | None]:
    out = subprocess.run(
        [sys.executable, str(CHILD), mode, str(run), str(STEPS), str(SEED)],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return _parse(out.stdout.splitlines())


def _committed(run: Path) -> int:
    """The step of the run's head as a reader sees it now (0: none yet)."""
    try:
        head = Repository.open(run).reader().head()
    except (NotARunError, OSError):  # not created yet
        return 0
    return 0 if head is None else head.step


def _run_and_kill(run: Path, kill_at: int) -> tuple[dict[int, str], int]:
    """Kill the child at the first step ``>= kill_at`` it reports once a step of the run is
    committed (under load the child can report step 7 before its first commit lands: a
    kill then would test no resume at all). Returns its losses and the step it was killed
    at."""
    proc = subprocess.Popen(
        [sys.executable, str(CHILD), "fresh", str(run), str(STEPS), str(SEED)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
    )
    lines = []
    killed_at = -1
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            kind, *rest = line.split()
            if kind == "step" and int(rest[0]) >= kill_at and _committed(run) >= 1:
                os.kill(proc.pid, signal.SIGKILL)
                killed_at = int(rest[0])
                break
    finally:
        proc.kill()
        proc.wait(30)
        if proc.stdout:
            proc.stdout.close()
        if proc.stderr:
            proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL, "".join(lines)
    assert killed_at >= kill_at, f"no commit seen before the child ended: {''.join(lines)}"
    return _parse(lines)[1], killed_at


@pytest.fixture(scope="module")
def reference() -> tuple[dict[int, str], str]:
    start, losses, final = _run("plain", Path("/nonexistent"))
    assert start == 0
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert final
    return losses, final


@pytest.mark.parametrize("trial", [0, 1, 2])
def test_sigkill_then_resume_matches_an_uninterrupted_run(
    tmp_path: Path, reference, trial: int
) -> None:
    ref_losses, ref_final = reference
    kill_at = random.Random(1000 + trial).randint(6, STEPS - 4)
    run = tmp_path / "run"
    before, killed_at = _run_and_kill(run, kill_at)
    assert all(before[k] == ref_losses[k] for k in before)  # checkpointing perturbs nothing

    repo = Repository.open(run)
    assert repo.verify().problems == []  # a SIGKILL leaves no damage visible to readers
    head = repo.reader().head()
    assert head is not None  # a commit was seen before the kill: the resume has one to use
    committed = head.step
    assert 1 <= committed <= max(before)

    print(f"killed at step {killed_at}, resuming from committed step {committed}")
    start, after, final = _run("resume", run)
    assert start == committed
    assert sorted(after) == list(range(committed + 1, STEPS + 1))
    assert after == {k: ref_losses[k] for k in after}  # bit-exact, loss by loss
    assert final == ref_final


def test_the_kill_points_do_resume_from_a_checkpoint(tmp_path: Path) -> None:
    """Guard against a vacuous pass: a kill late in training must find committed steps."""
    run = tmp_path / "run"
    _, killed_at = _run_and_kill(run, STEPS - 2)
    head = Repository.open(run).reader().head()
    assert head is not None
    assert 1 <= head.step <= killed_at
