"""The two files of one step of one rank, built in one pass by several writer threads.

``StepFile`` is the stored zip (a plain Zarr v3 hierarchy): a writer thread reserves its
entry's byte range under a lock (O(1)), then writes without the lock (``Blob.write_at``), so
writer threads never wait for each other's I/O; ``finish`` appends the central directory.
``SideFile`` is the dstt-only companion (objects, delta payloads, the arrays table): checksummed
byte ranges the manifest points into, so a Zarr listing of the zip never meets a non-Zarr
entry (zarr would warn about one).

Rejected alternative: buffering the whole step and writing it at commit — the host cache
would hold every chunk until the last is copied, and the disk would idle during the copy.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Self

import numpy as np

from dstt.errors import DsttError
from dstt.store.storage.base import Blob, Data, as_parts

from .zipfmt import (
    Entry,
    crc32,
    directory_records,
    end_records,
    local_header,
)

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from dstt.store.storage.base import Storage

__all__ = ["Block", "SideFile", "StepFile", "StepState"]

_CD_HEADER_OFFSET = 42  # of the local header's offset in a central directory record


class _StepPart:
    """One of a step's two files, written through one blob that is opened on first use;
    another process may take it over (``handoff``, ``adopt``, ``handed_off``)."""

    def __init__(self, storage: Storage, key: str) -> None:
        self.key = key
        self._storage = storage
        self._blob: Blob | None = None
        self._mu = threading.Lock()
        self._cursor = 0
        self._finished = False

    def _open(self) -> Blob:
        if self._blob is None:
            self._blob = self._storage.open_blob(self.key)
        return self._blob

    @classmethod
    def adopt(cls, storage: Storage, state: StepState) -> Self:
        """This process's handle on a file another one started (``handoff``)."""
        f = cls(storage, state.key)
        f._resume(state)
        return f

    def _resume(self, state: StepState) -> None:
        self._blob = self._storage.adopt_blob(state.key, state.tmp)  # type: ignore[attr-defined]
        self._cursor = state.cursor

    def _let_go(self) -> Blob | None:
        with self._mu:
            blob, self._blob, self._finished = self._blob, None, True
        return blob

    def handed_off(self) -> None:
        """The other process published the file: close it here, touch it no more."""
        blob = self._let_go()
        if blob is not None:
            blob.release()  # type: ignore[attr-defined]

    def discard(self) -> None:
        blob = self._let_go()
        if blob is not None:
            blob.discard()


