"""The SIGKILL-then-resume check both framework callbacks share (``pl_child.py`` and
``hf_child.py`` print ``start K``, ``step K <loss hex>`` and ``final <hash>`` lines)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from dstt.store import Repository

HERE = Path(__file__).resolve().parent


def child_env() -> dict[str, str]:
    """The tests' environment for a child: this tree importable, one thread, offline."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(HERE.parents[1]) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    return env


def parse_child(text: str) -> tuple[int, dict[int, float], str | None]:
    """A child's output as (start step, {step: loss}, final state hash)."""
    start, losses, final = -1, {}, None
    for line in text.splitlines():
        kind, *rest = line.split() or [""]
        if kind == "start":
            start = int(rest[0])
        elif kind == "step":
            losses[int(rest[0])] = float.fromhex(rest[1])
        elif kind == "final":
            final = rest[0]
    return start, losses, final


def kill_then_resume(
    child: str, run: Path, args: list[str], kill_at: int, ref_losses: dict[int, float], steps: int
) -> str | None:
    """Train ``child`` fresh into ``run``, SIGKILL it once it printed step ``kill_at``, check
    the run verifies with a head at most ``kill_at``, resume in a new process and check it
    starts there and reproduces ``ref_losses`` up to ``steps``; returns its final hash."""
    cmd = [sys.executable, str(HERE / child)]
    proc = subprocess.Popen(
        [*cmd, "fresh", str(run), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=child_env(),
    )
    lines = []
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        if line.startswith(f"step {kill_at} "):
            os.kill(proc.pid, signal.SIGKILL)
            break
    proc.wait(60)
    proc.stdout.close()
    assert proc.returncode == -signal.SIGKILL, "".join(lines)
    repo = Repository.open(run)
    assert repo.verify().problems == []
    head = repo.reader().head()
    assert head is not None
    assert 1 <= head.step <= kill_at
    done = subprocess.run(
        [*cmd, "resume", str(run), *args],
        capture_output=True,
        text=True,
        env=child_env(),
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    start, after, final = parse_child(done.stdout)
    assert start == head.step
    assert after == {k: ref_losses[k] for k in range(head.step + 1, steps + 1)}
    return final
