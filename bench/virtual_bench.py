"""The run as one virtual Zarr store (issue 41): what its references cost and how fast plain
xarray reads a trajectory through them, against ``run.trajectory``.

Synthesizes runs of ``--steps`` (default 1,000 and 10,000) committed steps of ``--tensors``
(default 12) tiny fp32 tensors (8 x 8) and a ``loss``, straight through ``Repository → Writer
→ Transaction`` with ``durability="none"`` (capture is not what is measured). Then:

* ``refs_s``: ``run.virtual(out)`` on a fresh ``dstt.open`` (every step), ``refs_bytes`` the
  file's size and ``refs_keys`` its references;
* ``append_s``: 10 more steps committed, then the incremental re-run that appends them (it
  reads and rewrites the whole file: its cost grows with the run, not with what it adds);
* ``xr_open_s``: ``xr.open_datatree("reference://run", ...)`` (the reference file parsed,
  every group listed); ``xr_read_s``: one tensor's trajectory over every step read through
  it (``.values``); ``dstt_read_s``: the same with ``dstt.open(run).trajectory(name).values``
  (open included). Medians of ``--repeats``, each reader fresh (no instance cache).

The machine may be shared: say so with the figures.

    python bench/virtual_bench.py [--steps 1000,10000] [--tensors 12] [--repeats 3]
                                  [--dir DIR] [--json bench/results/virtual.json] [--quick]
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

SHAPE = (8, 8)
NAME = "params/layers/1/t0/weight"


def synthesize(path: Path, first: int, last: int, tensors: int) -> float:
    """Commit steps ``first..last-1`` (creating the run if needed); seconds taken."""
    t0 = time.perf_counter()
    base = np.random.default_rng(0).standard_normal((tensors, *SHAPE)).astype(np.float32)
    paths = [f"params/layers/{i // 4}/t{i % 4}/weight" for i in range(tensors)]
    repo = Repository.create(LocalStorage(path, durability="none", create=True))
    with repo.writer() as w:
        for s in range(first, last):
            txn = w.begin(s)
            data = base * np.float32(1 + 1e-3 * s)
            for i, p in enumerate(paths):
                txn.declare(p, "float32", SHAPE)
                txn.put_chunk(p, 0, data[i].reshape(-1).view(np.uint8))
            txn.commit({"loss": 2.0 / (1 + s), "lr": 1e-3})
    return time.perf_counter() - t0


def median_time(fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_run(root: Path, steps: int, tensors: int, repeats: int) -> dict[str, Any]:
    import xarray as xr

    path, refs = root / f"run{steps}", root / f"run{steps}.refs.json"
    out: dict[str, Any] = {"steps": steps, "tensors": tensors}
    out["synthesize_s"] = synthesize(path, 0, steps, tensors)
    t0 = time.perf_counter()
    rep = dstt.open(path).virtual(refs)
    out["refs_s"] = time.perf_counter() - t0
    assert len(rep.steps) == steps
    assert not rep.left_out_steps
    out["refs_bytes"] = refs.stat().st_size
    out["refs_keys"] = len(json.loads(refs.read_text())["refs"])
    synthesize(path, steps, steps + 10, tensors)
    t0 = time.perf_counter()
    rep = dstt.open(path).virtual(refs)
    out["append_s"] = time.perf_counter() - t0
    assert len(rep.added) == 10

    def tree() -> Any:
        return xr.open_datatree(
            "reference://run",
            engine="zarr",
            consolidated=False,
            zarr_format=3,
            storage_options={
                "fo": str(refs),
                "remote_protocol": "file",
                "skip_instance_cache": True,
            },
        )

    want = dstt.open(path).trajectory(NAME).values
    got = tree()[NAME].values
    assert np.ascontiguousarray(got).tobytes() == np.ascontiguousarray(want).tobytes()
    out["xr_open_s"] = median_time(tree, repeats)
    trees = [tree() for _ in range(repeats)]
    it = iter(trees)
    out["xr_read_s"] = median_time(lambda: next(it)[NAME].values, repeats)
    out["dstt_read_s"] = median_time(lambda: dstt.open(path).trajectory(NAME).values, repeats)
    shutil.rmtree(path)
    refs.unlink()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", default="1000,10000")
    ap.add_argument("--tensors", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--json", default=str(Path(__file__).parent / "results" / "virtual.json"))
    ap.add_argument("--quick", action="store_true", help="100 steps (smoke test)")
    args = ap.parse_args()
    steps = [100] if args.quick else [int(s) for s in args.steps.split(",")]
    root = Path(tempfile.mkdtemp(prefix="virtual-bench-", dir=args.dir))
    t_start = time.perf_counter()
    res: dict[str, Any] = {
        "benchmark": "virtual",
        "quick": args.quick,
        "repeats": args.repeats,
        "machine": platform.platform(),
        "cpus": os.cpu_count(),
        "loadavg_before": os.getloadavg(),
        "source": source_state(),
        "runs": {},
    }
    try:
        for n in steps:
            res["runs"][str(n)] = bench_run(root, n, args.tensors, args.repeats)
            print(json.dumps(res["runs"][str(n)], indent=1), flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    res["loadavg_after"] = os.getloadavg()
    res["wall_s"] = time.perf_counter() - t_start
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(res, indent=2) + "\n")
    print(f"wrote {args.json} ({res['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
