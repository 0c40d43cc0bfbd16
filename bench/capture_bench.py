"""Per-iteration training time with a checkpoint every step: dstt against its peers (issue 3).

A GPT-like model (``dstt.testing.models.TinyGPT``) trains on this CPU with AdamW. Each mode
below runs the same model (it keeps training across modes) for ``--warmup`` untimed and then
``--iters`` timed iterations, once per repeat; the modes run round-robin inside a repeat, in
a rotated order, so a noisy neighbour or a slow patch of the disk hits every mode alike:

* ``none``        no checkpointing — the baseline every ratio is taken against;
* ``dstt``        ``dstt.session(model, opt, run=..., every=1)`` (defaults: syncfs barrier,
                  4 writers, 256 MiB cache, write-time summaries on);
* ``torch_save``  ``torch.save({"model": sd, "optim": osd})`` to a tmp file, ``fsync``,
                  ``os.replace`` onto the checkpoint, ``fsync`` of the directory — all on the
                  training thread;
* ``dcp``         ``torch.distributed.checkpoint.async_save`` with its best CPU staging: a
                  user-owned ``DefaultStager(StagingOptions(use_pinned_memory=False,
                  use_shared_memory=False, use_async_staging=True, use_non_blocking_copy=False))``
                  (background staging into cached, reused storages), the thread executor,
                  ``FileSystemWriter(sync_files=True)`` alternating two directories, a
                  single-process gloo group (FileStore). As a real loop must, it waits for the
                  staging of step k before optimizer step k+1 and for the upload of step k
                  before starting step k+1's save. (Pinned memory and the blocking cached
                  stager need an accelerator: ``FileSystemWriter(cache_staged_state_dict=True)``
                  raises "Cannot access accelerator device" here.)
* ``dstt_delta``  like ``dstt`` with ``encoding=dstt.DeltaPolicy()`` (issue 8), large size only
                  unless ``--delta-all``.

Experiments, only with ``--modes``: ``dstt_nice`` (dstt's background threads at nice 19, set
from outside the library), ``dstt_lean`` (nice 19 + ``summaries=False`` + ``writers=1``),
``dstt_delta_always`` (``DeltaPolicy(raw_when_busy=False)``: never falls back to raw),
``dstt_delta_lz4`` (lz4 for prediction residuals) and ``dstt_xor`` (XOR deltas only, no
predictions). Where the disk binds (issue 8's target) is measured by capping the disk:
``bench/slow_disk.sh 250000000 python bench/capture_bench.py --sizes large ...``.

Per repeat and mode: ``s/iter`` = (timed iterations + the final drain of pending saves) / N —
what a run of N steps costs; the per-iteration median (steady state) is reported beside it.
Blocked time per step: dstt ``StepMetrics.blocked_s``; torch.save the whole save; DCP the
``async_save`` call (state_dict included) + the wait for the previous upload + the wait for the
previous staging before the optimizer step. The disk's write bandwidth (64 MiB writes into one
new file + fsync) is measured in every repeat, and the physical floor of an every-step
checkpoint is ``max(s/iter of none, state bytes per step / disk bandwidth)``.

Reported: medians over repeats, ratios as the median of per-repeat ratios (each against the
``none`` of the same repeat), and the spread (max-min)/median as a noise gauge.

    python bench/capture_bench.py [--quick] [--sizes small,large] [--repeats 3]
                                  [--threads 1] [--dir DIR] [--json bench/results/capture.json]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from _common import disk_bandwidth, finish, source_state

import dstt
from dstt.store.storage.posix import fsync_dir
from dstt.testing.models import TinyGPT, make_batch

MiB = 1024 * 1024

#: model configurations; ``state`` ≈ 12 bytes per parameter (fp32 params + Adam's two moments)
SIZES: dict[str, dict[str, int]] = {
    # ~0.44 M params, ~5 MB of state per step: the disk absorbs it within an iteration
    "small": dict(vocab=256, d=128, layers=2, heads=4, seq=64, batch=16),
    # ~20 M params, ~240 MB of state per step, ~0.26 s/iter on a quiet core: about what the
    # disk writes in an iteration at 1 GB/s, well beyond it at the 0.45 GB/s of DESIGN §7
    "large": dict(vocab=2048, d=512, layers=6, heads=8, seq=64, batch=2),
}
QUICK_SIZES: dict[str, dict[str, int]] = {
    "small": dict(vocab=64, d=32, layers=1, heads=2, seq=16, batch=4),
    "large": dict(vocab=128, d=64, layers=2, heads=2, seq=16, batch=4),
}
ALL_MODES = ("none", "dstt", "torch_save", "dcp", "dstt_delta")


# -- helpers --------------------------------------------------------------------------------
def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def spread(xs: list[float]) -> float:
    """(max - min) / median: how noisy a figure was across repeats."""
    if len(xs) < 2:
        return 0.0
    m = statistics.median(xs)
    return (max(xs) - min(xs)) / m if m else float("nan")


def state_bytes(model: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    seen: set[int] = set()
    n = 0
    tensors = list(model.state_dict().values())
    for st in opt.state.values():
        tensors += [v for v in st.values() if isinstance(v, torch.Tensor)]
    for t in tensors:
        key = t.untyped_storage().data_ptr()
        if key in seen:  # tied weights
            continue
        seen.add(key)
        n += t.numel() * t.element_size()
    return n


class Trainer:
    """One model + AdamW + a fixed set of pre-built batches (batch generation is not timed)."""

    def __init__(self, cfg: dict[str, int]) -> None:
        torch.manual_seed(0)
        self.cfg = cfg
        self.model = TinyGPT(
            vocab=cfg["vocab"],
            d=cfg["d"],
            layers=cfg["layers"],
            heads=cfg["heads"],
            seq=cfg["seq"],
            dropout=0.0,
        )
        self.opt = torch.optim.AdamW(
            self.model.parameters(), lr=3e-4, weight_decay=0.1, betas=(0.9, 0.95)
        )
        self.batches = [
            make_batch(i, batch_size=cfg["batch"], seq=cfg["seq"], vocab=cfg["vocab"])
            for i in range(16)
        ]
        self.i = 0
        self.params = sum(p.numel() for p in self.model.parameters())

    def fwd_bwd(self) -> None:
        x, y = self.batches[self.i % len(self.batches)]
        self.i += 1
        _, loss = self.model(x, y)
        assert loss is not None
        loss.backward()

    def opt_step(self) -> None:
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def step(self) -> None:
        self.fwd_bwd()
        self.opt_step()

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optim": self.opt.state_dict()}


# -- modes: each returns {"iter_s": [...], "total_s": float, "blocked_s": [...], ...} -------
def run_none(tr: Trainer, warmup: int, iters: int, **_: Any) -> dict[str, Any]:
    for _ in range(warmup):
        tr.step()
    its = []
    t0, c0, p0 = time.perf_counter(), time.thread_time(), time.process_time()
    for _ in range(iters):
        t = time.perf_counter()
        tr.step()
        its.append(time.perf_counter() - t)
    return {
        "iter_s": its,
        "total_s": time.perf_counter() - t0,
        "blocked_s": [0.0] * iters,
        "train_cpu_s": (time.thread_time() - c0) / iters,
        "proc_cpu_s": (time.process_time() - p0) / iters,
    }


def _nice_dstt_threads(level: int = 19) -> None:
    """Experiment (Linux): lower the scheduling priority of dstt's background threads only."""
    import threading

    for t in threading.enumerate():
        if t.name.startswith("dstt-") and t.native_id is not None:
            os.setpriority(os.PRIO_PROCESS, t.native_id, level)


