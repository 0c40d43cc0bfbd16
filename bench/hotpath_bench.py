"""Training time with a checkpoint EVERY iteration, on many small tensors (issue 13).

Three workloads, each trained with AdamW on this CPU:

* ``lin1200``  ``nn.Sequential`` of 100 x (``Linear(128, 128)`` + ``LayerNorm(128)``), random
               input (batch 64), MSE loss: 400 parameter tensors + 800 Adam moments, ~20 MB of
               state per step — the per-tensor overhead dominates;
* ``lin360``   the same with 30 blocks: ~360 tensors, ~6 MB;
* ``gpt87``    ``dstt.testing.models.TinyGPT`` (d=256, 2 layers, vocab 8192, seq 128, batch 4):
               28 parameters (+1 tied head in the state dict) + 56 moments, ~45 MB.

Modes (the mode implementations of ``bench/capture_bench.py`` are reused as they are):

* ``none``        no checkpointing: the baseline;
* ``bare``        the "bare background writer", a floor for any asynchronous checkpointer that
                  copies on the training thread: after each optimizer step the training thread
                  waits for the previous write, then copies every parameter and Adam moment
                  (``exp_avg``, ``exp_avg_sq``; step counters skipped) into ONE preallocated flat
                  uint8 buffer with ONE ``torch._foreach_copy_`` into precomputed views and hands
                  it to ONE background thread, which writes it to one file (``O_TRUNC``, 64 MiB
                  ``os.write`` pieces, the disk probe's method), ``fsync``s and closes it. One
                  buffer (single buffering): the wait for write k happens before the copy of
                  step k+1, i.e. a write has a whole iteration to finish. Double buffering
                  would only hide the copy behind a write that is already late — where the
                  disk, not the copy, bounds the run;
* ``bare_guarded`` the bare writer plus the per-step work dstt's guarantees and defaults need,
                  with no engine: crc32c + CRC-32 of every tensor, the write-time summaries, a
                  new file per step renamed into place, a manifest written last, ``syncfs``
                  (``bench/_writers.py``) — the floor for a checkpointer that keeps them;
* ``dstt``        ``dstt.session(model, opt, run=<fresh dir>, every=1)`` with its defaults;
* ``dstt_delta``  the same with ``encoding=dstt.DeltaPolicy()``;
* ``dstt_delta_always``  ``DeltaPolicy(raw_when_busy=False)``: every step encoded (what the
  encode itself costs; not in the default set);
* ``torch_save``  ``torch.save`` + fsync + ``os.replace`` + directory fsync on the training thread;
* ``dcp``         ``torch.distributed.checkpoint.async_save`` with async CPU staging (see
                  capture_bench for the exact setup).

Protocol: for each ``--threads`` value (``torch.set_num_threads``) and workload, one model and
optimizer train through ``--repeats`` rounds; in each round the disk's write bandwidth is
measured, then every mode runs ``--warmup`` untimed + ``--iters`` timed iterations, the modes in
an order rotated by one per round. Where an iteration is short, both counts grow so that every
mode warms up for ``--warmup-seconds`` (default 1 s: past dstt's start — the flusher process and
first layouts, ~0.2 s a run pays once) and is timed for ``--seconds`` (default 2 s, the same
iteration count for every mode of a workload); the close of each mode's run (the final drain) is
timed on its own (``close s``: for dstt the drain of the last steps and the session's last index
job, ~1 s after a few hundred commits — a cost per run, not per step). ``s/iter`` = timed
iterations / iters (with the close: ``s_per_iter_with_close`` in the JSON, the protocol before
2026-12-01 17:30). Ratios (x none, x bare, x guarded) are medians of per-round ratios
against the same round's ``none``/``bare``/``bare_guarded``. Blocked time per step: dstt
``StepMetrics.blocked_s``; bare (and guarded) the wait for the previous write + the copy;
torch.save the whole save; DCP the ``async_save`` call + the waits for the previous upload and
staging. Engine CPU per step: dstt
``StepMetrics.writer_cpu_s``; bare the writer thread's CPU time per write. The check
``bytes/step / disk bandwidth < iteration time`` (of ``none``) says whether the disk can absorb
a checkpoint per iteration at all.

    python bench/hotpath_bench.py [--quick] [--workloads lin1200,lin360,gpt87]
        [--modes none,bare,dstt,dstt_delta,torch_save,dcp] [--threads 2[,1]] [--repeats 3]
        [--warmup 3] [--iters 20] [--seconds 2] [--warmup-seconds 1] [--dir DIR]
        [--json bench/results/hotpath.json]
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import capture_bench as cb
import torch
from _common import MiB, disk_bandwidth, finish, source_state
from _writers import ALIGN, PIECE, BareWriter, GuardedWriter
from capture_bench import med, spread, state_bytes
from torch import nn

#: TinyGPT configuration of ``gpt87`` (3.71 M params, 44.5 MB of fp32 params + Adam moments)
GPT87 = dict(vocab=8192, d=256, layers=2, heads=4, seq=128, batch=4)
#: ``lin*`` workloads: number of (Linear(128,128) + LayerNorm(128)) blocks
LIN_BLOCKS = {"lin1200": 100, "lin360": 30}
LIN_WIDTH, LIN_BATCH = 128, 64
WORKLOADS = ("lin1200", "lin360", "gpt87")
ALL_MODES = ("none", "bare", "bare_guarded", "dstt", "dstt_sync", "dstt_delta", "torch_save", "dcp")


class LinTrainer(cb.Trainer):
    """``capture_bench.Trainer``'s interface (model, opt, step, fwd_bwd, opt_step, state_dict)
    for a stack of Linear + LayerNorm blocks on random data with an MSE loss."""

    def __init__(self, blocks: int, width: int = LIN_WIDTH, batch: int = LIN_BATCH) -> None:
        torch.manual_seed(0)
        self.cfg = {"blocks": blocks, "width": width, "batch": batch}
        layers: list[nn.Module] = []
        for _ in range(blocks):
            layers += [nn.Linear(width, width), nn.LayerNorm(width)]
        self.model = nn.Sequential(*layers)  # type: ignore[assignment]
        self.opt = torch.optim.AdamW(
            self.model.parameters(), lr=3e-4, weight_decay=0.1, betas=(0.9, 0.95)
        )
        g = torch.Generator().manual_seed(0)
        self.batches = [
            (torch.randn(batch, width, generator=g), torch.randn(batch, width, generator=g))
            for _ in range(16)
        ]
        self.i = 0
        self.params = sum(p.numel() for p in self.model.parameters())

    def fwd_bwd(self) -> None:
        x, y = self.batches[self.i % len(self.batches)]
        self.i += 1
        nn.functional.mse_loss(self.model(x), y).backward()


def make_trainer(name: str) -> cb.Trainer:
    if name in LIN_BLOCKS:
        return LinTrainer(LIN_BLOCKS[name])
    if name == "gpt87":
        return cb.Trainer(GPT87)
    raise ValueError(f"unknown workload {name!r}")


def hot_tensors(tr: cb.Trainer) -> list[torch.Tensor]:
    """What the bare writer copies: every parameter and every non-``step`` optimizer tensor."""
    out: list[torch.Tensor] = []
    for p in tr.model.parameters():  # tied weights come once
        out.append(p.detach())
        for k, v in tr.opt.state.get(p, {}).items():
            if k != "step" and isinstance(v, torch.Tensor):
                out.append(v)
    return out


def run_bare(
    tr: cb.Trainer,
    warmup: int,
    iters: int,
    root: Path,
    *,
    writer: type[BareWriter] = BareWriter,
    **kw: Any,
) -> dict[str, Any]:
    bw = writer(hot_tensors(tr), root / "bare.bin")  # views are rebuilt for every run
    try:
        for _ in range(warmup):
            tr.step()
            bw.save()
        bw.drain()
        n0 = len(bw.write_s)
        its, blocked, waits, copies = [], [], [], []
        t0, c0, p0 = time.perf_counter(), time.thread_time(), time.process_time()
        for _ in range(iters):
            t = time.perf_counter()
            tr.step()
            w, c = bw.save()
            its.append(time.perf_counter() - t)
            waits.append(w)
            copies.append(c)
            blocked.append(w + c)
        train_cpu = (time.thread_time() - c0) / iters
        bw.drain()  # the final drain: the last write is durable
        total = time.perf_counter() - t0
        proc_cpu = (time.process_time() - p0) / iters
    finally:
        bw.close()
    (root / "bare.bin").unlink(missing_ok=True)
    return {
        "iter_s": its,
        "total_s": total,
        "blocked_s": blocked,
        "wait_s": waits,
        "copy_s": copies,
        "write_s": bw.write_s[n0:],
        "writer_cpu_s": bw.write_cpu_s[n0:],
        "bytes": bw.nbytes,
        "tensors": len(bw.src),
        "train_cpu_s": train_cpu,
        "proc_cpu_s": proc_cpu,
    }


def run_bare_guarded(
    tr: cb.Trainer, warmup: int, iters: int, root: Path, **_: Any
) -> dict[str, Any]:
    """The bare writer plus the work the guarantees need (``_writers.GuardedWriter``)."""
    return run_bare(tr, warmup, iters, root, writer=GuardedWriter)


def run_dstt_sync(tr: cb.Trainer, warmup: int, iters: int, root: Path, **_: Any) -> dict[str, Any]:
    """dstt with ``copy="sync"``: the batched copy on the training thread (no copy thread)."""
    return cb._run_dstt(tr, warmup, iters, root, None, copy="sync")


RUNNERS: dict[str, Callable[..., dict[str, Any]]] = {
    "none": cb.run_none,
    "bare": run_bare,
    "bare_guarded": run_bare_guarded,
    "dstt": cb.run_dstt,
    "dstt_sync": run_dstt_sync,
    "dstt_delta": cb.run_dstt_delta,
    "dstt_delta_always": cb.run_dstt_delta_always,
    "torch_save": cb.run_torch_save,
    "dcp": cb.run_dcp,
}


# -- driver ---------------------------------------------------------------------------------
def _ratios(a: list[float], b: list[float]) -> list[float]:
    return [x / y for x, y in zip(a, b, strict=True)]


def bench_workload(
    name: str,
    modes: list[str],
    *,
    repeats: int,
    warmup: int,
    iters: int,
    root: Path,
    disk_total: int,
    log: Any,
    seconds: float = 0.0,
    warmup_seconds: float = 0.0,
) -> dict[str, Any]:
    tr = make_trainer(name)
    for _ in range(3):  # allocate optimizer state, warm the allocator
        tr.step()
    if seconds or warmup_seconds:  # at least this long per round and mode (same for all)
        t0 = time.perf_counter()
        for _ in range(5):
            tr.step()
        it = (time.perf_counter() - t0) / 5
        iters = max(iters, math.ceil(seconds / it))
        warmup = max(warmup, math.ceil(warmup_seconds / it))
    sbytes = state_bytes(tr.model, tr.opt)
    hot = hot_tensors(tr)
    n_state_dict = len(tr.model.state_dict()) + sum(
        1 for st in tr.opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)
    )
    log(
        f"[{name}] {tr.params / 1e6:.2f} M params, {len(hot)} tensors (+step counters), "
        f"{sbytes / 1e6:.1f} MB of state per step; {repeats} x {iters} iterations "
        f"(+{warmup} warmup)"
    )
    per: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    bw: list[float] = []
    for rep in range(repeats):
        bw.append(disk_bandwidth(root, disk_total))
        rot = modes[rep % len(modes) :] + modes[: rep % len(modes)]
        for mode in rot:
            gc.collect()
            d = root / mode
            d.mkdir()
            try:
                r = RUNNERS[mode](tr, warmup, iters, root=d)
            finally:
                shutil.rmtree(d, ignore_errors=True)
            # steady state: the timed iterations; the close (the drain of the last steps
            # and, for dstt, the session's last index job) is reported on its own
            loop = sum(r["iter_s"])
            r["s_per_iter"] = loop / iters
            r["close_s"] = max(0.0, r["total_s"] - loop)
            per[mode].append(r)
            log(
                f"[{name}] round {rep + 1}/{repeats} {mode:>10}: "
                f"{r['s_per_iter'] * 1e3:8.2f} ms/iter, blocked "
                f"{med(r['blocked_s']) * 1e3:7.2f} ms/step"
            )
    base = {
        m: [r["s_per_iter"] for r in per[m]] for m in ("none", "bare", "bare_guarded") if m in per
    }
    out_modes: dict[str, Any] = {}
    for mode, rs in per.items():
        spi = [r["s_per_iter"] for r in rs]
        eng = [med(r["writer_cpu_s"]) for r in rs if r.get("writer_cpu_s")]
        row: dict[str, Any] = {
            "s_per_iter": med(spi),
            "s_per_iter_all": spi,
            "spread": spread(spi),
            "close_s": med([r["close_s"] for r in rs]),
            "s_per_iter_with_close": med([r["total_s"] / iters for r in rs]),
            "iter_median_s": med([med(r["iter_s"]) for r in rs]),
            "ratio_vs_none": med(_ratios(spi, base["none"])) if "none" in base else None,
            "ratio_vs_none_all": _ratios(spi, base["none"]) if "none" in base else None,
            "ratio_vs_bare": med(_ratios(spi, base["bare"])) if "bare" in base else None,
            "ratio_vs_guarded": (
                med(_ratios(spi, base["bare_guarded"])) if "bare_guarded" in base else None
            ),
            "blocked_s_per_step": med([med(r["blocked_s"]) for r in rs]),
            "blocked_s_mean_per_step": med(
                [statistics.fmean(r["blocked_s"]) if r["blocked_s"] else 0.0 for r in rs]
            ),
            "engine_cpu_s_per_step": med(eng) if eng else None,
            "cpu_s_per_iter": med([r["proc_cpu_s"] for r in rs]),
            "train_thread_cpu_s_per_iter": med([r["train_cpu_s"] for r in rs]),
        }
        if mode in ("bare", "bare_guarded"):
            row.update({k: med([med(r[k]) for r in rs]) for k in ("wait_s", "copy_s", "write_s")})
            row.update({"bytes_per_step": rs[0]["bytes"], "tensors": rs[0]["tensors"]})
        elif mode.startswith("dstt"):
            row.update(
                {
                    "bytes_per_step": med([med(r["bytes"]) for r in rs]),
                    "written_bytes_per_step": med([med(r["written_bytes"]) for r in rs]),
                    "steps_measured": sum(len(r["bytes"]) for r in rs),
                    "committed": sum(r["committed"] for r in rs),
                    "backlog_max": max(r["backlog_max"] for r in rs),
                    "copy_s": med([med(r["copy_s"]) for r in rs]),
                    "flush_s": med([med(r["flush_s"]) for r in rs]),
                }
            )
        elif mode == "torch_save":
            row["file_bytes"] = rs[0]["file_bytes"]
        out_modes[mode] = row
    disk_s = [sbytes / b for b in bw]
    check: dict[str, Any] = {"disk_s_per_step": med(disk_s), "disk_s_per_step_all": disk_s}
    if "none" in base:
        per_round = [d < n for d, n in zip(disk_s, base["none"], strict=True)]
        check.update(
            {
                "none_s_per_iter": med(base["none"]),
                "disk_below_iter_all": per_round,
                "disk_below_iter": med(disk_s) < med(base["none"]),
            }
        )
    return {
        "model": {
            **tr.cfg,
            "params": tr.params,
            "state_bytes": sbytes,
            "tensors": len(hot),
            "tensors_with_step_counters": n_state_dict,
        },
        "warmup": warmup,
        "iters": iters,
        "disk": {
            "write_bytes_per_s": med(bw),
            "all": bw,
            "spread": spread(bw),
            "probe_bytes": disk_total,
            "method": "64 MiB writes into one file + fsync",
        },
        "check": check,
        "modes": out_modes,
    }


def _ms(x: float | None, fmt: str = ".2f") -> str:
    return "-" if x is None else format(x * 1e3, fmt)


def _x(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def print_tables(res: dict[str, Any]) -> None:
    for threads, run in res["runs"].items():
        for name, w in run["workloads"].items():
            m, disk, chk = w["model"], w["disk"], w["check"]
            ok = chk.get("disk_below_iter")
            print(
                f"\n### {name}, {threads} thread(s): {m['tensors']} tensors, "
                f"{m['state_bytes'] / 1e6:.1f} MB/step; disk "
                f"{disk['write_bytes_per_s'] / 1e9:.2f} GB/s -> "
                f"{chk['disk_s_per_step'] * 1e3:.1f} ms/step"
                + (
                    ""
                    if ok is None
                    else f" {'<' if ok else '>='} iteration "
                    f"{chk['none_s_per_iter'] * 1e3:.1f} ms ({'ok' if ok else 'disk-bound'})"
                )
                + "\n"
            )
            print(
                "| mode | s/iter | \u00d7 none | \u00d7 bare | \u00d7 guarded | blocked ms/step "
                "| engine CPU ms/step | close s |"
            )
            print("|---|---:|---:|---:|---:|---:|---:|---:|")
            for mode, r in w["modes"].items():
                print(
                    f"| {mode} | {r['s_per_iter']:.4f} | {_x(r['ratio_vs_none'])} | "
                    f"{_x(r['ratio_vs_bare'])} | {_x(r.get('ratio_vs_guarded'))} | "
                    f"{_ms(r['blocked_s_per_step'])} | "
                    f"{_ms(r['engine_cpu_s_per_step'])} | {r.get('close_s', 0.0):.2f} |"
                )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="1 repeat, 1 warmup, 3 iterations")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--modes", default=",".join(ALL_MODES))
    ap.add_argument(
        "--threads",
        default="2",
        help="torch intra-op threads; a comma list runs the whole bench per value",
    )
    ap.add_argument("--repeats", type=int, default=None, help="rounds (default 3)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed iterations (default 3)")
    ap.add_argument("--iters", type=int, default=None, help="timed iterations (default 20)")
    ap.add_argument(
        "--seconds",
        type=float,
        default=None,
        help="timed seconds per round and mode at least (more iterations where "
        "an iteration is short; default 2, quick 0: --iters only)",
    )
    ap.add_argument(
        "--warmup-seconds",
        type=float,
        default=None,
        help="untimed seconds at least (default 1, quick 0): past dstt's start "
        "(the flusher process, first layouts), which a run pays once",
    )
    ap.add_argument(
        "--disk-mib",
        type=int,
        default=None,
        help="MiB written by the disk probe per round (default 256, quick 32)",
    )
    ap.add_argument("--dir", default=None, help="where checkpoints go (default: a temp dir)")
    ap.add_argument("--json", default=None, help="default bench/results/hotpath.json")
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore", module="torch.distributed")

    names = [w for w in args.workloads.split(",") if w]
    modes = [m for m in args.modes.split(",") if m]
    for w in names:
        if w not in WORKLOADS:
            ap.error(f"unknown workload {w!r}; choose from {list(WORKLOADS)}")
    for m in modes:
        if m not in RUNNERS:
            ap.error(f"unknown mode {m!r}; choose from {list(RUNNERS)}")
    try:
        threads = [int(t) for t in args.threads.split(",") if t]
    except ValueError:
        ap.error(f"--threads takes integers, not {args.threads!r}")
    repeats = args.repeats or (1 if args.quick else 3)
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 3)
    iters = args.iters or (3 if args.quick else 20)
    disk_total = (args.disk_mib or (32 if args.quick else 256)) * MiB
    seconds = args.seconds if args.seconds is not None else (0.0 if args.quick else 2.0)
    warmup_seconds = (
        args.warmup_seconds if args.warmup_seconds is not None else (0.0 if args.quick else 1.0)
    )
    out_json = (
        Path(args.json)
        if args.json
        else (
            Path(__file__).parent
            / "results"
            / ("hotpath_quick.json" if args.quick else "hotpath.json")
        )
    )

    def log(msg: str) -> None:
        print(msg, flush=True)

    root = Path(tempfile.mkdtemp(prefix="dstt-hotpath-", dir=args.dir))
    t_start = time.perf_counter()
    res: dict[str, Any] = {
        "benchmark": "hotpath",
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "quick": args.quick,
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "source": source_state(),
            "platform": platform.platform(),
            "loadavg_before": os.getloadavg(),
        },
        "repeats": repeats,
        "warmup": warmup,
        "iters": iters,
        "seconds": seconds,
        "warmup_seconds": warmup_seconds,
        "modes": modes,
        "bare_writer": {
            "buffers": 1,
            "piece_bytes": PIECE,
            "align": ALIGN,
            "file": "O_TRUNC rewrite of one file + fsync per step",
            "guarded": "+ crc32c and CRC-32 per tensor, sumsq/max/min per tensor, "
            "a new file per step renamed into place, a JSON manifest "
            "written last, syncfs",
        },
        "runs": {},
    }
    try:
        if "dcp" in modes:  # its FileStore lives in root, not in the per-mode dirs
            cb._process_group(root)
        for t in threads:
            torch.set_num_threads(t)
            run: dict[str, Any] = {"threads": t, "workloads": {}}
            res["runs"][str(t)] = run
            log(f"-- torch threads: {t}")
            for name in names:
                run["workloads"][name] = bench_workload(
                    name,
                    modes,
                    repeats=repeats,
                    warmup=warmup,
                    iters=iters,
                    root=root,
                    disk_total=disk_total,
                    log=log,
                    seconds=seconds,
                    warmup_seconds=warmup_seconds,
                )
    finally:
        shutil.rmtree(root, ignore_errors=True)
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    return finish(res, out_json, t_start, print_tables)


if __name__ == "__main__":
    main()
