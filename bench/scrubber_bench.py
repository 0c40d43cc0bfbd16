"""The scrubber at interactive speed (issue 37): one step change, driven from code.

Builds a run like the shipped notebooks' (``dstt.testing.models.TinyGPT``, ``--steps`` steps
with a session, ``every=1``) or a small Llama (``--llama``: ``dstt.testing.llama``), opens
``dstt.widgets.scrubber(run)`` (the matplotlib Agg backend; no browser) and times
``slider.value = k`` for each of ``--moves`` steps in a row, the way a user clicks ▶: the
median and the worst, and the CPU time of each move with its prefetch of the neighbours
(waited for before the next move): what a quiet machine's wall time approaches, where a
loaded machine's wall time mostly measures the neighbours. Goal: <= 0.25 s a step change.

    python bench/scrubber_bench.py [--steps 40] [--moves 12] [--llama] [--profile]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("MPLBACKEND", "Agg")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

import dstt
import dstt.widgets


def build(path: Path, steps: int, llama: bool) -> None:
    from dstt.testing.llama import LlamaConfig, TinyLlama
    from dstt.testing.models import TinyGPT

    torch.manual_seed(0)
    torch.set_num_threads(1)  # small models: threads only contend on a shared machine
    model: torch.nn.Module
    if llama:  # LLAMA_125M's shape, scaled down: 4 layers of d=256, 4k vocabulary (4.6 M)
        cfg = LlamaConfig(vocab=4096, d=256, layers=4, heads=8, kv_heads=4, ffn=688, seq=64)
        model = TinyLlama(cfg)
    else:
        model = TinyGPT()
        cfg = None
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)

    def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
        vocab = cfg.vocab if cfg is not None else 64
        out = []
        for _ in range(steps):
            idx = torch.randint(0, vocab, (4, 17), generator=g)
            out.append((idx[:, :-1], idx[:, 1:]))
        return out

    with dstt.session(model, opt, run=str(path), every=1) as s:
        for x, y in s.data(batches()):
            _, loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            s.log(loss=loss.item())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--moves", type=int, default=12)
    ap.add_argument("--llama", action="store_true")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--run", default=None, help="an existing run instead of building one")
    args = ap.parse_args()
    path = Path(args.run) if args.run else Path(tempfile.mkdtemp(prefix="scrub-")) / "run"
    if not args.run:
        build(path, args.steps, args.llama)
    t0 = time.perf_counter()
    w = dstt.widgets.scrubber(dstt.open(path))
    first = time.perf_counter() - t0
    steps = list(w.slider.options)
    times, cpus = [], []
    prof = None
    if args.profile:
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    for k in steps[: args.moves]:
        t, c = time.perf_counter(), time.process_time()
        w.slider.value = k
        times.append(time.perf_counter() - t)
        w.model.wait_prefetch()  # the neighbours' loads count to this move's CPU
        cpus.append(time.process_time() - c)
    if prof is not None:
        prof.disable()
        import pstats

        pstats.Stats(prof).sort_stats("cumulative").print_stats(30)
    out = {
        "steps": len(steps),
        "open_s": first,
        "median_s": statistics.median(times),
        "max_s": max(times),
        "all_s": times,
        "cpu_median_s": statistics.median(cpus),
        "cpu_all_s": cpus,
        "load": os.getloadavg()[0],
    }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