class StepFile(_StepPart):
    """A stored zip written entry by entry at reserved offsets; ``finish`` seals it."""

    def __init__(self, storage: Storage, key: str) -> None:
        super().__init__(storage, key)
        self._entries: list[Entry] = []
        #: central directory records of entries written elsewhere (blocks, flat images)
        self._prebuilt: list[tuple[bytes, int]] = []  # (records, how many entries)
        self._names: set[str] = set()

    def _check_open(self) -> None:
        if self._finished:
            raise DsttError(f"{self.key}: step file already finished")

    # -- handing the file to the flusher process to finish (``commit/job.py``) --------------
    def handoff(self) -> StepState | None:
        """What another process needs to finish this file (``adopt``), or None where it
        cannot: entries written one by one here, or a blob that is not a local file."""
        with self._mu:
            tmp = getattr(self._blob, "tmp", None)
            if self._finished or self._entries or not isinstance(tmp, str):
                return None
            return StepState(self.key, tmp, self._cursor, tuple(self._prebuilt))

    def _resume(self, state: StepState) -> None:
        super()._resume(state)
        self._prebuilt = list(state.prebuilt)

    @property
    def nbytes(self) -> int:
        return self._cursor

    def add(
        self, name: str, parts: Sequence[bytes | bytearray | memoryview], size: int, crc: int
    ) -> int:
        """Write entry ``name`` whose bytes are ``parts`` (``size`` bytes, ZIP CRC-32
        ``crc``); returns the offset of its first data byte. Thread-safe."""
        return self.add_many([name], [parts], [size], [crc])[0]

    def add_many(
        self,
        names: Sequence[str],
        bodies: Sequence[Sequence[bytes | bytearray | memoryview]],
        sizes: Sequence[int],
        crcs: Sequence[int],
    ) -> list[int]:
        """Several entries at once: one reservation, a few ``pwritev`` calls; returns the data
        offset of each (the batched form of :meth:`add`)."""
        fresh = set(names)
        with self._mu:
            self._check_open()
            if len(fresh) != len(names) or not fresh.isdisjoint(self._names):
                dup = sorted(fresh & self._names) or sorted(n for n in fresh if names.count(n) > 1)
                raise ValueError(f"{self.key}: entry {dup[0]!r} written twice")
            self._names |= fresh
            blob = self._open()
            start = off = self._cursor
            iov: list[bytes | bytearray | memoryview] = []
            out: list[int] = []
            entries = self._entries
            for name, body, size, crc in zip(names, bodies, sizes, crcs, strict=True):
                head = local_header(name, size, crc, off)
                entries.append(Entry(name, off, size, crc))
                iov.append(head)
                iov.extend(body)
                off += len(head) + size
                out.append(off - size)
            self._cursor = off
        blob.write_at(start, iov, raw=True)
        return out

    @property
    def cursor(self) -> int:
        with self._mu:
            return self._cursor

    def add_block(self, block: Block) -> bool:
        """Write a prebuilt run of entries (``Block``) if the file is at ``block.start``;
        False (nothing written) otherwise."""
        with self._mu:
            self._check_open()
            if self._cursor != block.start or not block.names.isdisjoint(self._names):
                return False
            self._names |= block.names
            self._prebuilt.append((block.directory, block.count))
            self._cursor = block.start + block.nbytes
            blob = self._open()
        blob.write_at(block.start, block.iov, raw=True)
        return True

    def reserve(self, names: frozenset[str], nbytes_at: Callable[[int], int]) -> int:
        """Reserve the byte range of entries ``names`` written by someone else (a flat
        image: this thread, or the flusher process): returns where it starts; the range is
        ``nbytes_at(start)`` bytes. Their directory comes later (:meth:`add_directory`)."""
        with self._mu:
            self._check_open()
            if not names.isdisjoint(self._names):
                raise ValueError(
                    f"{self.key}: entry {sorted(names & self._names)[0]!r} written twice"
                )
            self._open()
            start = self._cursor
            self._cursor = start + nbytes_at(start)
            self._names |= names
            return start

    def add_directory(self, records: bytes, count: int) -> None:
        """The central directory records of ``count`` entries of a reserved range."""
        with self._mu:
            self._prebuilt.append((records, count))

    def write_at(self, offset: int, iov: list[bytes | bytearray | memoryview]) -> None:
        """Write byte buffers into a reserved range."""
        blob = self._blob
        if blob is None:
            raise DsttError(f"{self.key}: nothing reserved")
        blob.write_at(offset, iov, raw=True)

    @property
    def local_path(self) -> str | None:
        """The temporary file being written, where the blob is one (``LocalStorage``)."""
        blob = self._blob
        return getattr(blob, "tmp", None) if blob is not None else None

    def add_bytes(self, name: str, data: bytes) -> int:
        return self.add(name, [data], len(data), crc32(data))

    def finish(self) -> None:
        """Append the central directory (every ``add`` must have returned)."""
        with self._mu:
            if self._finished:
                return
            self._finished = True
            blob, start = self._open(), self._cursor
            parts = [records for records, _ in self._prebuilt]
            parts.append(directory_records(self._entries))
            count = len(self._entries) + sum(n for _, n in self._prebuilt)
            cd = b"".join(parts)
            tail = cd + end_records(count, len(cd), start)
            self._cursor += len(tail)
        blob.write_at(start, tail)

    def publish(self, *, durable: bool = False) -> None:
        self.finish()
        assert self._blob is not None
        self._blob.publish(durable=durable)


