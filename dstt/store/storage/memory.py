"""Small real storages for tests: an in-memory store that can "lose power", and a wrapper that
injects I/O faults, shipped (like zarr's ``testing``) so users can test their integrations.

Durability is modelled per *handle* (``handle()``: another process's view of the same keys).
A barrier in ``"syncfs"`` mode (the default) makes every pending write durable, like one
``syncfs``; in ``"fsync"`` mode only its own handle's (as ``LocalStorage`` in its ``"fsync"``
mode, or a shared filesystem), so a rank that votes before its own barrier is visible to a
power cut.

Rejected alternatives: mocks (they test call sequences, not whether a run survives a crash);
per-thread pending sets (a rank's files are written by many threads).
"""

from __future__ import annotations

import contextlib
import errno as _errno
import os
import re
import threading
from typing import TYPE_CHECKING, Literal, TypeAlias

from dstt.errors import RunLockedError, StorageError

from .base import Data, Storage, as_parts, missing

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator, Sequence

__all__ = ["DelegatingStorage", "FaultyStorage", "MemoryDurability", "MemoryStorage"]

#: what a ``MemoryStorage`` barrier covers (module docstring)
MemoryDurability: TypeAlias = Literal["syncfs", "fsync"]


class MemoryStorage(Storage):
    """Keys in a dict. ``crash()`` returns what would survive a power cut: only durable data.

    ``durability``: what ``barrier`` covers — ``"syncfs"`` every pending write of every handle,
    ``"fsync"`` only this handle's (module docstring); ``handle()`` opens another handle.
    """

    def __init__(self, durability: MemoryDurability = "syncfs") -> None:
        if durability not in ("syncfs", "fsync"):
            raise ValueError(f"durability must be 'syncfs' or 'fsync', not {durability!r}")
        self.durability = durability
        self.location = f"memory://{id(self):x}"
        self.data: dict[str, bytes] = {}
        self.durable: dict[str, bytes] = {}
        self._pending: set[str] = set()
        self._mu = threading.Lock()
        self._locks: set[str] = set()
        self._handles: list[MemoryStorage] = [self]

    def handle(self) -> MemoryStorage:
        """Another handle on the same keys, locks and durable state, with its own pending
        writes: another process's view of the run (see ``durability``)."""
        h = object.__new__(MemoryStorage)
        h.durability, h.location = self.durability, self.location
        h.data, h.durable, h._mu, h._locks = self.data, self.durable, self._mu, self._locks
        h._pending = set()
        h._handles = self._handles
        with self._mu:
            self._handles.append(h)
        return h

    def pending(self) -> list[str]:
        """Keys written but not yet durable, by any handle (sorted)."""
        with self._mu:
            return sorted({k for h in self._handles for k in h._pending if k in self.data})  # noqa: SLF001 - a handle

    def read(self, key: str) -> bytes:
        try:
            return self.data[key]
        except KeyError:
            raise missing(self.location, key) from None

    def read_range(self, key: str, start: int, length: int) -> bytes:
        return self.read(key)[start : start + length]

    def write(self, key: str, data: Data) -> None:
        value = b"".join(bytes(p) for p in as_parts(data))
        with self._mu:
            self.data[key] = value
            self._pending.add(key)

    def write_durable(self, key: str, data: Data) -> None:
        self.write(key, data)
        with self._mu:
            self.durable[key] = self.data[key]
            self._pending.discard(key)

    def barrier(self) -> None:
        with self._mu:
            for h in self._handles if self.durability == "syncfs" else [self]:
                for k in h._pending:  # noqa: SLF001 - another handle of this storage
                    if k in self.data:
                        self.durable[k] = self.data[k]
                h._pending.clear()  # noqa: SLF001 - another handle of this storage

    def exists(self, key: str) -> bool:
        return key in self.data

    def size(self, key: str) -> int:
        return len(self.read(key))

    def list(self, prefix: str) -> Iterator[str]:
        pre = f"{prefix}/" if prefix else ""
        names = {k[len(pre) :].split("/", 1)[0] for k in list(self.data) if k.startswith(pre)}
        return iter(sorted(names))

    def delete(self, key: str) -> None:
        with self._mu:
            for k in [k for k in self.data if k == key or k.startswith(key + "/")]:
                del self.data[k]
                self.durable.pop(k, None)  # deletes are treated as durable at once
                self._pending.discard(k)

    @contextlib.contextmanager
    def lock(self, name: str) -> Iterator[None]:
        with self._mu:
            if name in self._locks:
                raise RunLockedError(f"run {self.location} is locked by another writer")
            self._locks.add(name)
        try:
            yield
        finally:
            with self._mu:
                self._locks.discard(name)

    def crash(self, written_back: Callable[[str], bool] | None = None) -> MemoryStorage:
        """A new storage (same ``durability``) holding only what was durable: un-barriered
        writes are lost, except those ``written_back(key)`` keeps (asked once per pending
        key, in key order: the page cache had written them back when the power went)."""
        out = MemoryStorage(self.durability)
        with self._mu:
            out.data = dict(self.durable)
            if written_back is not None:
                pending = {k for h in self._handles for k in h._pending}  # noqa: SLF001 - handles
                for k in sorted(pending):
                    if k in self.data and written_back(k):
                        out.data[k] = self.data[k]
        out.durable = dict(out.data)
        return out


