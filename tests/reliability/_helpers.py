"""Shared helpers: a small real training loop under ``dstt.session``, the CLI, bit comparison."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

import dstt
from dstt.testing.models import SyntheticBatches, TinyGPT

ROOT = Path(__file__).resolve().parents[2]
#: a small host cache, so most TinyGPT tensors span several 4 KiB chunk files
BUDGET = 1 << 14


def env() -> dict[str, str]:
    e = dict(os.environ)
    e["PYTHONPATH"] = str(ROOT) + os.pathsep + e.get("PYTHONPATH", "")
    e["OMP_NUM_THREADS"] = "1"
    return e


def cli(*args: str, timeout: float = 300) -> tuple[int, Any, str]:
    """Run ``python -m dstt.cli ARGS --json``; (exit code, parsed stdout or None, stderr)."""
    out = subprocess.run(
        [sys.executable, "-m", "dstt.cli", *args, "--json"],
        capture_output=True,
        text=True,
        env=env(),
        timeout=timeout,
    )
    try:
        doc = json.loads(out.stdout) if out.stdout.strip() else None
    except ValueError:
        doc = None
    return out.returncode, doc, out.stderr


def model_and_optimizer(seed: int = 0) -> tuple[TinyGPT, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = TinyGPT(vocab=64, d=32, layers=2, heads=4, seq=16, dropout=0.1)
    return model, torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)


def params(model: torch.nn.Module) -> dict[str, np.ndarray]:
    """Parameters by torch name, copied; a tied weight under each of its names, as a
    snapshot lists them (``names/tied``: stored once, reachable by every name)."""
    return {n: p.detach().numpy().copy() for n, p in model.named_parameters(remove_duplicate=False)}


def train(
    run: Any,
    steps: int,
    *,
    seed: int = 0,
    resume: bool = False,
    until: int | None = None,
    **session: Any,
) -> tuple[dict[int, dict[str, np.ndarray]], list[float]]:
    """Train TinyGPT under ``dstt.session`` to step ``until`` (default ``steps``) of a
    ``steps``-batch epoch; returns the parameters after every step and the losses."""
    torch.set_num_threads(1)
    model, opt = model_and_optimizer(seed)
    after: dict[int, dict[str, np.ndarray]] = {}
    losses: list[float] = []
    session.setdefault("budget_bytes", BUDGET)
    with dstt.session(model, opt, run=run, resume=resume, **session) as s:
        for x, y in s.data(SyntheticBatches(steps, seed=seed)):
            if until is not None and s.step >= until:
                break
            _, loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            s.log(loss=loss.item())
            losses.append(loss.item())
            after[s.step] = params(model)
    return after, losses


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes()
    )


def assert_params(got: Mapping[str, np.ndarray], want: Mapping[str, np.ndarray]) -> None:
    assert sorted(got) == sorted(want)
    for k in want:
        assert same_bits(got[k], want[k]), k


def stored_params(run: Any, step: int) -> dict[str, np.ndarray]:
    """Every parameter of ``step`` read back through ``dstt.open(run).at(step)``."""
    snap = dstt.open(run).at(step)
    return {n: snap.to_numpy(n) for n in snap.names()}
