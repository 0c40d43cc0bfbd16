"""Inspection overhead vs the raw read ceiling of the same bytes.

Two measurements on a synthetic run written through ``dstt.store`` (no training):

1. **open and select**: ``dstt.open`` + ``run.at(step)`` + ``snap.layer(sel)`` + loading the
   selected layer's values, in a 1000-tensor run; against the ceiling of opening and reading
   exactly those chunk files (keys known in advance, no metadata, no checks).
2. **trajectory**: ``run.trajectory(name).values`` of one tensor over N steps (float32 and
   bfloat16, the latter upcast to float32); against reading the same chunk files into one
   preallocated buffer.

Both sides read warm from the page cache (the run was just written), so the ratio isolates
dstt's own cost: manifest walking, crc32c verification, decoding, xarray assembly. Each figure
is the median of ``--repeats`` runs; ratios are dstt time / raw time (1.0 = at the ceiling).

    python bench/inspect_bench.py [--repeats 7] [--steps 100] [--mib 1] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dstt.run import open_run
from dstt.store import Repository
from dstt.store.api import dtype_name


def _median(fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _write(repo: Repository, steps: int, arrays_at: Callable[[int], dict[str, np.ndarray]]) -> None:
    with repo.writer() as w:
        for s in range(steps):
            txn = w.begin(s)
            for name, a in arrays_at(s).items():
                plan = txn.declare(name, dtype_name(a.dtype), a.shape)
                flat = a.reshape(-1).view(np.uint8)
                for i in range(plan.n_chunks):
                    lo, hi = plan.byte_range(i)
                    txn.put_chunk(name, i, flat[lo:hi])
            txn.commit({"loss": 1.0 / (s + 1)})


def _raw_read(root: str, keys: list[str], out: np.ndarray | None = None) -> int:
    """Read chunk files directly (data part, crc trailer dropped) — the ceiling."""
    n = 0
    for k in keys:
        with open(os.path.join(root, k), "rb") as f:
            data = f.read()
        body = np.frombuffer(data, dtype=np.uint8, count=len(data) - 4)
        if out is not None:
            out[n : n + body.size] = body
        n += body.size
    return n


def bench_select(root: Path, repeats: int) -> dict[str, float]:
    path = root / "select"
    rng = np.random.default_rng(0)
    layers = 250

    def model(step: int) -> dict[str, np.ndarray]:
        out = {}
        for i in range(layers):
            out[f"params/layers/{i}/attn/q_proj/weight"] = rng.standard_normal((64, 64)).astype(
                ml_dtypes.bfloat16
            )
            out[f"params/layers/{i}/attn/q_proj/bias"] = np.zeros(64, np.float32)
            out[f"params/layers/{i}/mlp/weight"] = np.zeros((64, 16), np.float32)
            out[f"params/layers/{i}/norm/weight"] = np.ones(64, np.float32)
        return out

    _write(Repository.create(path, durability="none"), 5, model)
    sel, step = "layers.7.attn", 3

    def dstt_side() -> None:
        tree = open_run(path).at(step).layer(sel)
        tree.load()

    def open_only() -> None:
        open_run(path).at(step).layer(sel)

    r = Repository.open(path).reader()
    h = r.find(step)
    table = r.arrays(h)
    keys = [
        c.key
        for p in ("params/layers/7/attn/q_proj/weight", "params/layers/7/attn/q_proj/bias")
        for c in table[p].chunks
    ]

    def table_only() -> None:  # the store's share: refs, lineage, verify + parse the table
        rr = Repository.open(path).reader()
        rr.arrays(rr.find(step))

    dstt_side()  # warm imports and caches once
    t_dstt = _median(dstt_side, repeats)
    t_open = _median(open_only, repeats)
    t_table = _median(table_only, repeats)
    t_raw = _median(lambda: _raw_read(str(path), keys), repeats)
    return {
        "tensors": float(len(table)),
        "store_table_ms": t_table * 1e3,
        "open_select_ms": t_open * 1e3,
        "open_select_load_ms": t_dstt * 1e3,
        "raw_ms": t_raw * 1e3,
        "ratio": t_dstt / t_raw,
    }


def bench_trajectory(
    root: Path, repeats: int, steps: int, mib: float, dtype: Any
) -> dict[str, float]:
    name = "bf16" if dtype == ml_dtypes.bfloat16 else np.dtype(dtype).name
    path = root / f"traj-{name}"
    itemsize = np.dtype(dtype).itemsize
    rows = max(1, int(mib * 2**20 / itemsize / 256))
    rng = np.random.default_rng(1)
    base = rng.standard_normal((rows, 256)).astype(dtype)
    _write(
        Repository.create(path, durability="none"),
        steps,
        lambda s: {"params/layers/0/w": base, "params/other": np.zeros(8, np.float32)},
    )
    run = open_run(path)
    r = Repository.open(path).reader()
    keys = [c.key for h in r.lineage() for c in r.arrays(h)["params/layers/0/w"].chunks]
    nbytes = base.nbytes * steps
    buf = np.empty(nbytes, dtype=np.uint8)

    def dstt_side() -> None:
        v = run.trajectory("layers.0.w").values
        assert v.shape == (steps, rows, 256)

    dstt_side()
    t_dstt = _median(dstt_side, repeats)
    # the ceiling returns a new array too (as any reader must); a reused buffer skips the
    # first-touch page faults of a fresh allocation and is shown for reference
    t_raw = _median(lambda: _raw_read(str(path), keys, np.empty(nbytes, np.uint8)), repeats)
    t_reuse = _median(lambda: _raw_read(str(path), keys, buf), repeats)
    gbs = nbytes / 1e9
    return {
        "bytes": float(nbytes),
        "dstt_GBps": gbs / t_dstt,
        "raw_GBps": gbs / t_raw,
        "raw_reused_buffer_GBps": gbs / t_reuse,
        "ratio": t_dstt / t_raw,
        "ratio_vs_reused_buffer": t_dstt / t_reuse,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--mib", type=float, default=1.0, help="tensor size per step")
    ap.add_argument("--dir", help="where to write the runs (default: a temp dir)")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        root = Path(tmp)
        res = {
            "select": bench_select(root, args.repeats),
            "trajectory_f32": bench_trajectory(
                root, args.repeats, args.steps, args.mib, np.float32
            ),
            "trajectory_bf16": bench_trajectory(
                root, args.repeats, args.steps, args.mib, ml_dtypes.bfloat16
            ),
        }
    s = res["select"]
    print(
        f"open+select ({s['tensors']:.0f} tensors): {s['open_select_ms']:.1f} ms "
        f"(store refs+table {s['store_table_ms']:.1f} ms); with load "
        f"{s['open_select_load_ms']:.1f} ms vs raw {s['raw_ms']:.2f} ms -> {s['ratio']:.0f}x"
    )
    for k in ("trajectory_f32", "trajectory_bf16"):
        t = res[k]
        print(
            f"{k} ({t['bytes'] / 2**20:.0f} MiB over {args.steps} steps): "
            f"{t['dstt_GBps']:.2f} GB/s vs raw {t['raw_GBps']:.2f} GB/s -> {t['ratio']:.2f}x "
            f"time (vs a reused buffer {t['raw_reused_buffer_GBps']:.2f} GB/s: "
            f"{t['ratio_vs_reused_buffer']:.2f}x)"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