def _run_dstt(
    tr: Trainer,
    warmup: int,
    iters: int,
    root: Path,
    encoding: Any,
    nice: bool = False,
    **options: Any,
) -> dict[str, Any]:
    run = root / "dstt-run"
    shutil.rmtree(run, ignore_errors=True)
    its: list[float] = []
    sess = dstt.session(tr.model, tr.opt, run=run, every=1, encoding=encoding, **options)
    with sess as s:
        if nice:
            _nice_dstt_threads()
        for _ in range(warmup):
            tr.step()
        first = s.step  # metrics of steps first..first+iters-1 are waited on in the timed loop
        t0, c0, p0 = time.perf_counter(), time.thread_time(), time.process_time()
        for _ in range(iters):
            t = time.perf_counter()
            tr.step()
            its.append(time.perf_counter() - t)
        train_cpu = (time.thread_time() - c0) / iters
    total = time.perf_counter() - t0  # includes close(): seal + drain of the last steps
    proc_cpu = (time.process_time() - p0) / iters
    ms = {m.step: m for m in s.metrics}
    timed = [ms[k] for k in range(first, first + iters) if k in ms]
    tail = [ms[k] for k in range(first + 1, first + iters + 1) if k in ms]
    out = {
        "iter_s": its,
        "total_s": total,
        "train_cpu_s": train_cpu,
        "proc_cpu_s": proc_cpu,
        "blocked_s": [m.blocked_s for m in timed],
        "copy_s": [m.copy_s for m in tail],
        "flush_s": [m.flush_s for m in tail],
        "stall_s": [m.stall_s for m in tail],
        "writer_cpu_s": [m.writer_cpu_s for m in tail],
        "bytes": [m.bytes for m in tail],
        "written_bytes": [m.written_bytes for m in tail],
        "keyframes": sum(m.keyframes for m in tail),
        "deltas": sum(m.deltas for m in tail),
        "dedups": sum(m.dedups for m in tail),
        "raw_fallback_steps": sum(1 for m in tail if m.raw_fallback),
        "committed": sum(1 for m in tail if m.committed),
        "backlog_max": max((m.backlog for m in tail), default=0),
    }
    shutil.rmtree(run, ignore_errors=True)
    return out


