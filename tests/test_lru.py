"""The one LRU every reader-side cache uses: bounds by count and by weight, recency, counters."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from dstt._lru import LRU


def test_evicts_the_least_recently_used_entry_by_count() -> None:
    c: LRU[str, int] = LRU(2)
    c.put("a", 1)
    c.put("b", 2)
    assert c.get("a") == 1  # a is now the most recent
    c.put("c", 3)
    assert "b" not in c
    assert "a" in c
    assert "c" in c
    assert (c.hits, c.misses) == (1, 0)
    assert c.get("b") is None
    assert c.misses == 1


def test_weight_bound_counts_bytes_and_skips_oversized_values() -> None:
    c: LRU[int, np.ndarray] = LRU(100, weigh=lambda a: int(a.nbytes), max_weight=64)
    for i in range(4):
        c.put(i, np.zeros(4, np.float32))  # 16 bytes each: all four fit
    assert len(c) == 4
    assert c.weight == 64
    c.put(9, np.zeros(8, np.float32))  # 32 bytes: the two oldest go
    assert sorted(k for k in range(10) if k in c) == [2, 3, 9]
    assert c.weight == 64
    c.put(10, np.zeros(100, np.float32))  # heavier than the budget: never kept
    assert 10 not in c
    assert c.weight == 64
    c.put(9, np.zeros(2, np.float32))  # replacing a key re-weighs it
    assert c.weight == 16 + 16 + 8
    c.clear()
    assert len(c) == 0
    assert c.weight == 0


def test_get_or_make_makes_once_per_miss() -> None:
    made: list[int] = []
    c: LRU[int, int] = LRU(4)
    for _ in range(3):
        assert c.get_or_make(7, lambda: made.append(7) or 49) == 49
    assert made == [7]
    assert (c.hits, c.misses) == (2, 1)


def test_bad_bounds_are_refused() -> None:
    with pytest.raises(ValueError, match="capacity"):
        LRU(0)
    with pytest.raises(ValueError, match="together"):
        LRU(2, max_weight=10)


def test_concurrent_puts_keep_the_bounds() -> None:
    c: LRU[int, bytes] = LRU(50, weigh=len, max_weight=400)

    def work(base: int) -> None:
        for i in range(2000):
            c.put(base + i % 97, b"x" * (i % 13))
            c.get(base + (i * 7) % 97)

    threads = [threading.Thread(target=work, args=(k * 1000,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(c) <= 50
    assert c.weight <= 400
    assert c.weight == sum(len(v) for v in c._items.values())
