"""Write throughput of ``dstt.store`` against the disk's own ceiling, measured in the same run.

One "step" of a synthetic training state — ``size/16`` float32 tensors of 16 MiB (one chunk
each at the default 16 MiB chunk size) plus 64 small 4 KiB tensors, as biases and norms are —
is committed through ``Repository → Writer → Transaction`` with 1, 2 and 4 writer threads
calling ``put_chunk`` concurrently, timed from ``begin`` to the return of ``commit`` (so the
durability barrier, the manifest and the ref are included). The ceilings, on the same disk in
the same run:

* ``raw 1 write``: the same bytes, one preallocated buffer, a single ``write`` + ``fsync``;
* ``raw 64 MiB``: the same bytes written 64 MiB at a time into one file + ``fsync``.

Each configuration is repeated ``--repeats`` times, round-robin (so a slow patch of the disk
hits every configuration alike), and the median is reported. GB are 10^9 bytes of tensor data.
The runs are deleted afterwards.

    python bench/store_bench.py [--size-mib 1024] [--repeats 3] [--threads 1,2,4]
                                [--durability syncfs] [--dir DIR] [--json bench/results/store.json]
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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dstt.store import Repository
from dstt.store.storage.posix import fsync_dir

BIG = 16 * 1024 * 1024
SMALL = 4096
N_SMALL = 64


def make_state(size_mib: int) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """One preallocated buffer holding every tensor (views into it), bytes not all zero."""
    n_big = max(1, size_mib * 1024 * 1024 // BIG)
    total = n_big * BIG + N_SMALL * SMALL
    buf = np.empty(total, dtype=np.uint8)
    pattern = np.random.default_rng(0).integers(0, 256, 1 << 20, dtype=np.uint8)
    for off in range(0, total, len(pattern)):
        n = min(len(pattern), total - off)
        buf[off : off + n] = pattern[:n]
    tensors: dict[str, np.ndarray] = {}
    off = 0
    for i in range(n_big):
        tensors[f"params/layers/{i}/mlp/weight"] = (
            buf[off : off + BIG].view(np.float32).reshape(4096, 1024)
        )
        off += BIG
    for i in range(N_SMALL):
        tensors[f"params/layers/{i}/norm/bias"] = buf[off : off + SMALL].view(np.float32)
        off += SMALL
    return buf, tensors


def raw_write(buf: np.ndarray, path: Path, piece: int | None) -> float:
    """Seconds to write ``buf`` to a new file (one write, or ``piece``-byte writes) + fsync."""
    view = memoryview(buf).cast("B")
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        step = piece or len(view)
        for start in range(0, len(view), step):
            part = view[start : start + step]
            while part:  # a single write() may return short (e.g. beyond 2 GiB)
                part = part[os.write(fd, part) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    fsync_dir(str(path.parent))
    elapsed = time.perf_counter() - t0
    path.unlink()
    return elapsed


class StoreCase:
    """A run that one thread-count configuration commits its steps into."""

    def __init__(self, root: Path, threads: int, durability: str) -> None:
        self.path = root / f"run-t{threads}"
        self.repo = Repository.create(self.path, durability=durability)
        self.threads = threads
        self.step = 0
        self.pool = ThreadPoolExecutor(threads)

    def commit(self, tensors: dict[str, np.ndarray]) -> float:
        with self.repo.writer() as w:
            t0 = time.perf_counter()
            txn = w.begin(self.step)
            jobs = []
            for name, a in tensors.items():
                plan = txn.declare(name, "float32", a.shape)
                flat = a.reshape(-1).view(np.uint8)
                for i in range(plan.n_chunks):
                    lo, hi = plan.byte_range(i)
                    jobs.append((name, i, flat[lo:hi]))
            for f in [self.pool.submit(txn.put_chunk, *j) for j in jobs]:
                f.result()
            txn.commit()
            elapsed = time.perf_counter() - t0
        self.step += 1
        self.repo.gc(keep_last=1)  # not timed: keeps disk use at ~2 states per run
        return elapsed

    def close(self) -> None:
        self.pool.shutdown()
        shutil.rmtree(self.path, ignore_errors=True)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mib", type=int, default=1024, help="state size (default 1024)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", default="1,2,4")
    ap.add_argument("--durability", default="syncfs", choices=["syncfs", "fsync", "none"])
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir in bench/)")
    ap.add_argument("--json", default=str(Path(__file__).parent / "results" / "store.json"))
    args = ap.parse_args(argv)
    threads = [int(t) for t in args.threads.split(",")]

    buf, tensors = make_state(args.size_mib)
    nbytes = sum(a.nbytes for a in tensors.values())
    parent = Path(args.dir) if args.dir else Path(__file__).parent
    root = Path(tempfile.mkdtemp(prefix="store_bench.", dir=parent))
    print(
        f"state: {len(tensors)} tensors, {nbytes / 2**20:.1f} MiB; writing in {root}; "
        f"durability={args.durability}; {os.cpu_count()} CPUs",
        flush=True,
    )

    times: dict[str, list[float]] = {"raw 1 write": [], "raw 64 MiB": []}
    times.update({f"dstt {t} thread{'s' if t > 1 else ''}": [] for t in threads})
    cases = {t: StoreCase(root, t, args.durability) for t in threads}
    try:
        for case in cases.values():  # warm-up, not timed: the first step also writes every
            case.commit(tensors)  # tensor's zarr.json; the timed steps are steady state
        for r in range(args.repeats):
            times["raw 1 write"].append(raw_write(buf, root / "raw.bin", None))
            times["raw 64 MiB"].append(raw_write(buf, root / "raw.bin", 64 << 20))
            for t, case in cases.items():
                key = f"dstt {t} thread{'s' if t > 1 else ''}"
                times[key].append(case.commit(tensors))
            print(
                f"repeat {r + 1}/{args.repeats}: "
                + ", ".join(f"{k} {v[-1]:.2f}s" for k, v in times.items()),
                flush=True,
            )
    finally:
        for case in cases.values():
            case.close()
        shutil.rmtree(root, ignore_errors=True)

    med = {k: statistics.median(v) for k, v in times.items()}
    base1, base64 = med["raw 1 write"], med["raw 64 MiB"]
    rows = []
    print(
        f"\n{'configuration':<16} {'median s':>9} {'GB/s':>7} {'vs 1 write':>11} {'vs 64 MiB':>10}"
    )
    for k, s in med.items():
        gbps = nbytes / s / 1e9
        rows.append(
            {
                "config": k,
                "median_s": s,
                "gb_per_s": gbps,
                "vs_raw_1_write": base1 / s,
                "vs_raw_64mib": base64 / s,
                "all_s": times[k],
            }
        )
        print(f"{k:<16} {s:>9.3f} {gbps:>7.3f} {base1 / s:>10.2f}x {base64 / s:>9.2f}x")
    result = {
        "benchmark": "store_write",
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "size_bytes": nbytes,
        "tensors": len(tensors),
        "repeats": args.repeats,
        "durability": args.durability,
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "note": "ratios > 1 are faster than the raw ceiling; GB = 1e9 bytes of tensor data",
        "results": rows,
    }
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {out}")
    return result


if __name__ == "__main__":
    main()