def run_dstt(tr: Trainer, warmup: int, iters: int, root: Path, **_: Any) -> dict[str, Any]:
    return _run_dstt(tr, warmup, iters, root, None)


def run_dstt_delta(tr: Trainer, warmup: int, iters: int, root: Path, **_: Any) -> dict[str, Any]:
    return _run_dstt(tr, warmup, iters, root, dstt.DeltaPolicy())


# experiments (not run by default; pass --modes): what the findings in docs/benchmarks.md suggest
def run_dstt_delta_lz4(
    tr: Trainer, warmup: int, iters: int, root: Path, **_: Any
) -> dict[str, Any]:
    """DeltaPolicy with lz4 instead of zstd for prediction residuals (less CPU, more bytes)."""
    return _run_dstt(tr, warmup, iters, root, dstt.DeltaPolicy(residual_cname="lz4"))


def run_dstt_delta_always(
    tr: Trainer, warmup: int, iters: int, root: Path, **_: Any
) -> dict[str, Any]:
    """DeltaPolicy that never falls back to raw (disk space first)."""
    return _run_dstt(tr, warmup, iters, root, dstt.DeltaPolicy(raw_when_busy=False))


def run_dstt_xor(tr: Trainer, warmup: int, iters: int, root: Path, **_: Any) -> dict[str, Any]:
    """DeltaPolicy without predictions: XOR deltas only (the first version of issue 8)."""
    return _run_dstt(tr, warmup, iters, root, dstt.DeltaPolicy(predict=False))


def run_dstt_nice(tr: Trainer, warmup: int, iters: int, root: Path, **_: Any) -> dict[str, Any]:
    """dstt with its background threads at nice 19 (the training thread keeps its priority)."""
    return _run_dstt(tr, warmup, iters, root, None, nice=True)


def run_dstt_lean(tr: Trainer, warmup: int, iters: int, root: Path, **_: Any) -> dict[str, Any]:
    """dstt without write-time summaries, 1 writer thread, background threads at nice 19."""
    return _run_dstt(tr, warmup, iters, root, None, nice=True, summaries=False, writers=1)


