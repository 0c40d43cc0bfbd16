"""The capture path's Python work per step does not grow with the number of tensors (issue 13).

Every thread of the training process is traced while a session checkpoints a few steps, and
the lines of dstt's own code that run per step are counted, with every call dstt makes into
another package's Python (``Tensor.__hash__`` behind a dict lookup keyed by a parameter, for
one) — for a model with 5 layers and for one with 50 (10x the tensors). Per-tensor work
must run in C (``torch._foreach_copy_``, ``map`` over prebuilt columns, numpy over the flat
buffer): a Python line per tensor per step would show as hundreds of extra lines. Before
this was made so, the larger model ran ~8 more lines per extra tensor per step (the
optimizer-state check, the parameter slots, the sources of the copy, the CUDA check, the
chunk spans, the param-group names), and a hash of every parameter to find its optimizer
state.

With ``DSTT_FLUSHER=0`` the flusher's work (checksums, digests, the commit) runs in this
process and is counted too.
"""

from __future__ import annotations

import sys
import threading
import time
from collections import Counter
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
import torch
from torch import nn

import dstt

PKG = str(Path(dstt.__file__).parent)
STEPS = 6


class LineCounter:
    """Counts the lines executed in dstt's modules, on every thread, while ``on``."""

    def __init__(self) -> None:
        self.on = False
        self.lines: Counter[tuple[str, int]] = Counter()
        self._mu = threading.Lock()

    def _local(self, frame: FrameType, event: str, arg: Any) -> Any:
        if event == "line" and self.on:
            with self._mu:
                self.lines[(frame.f_code.co_filename, frame.f_lineno)] += 1
        return self._local

    def trace(self, frame: FrameType, event: str, arg: Any) -> Any:
        if not self.on:
            return None
        if frame.f_code.co_filename.startswith(PKG):
            return self._local
        caller = frame.f_back  # a Python function of another package that dstt calls (a
        if caller is not None and caller.f_code.co_filename.startswith(PKG):  # hash, say)
            with self._mu:
                self.lines[(frame.f_code.co_filename, frame.f_code.co_firstlineno)] += 1
        return None


def _lines_per_step(tmp_path: Path, layers: int) -> tuple[float, Counter[tuple[str, int]]]:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(4, 8)

    def step() -> None:
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()

    counter = LineCounter()
    threading.settrace(counter.trace)  # the engine's threads start inside the session
    sys.settrace(counter.trace)
    try:
        with dstt.session(model, opt, run=tmp_path / f"run{layers}", every=1) as s:
            for _ in range(6):  # layouts, plans and caches are built here
                step()
            s.wait()
            _settle(s, 6)
            fl = s._pipeline.sink.flusher  # (None: DSTT_FLUSHER=0)
            assert fl is None or fl.wait_ready(120)  # its work there, not here while it starts
            for _ in range(2):  # the child's first steps: the constants it caches are sent
                step()
            s.wait()
            _settle(s, 8)
            counter.on = True
            for _ in range(STEPS):
                step()
            s.wait()
            _settle(s, 8 + STEPS)  # every traced step committed
            counter.on = False
    finally:
        sys.settrace(None)
        threading.settrace(None)  # type: ignore[arg-type]
    return sum(counter.lines.values()) / STEPS, counter.lines


def _settle(s: Any, committed: int) -> None:
    deadline = time.monotonic() + 30
    while len(s.metrics) < committed and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(s.metrics) >= committed, f"{len(s.metrics)} of {committed} steps committed"


@pytest.mark.parametrize("flusher", ["1", "0"], ids=["flusher process", "in process"])
def test_python_lines_per_step_do_not_grow_with_the_tensor_count(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, flusher: str
) -> None:
    monkeypatch.setenv("DSTT_FLUSHER", flusher)
    monkeypatch.setenv("DSTT_INDEX_JOBS", "0")  # a job every 10 s is not per step
    small, small_lines = _lines_per_step(tmp_path, 5)
    large, large_lines = _lines_per_step(tmp_path, 50)
    extra_tensors = (50 - 5) * 2 * 4  # weight and bias, each with exp_avg, exp_avg_sq, step
    growth = [
        ((f.removeprefix(PKG), n), (large_lines[(f, n)] - small_lines.get((f, n), 0)) / STEPS)
        for f, n in large_lines
    ]
    worst = sorted(growth, key=lambda g: -g[1])[:5]
    assert small > 100, "the tracer saw the engine's lines"  # it measures something
    assert (large - small) / extra_tensors < 0.1, (
        f"{small:.0f} -> {large:.0f} dstt lines (and calls out of dstt) per step for "
        f"{extra_tensors} more tensors; "
        f"lines that grew most per step: {worst}"
    )
