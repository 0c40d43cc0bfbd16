"""Step files of a ``LocalStorage`` as blobs (``_FileBlob``): writer threads ``pwritev`` their
pieces at offsets into a temporary file, and ``publish`` renames it into place — fsyncing it and
its folders when ``durable``, else leaving it to the storage's next barrier.

Atomic visibility by tmp file + ``rename``, as for every ``LocalStorage`` write: a blob another
process opened (the flusher child; ``LocalStorage.adopt_blob``) may be published by either, and
a rename that finds the tmp file gone checks that the final file is the same inode. Rejected
alternative: writing the step file in place under its final key, visible before it is whole.
"""

from __future__ import annotations

import contextlib
import os
from typing import TYPE_CHECKING, Protocol

from .base import Blob, Data, as_parts
from .posix import fsync_dir, pwrite_all

if TYPE_CHECKING:
    from collections.abc import Sequence

    from dstt.errors import StorageError


class FileOwner(Protocol):
    """What a file blob needs of its ``LocalStorage`` (``local.py``, which imports this
    module: a protocol, not the class): where a key lives, its folders, its error and the
    note that a file awaits the next barrier."""

    @property
    def durability(self) -> str: ...
    def _path(self, key: str) -> str: ...
    def _ensure_parent(self, path: str) -> tuple[str, list[str]]: ...
    def _io_error(self, e: OSError, what: str, key: str) -> StorageError: ...
    def _published(self, path: str, parent: str, grown: list[str]) -> None: ...


class _FileBlob(Blob):
    """A temporary file written with ``pwritev`` at offsets, renamed into place on publish."""

    def __init__(self, storage: FileOwner, key: str, *, tmp: str | None = None) -> None:
        """``tmp``: adopt the temporary file another process created for ``key``."""
        self.storage, self.key = storage, key
        self.path = storage._path(key)
        try:
            self.parent, self.grown = storage._ensure_parent(self.path)
            if tmp is None:
                self.tmp = f"{self.path}.tmp.{os.getpid()}.{id(self):x}"
                self.fd: int | None = os.open(
                    self.tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644
                )
            else:
                self.tmp = tmp
                try:
                    self.fd = os.open(tmp, os.O_WRONLY)
                except FileNotFoundError:
                    # published already by an earlier attempt of the same commit (which
                    # then failed later, e.g. at the header on a full disk): that file
                    self.fd = os.open(self.path, os.O_WRONLY)
        except OSError as e:
            raise storage._io_error(e, "write", key) from e

    def write_at(self, offset: int, data: Data, *, raw: bool = False) -> None:
        fd = self.fd
        if fd is None:
            raise ValueError(f"blob {self.key!r} is already published or discarded")
        views: Sequence[bytes | bytearray | memoryview] = data if raw else as_parts(data)  # type: ignore[assignment]
        try:
            pwrite_all(fd, views, offset)
        except OSError as e:
            raise self.storage._io_error(e, "write", self.key) from e

    def publish(self, *, durable: bool = False) -> None:
        fd, self.fd = self.fd, None
        if fd is None:
            raise ValueError(f"blob {self.key!r} is already published or discarded")
        st = self.storage
        try:
            try:
                if durable and st.durability != "none":
                    os.fsync(fd)
                mine = os.fstat(fd)
            finally:
                os.close(fd)
            try:
                os.rename(self.tmp, self.path)
            except FileNotFoundError:
                # published already by the process this blob was shared with (the flusher
                # committed, then died before it replied): the same file, nothing to do
                if not os.path.samestat(mine, os.stat(self.path)):
                    raise
            if durable and st.durability != "none":
                for d in (self.parent, *self.grown):
                    fsync_dir(d)
        except OSError as e:
            with contextlib.suppress(OSError):
                os.unlink(self.tmp)
            raise st._io_error(e, "write", self.key) from e
        if not durable:
            st._published(self.path, self.parent, self.grown)

    def discard(self) -> None:
        fd, self.fd = self.fd, None
        if fd is not None:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(self.tmp)

    def release(self) -> None:
        """Let go of a blob another process published (its file is not this one's to
        touch any more)."""
        fd, self.fd = self.fd, None
        if fd is not None:
            os.close(fd)