@dataclass(frozen=True)
class StepState:
    """A step file in the making, as another process takes it over: its key, the
    temporary file being written, the end of what was written, and the central directory
    records of the entries written so far (zip only)."""

    key: str
    tmp: str
    cursor: int
    prebuilt: tuple[tuple[bytes, int], ...]


class Block:
    """A run of zip entries laid out once for a given start offset (e.g. the zarr.json
    documents of a step's arrays, the same at every step of a run): their bytes and their
    central directory records, reused while the step files have the same shape."""

    def __init__(self, start: int, names: Sequence[str], datas: Sequence[bytes]) -> None:
        self.start = start
        self.names = frozenset(names)
        if len(self.names) != len(names):
            raise ValueError("a block names an entry twice")
        iov: list[bytes] = []
        entries: list[Entry] = []
        off = start
        for name, data in zip(names, datas, strict=True):
            crc = crc32(data)
            head = local_header(name, len(data), crc, off)
            entries.append(Entry(name, off, len(data), crc))
            iov += [head, data]
            off += len(head) + len(data)
        self.iov, self.count, self.nbytes = iov, len(entries), off - start
        self.directory = directory_records(entries)
        self._entries, self._shift = entries, 0
        #: where each directory record's header offset sits, and the offsets (for ``moved``)
        self._cd_at: np.ndarray | None = None
        self._offs: np.ndarray | None = None

    @property
    def entries(self) -> list[Entry]:
        if self._shift:
            return [e._replace(offset=e.offset + self._shift) for e in self._entries]
        return self._entries

    def moved(self, start: int) -> Block:
        """The same entries placed at ``start``: local headers do not depend on where they
        are (no alignment; below 4 GiB no zip64 fields), so only the directory's header
        offsets change — patched with numpy, not rebuilt entry by entry. Rebuilt where
        either place needs zip64."""
        if start == self.start:
            return self
        if max(self.start, start) + self.nbytes >= 0xFFFFFFFF:
            return Block(start, [e.name for e in self.entries], self.iov[1::2])
        if self._cd_at is None or self._offs is None:
            entries = self.entries
            lens = np.fromiter((46 + len(e.name.encode()) for e in entries), np.int64, self.count)
            self._cd_at = (np.cumsum(lens) - lens + _CD_HEADER_OFFSET)[:, None] + np.arange(4)
            self._offs = np.fromiter((e.offset for e in entries), np.int64, self.count)
        out = object.__new__(Block)
        out.start, out.names, out.iov = start, self.names, self.iov
        out.count, out.nbytes = self.count, self.nbytes
        out._entries, out._shift = self._entries, self._shift + start - self.start
        out._cd_at, out._offs = self._cd_at, self._offs + (start - self.start)
        cd = np.frombuffer(bytearray(self.directory), np.uint8)
        cd[out._cd_at] = out._offs.astype("<u4").view(np.uint8).reshape(-1, 4)
        out.directory = cd.tobytes()
        return out


class SideFile(_StepPart):
    """Checksummed byte ranges appended at reserved offsets; created on the first append."""

    def handoff(self) -> StepState | None:
        """What another process needs to append to and publish this file (``adopt``);
        None where its blob is not a local file. Creates the file if nothing was written."""
        with self._mu:
            tmp = getattr(self._open(), "tmp", None)
            if not isinstance(tmp, str):
                return None
            return StepState(self.key, tmp, self._cursor, ())

    def append(self, data: Data) -> int:
        """Write ``data`` after everything reserved so far; returns its offset. Thread-safe."""
        parts = as_parts(data)
        n = sum(map(len, parts))
        with self._mu:
            blob, off = self._open(), self._cursor
            self._cursor += n
        blob.write_at(off, parts)
        return off

    def publish(self, *, durable: bool = False) -> None:
        if self._blob is not None:
            self._blob.publish(durable=durable)
