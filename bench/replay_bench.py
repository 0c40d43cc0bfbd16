"""Replay cost (issue 30): one replay of a past step against one training step plus one
restore of the same step, measured in the same run.

A TinyGPT (``--layers`` blocks, AdamW, gradient accumulation over two micro-batches, a
DataLoader through ``s.data``) is trained ``--steps`` steps with a checkpoint every step. Then,
``--repeats`` times, interleaved: one training step (forward, backward, optimizer step) on a
live model; one ``run.at(k).load_into(model, optimizer, scheduler)``; one ``run.replay(k, ...)``
(restore k-1, forward/backward of the step's micro-batches, optimizer step, comparison with
commit k, per-sample losses). Reported: medians, and the ratio
``replay / (train step + restore)``; ~1 means a replay costs what it must (one step and one
restore) and the per-sample pass is extra (it is reported with ``--no-per-sample`` too).

    python bench/replay_bench.py [--quick] [--repeats 5] [--json bench/results/replay.json]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from torch.utils.data import DataLoader, TensorDataset

import dstt
from dstt.testing.models import TinyGPT, make_batch

SIZE = dict(vocab=512, d=128, layers=4, heads=4, seq=64, micro=8, samples=256)
QUICK = dict(vocab=64, d=32, layers=2, heads=4, seq=16, micro=4, samples=32)
ACCUM = 2


def build(size: dict[str, int]) -> tuple[Any, Any, Any]:
    torch.manual_seed(0)
    m = TinyGPT(
        vocab=size["vocab"],
        d=size["d"],
        layers=size["layers"],
        heads=size["heads"],
        seq=size["seq"],
        dropout=0.1,
    )
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: min(1.0, (k + 1) / 4))
    return m, opt, sched


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    size = QUICK if args.quick else SIZE
    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="dstt-replay-bench-"))
    try:
        x, y = make_batch(0, batch_size=size["samples"], seq=size["seq"], vocab=size["vocab"])
        ds = TensorDataset(x, y)

        def loss_fn(model: Any, b: Any) -> torch.Tensor:
            return model(b[0], b[1])[1] / ACCUM

        m, opt, sched = build(size)
        loader = DataLoader(
            ds, batch_size=size["micro"], shuffle=True, generator=torch.Generator().manual_seed(1)
        )
        with dstt.session(m, opt, run=work / "run", scheduler=sched) as s:
            micro = 0
            while s.step < args.steps:
                for b in s.data(loader):
                    loss_fn(m, b).backward()
                    micro += 1
                    if micro % ACCUM == 0:
                        opt.step()
                        sched.step()
                        opt.zero_grad()
                        if s.step == args.steps:
                            break
        run = dstt.open(work / "run")
        k = args.steps - 1
        step_s, restore_s, replay_s, replay_np_s, faithful = [], [], [], [], []
        batches = [ds[i] for i in range(size["micro"])]
        mb = (torch.stack([b[0] for b in batches]), torch.stack([b[1] for b in batches]))
        for _ in range(args.repeats):
            m, opt, sched = build(size)
            t = time.perf_counter()
            for _ in range(ACCUM):
                loss_fn(m, mb).backward()
            opt.step()
            sched.step()
            opt.zero_grad()
            step_s.append(time.perf_counter() - t)
            t = time.perf_counter()
            run.at(k).load_into(m, opt, sched)
            restore_s.append(time.perf_counter() - t)
            m, opt, sched = build(size)
            t = time.perf_counter()
            r = run.replay(k, m, opt, scheduler=sched, dataset=ds, loss_fn=loss_fn)
            replay_s.append(time.perf_counter() - t)
            faithful.append(bool(r.faithful))
            m, opt, sched = build(size)
            t = time.perf_counter()
            run.replay(k, m, opt, scheduler=sched, dataset=ds, loss_fn=loss_fn, per_sample=False)
            replay_np_s.append(time.perf_counter() - t)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    med = statistics.median
    res = {
        "bench": "replay",
        "size": size,
        "accum": ACCUM,
        "repeats": args.repeats,
        "train_step_s": med(step_s),
        "restore_s": med(restore_s),
        "replay_s": med(replay_s),
        "replay_no_per_sample_s": med(replay_np_s),
        "ratio": med(replay_s) / (med(step_s) + med(restore_s)),
        "ratio_no_per_sample": med(replay_np_s) / (med(step_s) + med(restore_s)),
        "faithful": all(faithful),
    }
    print(f"TinyGPT {size}, {ACCUM} micro-batches per step, medians of {args.repeats}:")
    print(
        f"  train step {res['train_step_s'] * 1e3:.1f} ms, restore {res['restore_s'] * 1e3:.1f}"
        f" ms, replay {res['replay_s'] * 1e3:.1f} ms (without per-sample losses "
        f"{res['replay_no_per_sample_s'] * 1e3:.1f} ms)"
    )
    print(
        f"  replay / (step + restore) = {res['ratio']:.2f} "
        f"({res['ratio_no_per_sample']:.2f} without per-sample); faithful: {res['faithful']}"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
