"""One least-recently-used cache for every reader-side cache of dstt.

Parsed arrays tables by slot (the store's ``Reader`` and inspection's shared table cache),
decoded delta chunks bounded in bytes, and the steps a widget has loaded all want the same
thing: bounded memory, recency order, thread safety, and counters a test can assert on. Each
used to have its own ``OrderedDict`` wrapper, with its own locking and eviction bugs to find.
Bounds are an entry count, and optionally a total *weight* (e.g. ``nbytes``) with a ``weigh``
function; an entry heavier than the whole budget is never kept.
Rejected alternative: ``functools.lru_cache`` — it cannot be bounded in bytes, shared between
objects, cleared per key, or populated with values computed elsewhere.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

__all__ = ["LRU"]

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class LRU(Generic[K, V]):
    """A thread-safe LRU cache bounded by ``capacity`` entries and, with ``weigh``, by
    ``max_weight`` in total. ``hits``/``misses`` count ``get`` and ``get_or_make`` lookups."""

    def __init__(
        self,
        capacity: int,
        *,
        weigh: Callable[[V], int] | None = None,
        max_weight: int | None = None,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        if (weigh is None) != (max_weight is None):
            raise ValueError("pass weigh and max_weight together")
        self.capacity = capacity
        self.max_weight = max_weight
        self._weigh = weigh
        self.weight = 0
        self.hits = self.misses = 0
        self._items: OrderedDict[K, V] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: K) -> V | None:
        """The cached value (now the most recent), or None."""
        with self._lock:
            value = self._items.get(key)
            if value is None:
                self.misses += 1
                return None
            self.hits += 1
            self._items.move_to_end(key)
            return value

    def put(self, key: K, value: V) -> None:
        """Cache ``value`` as the most recent entry, evicting the least recent ones."""
        w = self._weigh(value) if self._weigh is not None else 0
        if self.max_weight is not None and w > self.max_weight:
            return
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None and self._weigh is not None:
                self.weight -= self._weigh(old)
            self._items[key] = value
            self.weight += w
            while len(self._items) > self.capacity or (
                self.max_weight is not None and self.weight > self.max_weight
            ):
                _, gone = self._items.popitem(last=False)
                if self._weigh is not None:
                    self.weight -= self._weigh(gone)

    def get_or_make(self, key: K, make: Callable[[], V]) -> V:
        """The cached value, or ``make()``'s (cached). ``make`` runs outside the lock, so two
        threads missing the same key at once may both make it; the last one is kept."""
        value = self.get(key)
        if value is None:
            value = make()
            self.put(key, value)
        return value

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self.weight = 0

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._items

    def __len__(self) -> int:
        return len(self._items)
