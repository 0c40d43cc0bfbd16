"""Where dstt's time goes per step at one workload of ``hotpath_bench.py`` (issue 13).

Two views of the same loop (a checkpoint every iteration, dstt defaults), after a warm-up:

* **per thread**: CPU milliseconds per iteration of every thread of the training process
  (``/proc/self/task/*/stat``, named from ``threading``) and of its child processes (the
  flusher, index jobs), next to the iteration time with and without dstt — what competes with
  training for the cores;
* **per function**: CPU milliseconds per step of the engine's steps as their threads see them
  (``time.thread_time`` around each, so waiting is not counted) — where that CPU goes;
* the training thread's time off the CPU that is not dstt's blocked time: waiting for the
  GIL the engine's threads hold, or for a core (with torch threads = 1 and a spare core,
  mostly the GIL).

    python bench/hotpath_profile.py [--workload lin1200] [--threads 2] [--iters 100]

A sampling profiler (``py-spy record --threads``) shows the same picture but counts a thread
blocked in a system call as busy; this counts CPU only.
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hotpath_bench as hb
import torch

import dstt
from dstt.engine.capture import committer as CM
from dstt.engine.capture import flatwrite as FW
from dstt.engine.capture import pipeline as P
from dstt.store.commit import step_table as ST
from dstt.store.commit import transaction as TX
from dstt.store.commit import writer as W
from dstt.store.flusher import parent as FL
from dstt.store.storage import local as L

HZ = os.sysconf("SC_CLK_TCK")
#: (owner, method names) timed per call
TIMED: list[tuple[Any, str]] = [
    (P.Pipeline, "stage _copy"),
    (CM.Committer, "_finish _flat_summaries"),
    (FW.FlatLane, "write"),
    (TX.Transaction, "commit put_object reserve_flat complete_flat"),
    (ST.StepTable, "arrays_table"),
    (W.Writer, "_metadata"),
    (L.LocalStorage, "barrier evict write"),
    (FL.Flusher, "write"),
]


def _ticks(pid: int | str) -> dict[str, tuple[str, int, int]]:
    out = {}
    for t in glob.glob(f"/proc/{pid}/task/*"):
        try:
            name = Path(t, "comm").read_text().strip()
            f = Path(t, "stat").read_text().rsplit(")", 1)[1].split()
            out[t.rsplit("/", 1)[1]] = (name, int(f[11]), int(f[12]))
        except OSError:
            pass
    return out


def _children() -> dict[str, tuple[str, int, int]]:
    out = {}
    for p in glob.glob("/proc/[0-9]*"):
        try:
            stat = Path(p, "stat").read_text()
            f = stat.rsplit(")", 1)[1].split()
            if int(f[1]) == os.getpid():
                out[p] = (
                    (Path(p, "cmdline").read_text().split("\0")[2:3] or ["?"])[0],
                    int(f[11]),
                    int(f[12]),
                )
        except (OSError, IndexError):
            pass
    return out


def _timed(cpu: dict[str, float], calls: dict[str, int]) -> Callable[[], None]:
    undo = []
    for owner, names in TIMED:
        for name in names.split():
            orig = getattr(owner, name)
            tag = f"{owner.__name__}.{name}"

            def wrapper(*a: Any, _orig: Any = orig, _tag: str = tag, **k: Any) -> Any:
                c0 = time.thread_time()
                try:
                    return _orig(*a, **k)
                finally:
                    cpu[_tag] += time.thread_time() - c0
                    calls[_tag] += 1

            setattr(owner, name, wrapper)
            undo.append((owner, name, orig))
    return lambda: [setattr(o, n, f) for o, n, f in undo]  # type: ignore[func-returns-value]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", default="lin1200", choices=hb.WORKLOADS)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--iters", type=int, default=100)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    tr = hb.make_trainer(args.workload)
    for _ in range(3):
        tr.step()
    t0 = time.perf_counter()
    for _ in range(args.iters):
        tr.step()
    none = (time.perf_counter() - t0) / args.iters
    cpu: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    undo = _timed(cpu, calls)
    root = Path(tempfile.mkdtemp())
    try:
        with dstt.session(tr.model, tr.opt, run=root / "run", every=1) as s:
            for _ in range(5):
                tr.step()
            time.sleep(0.5)
            cpu.clear()
            calls.clear()
            a, ca = _ticks(os.getpid()), _children()
            t0, c0 = time.perf_counter(), time.thread_time()
            for _ in range(args.iters):
                tr.step()
            wall = (time.perf_counter() - t0) / args.iters
            train_cpu = (time.thread_time() - c0) / args.iters
            b, cb = _ticks(os.getpid()), _children()
            names = {str(t.native_id): t.name for t in threading.enumerate()}
            blocked = sorted(m.blocked_s for m in list(s.metrics)[-args.iters :])
    finally:
        undo()
        shutil.rmtree(root, ignore_errors=True)
    n = args.iters
    print(
        f"{args.workload}, torch threads {args.threads}: {none * 1e3:.1f} ms/iter without "
        f"checkpoints, {wall * 1e3:.1f} with dstt ({wall / none:.2f}x); blocked per step "
        f"median {blocked[len(blocked) // 2] * 1e3:.2f} ms, mean "
        f"{sum(blocked) / len(blocked) * 1e3:.2f} ms"
    )
    off = wall - train_cpu - sum(blocked) / len(blocked)
    print(
        f"training thread: {train_cpu * 1e3:.1f} ms of CPU per iteration; off the CPU and "
        f"not blocked by dstt {off * 1e3:.1f} ms (waiting for the GIL, or for a core)\n"
    )
    print("| thread | user ms/iter | sys ms/iter |\n|---|---:|---:|")
    for tid, (name, u, sy) in sorted(b.items(), key=lambda kv: -(kv[1][1] + kv[1][2])):
        u0, s0 = a.get(tid, (name, 0, 0))[1:]
        du, ds = (u - u0) / HZ / n * 1e3, (sy - s0) / HZ / n * 1e3
        label = names.get(tid, name)
        label = "training (main)" if label == "MainThread" else label
        label = "torch intra-op worker" if label == "python" else label
        if du + ds >= 0.05 or label.startswith(("dstt", "training")):  # (CPU in 1/HZ ticks)
            print(f"| {label} | {du:.2f} | {ds:.2f} |")
    for pid, (what, u, sy) in cb.items():
        u0, s0 = ca.get(pid, (what, 0, 0))[1:]
        du, ds = (u - u0) / HZ / n * 1e3, (sy - s0) / HZ / n * 1e3
        print(f"| child `{what}` | {du:.2f} | {ds:.2f} |")
    print("\n| engine step (its thread's CPU) | ms/step | calls/step |\n|---|---:|---:|")
    for tag, c in sorted(cpu.items(), key=lambda kv: -kv[1]):
        print(f"| `{tag}` | {c / n * 1e3:.3f} | {calls[tag] / n:.0f} |")


if __name__ == "__main__":
    main()
