"""Runs the PyTorch-native distributed scenarios once per test session, in spawned gloo ranks.

``rank_results`` starts ``worker.py`` phases as child processes (one per rank, a free port
each time), in order, each over the runs the phase before left:

1. ``train``  — 2 ranks, DDP, FSDP2 and tensor parallel, each its own run;
2. ``single`` — 1 plain process (no process group) reads and resumes those runs (2 → 1);
3. ``grow``   — 2 ranks resume what ``single`` committed (1 → 2);
4. ``train4``/``single4``/``grow4`` — the same for a 2-d mesh (FSDP2 x tensor parallel) on 4
   ranks;
5. ``crash``  — per kind, 2 ranks train until the parent SIGKILLs rank 1 (mid-flush: a step
   is committed every few ms) once steps have committed, then rank 0; ``after`` resumes;
6. ``misuse`` — sessions the ranks disagree on, and a session on rank 0 only.

Each phase writes a JSON report per rank that the tests read, so a failure is reported per
case while the processes are shared.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

WORKER = Path(__file__).with_name("worker.py")
FRAMEWORKS_WORKER = Path(__file__).with_name("frameworks_worker.py")
FRAMEWORK_CASES = (("hf", "ddp", 6), ("pl", "ddp", 8), ("pl", "fsdp2", 8))
ROOT = Path(__file__).resolve().parents[2]
KINDS = ("ddp", "fsdp", "tp")
CRASH_KINDS = ("ddp", "fsdp")
PHASE_TIMEOUT = 240  # s


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(
    worker: Path,
    args: list[str],
    world: int,
    logs: Path,
    tag: str,
    env: dict[str, str] | None = None,
) -> list[subprocess.Popen[bytes]]:
    """``world`` ranks of ``worker args`` on one free port (``world == 0``: one plain process,
    no process group); each rank's output goes to ``logs/<tag>.r<rank>.log``."""
    port = free_port()
    procs = []
    for rank in range(max(world, 1)):
        child = {
            k: v
            for k, v in os.environ.items()
            if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
        }
        child["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
        child.update(env or {})
        if world:
            child.update(
                RANK=str(rank),
                WORLD_SIZE=str(world),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
            )
        with open(logs / f"{tag}.r{rank}.log", "wb") as log:  # the child keeps its fd
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(worker), *args],
                    env=child,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
    return procs


def spawn(
    phase: str, world: int, root: Path, out: Path, kinds: str, tag: str | None = None
) -> list[subprocess.Popen[bytes]]:
    """``world`` ranks of ``worker.py``'s ``phase`` (``world == 0``: one plain process)."""
    env = {"DSTT_TEST_HANG_S": str(PHASE_TIMEOUT), "DSTT_TEST_TAG": tag or phase}
    return launch(WORKER, [phase, str(root), str(out), kinds], world, out, tag or phase, env)


def logs_of(out: Path, tag: str) -> str:
    """Every rank's log of ``tag``, for an assertion message."""
    return "\n".join(f.read_text(errors="replace") for f in sorted(out.glob(f"{tag}.r*.log")))


