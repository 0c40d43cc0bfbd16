"""The storage contract: the only interface the commit protocol is written against.

One small ABC, ``Storage``, with key/value semantics over '/'-separated keys. Every write is
*atomically visible* (a reader sees the whole value or nothing); durability is explicit:
``write`` may sit in the page cache until ``barrier()``, ``write_durable`` is durable on return.
A ``Blob`` is a large value written at offsets (a step file) and published atomically once.
Implementations: ``local.LocalStorage`` (POSIX), ``memory.MemoryStorage`` (the test fake with a
crash model) and wrappers that inject faults. An object store fits the same contract (a PUT is
atomic and durable; ``barrier`` is a no-op).
Rejected alternative: the commit protocol calling ``os``/``fsync`` directly — the memory fake
could then not cut power at every write, and no other backend could follow.
"""

from __future__ import annotations

import errno
import threading
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, Literal, TypeAlias

from dstt.errors import MissingFileError, RunLockedError

if TYPE_CHECKING:
    import contextlib
    from collections.abc import Iterator, Sequence

__all__ = ["Blob", "Data", "Durability", "Storage", "as_parts", "missing"]

Durability = Literal["fsync", "syncfs", "none"]
#: a value to write: one buffer, or several written back to back (no concatenation copy)
Data: TypeAlias = "bytes | bytearray | memoryview | Sequence[bytes | bytearray | memoryview]"


def as_parts(data: Data) -> list[memoryview]:
    parts: Sequence[Any] = data if isinstance(data, (list, tuple)) else [data]
    return [memoryview(p).cast("B") for p in parts]


class Blob(ABC):
    """One value written in pieces at byte offsets (from several threads), then published
    atomically under its key: a reader sees nothing before ``publish`` and the whole value
    after. Step files are written this way, straight from the host cache."""

    key: str

    @abstractmethod
    def write_at(self, offset: int, data: Data, *, raw: bool = False) -> None:
        """Write ``data`` (one buffer or several back to back) at ``offset``; thread-safe.
        ``raw``: ``data`` is a list of byte buffers already (bytes, bytearray or 1-d byte
        memoryviews), so no per-part normalisation is needed (the hot path)."""

    @abstractmethod
    def publish(self, *, durable: bool = False) -> None:
        """Make the value visible under ``key``; durable now (``durable``) or after the
        storage's next ``barrier``."""

    @abstractmethod
    def discard(self) -> None:
        """Drop an unpublished value (no error if already published or discarded)."""


class _BufferedBlob(Blob):
    """The portable blob: pieces collected in memory, one ``write`` on publish."""

    def __init__(self, storage: Storage, key: str) -> None:
        self.storage, self.key = storage, key
        self._buf = bytearray()
        self._mu = threading.Lock()
        self._done = False

    def write_at(self, offset: int, data: Data, *, raw: bool = False) -> None:
        views: Sequence[bytes | bytearray | memoryview] = data if raw else as_parts(data)  # type: ignore[assignment]
        with self._mu:
            for view in views:
                end = offset + len(view)
                if end > len(self._buf):
                    self._buf.extend(bytes(end - len(self._buf)))
                self._buf[offset:end] = view
                offset = end

    def publish(self, *, durable: bool = False) -> None:
        with self._mu:
            data, self._done = bytes(self._buf), True
        (self.storage.write_durable if durable else self.storage.write)(self.key, data)

    def discard(self) -> None:
        with self._mu:
            self._buf, self._done = bytearray(), True


class Storage(ABC):
    """Key/value bytes with atomic visibility and an explicit durability barrier."""

    #: a human-readable location used in error messages
    location: str
    #: whether ``lock`` gives real mutual exclusion between processes
    supports_locking: bool = True
    #: whether step files are published create-only (an object store, whose lease a stalled
    #: writer can outlive): a writer then numbers its slots past every step file there
    write_once_steps: bool = False

    @abstractmethod
    def read(self, key: str) -> bytes:
        """Return the whole value; ``FileNotFoundError`` (a ``StorageError``) if missing."""

    @abstractmethod
    def read_range(self, key: str, start: int, length: int) -> bytes:
        """Return ``length`` bytes from ``start``."""

    def read_ranges(self, ranges: Sequence[tuple[str, int, int]]) -> list[bytes]:
        """Many ``read_range`` calls at once (a trajectory: one range in each step's file);
        a backend may override it with a tighter loop."""
        return [self.read_range(k, start, n) for k, start, n in ranges]

    @abstractmethod
    def write(self, key: str, data: Data) -> None:
        """Store ``data`` atomically; durable only after the next ``barrier``."""

    @abstractmethod
    def write_durable(self, key: str, data: Data) -> None:
        """Store ``data`` atomically and durably (value and its name) before returning."""

    def create(self, key: str, data: Data) -> None:
        """``write`` a key no one has written (a new commit header): ``RunLockedError`` if
        it exists with other bytes (the same bytes: this writer's own write, finished again
        after its committer died, is done). Default: checked, then written — enough where
        ``lock`` excludes every other writer for as long as its holder lives; an object
        store overrides it with a conditional PUT."""
        if self.exists(key):
            whole = (
                bytes(data)
                if isinstance(data, bytes | bytearray | memoryview)
                else b"".join(bytes(p) for p in data)
            )
            if bytes(self.read(key)) == whole:
                return
            raise RunLockedError(
                f"{key!r} in {self.location} was already written by another writer; nothing "
                "was overwritten — reopen the run to see its current state"
            )
        self.write(key, data)

    @abstractmethod
    def barrier(self) -> None:
        """Make every ``write`` that returned before this call durable."""

    @abstractmethod
    def exists(self, key: str) -> bool: ...

    @abstractmethod
    def size(self, key: str) -> int: ...

    @abstractmethod
    def list(self, prefix: str) -> Iterator[str]:
        """Names (not full keys) directly under ``prefix``; empty if there are none."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove ``key`` if present (no error when missing)."""

    @abstractmethod
    def lock(self, name: str) -> contextlib.AbstractContextManager[None]:
        """Exclusive, non-blocking writer lock; ``RunLockedError`` if held elsewhere."""

    def open_blob(self, key: str) -> Blob:
        """A value to write in pieces and publish atomically (default: buffered in memory)."""
        return _BufferedBlob(self, key)

    def evict(self, keys: Sequence[str]) -> None:  # noqa: B027 - optional hook, no-op by default
        """Hint: these values are durable and will not be read soon (drop cached copies)."""

    def check_writable(self, prefixes: Sequence[str] = ()) -> None:  # noqa: B027 - optional
        """Raise ``ReadOnlyRunError`` now if writes to the root or to the folders named by
        ``prefixes`` (where they exist) would fail (checked at session start). No-op by
        default."""

    def remove_temporaries(self) -> int:
        """Delete leftovers of interrupted writes; only call while holding the writer lock."""
        return 0


def missing(location: str, key: str) -> MissingFileError:
    return MissingFileError(
        errno.ENOENT, f"missing file {key!r} in {location}", f"{location}/{key}"
    )
