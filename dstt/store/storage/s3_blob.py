"""Step files of an ``S3Storage`` as blobs: writer threads ``pwritev`` their pieces at offsets
into an unlinked spool file (page cache), and ``publish`` uploads it under its final, immutable
key — a multipart upload (``chunk_size`` parts, ``max_concurrency`` at once) for anything larger
than one part.

Nothing is renamed, unlike ``LocalStorage``'s tmp file + ``rename``: an object is invisible until
its upload completes, so a crash mid-upload leaves no key (only an unfinished multipart upload,
which ``remove_temporaries`` — gc — aborts).
"""

from __future__ import annotations

import os
import tempfile
from typing import TYPE_CHECKING, Any, BinaryIO, Protocol

import obstore

from dstt.errors import RunLockedError, StorageError

from .base import Blob, Data, as_parts
from .posix import pwrite_all

if TYPE_CHECKING:
    from collections.abc import Sequence


class SpoolOwner(Protocol):
    """What an upload blob needs of its ``S3Storage`` (``s3.py``, which imports this module:
    a protocol, not the class): the bucket, the spool folder and upload sizes, the lease
    check before a write and the storage's error."""

    store: Any
    spool_dir: str | None
    chunk_size: int
    max_concurrency: int

    def _check_lease(self) -> None: ...
    def is_write_once(self, key: str) -> bool: ...
    def put_once(self, key: str, body: bytes | memoryview) -> None: ...
    def put_once_large(self, key: str, f: BinaryIO, size: int) -> None: ...
    def _error(self, e: Exception, what: str, key: str) -> StorageError: ...


class _S3Blob(Blob):
    """Pieces ``pwritev``-ed into an unlinked spool file; one (multipart) upload on publish."""

    def __init__(self, storage: SpoolOwner, key: str) -> None:
        self.storage, self.key = storage, key
        self._file: Any = tempfile.TemporaryFile(  # noqa: SIM115 - closed by publish/discard
            dir=storage.spool_dir, prefix="dstt-blob-"
        )

    def write_at(self, offset: int, data: Data, *, raw: bool = False) -> None:
        f = self._file
        if f is None:
            raise ValueError(f"blob {self.key!r} is already published or discarded")
        views: Sequence[bytes | bytearray | memoryview] = data if raw else as_parts(data)  # type: ignore[assignment]
        pwrite_all(f.fileno(), views, offset)

    def publish(self, *, durable: bool = False) -> None:
        f, self._file = self._file, None
        if f is None:
            raise ValueError(f"blob {self.key!r} is already published or discarded")
        st = self.storage
        try:
            st._check_lease()
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(0)
            once = st.is_write_once(self.key)
            if size <= st.chunk_size:
                if once:  # create-only: never over another writer's step file
                    st.put_once(self.key, f.read())
                else:
                    obstore.put(st.store, self.key, f.read())
            else:
                if once:  # create-only, whole or not at all
                    st.put_once_large(self.key, f, size)
                    return
                obstore.put(
                    st.store,
                    self.key,
                    f,
                    use_multipart=True,
                    chunk_size=st.chunk_size,
                    max_concurrency=st.max_concurrency,
                )
        except (RunLockedError, StorageError):
            raise
        except Exception as e:
            raise st._error(e, "write", self.key) from e
        finally:
            f.close()

    def discard(self) -> None:
        f, self._file = self._file, None
        if f is not None:
            f.close()
