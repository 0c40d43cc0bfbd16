"""The flusher process's side (``python -m dstt.store.flusher._main``): serve ``flusher/parent.py``.

Three threads: the main one reads requests and checksums and digests each flat step in the
shared buffer (``FlatImage.fill``, ``summary_kernel.digest``), a writer thread writes it (whole
4 KiB blocks with ``O_DIRECT``) and replies — so step k+1's CPU work overlaps step k's wait
for the disk — and a commit thread runs the commits the writer hands over
(``commit/job.py``: ``run_commit``) in the order they come. The main and writer threads run at
``SCHED_IDLE`` where the OS allows; the commit thread keeps normal priority. Kept apart from
the parent's handle (``flusher/parent.py``), which never imports it: what runs in the child is
only what this module and its imports (no torch) bring.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno as _errno
import gc
import mmap
import os
import pickle
import queue
import signal
import sys
import threading
from dataclasses import replace
from typing import IO, TYPE_CHECKING, Any

from dstt.analysis.summary_kernel import digest
from dstt.store.commit.job import run_commit
from dstt.store.format.flat import FlatImage
from dstt.store.format.stepfile import SideFile, StepFile
from dstt.store.storage.local import LocalStorage
from dstt.store.storage.posix import pwrite_all, start_writeback

from .parent import _recv, _send

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["main"]


def _lower_priority(sched: str) -> None:
    if sched != "idle":
        return
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        with contextlib.suppress(OSError):
            os.nice(19)


_PR_SET_PDEATHSIG = 1


def _die_with_parent(parent: int) -> None:
    """Have the kernel SIGKILL this process the moment its parent dies (Linux
    ``PR_SET_PDEATHSIG``), and exit now if it already has.

    A trainer killed mid-run must not leave a process behind that goes on committing the
    steps it had handed over: the requests still sit in the pipe, and a resumed run (which
    takes the run over from the dead one) would race it for the ref. Waiting for the pipe's
    end of file is not enough — the requests before it would still be served, and this
    process runs at ``SCHED_IDLE``, so it may see it late. The signal is sent while the
    parent exits, before anyone can reap it, so whoever saw the trainer die sees this
    process dead or dying: at most the system call it was in (one rename, one fsync)
    completes. The kernel's "parent" is the thread that started this process (the
    training thread's first flat step); if that thread ends before the session does, this
    process dies with it and the parent finishes the steps itself (``Flusher.dead``)."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if parent and os.getppid() != parent:  # died before the line above
        os._exit(1)


def _serve(inp: IO[bytes], out: IO[bytes], sched: str) -> None:
    """The child's loop: this thread checksums and digests each step, a writer thread
    writes it and replies — so step k+1's CPU work overlaps step k's wait for the disk."""
    # nothing here makes reference cycles worth a collector pass per few hundred allocations
    # (each pass walks every cached image); collect once per new layout instead
    gc.disable()
    maps: list[memoryview] = []
    objs: dict[int, Any] = {}
    images: dict[tuple[int, int, int], FlatImage] = {}
    bound: dict[int, FlatImage] = {}  # buffer -> the in-place image whose headers it holds
    # O_DIRECT until the filesystem refuses it once (DSTT_DIRECT=0: never, e.g. to compare)
    direct = [os.environ.get("DSTT_DIRECT", "1") != "0"]
    send_mu = threading.Lock()

    def reply(msg: tuple[Any, ...]) -> None:
        with send_mu:
            _send(out, msg)

    writes: queue.SimpleQueue[tuple[Any, ...] | None] = queue.SimpleQueue()
    commits: queue.SimpleQueue[tuple[Any, ...] | None] = queue.SimpleQueue()
    # made before the priority drops: a commit is little CPU, and training waits for its
    # step's buffer only, but a commit starved at SCHED_IDLE would pile up steps in flight
    committer = threading.Thread(target=_commit_loop, args=(commits, reply), daemon=True)
    committer.start()
    _lower_priority(sched)
    writer = threading.Thread(target=_write_loop, args=(writes, reply, direct), daemon=True)
    writer.start()
    # the threads at SCHED_IDLE, for the parent's ``urgent``: the kernel schedules threads,
    # not processes, so raising the process id alone would leave the writer behind
    lowered = [threading.get_native_id(), writer.native_id]
    try:
        while True:
            try:
                msg = _recv(inp)
            except EOFError:  # the parent is gone (it sends "exit" when it closes):
                os._exit(1)  # serve nothing it left in flight, not even a commit
            kind = msg[0]
            if kind == "exit":
                return
            rid = msg[1] if kind in ("flat", "commit", "digest") else None
            try:
                if kind == "init":
                    maps = [memoryview(mmap.mmap(fd, n)) for fd, n in msg[1]]
                    reply(("ready", lowered))
                elif kind == "commit":  # in order, after this step's write (it replied)
                    commits.put(
                        (*msg[1:6], [None if i is None else objs[i] for i in msg[6]], msg[7])
                    )
                elif kind == "forget":
                    objs.clear()
                    images.clear()
                    bound.clear()
                elif kind in ("layout", "const"):
                    objs[msg[1]] = msg[2]
                    gc.collect()
                    for k in [k for k in images if k[0] == msg[1]]:
                        del images[k]
                elif kind == "digest":  # a step the parent writes (encoded): digest only
                    _, rid, buffer, pid, token = msg
                    reply(("ok", rid, digest(objs[pid], maps[buffer], token)))
                elif kind == "flat":
                    _, rid, buffer, lid, start, path, pid, token = msg
                    image = images.get((lid, buffer, start))
                    if image is None:
                        image = images[(lid, buffer, start)] = FlatImage(
                            objs[lid], start, maps[buffer]
                        )
                    elif image.inplace and bound.get(buffer) is not image:
                        image.bind(maps[buffer])  # another layout's headers sit in this buffer
                    if image.inplace:
                        bound[buffer] = image
                    crcs, _ = image.fill()
                    stats = digest(objs[pid], maps[buffer], token) if pid is not None else None
                    writes.put(
                        (rid, path, image, start, ("ok", rid, crcs, bytes(image.directory), stats))
                    )
                else:
                    raise ValueError(f"unknown request {kind!r}")
            except Exception as e:  # reported to the parent, which fails the step
                reply(("err", rid, getattr(e, "errno", None), f"{type(e).__name__}: {e}"))
    finally:
        writes.put(None)
        writer.join()
        commits.put(None)
        committer.join()


