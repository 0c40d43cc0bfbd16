"""Runs the DeepSpeed scenarios once per test session, in spawned gloo ranks on the CPU.

``ds_results`` starts ``ds_worker.py`` phases as child processes (one per rank, a free port
each time): ``train`` (two ranks, killed with SIGKILL once every stage has trained), ``resume``
(two ranks) and ``world1`` (one rank). Each writes a JSON report per rank that the tests read,
so a failure is reported per case while the processes (and DeepSpeed's start-up cost) are
shared. The first ``init_distributed`` on a fresh machine JIT-compiles DeepSpeed's shm comm op
with g++ (~1-2 min, cached in ``~/.cache/torch_extensions``). Shared-memory files DeepSpeed
leaves in /dev/shm for our ports are removed at teardown.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

if importlib.util.find_spec("deepspeed") is None:
    if os.environ.get("CI"):  # .ci/run installs it: a skip there would hide a broken install
        raise RuntimeError("DeepSpeed is not installed, but CI installs it (scripts/dev)")
    pytest.skip(
        "DeepSpeed is not installed (scripts/dev installs it, or pip install "
        "--no-build-isolation deepspeed)",
        allow_module_level=True,
    )

WORKER = Path(__file__).with_name("ds_worker.py")
ROOT = Path(__file__).resolve().parents[2]
STAGES = (0, 1, 2, 3)
TRAIN_STEPS, TOTAL_STEPS = 4, 6
PHASE_TIMEOUT = 420  # s; includes the one-time g++ build on a fresh machine


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _spawn(
    phase: str,
    world: int,
    root: Path,
    out: Path,
    *args: str,
    ports: list[int],
    stages: tuple[int, ...] = STAGES,
) -> list[subprocess.Popen[bytes]]:
    port = free_port()
    ports.append(port)
    procs = []
    for rank in range(world):
        env = {
            **os.environ,
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(rank),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "DS_ACCELERATOR": "cpu",
            "DS_BUILD_OPS": "0",
            "DSTT_TEST_HANG_S": str(PHASE_TIMEOUT),
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        }
        with open(out / f"{phase}.r{rank}.log", "wb") as log:  # the child keeps its fd
            procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        str(WORKER),
                        phase,
                        str(root),
                        str(out),
                        ",".join(map(str, stages)),
                        *args,
                    ],
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
    return procs


def _reports(phase: str, world: int, out: Path) -> list[dict[str, Any]]:
    reports = []
    for rank in range(world):
        f = out / f"{phase}.r{rank}.json"
        log = out / f"{phase}.r{rank}.log"
        if not f.exists():
            tail = log.read_text(errors="replace")[-3000:] if log.exists() else ""
            raise AssertionError(f"{phase} rank {rank} wrote no report; log tail:\n{tail}")
        reports.append(json.loads(f.read_text()))
    return reports


def _wait(procs: list[subprocess.Popen[bytes]], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise


def _run_all(root: Path, out: Path, ports: list[int]) -> dict[str, list[dict[str, Any]]]:
    # phase 1: train every stage with a session per stage, then SIGKILL both ranks
    procs = _spawn("train", 2, root, out, str(TRAIN_STEPS), ports=ports)
    deadline = time.monotonic() + PHASE_TIMEOUT
    try:
        while not all((out / f"train.r{r}.json").exists() for r in range(2)):
            if any(p.poll() is not None for p in procs) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
    finally:
        for p in procs:
            p.send_signal(signal.SIGKILL)
            p.wait()
    results = {"train": _reports("train", 2, out)}
    # phase 2: resume every stage on two ranks; dstt's checkpoint engine; inspection
    procs = _spawn("resume", 2, root, out, str(TOTAL_STEPS), ports=ports)
    _wait(procs, PHASE_TIMEOUT)
    results["resume"] = _reports("resume", 2, out)
    # phase 3: one rank resumes and inspects what two ranks wrote
    procs = _spawn("world1", 1, root, out, ports=ports)
    _wait(procs, PHASE_TIMEOUT)
    results["world1"] = _reports("world1", 1, out)
    return results


def _clean_shm(ports: list[int], before: set[str]) -> None:
    shm = Path("/dev/shm")
    if not shm.is_dir():
        return
    for p in shm.iterdir():
        if p.name in before:
            continue
        if "deepspeed" in p.name or any(f"_{port}" in p.name for port in ports):
            with contextlib.suppress(OSError):
                p.unlink()


@pytest.fixture(scope="session")
def ds_results(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    base = tmp_path_factory.mktemp("deepspeed")
    root, out = base / "runs", base / "out"
    root.mkdir()
    out.mkdir()
    ports: list[int] = []
    shm = Path("/dev/shm")
    before = {p.name for p in shm.iterdir()} if shm.is_dir() else set()
    try:
        results = _run_all(root, out, ports)
        results["root"] = root  # type: ignore[assignment]
        yield results
    finally:
        _clean_shm(ports, before)
