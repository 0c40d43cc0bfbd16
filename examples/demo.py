"""dstt in two minutes: train with a checkpoint every step, look inside, go back in time.

    scripts/dev demo            (or: python examples/demo.py [--run DIR] [--steps N])

1. trains a small GPT-like model on synthetic data, checkpointing *every* optimizer step;
2. opens the run like a notebook would: steps, a layer as lazy xarray, a trajectory, summaries;
3. rolls back to an earlier step, skipping a few batches, and resumes on a new timeline;
4. shows both timelines side by side — nothing was deleted.
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

import torch

import dstt
from dstt.testing.models import SyntheticBatches, TinyGPT


def train(run: Path, steps: int, *, resume: bool = False) -> list[float]:
    torch.manual_seed(0)
    model = TinyGPT(vocab=64, d=64, layers=2, heads=4, seq=32)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=20, gamma=0.5)
    data = SyntheticBatches(steps + 16, batch_size=8, seq=32, vocab=64, seed=1)
    losses = []
    # fewer bytes, losslessly: XOR deltas, Adam(W) state predicted from the update rule;
    # raw_when_busy=False encodes every step even where writing raw would be faster
    enc = dstt.DeltaPolicy(raw_when_busy=False)
    with dstt.session(
        model, opt, run=run, every=1, scheduler=sched, resume=resume, encoding=enc
    ) as s:
        start = s.step
        for x, y in s.data(data):
            if s.step >= steps:
                break
            _, loss = model(x, y)
            loss.backward()
            opt.step()  # dstt waits here only if the previous step's copy is unfinished
            opt.zero_grad()
            sched.step()
            s.log(loss=loss.item(), lr=sched.get_last_lr()[0])
            losses.append(loss.item())
        blocked = [m.blocked_s for m in s.metrics]
        raw = sum(m.bytes for m in s.metrics)
        written = sum(m.written_bytes for m in s.metrics)
    label = "resumed" if resume else "trained"
    print(
        f"  {label} steps {start + 1}..{start + len(losses)}; "
        f"median blocked time per step {sorted(blocked)[len(blocked) // 2] * 1e3:.2f} ms; "
        f"wrote {written / 1e6:.1f} MB for {raw / 1e6:.1f} MB of state "
        f"({raw / max(1, written):.1f}x fewer bytes)"
    )
    return losses


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--run",
        type=Path,
        default=Path("runs/demo"),
        help="run directory, replaced if it exists (default: runs/demo)",
    )
    ap.add_argument("--steps", type=int, default=60)
    args = ap.parse_args()
    if args.run.exists():
        dstt.open(args.run)  # refuse to delete a directory that is not a dstt run
        shutil.rmtree(args.run)
    t0 = time.perf_counter()
    print(f"1. training {args.steps} steps with a checkpoint every step -> {args.run}")
    train(args.run, args.steps)

    print("2. inspecting")
    run = dstt.open(args.run)
    print(f"  {len(run.steps)} committed steps: {run.steps[0]}..{run.steps[-1]}")
    layer = run.at(step=args.steps // 2).layer("layers.0")
    print(
        f"  run.at(step={args.steps // 2}).layer('layers.0') -> lazy {type(layer).__name__} "
        f"of {len(list(layer.subtree))} nodes"
    )
    name = "layers.0.qkv.weight"
    traj = run.trajectory(name, steps=slice(1, args.steps))
    drift = float(abs(traj.isel(step=-1) - traj.isel(step=0)).max())
    print(f"  trajectory of {name}: dims {dict(traj.sizes)}, max drift {drift:.4f}")
    loss = run.metrics()["loss"]
    print(f"  loss: first {float(loss[0]):.3f} -> last {float(loss[-1]):.3f}")
    ok = run.verify().ok
    print(f"  verify: {'ok' if ok else 'PROBLEMS'}")

    back = args.steps * 2 // 3
    print(f"3. rolling back to step {back} (skipping 2 batches) and resuming")
    timeline = run.rollback(to=back, skip_data=2)
    train(args.run, args.steps, resume=True)

    print("4. both timelines are still there")
    run = dstt.open(args.run)
    for tl in run.timelines:
        steps = [h.step for h in run.commits(tl)]
        print(f"  timeline {tl!r}: steps {steps[0]}..{steps[-1]}")
    a = run.at(step=args.steps, timeline="main").to_numpy(name)
    b = run.at(step=args.steps, timeline=timeline).to_numpy(name)
    print(f"  step {args.steps}: |main - {timeline}| max = {abs(a - b).max():.4f}")
    print(f"done in {time.perf_counter() - t0:.1f} s. Next: dstt ls --run {args.run}")


if __name__ == "__main__":
    main()
