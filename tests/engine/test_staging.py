"""The buffer ring, segmented copies and the version guard, without a store."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dstt.engine.capture.flatlane import StepBuffers, segments
from dstt.engine.capture.staging import Copier, VersionGuard, tensor_checksum
from dstt.engine.tensors._convert import flat_bytes
from dstt.store.format.flat import FlatLayout
from dstt.store.format.layout import plan_chunks


def test_the_ring_applies_backpressure_until_a_buffer_is_released() -> None:
    ring = StepBuffers(1024, 2)
    a, _ = ring.acquire()
    b, _ = ring.acquire()
    got: list[int] = []
    t = threading.Thread(target=lambda: got.append(ring.acquire()[0]))
    t.start()
    time.sleep(0.1)
    assert got == []  # both buffers held: the third acquire waits
    assert ring.peak_bytes == ring.capacity == 2048
    ring.release(a)
    t.join(2)
    assert got == [a]
    assert ring.stall_s > 0.05
    ring.release(b)
    ring.release(a)
    assert ring.in_use == 0


def test_closing_the_ring_wakes_a_blocked_acquire() -> None:
    ring = StepBuffers(64, 1)
    ring.acquire()
    errors: list[BaseException] = []

    def blocked() -> None:
        try:
            ring.acquire()
        except RuntimeError as e:
            errors.append(e)

    t = threading.Thread(target=blocked)
    t.start()
    time.sleep(0.05)
    ring.close()
    t.join(2)
    assert len(errors) == 1


@settings(max_examples=40, deadline=None)
@given(
    shape=st.lists(st.integers(0, 40), min_size=0, max_size=3),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.int64, torch.uint8]),
    chunk=st.integers(8, 600),
    room=st.integers(1, 4),
)
def test_a_segmented_copy_through_a_small_ring_is_byte_exact(shape, dtype, chunk, room) -> None:
    """Any tensor, copied segment by segment through a buffer smaller than itself (at least
    one chunk), arrives intact: the segments' parts cover its bytes once, in order."""
    t = (torch.randn(shape) * 1000).to(dtype)
    src = flat_bytes(t)
    plan = plan_chunks(tuple(shape), t.element_size(), chunk)
    layout = FlatLayout.build([("x/t", "float32", plan)], framed=False)
    nbytes = max(1, min(plan.chunk_nbytes, plan.nbytes)) * room
    ring = StepBuffers(nbytes, 2)
    out = torch.empty_like(src)
    copier = Copier()
    for seg in segments(layout, nbytes):
        index, _ = ring.acquire()
        buf = ring.buffers[index]
        dst = [buf[lo - seg.start : hi - seg.start] for _, lo, hi in seg.parts]
        copier.copy_all(dst, [src[lo:hi] for _, lo, hi in seg.parts]).wait()
        for _, lo, hi in seg.parts:  # what a writer thread would write
            out[lo:hi] = buf[lo - seg.start : hi - seg.start]
        ring.release(index)
    assert torch.equal(out, src)
    assert ring.in_use == 0


def test_checksum_is_additive_over_chunks() -> None:
    t = torch.randn(33, 7).to(torch.bfloat16)
    src = flat_bytes(t)
    plan = plan_chunks((33, 7), 2, 50)
    total = 0
    for i in range(plan.n_chunks):
        a, b = plan.byte_range(i)
        total += int(tensor_checksum(src[a:b], 2))
    assert total & (2**64 - 1) == int(tensor_checksum(src, 2)) & (2**64 - 1)


def test_version_guard_sees_in_place_writes_only() -> None:
    w = torch.nn.Parameter(torch.ones(4))
    guard = VersionGuard({"w": w}, {"w": 4})
    assert guard.check({"w": w}) == []
    with torch.no_grad():
        w.data.add_(1)  # bypasses the version counter
    assert guard.check({"w": w}) == []
    with torch.no_grad():
        w.mul_(2)
    (report,) = guard.check({"w": w})
    assert report.path == "w"
    assert "version" in report.reason


def test_verify_mode_catches_data_writes_before_or_after_the_copy() -> None:
    for write_before_copy in (True, False):
        w = torch.nn.Parameter(torch.arange(6, dtype=torch.float32))
        guard = VersionGuard({"w": w}, {"w": 4}, verify=True)
        if write_before_copy:
            w.data[0] = 100.0
        guard.add_copy("w", flat_bytes(w).clone())
        if not write_before_copy:
            w.data[0] = 100.0
        (report,) = guard.check({"w": w})
        assert ".data" in report.reason


def test_verify_mode_passes_an_untouched_tensor() -> None:
    w = torch.randn(10, 3)
    guard = VersionGuard({"w": w}, {"w": 4}, verify=True)
    src = flat_bytes(w)
    guard.add_copy("w", src[:60].clone())
    guard.add_copy("w", src[60:].clone())
    assert guard.check({"w": w}) == []


def test_step_buffers_report_pressure_when_the_last_buffer_goes_and_relief_when_all_are_back() -> (
    None
):
    """The flusher runs at SCHED_IDLE until the ring runs low: taking the last free buffer
    says so (it is raised to normal priority), and only a ring that is free again lowers it."""
    from dstt.engine.capture.flatlane import StepBuffers

    ring = StepBuffers(64, 3)
    calls: list[bool] = []
    ring.on_pressure = calls.append
    a, _ = ring.acquire()
    b, _ = ring.acquire()
    assert calls == []  # one left: no pressure yet
    c, _ = ring.acquire()
    assert calls == [True]
    ring.release(a)
    d, _ = ring.acquire()  # the last one again, while still pressed: said once
    assert calls == [True]
    for i in (b, c, d):
        ring.release(i)
    assert calls == [True, False]


def test_an_urgent_flusher_runs_at_normal_priority_until_it_has_caught_up() -> None:
    """Every thread of the child that runs at SCHED_IDLE moves: Linux schedules threads, and
    raising only the process id had left the writer thread idle while the engine waited."""
    import os

    from dstt.store.flusher.parent import Flusher, flusher_supported

    if not flusher_supported() or not hasattr(os, "SCHED_IDLE"):
        pytest.skip("the flusher process needs Linux")
    fl = Flusher(4096, 2)
    try:
        assert fl.proc is not None
        pid = fl.proc.pid
        tids = fl.idle_threads
        assert pid in tids
        assert len(tids) == 2  # the main thread and the writer
        assert set(tids) <= {int(t) for t in os.listdir(f"/proc/{pid}/task")}
        policy = {t: os.sched_getscheduler(t) for t in tids}
        assert set(policy.values()) == {os.SCHED_IDLE}, policy  # lowered before "ready"
        fl.urgent(True)
        if os.sched_getscheduler(pid) != os.SCHED_OTHER:  # refused here: urgent() tolerates
            with pytest.raises(PermissionError):  # it, as documented; the OS refuses it
                os.sched_setscheduler(pid, os.SCHED_OTHER, os.sched_param(0))
        else:
            assert [os.sched_getscheduler(t) for t in tids] == [os.SCHED_OTHER] * 2
        fl.urgent(False)
        assert [os.sched_getscheduler(t) for t in tids] == [os.SCHED_IDLE] * 2
    finally:
        fl.close()