def wait(procs: list[subprocess.Popen[bytes]], timeout: float = PHASE_TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.wait(max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        for q in procs:
            q.kill()
        raise


def reports(tag: str, world: int, out: Path) -> list[dict[str, Any]]:
    got = []
    for rank in range(max(world, 1)):
        f, log = out / f"{tag}.r{rank}.json", out / f"{tag}.r{rank}.log"
        if not f.exists():
            tail = log.read_text(errors="replace")[-4000:] if log.exists() else ""
            got.append({"ok": False, "error": f"{tag} rank {rank} wrote no report:\n{tail}"})
        else:
            got.append(json.loads(f.read_text()))
    return got


def committed(run: Path) -> int:
    """Steps committed on the run's current timeline (0 while it has none), read as a
    plain reader would, without dstt's process."""
    try:
        out = subprocess.run(
            [
                sys.executable,
                "-c",
                "import sys, dstt; print(len(dstt.open(sys.argv[1]).steps))",
                str(run),
            ],
            capture_output=True,
            text=True,
            timeout=60,
            env={
                **os.environ,
                "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
            },
        )
        return int(out.stdout.strip() or 0)
    except (subprocess.TimeoutExpired, ValueError):
        return 0


def crash(kind: str, root: Path, out: Path) -> dict[str, Any]:
    """Two ranks train ``kind`` with a session; once >= 3 steps have committed, SIGKILL rank 1
    (while its flusher writes: a step every few ms), then rank 0."""
    procs = spawn("crash", 2, root, out, kind, tag=f"crash-{kind}")
    run = root / f"crash-{kind}"
    deadline = time.monotonic() + PHASE_TIMEOUT
    before = 0
    try:
        while time.monotonic() < deadline and all(p.poll() is None for p in procs):
            if run.exists():
                before = committed(run)
                if before >= 3:
                    break
            time.sleep(0.2)
    finally:
        procs[1].send_signal(signal.SIGKILL)
        procs[1].wait()
        time.sleep(0.5)
        procs[0].send_signal(signal.SIGKILL)
        procs[0].wait()
    return {"committed_before_kill": before, "exit": [p.returncode for p in procs]}


@pytest.fixture(scope="session")
def rank_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    base = tmp_path_factory.mktemp("ranks")
    root, out = base / "runs", base / "out"
    root.mkdir()
    out.mkdir()
    kinds = ",".join(KINDS)
    results: dict[str, Any] = {"root": root, "out": out}
    for phase, world, ks, tag in (
        ("train", 2, kinds, "train"),
        ("single", 0, kinds, "single"),
        ("grow", 2, kinds, "grow"),
        ("train", 4, "fsdp_tp", "train4"),
        ("single", 0, "fsdp_tp", "single4"),
        ("grow", 4, "fsdp_tp", "grow4"),
        ("misuse", 2, "ddp", "misuse"),
    ):
        wait(spawn(phase, world, root, out, ks, tag=tag))
        results[tag] = reports(tag, world, out)
    for kind in CRASH_KINDS:
        results[f"crash-{kind}"] = crash(kind, root, out)
        wait(spawn("after", 2, root, out, kind, tag=f"after-{kind}"))
        results[f"after-{kind}"] = reports(f"after-{kind}", 2, out)
    return results


def spawn_framework(
    framework: str, mode: str, strategy: str, steps: int, root: Path, out: Path
) -> tuple[str, list[subprocess.Popen[bytes]]]:
    """Two ranks of ``frameworks_worker.py`` with torchrun's environment (the frameworks make
    their own process group)."""
    tag = f"{framework}-{strategy}-{mode}"
    port = free_port()
    procs = []
    for rank in range(2):
        env = {
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": "2",
            "LOCAL_WORLD_SIZE": "2",
            "GROUP_RANK": "0",
            "TORCHELASTIC_RUN_ID": "dstt",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "DSTT_TEST_TAG": tag,
            "DSTT_TEST_HANG_S": str(PHASE_TIMEOUT),
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        }
        run = root / f"{framework}-{strategy}"
        with open(out / f"{tag}.r{rank}.log", "wb") as log:  # the child keeps its fd
            procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        str(FRAMEWORKS_WORKER),
                        framework,
                        mode,
                        str(run),
                        str(out),
                        str(steps),
                        strategy,
                    ],
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
    return tag, procs


@pytest.fixture(scope="session")
def framework_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Per (framework, strategy): a reference fit without dstt, a fit with the callback
    stopped halfway, and a resumed fit to the end — 2 ranks each."""
    base = tmp_path_factory.mktemp("frameworks")
    root, out = base / "runs", base / "out"
    root.mkdir()
    out.mkdir()
    results: dict[str, Any] = {"root": root}
    for framework, strategy, steps in FRAMEWORK_CASES:
        for mode in ("plain", "fresh", "resume"):
            tag, procs = spawn_framework(framework, mode, strategy, steps, root, out)
            wait(procs)
            results[tag] = reports(tag, 2, out)
    return results
