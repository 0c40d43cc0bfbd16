"""Read-side latency at per-iteration scale (issue 14): the run's index against the targets.

Synthesizes runs of ``--steps`` (default 1,000 and 10,000) committed steps of a 120-tensor
model (small fp32 tensors, a write-time ``summaries`` object and a ``loss`` with one spike per
step) straight through ``Repository → Writer → Transaction`` with ``durability="none"`` (the
capture path is not what is measured here), plus a 3-step run of 1,000 tensors for
``at(step).layer(x)``. Then, each a median of ``--repeats`` (>= 3) on a fresh ``dstt.open``:

* ``open``: ``dstt.open(run).steps`` (the index's segments + the tail's headers);
* ``metrics``, ``spikes``, ``summaries``: over every step;
* ``layer``: ``run.at(step).layer("layers.7")`` on the 1,000-tensor step, values read;
* ``trajectory``: ``run.trajectory(name).values`` of one tensor over every step, as bytes/s,
  against the *raw ceiling*: the same byte ranges read with ``os.open``/``os.pread``/``close``
  in one thread (what any reader must do at least: one file per step).

Targets: open < 0.1 s at 10,000 steps; metrics, spikes, summaries < 1 s; layer < 0.05 s;
trajectory >= 50 % of the ceiling. The machine is shared: figures are noisy.

    python bench/index_bench.py [--steps 1000,10000] [--repeats 3] [--dir DIR]
                                [--json bench/results/index.json] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import dstt
from bench._common import source_state
from dstt.store import LocalStorage, Repository

N_TENSORS = 120
SHAPE = (16, 16)  # 1 KiB of fp32 per tensor
FIELDS = ("l2", "rms", "maxabs", "nan", "inf", "update_l2", "update_ratio")


def synthesize(
    path: Path, steps: int, tensors: int = N_TENSORS, shape: tuple[int, ...] = SHAPE
) -> float:
    """A run of ``steps`` commits; returns seconds taken."""
    t0 = time.perf_counter()
    rng = np.random.default_rng(0)
    base = rng.standard_normal((tensors, *shape)).astype(np.float32)
    paths = [f"params/layers/{i // 6}/t{i % 6}/weight" for i in range(tensors)]
    repo = Repository.create(LocalStorage(path, durability="none", create=True))
    with repo.writer() as w:
        for s in range(steps):
            txn = w.begin(s)
            data = base * np.float32(1 + 1e-3 * s)
            for i, p in enumerate(paths):
                txn.declare(p, "float32", shape)
                txn.put_chunk(p, 0, data[i].reshape(-1).view(np.uint8))
            cols: dict[str, Any] = {"columns": 1, "path": paths}
            for f in FIELDS:
                cols[f] = rng.random(tensors)
            cols["probe"] = rng.standard_normal((tensors, 16))
            cols["probe_len"] = np.full(tensors, 16)
            txn.put_object("summaries", cols)
            loss = 2.0 + 0.01 * rng.standard_normal() + (3.0 if s == steps * 2 // 3 else 0.0)
            txn.commit({"loss": float(loss), "lr": 1e-3})
    return time.perf_counter() - t0


def median_time(fn: Callable[[], Any], repeats: int) -> tuple[float, list[float]]:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), times


def raw_ceiling(run: Any, name: str) -> tuple[float, int]:
    """Seconds to read the trajectory's byte ranges with os.pread, one open per file."""
    r = run.reader
    ranges = []
    for h in run.commits():
        rec = r.record(h, name)
        ranges += [(os.path.join(run.path, c.key), c.offset, c.nbytes) for c in rec.chunks]
    t0 = time.perf_counter()
    total = 0
    for f, off, n in ranges:
        fd = os.open(f, os.O_RDONLY)
        try:
            total += len(os.pread(fd, n, off))
        finally:
            os.close(fd)
    return time.perf_counter() - t0, total


def bench_run(path: Path, steps: int, repeats: int) -> dict[str, Any]:
    made = synthesize(path, steps)
    out: dict[str, Any] = {
        "steps": steps,
        "tensors": N_TENSORS,
        "synthesize_s": made,
        "index_files": len(list((path / "_dstt" / "index").glob("*.idx"))),
    }

    def opened() -> Any:
        return dstt.open(path)

    opened().metrics()  # imports and first-touch costs are not what is measured
    out["open_s"], out["open_all_s"] = median_time(lambda: opened().steps, repeats)
    out["metrics_s"], _ = median_time(lambda: opened().metrics(), repeats)
    out["spikes_s"], _ = median_time(lambda: opened().spikes("loss"), repeats)
    out["summaries_s"], _ = median_time(lambda: opened().summaries(), repeats)
    name = "params/layers/7/t3/weight"
    run = opened()
    tensor_bytes = int(np.prod(SHAPE)) * 4 * steps
    runs = [opened() for _ in range(repeats)]
    for r in runs:  # a notebook's run: opened, its steps listed
        assert len(r.steps) == steps
    it = iter(runs)
    traj, _ = median_time(lambda: next(it).trajectory(name).values, repeats)
    ceil = statistics.median(raw_ceiling(run, name)[0] for _ in range(repeats))
    out["trajectory_s"], out["raw_ceiling_s"] = traj, ceil
    out["trajectory_bytes_per_s"] = tensor_bytes / traj
    out["raw_ceiling_bytes_per_s"] = tensor_bytes / ceil
    out["trajectory_vs_ceiling"] = ceil / traj
    return out


def bench_layer(path: Path, repeats: int) -> dict[str, Any]:
    synthesize(path, 3, tensors=1000, shape=(32, 32))
    dstt.open(path).at(1).layer("layers.7").load()
    t, _ = median_time(lambda: dstt.open(path).at(1).layer("layers.7").load(), repeats)
    return {"tensors": 1000, "layer_s": t}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", default="1000,10000")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--json", default=str(Path(__file__).parent / "results" / "index.json"))
    ap.add_argument("--quick", action="store_true", help="100 steps, 3 repeats (smoke test)")
    args = ap.parse_args()
    steps = [100] if args.quick else [int(s) for s in args.steps.split(",")]
    repeats = max(3, args.repeats)
    root = Path(tempfile.mkdtemp(prefix="index-bench-", dir=args.dir))
    res: dict[str, Any] = {
        "benchmark": "index",
        "quick": args.quick,
        "repeats": repeats,
        "machine": platform.platform(),
        "cpus": os.cpu_count(),
        "source": source_state(),
        "runs": {},
        "note": "shared machine, other test suites running: figures are noisy",
    }
    try:
        for n in steps:
            res["runs"][str(n)] = bench_run(root / f"run{n}", n, repeats)
            shutil.rmtree(root / f"run{n}")
            print(json.dumps(res["runs"][str(n)], indent=1), flush=True)
        res["layer"] = bench_layer(root / "layer", repeats)
        big = res["runs"][str(max(steps))]
        res["targets"] = {
            "open_below_0.1s": big["open_s"] < 0.1,
            "metrics_below_1s": big["metrics_s"] < 1,
            "spikes_below_1s": big["spikes_s"] < 1,
            "summaries_below_1s": big["summaries_s"] < 1,
            "layer_below_0.05s": res["layer"]["layer_s"] < 0.05,
            "trajectory_at_least_half_the_ceiling": big["trajectory_vs_ceiling"] >= 0.5,
        }
        print(json.dumps({"layer": res["layer"], "targets": res["targets"]}, indent=1))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