def run_torch_save(tr: Trainer, warmup: int, iters: int, root: Path, **_: Any) -> dict[str, Any]:
    final = root / "ckpt.pt"
    tmp = root / "ckpt.pt.tmp"

    def save() -> None:
        with open(tmp, "wb") as f:
            torch.save(tr.state_dict(), f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
        fsync_dir(root)

    for _ in range(warmup):
        tr.step()
        save()
    its, blocked = [], []
    t0, c0, p0 = time.perf_counter(), time.thread_time(), time.process_time()
    for _ in range(iters):
        t = time.perf_counter()
        tr.step()
        tb = time.perf_counter()
        save()
        now = time.perf_counter()
        blocked.append(now - tb)
        its.append(now - t)
    total = time.perf_counter() - t0
    train_cpu = (time.thread_time() - c0) / iters
    proc_cpu = (time.process_time() - p0) / iters
    size = final.stat().st_size
    final.unlink()
    return {
        "iter_s": its,
        "total_s": total,
        "blocked_s": blocked,
        "file_bytes": size,
        "train_cpu_s": train_cpu,
        "proc_cpu_s": proc_cpu,
    }


_PG: Any = None


def _process_group(root: Path) -> Any:
    """A single-process gloo group (DCP's collectives run on it); created once per process."""
    global _PG
    import torch.distributed as dist

    if _PG is None:
        if not dist.is_initialized():
            store = dist.FileStore(str(root / "pg-store"), 1)
            dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        _PG = dist.group.WORLD
    return _PG


def run_dcp(tr: Trainer, warmup: int, iters: int, root: Path, **_: Any) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    pg = _process_group(root)
    stager = DefaultStager(
        StagingOptions(
            use_pinned_memory=False,
            use_shared_memory=False,
            use_async_staging=True,
            use_non_blocking_copy=False,
        )
    )
    dirs = [root / "dcp-a", root / "dcp-b"]
    state: dict[str, Any] = {"resp": None, "n": 0}

    def before_opt_step() -> float:  # step k's staging must finish before step k+1 updates
        t = time.perf_counter()
        resp = state["resp"]
        if resp is not None:
            resp.staging_completion.result()
        return time.perf_counter() - t

    def save() -> float:
        t = time.perf_counter()
        resp = state["resp"]
        if resp is not None:
            resp.upload_completion.result()
        d = dirs[state["n"] % 2]
        state["n"] += 1
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            writer = FileSystemWriter(d, sync_files=True)
            state["resp"] = dcp.async_save(
                tr.state_dict(), storage_writer=writer, async_stager=stager, process_group=pg
            )
        return time.perf_counter() - t

    def one() -> float:
        tr.fwd_bwd()
        b = before_opt_step()
        tr.opt_step()
        return b + save()

    try:
        for _ in range(warmup):
            one()
        its, blocked = [], []
        t0, c0, p0 = time.perf_counter(), time.thread_time(), time.process_time()
        for _ in range(iters):
            t = time.perf_counter()
            blocked.append(one())
            its.append(time.perf_counter() - t)
        train_cpu = (time.thread_time() - c0) / iters
        state["resp"].upload_completion.result()
        total = time.perf_counter() - t0
        proc_cpu = (time.process_time() - p0) / iters
    finally:
        with contextlib.suppress(Exception):
            if state["resp"] is not None:
                state["resp"].upload_completion.result()
        stager.close()
        for d in dirs:
            shutil.rmtree(d, ignore_errors=True)
    return {
        "iter_s": its,
        "total_s": total,
        "blocked_s": blocked,
        "train_cpu_s": train_cpu,
        "proc_cpu_s": proc_cpu,
    }


RUNNERS = {
    "none": run_none,
    "dstt": run_dstt,
    "torch_save": run_torch_save,
    "dcp": run_dcp,
    "dstt_delta": run_dstt_delta,
    "dstt_nice": run_dstt_nice,
    "dstt_lean": run_dstt_lean,
    "dstt_delta_lz4": run_dstt_delta_lz4,
    "dstt_xor": run_dstt_xor,
    "dstt_delta_always": run_dstt_delta_always,
}


# -- driver ---------------------------------------------------------------------------------
def bench_size(
    name: str,
    cfg: dict[str, int],
    modes: list[str],
    *,
    repeats: int,
    warmup: int,
    iters: int,
    root: Path,
    disk_total: int,
    log: Any,
) -> dict[str, Any]:
    tr = Trainer(cfg)
    for _ in range(3):  # allocate optimizer state, warm the allocator
        tr.step()
    sbytes = state_bytes(tr.model, tr.opt)
    log(
        f"[{name}] {tr.params / 1e6:.2f} M params, {sbytes / 1e6:.1f} MB of state per step, "
        f"modes {modes}, {repeats} x {iters} iterations (+{warmup} warmup)"
    )
    per: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    bw: list[float] = []
    order = list(modes)
    for rep in range(repeats):
        bw.append(disk_bandwidth(root, disk_total))
        rot = order[rep % len(order) :] + order[: rep % len(order)]
        if "none" in rot:  # keep the baseline first so every ratio has a same-repeat base
            rot.remove("none")
            rot.insert(0, "none")
        for mode in rot:
            gc.collect()
            r = RUNNERS[mode](tr, warmup, iters, root=root)
            r["s_per_iter"] = r["total_s"] / iters
            per[mode].append(r)
            log(
                f"[{name}] repeat {rep + 1}/{repeats} {mode:>10}: "
                f"{r['s_per_iter'] * 1e3:8.1f} ms/iter, blocked "
                f"{med(r['blocked_s']) * 1e3:7.1f} ms/step"
            )
    bw_med = med(bw)
    out_modes: dict[str, Any] = {}
    base = [r["s_per_iter"] for r in per["none"]]
    for mode, rs in per.items():
        spi = [r["s_per_iter"] for r in rs]
        row: dict[str, Any] = {
            "s_per_iter": med(spi),
            "s_per_iter_all": spi,
            "spread": spread(spi),
            "iter_median_s": med([med(r["iter_s"]) for r in rs]),
            # CPU of the whole process (all threads, kernel time of its syscalls included) over
            # the timed iterations + final drain, per iteration: what checkpointing burns
            "cpu_s_per_iter": med([r["proc_cpu_s"] for r in rs]),
            # CPU of the training thread itself per timed iteration (saves on it included)
            "train_thread_cpu_s_per_iter": med([r["train_cpu_s"] for r in rs]),
            "ratio_vs_none": med([a / b for a, b in zip(spi, base, strict=True)]),
            "ratio_vs_none_all": [a / b for a, b in zip(spi, base, strict=True)],
            "blocked_s_per_step": med([med(r["blocked_s"]) for r in rs]),
            "blocked_s_mean_per_step": med(
                [statistics.fmean(r["blocked_s"]) if r["blocked_s"] else 0.0 for r in rs]
            ),
        }
        if mode.startswith("dstt"):
            raw = sum(sum(r["bytes"]) for r in rs)
            wr = sum(sum(r["written_bytes"]) for r in rs)
            row.update(
                {
                    "copy_s": med([med(r["copy_s"]) for r in rs]),
                    "flush_s": med([med(r["flush_s"]) for r in rs]),
                    "stall_s": med([med(r["stall_s"]) for r in rs]),
                    "bytes_per_step": med([med(r["bytes"]) for r in rs]),
                    "written_bytes_per_step": med([med(r["written_bytes"]) for r in rs]),
                    "write_ratio": raw / wr if wr else None,
                    "keyframes": sum(r["keyframes"] for r in rs),
                    "deltas": sum(r["deltas"] for r in rs),
                    "dedups": sum(r["dedups"] for r in rs),
                    "raw_fallback_steps": sum(r["raw_fallback_steps"] for r in rs),
                    "steps_measured": sum(len(r["bytes"]) for r in rs),
                    "backlog_max": max(r["backlog_max"] for r in rs),
                }
            )
        if mode == "torch_save":
            row["file_bytes"] = rs[0]["file_bytes"]
        out_modes[mode] = row
    none_s = out_modes["none"]["s_per_iter"] if "none" in out_modes else float("nan")
    disk_s = sbytes / bw_med
    floor = max(none_s, disk_s)
    for row in out_modes.values():
        row["vs_floor"] = row["s_per_iter"] / floor
    targets: dict[str, Any] = {"disk_keeps_up": disk_s <= none_s}
    if "dstt" in out_modes and "none" in out_modes:
        d = out_modes["dstt"]
        if disk_s <= none_s:
            targets["dstt_overhead_le_5pct"] = d["ratio_vs_none"] <= 1.05
        else:
            targets["dstt_within_10pct_of_floor"] = d["vs_floor"] <= 1.10
        peers = [
            out_modes[m]["blocked_s_per_step"] for m in ("torch_save", "dcp") if m in out_modes
        ]
        if peers:
            targets["dstt_blocked_below_peers"] = d["blocked_s_per_step"] < min(peers)
    if "dstt_delta" in out_modes:
        targets["delta_below_disk_floor"] = out_modes["dstt_delta"]["s_per_iter"] < disk_s
    return {
        "model": {**cfg, "params": tr.params, "state_bytes": sbytes},
        "disk": {
            "write_bytes_per_s": bw_med,
            "all": bw,
            "spread": spread(bw),
            "probe_bytes": disk_total,
            "method": "64 MiB writes into one file + fsync",
        },
        "disk_s_per_step": disk_s,
        "floor_s": floor,
        "modes": out_modes,
        "targets": targets,
    }


def print_table(res: dict[str, Any]) -> None:
    for name, sz in res["sizes"].items():
        m = sz["model"]
        disk = sz["disk"]
        print(
            f"\n== {name}: {m['params'] / 1e6:.2f} M params, "
            f"{m['state_bytes'] / 1e6:.1f} MB/step; disk {disk['write_bytes_per_s'] / 1e9:.2f}"
            f" GB/s (spread {disk['spread']:.0%}) -> {sz['disk_s_per_step'] * 1e3:.0f} "
            f"ms/step; floor {sz['floor_s'] * 1e3:.0f} ms/iter"
        )
        print(
            f"{'mode':>11} {'ms/iter':>9} {'x none':>7} {'x floor':>8} {'spread':>7} "
            f"{'iter med':>9} {'cpu/iter':>9} {'train cpu':>9} {'blocked/step':>13} "
            f"{'written/raw':>12}"
        )
        for mode, r in sz["modes"].items():
            wr = r.get("write_ratio")
            wr_s = f"{1 / wr:.3f}" if wr else "-"
            print(
                f"{mode:>11} {r['s_per_iter'] * 1e3:9.1f} {r['ratio_vs_none']:7.3f} "
                f"{r['vs_floor']:8.3f} {r['spread']:7.0%} {r['iter_median_s'] * 1e3:9.1f} "
                f"{r['cpu_s_per_iter'] * 1e3:9.1f} {r['train_thread_cpu_s_per_iter'] * 1e3:9.1f} "
                f"{r['blocked_s_per_step'] * 1e3:10.2f} ms {wr_s:>12}"
            )
        print("targets:", ", ".join(f"{k}={v}" for k, v in sz["targets"].items()))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny models, 1 repeat (smoke run)")
    ap.add_argument("--sizes", default="small,large")
    ap.add_argument(
        "--modes",
        default=",".join(ALL_MODES[:4]),
        help="modes for every size (dstt_delta is added at 'large')",
    )
    ap.add_argument("--delta-all", action="store_true", help="dstt_delta at every size")
    ap.add_argument("--no-delta", action="store_true", help="do not add dstt_delta at 'large'")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--iters", type=int, default=None, help="timed iterations per repeat")
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads for training (default 1, see docs)",
    )
    ap.add_argument("--dir", default=None, help="where checkpoints go (default: a temp dir)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", module="torch.distributed")

    sizes = QUICK_SIZES if args.quick else SIZES
    names = [s for s in args.sizes.split(",") if s]
    modes = [m for m in args.modes.split(",") if m]
    for m in modes:
        if m not in RUNNERS:
            ap.error(f"unknown mode {m!r}; choose from {sorted(RUNNERS)}")
    repeats = args.repeats or (1 if args.quick else 3)
    out_json = (
        Path(args.json)
        if args.json
        else (
            Path(__file__).parent
            / "results"
            / ("capture_quick.json" if args.quick else "capture.json")
        )
    )
    # (warmup, iters) per size: the large model runs ~0.4 s/iter without checkpoints
    plan = {"small": (2, 4), "large": (1, 3)} if args.quick else {"small": (5, 30), "large": (2, 8)}

    def log(msg: str) -> None:
        print(msg, flush=True)

    root = Path(tempfile.mkdtemp(prefix="dstt-capture-", dir=args.dir))
    load0 = os.getloadavg()
    t_start = time.perf_counter()
    res: dict[str, Any] = {
        "benchmark": "capture",
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "quick": args.quick,
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "train_threads": args.threads,
            "source": source_state(),
            "platform": platform.platform(),
            "loadavg_before": load0,
        },
        "repeats": repeats,
        "sizes": {},
    }
    try:
        for name in names:
            warmup, iters = plan.get(name, (2, 8))
            warmup = args.warmup if args.warmup is not None else warmup
            iters = args.iters or iters
            ms = list(modes)
            if (name == "large" or args.delta_all) and "dstt_delta" not in ms and not args.no_delta:
                ms.append("dstt_delta")
            disk_total = (16 if args.quick else 512) * MiB
            res["sizes"][name] = bench_size(
                name,
                sizes[name],
                ms,
                repeats=repeats,
                warmup=warmup,
                iters=iters,
                root=root,
                disk_total=disk_total,
                log=log,
            )
            res["sizes"][name]["warmup"], res["sizes"][name]["iters"] = warmup, iters
    finally:
        shutil.rmtree(root, ignore_errors=True)
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    return finish(res, out_json, t_start, print_table)


if __name__ == "__main__":
    main()
