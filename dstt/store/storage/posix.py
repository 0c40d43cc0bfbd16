"""The POSIX calls under ``LocalStorage``'s writes and barrier: ``fsync_dir``, ``pwrite_all``
(``pwritev`` at offsets, ``IOV_MAX`` at a time, finishing short writes), ``start_writeback``
(``sync_file_range``, best effort) and ``_syncfs`` (``syncfs(2)``), the last two through
``ctypes`` (the ``os`` module has neither).

Plain functions on file descriptors, not ``LocalStorage`` methods: the flusher child writes its
step images with them, ``S3Storage`` its spool files (``s3_blob.py``), and the DeepSpeed
checkpoint engine fsyncs folders with ``fsync_dir``. Rejected alternative: leaving them in
``local.py``, which made every such writer import the ``LocalStorage`` module for a system call.
"""

from __future__ import annotations

import ctypes
import functools
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = ["fsync_dir", "pwrite_all", "start_writeback"]


def fsync_dir(path: str) -> None:
    """Make a directory's entries (new or renamed names) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


_SYNC_FILE_RANGE_WRITE = 2


def start_writeback(fd: int) -> None:
    """Ask the kernel to start writing ``fd``'s dirty pages now, without waiting (Linux
    ``sync_file_range(SYNC_FILE_RANGE_WRITE)``; a no-op elsewhere). The disk then works while
    the commit is still being prepared, and the barrier that follows waits less. It makes
    nothing durable by itself."""
    fn = getattr(_libc(), "sync_file_range", None)
    if fn is not None:
        fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
        fn(fd, 0, 0, _SYNC_FILE_RANGE_WRITE)  # best effort: errors change nothing


def _syncfs(fd: int) -> None:
    if _libc().syncfs(fd) != 0:  # pragma: no cover - kernel refused
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


_IOV_MAX = 1024


def pwrite_all(fd: int, views: Sequence[bytes | bytearray | memoryview], offset: int) -> None:
    """Write byte buffers back to back at ``offset`` with ``pwritev`` (``IOV_MAX`` at a
    time), finishing short writes."""
    for i in range(0, len(views), _IOV_MAX):
        batch = views[i : i + _IOV_MAX]
        want = sum(map(len, batch))
        n = os.pwritev(fd, batch, offset)
        while n < want:  # a short write: finish the rest the slow way
            flat = b"".join(bytes(v) for v in batch)[n:]
            n += os.pwrite(fd, flat, offset + n)
        offset += want
