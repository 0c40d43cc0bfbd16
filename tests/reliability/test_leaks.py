"""Leaks: hundreds of checkpointed steps in one process keep memory and descriptors bounded.

These are correctness bounds on leaks, not speed: the thresholds are generous (a leak of a
step's worth of tensors, or one descriptor per step, still trips them). ``bench/leak_soak.py``
runs 2,000 steps and records the curve (docs/reliability.md).
"""

from __future__ import annotations

import gc
import os
import threading
from pathlib import Path

import psutil
import pytest
import torch

import dstt
from dstt.store import LocalStorage
from dstt.store.storage.local import _MADE_DIRS_KEPT
from dstt.testing.models import SyntheticBatches

from ._helpers import model_and_optimizer

MiB = 1 << 20
STEPS = 300
WARM = 100


def usage(proc: psutil.Process) -> tuple[float, int, int]:
    gc.collect()
    return proc.memory_info().rss / MiB, proc.num_fds(), threading.active_count()


def test_rss_and_descriptors_stay_flat_over_hundreds_of_steps(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    proc = psutil.Process()
    model, opt = model_and_optimizer()
    base_rss, base_fds, base_threads = usage(proc)
    samples: dict[int, tuple[float, int, int]] = {}
    budget = 4 * MiB
    with dstt.session(model, opt, run=tmp_path / "run", budget_bytes=budget) as s:
        for x, y in s.data(SyntheticBatches(STEPS)):
            _, loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            s.log(loss=loss.item())
            if s.step % 50 == 0:
                samples[s.step] = usage(proc)
        pipe = s._pipeline
        assert pipe is not None
        assert pipe.steps is not None
        assert pipe.steps.capacity <= budget  # the ring is the budgeted host memory
    rss, fds, threads = usage(proc)
    assert dstt.open(tmp_path / "run").steps == list(range(1, STEPS + 1))
    # after warm-up, 200 more checkpointed steps: a leak of one state (~370 KiB) per step
    # would be ~70 MiB; what the engine keeps per step (metrics) is well under 1 MiB
    growth = samples[STEPS][0] - samples[WARM][0]
    assert growth < 16, samples
    # not per step: the run's lock, the flusher's two pipes, and two open files (zip and side
    # file) per step awaiting its commit, of which there are at most ``max_backlog`` (a busy
    # machine gets there: the bound, not a handful, is what holds). One descriptor leaked per
    # step would be 300 here.
    fd_counts = [f for _, f, _ in samples.values()]
    assert max(fd_counts) <= base_fds + 2 * pipe.max_backlog + 6, samples
    assert fds == base_fds
    assert threads == base_threads  # all returned when the session closed
    assert rss - base_rss < 256  # the whole session: cache, torch, zarr/xarray imports


def test_descriptors_return_after_a_failed_session_start(tmp_path: Path) -> None:
    """A start refused by a damaged run must not keep the run's lock (a descriptor) open."""
    run = tmp_path / "run"
    model, opt = model_and_optimizer()
    with dstt.session(model, opt, run=run, budget_bytes=1 << 16) as s:
        for x, y in s.data(SyntheticBatches(2)):
            _, loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    # the head step's tensor bytes damaged (a lost HEAD or ref no longer refuses a start:
    # the reader rebuilds them from the headers)
    head = sorted((run / "steps").glob("*.zip"))[-1]
    good = head.read_bytes()
    bad = bytearray(good)
    for i in range(200, 400):
        bad[i] ^= 0xFF
    head.write_bytes(bytes(bad))
    proc = psutil.Process()
    before = usage(proc)[1]
    for _ in range(5):
        with pytest.raises(dstt.CorruptRunError, match=r"crc32c mismatch") as ei:
            dstt.session(model, opt, run=run, resume=True).start()
        assert usage(proc)[1] == before  # while the error (and its traceback) is alive
    del ei
    head.write_bytes(good)  # repaired: the same process can resume
    with dstt.session(model, opt, run=run, resume=True) as s:
        assert s.step == 2


def test_storage_forgets_the_folders_it_made(tmp_path: Path) -> None:
    """White-box: every step writes its objects into a new folder; the storage's memory of
    folders it made must not grow with the number of steps."""
    st = LocalStorage(tmp_path, durability="none")
    for slot in range(_MADE_DIRS_KEPT + 100):
        st.write(f"_dstt/objects/{slot:012d}/rng", b"x")
    assert len(st._made_dirs) <= _MADE_DIRS_KEPT
    st.write("_dstt/objects/000000000000/data", b"y")  # a forgotten folder still works
    assert (tmp_path / "_dstt/objects/000000000000/data").read_bytes() == b"y"
    assert len(os.listdir(tmp_path / "_dstt/objects")) == _MADE_DIRS_KEPT + 100
