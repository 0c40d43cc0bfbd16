"""Per-iteration overhead of a checkpoint every step under DeepSpeed (issue 6).

One DeepSpeed engine per mode (same seed, ZeRO ``--stage``, world size 1, gloo on the CPU,
AdamW as client optimizer) trains ``dstt.testing.models.TinyGPT``. Each repeat runs every mode
round-robin in a rotated order — ``--warmup`` untimed then ``--iters`` timed iterations — so a
noisy neighbour hits all modes alike:

* ``none``           no checkpointing: the baseline of every ratio;
* ``ds_torch``       ``engine.save_checkpoint`` every iteration with DeepSpeed's default
                     ``TorchCheckpointEngine`` (``torch.save`` on the training thread; it
                     fsyncs nothing, ``latest`` included — cheaper than durable);
* ``ds_decoupled``   ``save_checkpoint`` every iteration with DeepSpeed's
                     ``DecoupledCheckpointEngine`` (``"checkpoint": {"writer": {"type":
                     "python", "decoupled": true}}``: state dicts go to a writer process, the
                     commit waits at the next step);
* ``dstt_engine``    ``save_checkpoint`` every iteration through ``DsttCheckpointEngine``;
* ``dstt_session``   ``dstt.session(engine, run=...)``: every optimizer step captured lazily
                     (no ``save_checkpoint`` call at all).

Two tags alternate for the DeepSpeed-format modes so the disk holds two checkpoints. Per repeat
and mode: ``s/iter`` = (timed iterations + the final flush) / N, and the per-iteration median;
reported as medians over repeats and ratios to ``none`` (median of per-repeat ratios), and the
ratio of the best repeats (least inflated by a busy machine). ``blocked_median``: the session's
per-step wait for its copies (the only time dstt blocks training).

    python bench/deepspeed_bench.py [--quick] [--stage 2] [--repeats 3] [--iters 20]
                                    [--stages 2,0] [--json bench/results/deepspeed.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("DS_BUILD_OPS", "0")

import torch

import dstt
from dstt.testing.models import TinyGPT, make_batch

MODES = ("none", "ds_torch", "ds_decoupled", "dstt_engine", "dstt_session")
SIZE = dict(vocab=2048, d=256, layers=4, heads=4, seq=64, batch=4)
QUICK = dict(vocab=128, d=64, layers=2, heads=2, seq=16, batch=4)


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def init_dist() -> None:
    import deepspeed

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # CROSS_*: the launcher's machine count/rank, which DeepSpeed's checkpoint writers read
    os.environ.update(
        RANK="0",
        WORLD_SIZE="1",
        LOCAL_RANK="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        CROSS_SIZE="1",
        CROSS_RANK="0",
    )
    deepspeed.init_distributed(dist_backend="gloo")


def make_engine(size: dict[str, int], stage: int, mode: str) -> Any:
    import deepspeed

    torch.manual_seed(0)
    model = TinyGPT(**{k: v for k, v in size.items() if k != "batch"}, dropout=0.0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": size["batch"],
        "steps_per_print": 10**9,
        "zero_optimization": {"stage": stage},
    }
    if mode == "ds_decoupled":
        # "replica": DeepSpeed 0.19.8 fails without it when there is no mpu (dp_rank bug)
        cfg["checkpoint"] = {
            "writer": {"type": "python", "decoupled": True, "data_parallel": "replica"}
        }
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    return engine


def step(engine: Any, size: dict[str, int], i: int) -> None:
    x, y = make_batch(i, batch_size=size["batch"], seq=size["seq"], vocab=size["vocab"])
    _, loss = engine(x, y)
    engine.backward(loss)
    engine.step()


def run_mode(
    mode: str, engine: Any, size: dict[str, int], root: Path, warmup: int, iters: int, rep: int
) -> dict[str, Any]:
    from dstt.engine.ds.ds_checkpoint import DsttCheckpointEngine

    where = root / f"{mode}-{rep}"
    session = None
    ce = None
    if mode == "dstt_session":
        session = dstt.session(engine, run=where, summaries=True)
        session.start()
    elif mode == "dstt_engine":
        ce = DsttCheckpointEngine.attach(engine, run=where / "dstt")
    times: list[float] = []
    t_all = 0.0
    for i in range(warmup + iters):
        t0 = time.perf_counter()
        step(engine, size, i)
        if mode.startswith(("ds_", "dstt_engine")):
            engine.save_checkpoint(str(where), tag=f"t{i % 2}")
        dt = time.perf_counter() - t0
        if i >= warmup:
            times.append(dt)
            t_all += dt
    t0 = time.perf_counter()
    blocked = []
    if session is not None:
        session.close()
        blocked = [m.blocked_s for m in session.metrics]
    if ce is not None:
        ce.close()
    if mode == "ds_decoupled":
        engine.checkpoint_engine.commit(
            engine.checkpoint_engine.get_commit_info()
        ) if engine.checkpoint_engine.get_commit_info() is not None else None
    t_all += time.perf_counter() - t0
    shutil.rmtree(where, ignore_errors=True)
    return {
        "s_per_iter": t_all / iters,
        "iter_median": med(times),
        "blocked_median": med(blocked) if blocked else None,
    }


def summarize(
    runs: list[dict[str, Any]],
    base: list[dict[str, Any]],
    ratios: list[float],
    iter_ratios: list[float],
    blocked: list[float],
) -> dict[str, Any]:
    """Medians over repeats, plus the best repeat of each mode: on a shared machine the
    minimum is the figure least inflated by neighbours (``ratio_of_mins``)."""
    best = min(r["s_per_iter"] for r in runs)
    return {
        "s_per_iter": med([r["s_per_iter"] for r in runs]),
        "iter_median": med([r["iter_median"] for r in runs]),
        "ratio": med(ratios),
        "iter_ratio": med(iter_ratios),
        "s_per_iter_min": best,
        "ratio_of_mins": best / min(b["s_per_iter"] for b in base),
        "blocked_median": med(blocked) if blocked else None,
        "repeats": runs,
    }


def bench_stage(
    stage: int,
    modes: list[str],
    size: dict[str, int],
    root: Path,
    repeats: int,
    warmup: int,
    iters: int,
) -> dict[str, Any]:
    """Every mode at one ZeRO stage; returns the stage's table."""
    engines = {m: make_engine(size, stage, m) for m in modes}
    n_params = sum(p.numel() for p in engines["none"].module.parameters())
    per: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    failed: dict[str, str] = {}
    for rep in range(repeats):
        order = modes[rep % len(modes) :] + modes[: rep % len(modes)]
        for m in order:
            if m in failed:
                continue
            try:
                per[m].append(run_mode(m, engines[m], size, root, warmup, iters, rep))
            except Exception as e:  # a peer that does not work here is reported, not fatal
                failed[m] = f"{type(e).__name__}: {str(e)[:300]}"
                print(f"stage {stage} repeat {rep} {m:13s} FAILED {failed[m]}", flush=True)
                continue
            print(
                f"stage {stage} repeat {rep} {m:13s} {per[m][-1]['s_per_iter']:.4f} s/iter",
                flush=True,
            )
    result: dict[str, Any] = {m: {"error": e} for m, e in failed.items()}
    for m in modes:
        if m in failed:
            continue
        ratios = [
            r["s_per_iter"] / b["s_per_iter"] for r, b in zip(per[m], per["none"], strict=True)
        ]
        iter_ratios = [
            r["iter_median"] / b["iter_median"] for r, b in zip(per[m], per["none"], strict=True)
        ]
        blocked = [r["blocked_median"] for r in per[m] if r["blocked_median"] is not None]
        result[m] = summarize(per[m], per["none"], ratios, iter_ratios, blocked)
    for e in engines.values():
        ce = getattr(e, "checkpoint_engine", None)
        if ce is not None and ce.is_decoupled():
            try:
                ce.cleanup()
            except Exception as err:  # DeepSpeed's writer process may be gone already
                print(f"cleanup of {type(ce).__name__} failed: {err}")
    return {
        "params": n_params,
        "state_bytes": n_params * 12,
        "modes": {m: result[m] for m in modes},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument(
        "--stages",
        default="2,0",
        help="ZeRO stages, each a separate table (DeepSpeed's decoupled engine "
        "fails under ZeRO 1/2 here; stage 0 shows it working)",
    )
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--dir", default=None, help="scratch directory (default: a tmp dir)")
    ap.add_argument(
        "--json",
        default=None,
        help="default: bench/results/deepspeed.json (deepspeed_quick.json with --quick)",
    )
    args = ap.parse_args()
    size = QUICK if args.quick else SIZE
    repeats = args.repeats or (1 if args.quick else 3)
    iters = args.iters or (6 if args.quick else 20)
    warmup = args.warmup if args.warmup is not None else (2 if args.quick else 4)
    modes = [m for m in args.modes.split(",") if m]
    if "none" not in modes:
        modes.insert(0, "none")
    torch.set_num_threads(1)
    init_dist()
    root = Path(args.dir or tempfile.mkdtemp(prefix="dstt-dsbench-"))
    root.mkdir(parents=True, exist_ok=True)
    load0 = os.getloadavg()
    stages = [int(x) for x in args.stages.split(",")]
    try:
        by_stage = {
            str(st): bench_stage(st, modes, size, root, repeats, warmup, iters) for st in stages
        }
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    import deepspeed

    doc = {
        "benchmark": "deepspeed",
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "quick": args.quick,
        "world_size": 1,
        "model": size,
        "repeats": repeats,
        "iters": iters,
        "warmup": warmup,
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "deepspeed": deepspeed.__version__,
            "loadavg_before": load0,
            "loadavg_after": os.getloadavg(),
        },
        "stages": by_stage,
    }
    out = Path(args.json or f"bench/results/deepspeed{'_quick' if args.quick else ''}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2) + "\n")
    for st, res in by_stage.items():
        print(
            f"ZeRO stage {st}: {res['params']} params, {res['state_bytes'] / 2**20:.1f} MiB "
            "of fp32 state per step"
        )
        print(f"  {'mode':14s} {'s/iter':>8s} {'ratio':>6s} {'iter-ratio':>10s} {'min-ratio':>9s}")
        for m, r in res["modes"].items():
            if "error" in r:
                print(f"  {m:14s} failed: {r['error'][:120]}")
                continue
            print(
                f"  {m:14s} {r['s_per_iter']:8.4f} {r['ratio']:6.2f} {r['iter_ratio']:10.2f} "
                f"{r['ratio_of_mins']:9.2f}"
            )


if __name__ == "__main__":
    main()
