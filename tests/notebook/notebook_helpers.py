"""Helpers for the notebook-experience tests: small runs written through ``dstt.store.save``.

Imported by name (``from notebook_helpers import ...``): tests/notebook is on sys.path under
pytest's default import mode and is not a package. The run follows dstt's step rule (the loss
filed under step k was computed on the weights of step k - 1): ``layers.1.mlp.weight`` jumps in
the update into ``CAUSE_STEP`` (from ``CAUSE_STEP - 1``), so the loss filed under
``SPIKE_STEP = CAUSE_STEP + 1`` spikes; the update into ``SPIKE_STEP`` moves ``emb.weight``
(the optimizer's reaction to the bad loss), a decoy for code that looks one update too late.
Rejected alternative: training a model here — slower, and the exact tensors would not be known
to the assertions.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from dstt.store import LocalStorage, save

STEPS = list(range(1, 31))
SPIKE_STEP = 20
CAUSE_STEP = SPIKE_STEP - 1
JUMPER = "layers.1.mlp.weight"
REACTOR = "emb.weight"


def arrays_at(step: int, shift: float = 0.0) -> dict[str, np.ndarray]:
    """Deterministic tensors of ``step``; ``shift`` offsets a rollback timeline's weights."""
    rng = np.random.default_rng(7)
    base = {
        "params/emb/weight": rng.standard_normal((10, 4)),
        "params/layers/0/attn/weight": rng.standard_normal((8, 6)),
        "params/layers/0/attn/bias": rng.standard_normal(8),
        "params/layers/1/mlp/weight": rng.standard_normal((4, 3, 2)),
        "params/big/weight": rng.standard_normal((600, 10)),
    }
    drift = np.random.default_rng(11)
    out: dict[str, np.ndarray] = {}
    for k, v in base.items():
        d = drift.standard_normal(v.shape)
        w = v + 0.01 * step * d + shift
        if k == "params/layers/1/mlp/weight" and step >= CAUSE_STEP:
            w = w + 5.0  # the "blow-up": the update that causes the spike
        if k == "params/emb/weight" and step >= SPIKE_STEP:
            w = w + 0.5  # the reaction to the spike's gradient
        out[k] = w.astype(np.float32)
    out["buffers/layers/0/mask"] = np.array([1, 0, 1], dtype=np.int8)
    out["optim/exp_avg/layers/0/attn/weight"] = np.full((8, 6), 0.1 * step, np.float32)
    return out


def smooth_loss(step: int) -> float:
    """The loss of a rollback timeline: a little lower, no spike."""
    return 0.99 * 3.0 * np.exp(-step / 40)


def loss_at(step: int) -> float:
    return 3.0 * np.exp(-step / 40) + (5.0 if step == SPIKE_STEP else 0.0) + 0.01 * (step % 3)


def summaries_at(step: int, shift: float = 0.0) -> dict[str, Any]:
    """The engine's ``summaries`` object (exact updates against the previous step)."""
    cur, prev = arrays_at(step, shift), arrays_at(step - 1, shift) if step > 1 else None
    out: dict[str, Any] = {}
    for p, a in cur.items():
        x = a.astype(np.float64)
        l2 = float(np.linalg.norm(x))
        upd = None if prev is None else float(np.linalg.norm(x - prev[p]))
        out[p] = {
            "l2": l2,
            "rms": l2 / np.sqrt(x.size),
            "maxabs": float(np.abs(x).max()),
            "nan": 0,
            "inf": 0,
            "update_l2": upd,
            "update_ratio": None if upd is None or l2 == 0 else upd / l2,
            "probe": [],
            "update_exact": upd is not None,
        }
    return out


def write_run(
    path: Path,
    steps: list[int],
    *,
    summaries: bool = False,
    shift: float = 0.0,
    loss: Callable[[int], float] = loss_at,
) -> None:
    storage = LocalStorage(path, create=True, durability="none")  # tests need no fsync
    for s in steps:
        objects = {"summaries": summaries_at(s, shift)} if summaries else None
        save(
            storage, s, arrays_at(s, shift), objects=objects, metrics={"loss": loss(s), "lr": 1e-3}
        )
