"""Leak soak: ``--steps`` optimizer steps (default 2,000) checkpointed every step, in one process.

TinyGPT (the test model) trains under ``dstt.session(..., every=1)`` with a fixed host-cache
budget; every ``--every`` steps the process's resident memory (RSS), open file descriptors and
threads are sampled (after ``gc.collect()``), plus the sizes of the engine's bookkeeping that
grows with the step count by design (per-step metrics kept in memory) or by accident. After
the session closes, descriptors and threads must be back to their baseline. The curve goes to
``--json`` (default bench/results/leak.json); docs/reliability.md summarises it.

    python bench/leak_soak.py [--steps 2000] [--every 100] [--budget-mib 16] [--dir DIR]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import dstt
from dstt.testing.models import SyntheticBatches, TinyGPT

MiB = 1024 * 1024


def sample(proc: psutil.Process, step: int, s: Any) -> dict[str, Any]:
    gc.collect()
    storage = s.repo.storage if s is not None and s.repo is not None else None
    return {
        "step": step,
        "rss_mib": round(proc.memory_info().rss / MiB, 2),
        "fds": proc.num_fds(),
        "threads": threading.active_count(),
        "metrics_kept": len(s.metrics) if s is not None else 0,
        "storage_dir_cache": len(getattr(storage, "_made_dirs", ())),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--every", type=int, default=100)
    ap.add_argument("--budget-mib", type=float, default=16)
    ap.add_argument("--dir", help="where the run goes (default: a temporary directory)")
    ap.add_argument("--json", default=str(Path(__file__).parent / "results" / "leak.json"))
    a = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    work = Path(a.dir or tempfile.mkdtemp(prefix="dstt-leak-"))
    run = work / "run"
    proc = psutil.Process()
    model = TinyGPT(vocab=64, d=32, layers=2, heads=4, seq=16, dropout=0.1)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    base = sample(proc, 0, None)
    curve: list[dict[str, Any]] = []
    t0 = time.monotonic()
    with dstt.session(model, opt, run=run, budget_bytes=int(a.budget_mib * MiB)) as s:
        for x, y in s.data(SyntheticBatches(a.steps)):
            _, loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            s.log(loss=loss.item())
            if s.step % a.every == 0 or s.step == 1:
                curve.append(sample(proc, s.step, s))
                p = curve[-1]
                print(
                    f"step {p['step']:>6}  rss {p['rss_mib']:8.1f} MiB  fds {p['fds']:>4}  "
                    f"threads {p['threads']:>3}  metrics {p['metrics_kept']:>6}  "
                    f"dir cache {p['storage_dir_cache']:>6}",
                    flush=True,
                )
        cache = s._pipeline.cache if s._pipeline else None
        cache_capacity = cache.capacity if cache else 0
    seconds = time.monotonic() - t0
    end = sample(proc, a.steps, None)
    committed = len(dstt.open(run).steps)
    warm = next(p for p in curve if p["step"] >= min(200, a.steps))
    last = curve[-1]
    doc = {
        "benchmark": "leak_soak",
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "steps": a.steps,
        "committed": committed,
        "budget_bytes": int(a.budget_mib * MiB),
        "cache_capacity_bytes": cache_capacity,
        "seconds": round(seconds, 1),
        "baseline": base,
        "after_close": end,
        "rss_growth_after_warmup_mib": round(last["rss_mib"] - warm["rss_mib"], 2),
        "rss_growth_per_1000_steps_mib": round(
            (last["rss_mib"] - warm["rss_mib"]) * 1000 / max(1, last["step"] - warm["step"]), 3
        ),
        "fds_max_during": max(p["fds"] for p in curve),
        "fds_back_to_baseline": end["fds"] == base["fds"],
        "threads_back_to_baseline": end["threads"] == base["threads"],
        "curve": curve,
    }
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(doc, indent=2) + "\n")
    if not a.dir:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps({k: v for k, v in doc.items() if k != "curve"}, indent=2))
    ok = doc["fds_back_to_baseline"] and doc["threads_back_to_baseline"] and committed == a.steps
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
