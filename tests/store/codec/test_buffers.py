"""Reused encoder buffers: a retired shadow copy is recycled only once no encode that could
still be reading it is running (otherwise a delta would be computed against bytes that
change under it)."""

from __future__ import annotations

import threading

import numpy as np

from dstt.store.codec.buffers import Scratch, ShadowPool


def test_a_retired_buffer_is_not_reused_while_an_older_encode_runs() -> None:
    pool = ShadowPool(1 << 20)
    old = np.arange(64, dtype=np.uint8)
    epoch = pool.enter()  # an encode starts; it may read ``old`` as its base
    pool.retire([old])  # the step commits: ``old`` is replaced in the shadow
    fresh = pool.copy(np.zeros(64, dtype=np.uint8))
    assert fresh is not old
    assert old[5] == 5  # the running encode's base is untouched
    late = pool.enter()  # an encode that started after the swap cannot see ``old``
    pool.leave(epoch)
    again = pool.copy(np.full(64, 7, dtype=np.uint8))
    assert again is old
    assert (old == 7).all()  # now it is recycled
    pool.leave(late)


def test_the_free_list_is_bounded_and_sized() -> None:
    pool = ShadowPool(100)
    pool.retire([np.zeros(64, np.uint8), np.zeros(64, np.uint8), np.zeros(32, np.uint8)])
    assert pool.copy(np.ones(32, np.uint8)).nbytes == 32
    a, b = pool.copy(np.ones(64, np.uint8)), pool.copy(np.ones(64, np.uint8))
    assert a is not b  # only one 64-byte buffer fitted in the 100-byte bound


def test_scratch_is_per_thread_and_reused() -> None:
    s = Scratch()
    a = s.get("out", 100)
    assert s.get("out", 80).ctypes.data == a.ctypes.data  # the same memory, a smaller view
    other: list[np.ndarray] = []
    t = threading.Thread(target=lambda: other.append(s.get("out", 100)))
    t.start()
    t.join()
    assert other[0].ctypes.data != a.ctypes.data
