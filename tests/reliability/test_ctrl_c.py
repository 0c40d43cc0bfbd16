"""Ctrl-C at the terminal while a session trains or closes: one line, no traceback from
dstt's helper processes, and the run intact (issue 37).

A terminal's Ctrl-C is a SIGINT to the whole foreground process group. It used to reach the
flusher process and the index job too, which died mid-write printing ``KeyboardInterrupt``
tracebacks (one from ``dstt/store/index/job.py`` during a Trainer's shutdown). Here a real
SIGINT goes to the process group of a child running a session, as a terminal sends it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import dstt

CHILD = r"""
import sys
import torch
import dstt

run, phase = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)])
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
x = torch.randn(16, 256)
try:
    with dstt.session(model, opt, run=run, every=1) as s:
        for i in range(100_000):
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            s.log(loss=float(loss))
            if i == 24:
                print(phase, flush=True)
                if phase == "closing":
                    break
except KeyboardInterrupt:
    print("interrupted: the run keeps its committed steps", file=sys.stderr)
"""


@pytest.mark.parametrize("phase", ["training", "closing"])
def test_sigint_to_the_process_group_prints_one_line_and_keeps_the_run(
    tmp_path: Path, phase: str
) -> None:
    run = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(run), phase],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own group: the SIGINT below reaches what a terminal's would
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == phase
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert "Traceback" not in err, err
    assert proc.returncode == 0, err
    r = dstt.open(run)
    assert len(r.steps) >= 25
    assert r.steps == list(range(1, len(r.steps) + 1))
    assert r.verify().ok
    assert r.metrics().column("loss").size >= 25