def _commit_loop(
    commits: queue.SimpleQueue[tuple[Any, ...] | None], reply: Callable[[tuple[Any, ...]], None]
) -> None:
    """Run each step's commit on the files the parent started (``commit/job.py``)."""
    stores: dict[tuple[str, str], LocalStorage] = {}
    while (task := commits.get()) is not None:
        rid, root, durability, zip_state, side_state, consts, data = task
        files: list[StepFile | SideFile] = []
        try:
            st = stores.get((root, durability))
            if st is None:
                st = stores[(root, durability)] = LocalStorage(root, durability=durability)
            template, block, consolidated = consts
            job = replace(
                pickle.loads(data), template=template, block=block, consolidated=consolidated or b""
            )
            zf = StepFile.adopt(st, zip_state)
            files.append(zf)
            side = SideFile.adopt(st, side_state)
            files.append(side)
            header = run_commit(st, zf, side, job)
        except Exception as e:
            # let go of the files now: the parent deletes them (or commits them itself), and
            # a descriptor kept here would hold a deleted file's space until this process
            # exits — on a full disk, the room every later step needs
            for f in files:
                with contextlib.suppress(Exception):
                    f.handed_off()
            reply(("err", rid, getattr(e, "errno", None), f"{type(e).__name__}: {e}"))
            continue
        reply(("ok", rid, header))


def _write_loop(
    writes: queue.SimpleQueue[tuple[Any, ...] | None],
    reply: Callable[[tuple[Any, ...]], None],
    direct: list[bool],
) -> None:
    while (task := writes.get()) is not None:
        rid, path, image, start, done = task
        try:
            _write_image(path, image, start, direct)
        except Exception as e:
            reply(("err", rid, getattr(e, "errno", None), f"{type(e).__name__}: {e}"))
            continue
        reply(done)


_DIRECT_ALIGN = 4096


def _write_image(path: str, image: FlatImage, start: int, direct: list[bool]) -> None:
    """Write ``image`` at ``start`` of ``path``. An in-place image is the file's bytes in
    one page-aligned shared buffer: its whole 4 KiB blocks go with ``O_DIRECT`` (the disk
    reads them straight from the buffer: no copy into the page cache, no dirty pages for
    the kernel to write back and evict later), the last partial block through the page
    cache. Where the filesystem refuses ``O_DIRECT`` (tmpfs, some FUSE), everything goes
    through the page cache from then on."""
    head = 0
    if direct[0] and image.inplace and start % _DIRECT_ALIGN == 0:
        head = image.nbytes // _DIRECT_ALIGN * _DIRECT_ALIGN
    if head:
        try:
            fd = os.open(path, os.O_WRONLY | getattr(os, "O_DIRECT", 0))
            try:
                pwrite_all(fd, [image.iov[0][:head]], start)
            finally:
                os.close(fd)
        except OSError as e:
            if e.errno != _errno.EINVAL:
                raise
            direct[0], head = False, 0  # not supported here: the page cache it is
    fd = os.open(path, os.O_WRONLY)
    try:
        if head:
            pwrite_all(fd, [image.iov[0][head:]], start + head)
        else:
            pwrite_all(fd, image.iov, start)
        start_writeback(fd)  # the disk starts now; the parent's barrier waits
    finally:
        os.close(fd)


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent drains and closes us
    sched = sys.argv[1] if len(sys.argv) > 1 else "idle"
    _die_with_parent(int(sys.argv[2]) if len(sys.argv) > 2 else 0)
    _serve(sys.stdin.buffer, sys.stdout.buffer, sched)