class DelegatingStorage(Storage):
    """Passes every call to ``inner``; subclass it to observe or perturb a storage."""

    def __init__(self, inner: Storage) -> None:
        self.inner = inner
        self.location = inner.location

    def read(self, key: str) -> bytes:
        return self.inner.read(key)

    def read_range(self, key: str, start: int, length: int) -> bytes:
        return self.inner.read_range(key, start, length)

    def write(self, key: str, data: Data) -> None:
        self.inner.write(key, data)

    def write_durable(self, key: str, data: Data) -> None:
        self.inner.write_durable(key, data)

    def barrier(self) -> None:
        self.inner.barrier()

    def exists(self, key: str) -> bool:
        return self.inner.exists(key)

    def size(self, key: str) -> int:
        return self.inner.size(key)

    def list(self, prefix: str) -> Iterator[str]:
        return self.inner.list(prefix)

    def delete(self, key: str) -> None:
        self.inner.delete(key)

    def lock(self, name: str) -> contextlib.AbstractContextManager[None]:
        return self.inner.lock(name)

    def check_writable(self, prefixes: Sequence[str] = ()) -> None:
        self.inner.check_writable(prefixes)

    def evict(self, keys: Sequence[str]) -> None:
        self.inner.evict(keys)

    def remove_temporaries(self) -> int:
        return self.inner.remove_temporaries()


class FaultyStorage(DelegatingStorage):
    """Delegates to ``inner`` but fails writes per a rule, e.g. a disk that fills up.

    ``fail_after_writes=N``: the (N+1)-th and later writes fail; ``fail_keys``: a regex, writes
    to matching keys fail; ``fail_reads``: a regex for reads. ``heal()`` stops failing.
    """

    def __init__(
        self,
        inner: Storage,
        *,
        fail_after_writes: int | None = None,
        fail_keys: str | None = None,
        fail_reads: str | None = None,
        errno: int = _errno.ENOSPC,
        on_write: Callable[[str], None] | None = None,
    ) -> None:
        super().__init__(inner)
        self.fail_after_writes = fail_after_writes
        self.fail_keys = re.compile(fail_keys) if fail_keys else None
        self.fail_reads = re.compile(fail_reads) if fail_reads else None
        self.errno = errno
        self.on_write = on_write
        self.writes = 0
        self.failures = 0
        self._mu = threading.Lock()

    def heal(self) -> None:
        self.fail_after_writes = None
        self.fail_keys = None
        self.fail_reads = None

    def _maybe_fail(self, key: str) -> None:
        if self.on_write:
            self.on_write(key)
        with self._mu:
            self.writes += 1
            n = self.writes
        bad = (self.fail_after_writes is not None and n > self.fail_after_writes) or (
            self.fail_keys is not None and self.fail_keys.search(key)
        )
        if bad:
            self.failures += 1
            raise StorageError(
                self.errno,
                f"cannot write {key!r} in {self.location}: {os.strerror(self.errno)} (injected)",
            )

    def read(self, key: str) -> bytes:
        self._maybe_fail_read(key)
        return self.inner.read(key)

    def read_range(self, key: str, start: int, length: int) -> bytes:
        self._maybe_fail_read(key)
        return self.inner.read_range(key, start, length)

    def _maybe_fail_read(self, key: str) -> None:
        if self.fail_reads is not None and self.fail_reads.search(key):
            raise StorageError(_errno.EIO, f"cannot read {key!r}: I/O error (injected)")

    def write(self, key: str, data: Data) -> None:
        self._maybe_fail(key)
        self.inner.write(key, data)

    def write_durable(self, key: str, data: Data) -> None:
        self._maybe_fail(key)
        self.inner.write_durable(key, data)
