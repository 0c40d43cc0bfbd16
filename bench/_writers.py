"""The two reference writers of ``hotpath_bench.py`` (issue 13): floors dstt is measured against.

* ``BareWriter`` — the "bare background writer": one flat host buffer, one
  ``torch._foreach_copy_`` per step on the training thread, one background thread writing the
  buffer to one file (``O_TRUNC``) and ``fsync``-ing it. It is what lazy asynchronous capture
  costs when nothing else is in the way, and it keeps none of a checkpointer's guarantees.
* ``GuardedWriter`` — the same, plus the per-step work that dstt's guarantees and defaults
  require, done the cheapest way we know with no engine around it: a crc32c (the Zarr codec
  tensorstore checks) and a ZIP CRC-32 (what zipfile checks) of every tensor's bytes, the
  write-time summaries (sum of squares, max and min of every tensor: ``reduceat`` passes over
  the buffer, as dstt's digest makes them), a new file per step written through the page cache
  and renamed into place, a manifest of those numbers written last, and one ``syncfs`` that
  makes both durable. Its only Python per step is a handful of calls; every loop over tensors
  runs in C (``map`` over prebuilt views, ``reduceat`` over the whole buffer). The gap between
  it and ``BareWriter`` is the price of the guarantees on this machine, not of dstt's design;
  the gap between dstt and it is what dstt's design costs on top.

Rejected alternative for the floor: dstt's own building blocks (its digest plan, its flat
image) — the floor would then move with every change of dstt, and could hide a slow block.
"""

from __future__ import annotations

import ctypes
import json
import os
import queue
import threading
import time
from pathlib import Path

import crc32c
import numpy as np
import torch
from _common import MiB
from isal import isal_zlib

__all__ = ["ALIGN", "PIECE", "BareWriter", "GuardedWriter"]

PIECE = 64 * MiB  # os.write size of both writers
ALIGN = 64  # byte alignment of every tensor's slot in the flat buffer
KEEP = 2  # step files the guarded writer keeps (older ones are deleted: disk use stays flat)


class BareWriter:
    """One flat host buffer, one ``_foreach_copy_`` per step, one writer thread, one file."""

    def __init__(self, tensors: list[torch.Tensor], path: Path) -> None:
        self.src = tensors
        offs, n = [], 0
        for t in tensors:
            offs.append(n)
            n += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
        self.offsets = offs
        self.nbytes = n
        self.buf = torch.zeros(n, dtype=torch.uint8)  # touched once: no page faults later
        self.views = [
            self.buf[o : o + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
            for o, t in zip(offs, tensors, strict=True)
        ]
        self.mem = self.buf.numpy().data.cast("B")
        self.path = path
        self.todo: queue.Queue[bool] = queue.Queue()
        self.done = threading.Semaphore(1)  # 1 = the buffer is free
        self.write_s: list[float] = []
        self.write_cpu_s: list[float] = []
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._loop, name="bare-writer", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while self.todo.get():
            t, c = time.perf_counter(), time.thread_time()
            try:
                self._write_step()
            except BaseException as e:  # reported on the training thread by wait()
                self.error = e
            self.write_cpu_s.append(time.thread_time() - c)
            self.write_s.append(time.perf_counter() - t)
            self.done.release()

    def _write_step(self) -> None:
        self._write_file(self.path)
        fd = os.open(self.path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def _write_file(self, path: Path) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            done = 0
            while done < self.nbytes:
                done += os.write(fd, self.mem[done : min(done + PIECE, self.nbytes)])
        finally:
            os.close(fd)

    def wait(self) -> float:
        """Wait for the previous write; the seconds waited."""
        t = time.perf_counter()
        self.done.acquire()
        if self.error is not None:
            self.done.release()  # leave the buffer free for close()
            raise RuntimeError(f"{type(self).__name__} failed") from self.error
        return time.perf_counter() - t

    def drain(self) -> None:
        """Wait for the pending write, leaving the buffer free."""
        self.wait()
        self.done.release()

    def save(self) -> tuple[float, float]:
        """After an optimizer step: (wait for the previous write, copy) seconds."""
        w = self.wait()
        t = time.perf_counter()
        torch._foreach_copy_(self.views, self.src)
        c = time.perf_counter() - t
        self.todo.put(True)
        return w, c

    def close(self) -> None:
        self.done.acquire()  # no raise: write errors reach the hot path through wait()
        self.todo.put(False)
        self.thread.join()


class GuardedWriter(BareWriter):
    """``BareWriter`` plus checksums, summaries and a durable new file per step (module
    docstring). Every tensor must be float32 (the ``lin*`` and ``gpt87`` state is)."""

    def __init__(self, tensors: list[torch.Tensor], path: Path) -> None:
        if any(t.dtype != torch.float32 for t in tensors):
            raise ValueError("GuardedWriter summarizes float32 tensors only")
        super().__init__(tensors, path)
        sizes = [t.numel() * 4 for t in tensors]
        self.entries = [self.mem[o : o + n] for o, n in zip(self.offsets, sizes, strict=True)]
        self.values = np.frombuffer(self.mem, dtype=np.float32)
        # reduceat over [start, end) pairs: every other result is a tensor's, the padding's
        # between them is dropped
        self.bounds = np.array(
            [b for o, n in zip(self.offsets, sizes, strict=True) for b in (o // 4, (o + n) // 4)],
            dtype=np.intp,
        )
        if self.bounds[-1] == len(self.values):
            self.bounds = self.bounds[:-1]  # the last tensor runs to the buffer's end
        self.squares = np.empty_like(self.values)
        self.dir = path.parent
        self.steps = 0
        self.manifest: dict[str, list[float] | list[int] | int] = {}
        self._libc = ctypes.CDLL(None, use_errno=True)

    def _write_step(self) -> None:
        k = self.steps
        self.steps += 1
        crcs = list(map(crc32c.crc32c, self.entries))
        zips = list(map(isal_zlib.crc32, self.entries))
        x = self.values
        hi = np.maximum.reduceat(x, self.bounds)[::2]
        lo = np.minimum.reduceat(x, self.bounds)[::2]
        np.square(x, out=self.squares)
        sumsq = np.add.reduceat(self.squares, self.bounds)[::2].astype(np.float64)
        data, meta = self.dir / f"step-{k}.bin", self.dir / f"step-{k}.json"
        self._write_file(data.with_suffix(".tmp"))
        os.replace(data.with_suffix(".tmp"), data)
        self.manifest = {
            "step": k,
            "crc32c": crcs,
            "crc32": zips,
            "sumsq": sumsq.tolist(),
            "max": hi.astype(np.float64).tolist(),
            "min": lo.astype(np.float64).tolist(),
        }
        tmp = meta.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.manifest))
        os.replace(tmp, meta)  # written last: the step is visible once it is there
        fd = os.open(self.dir, os.O_RDONLY | os.O_DIRECTORY)
        try:
            if self._libc.syncfs(fd) != 0:
                err = ctypes.get_errno()
                raise OSError(err, os.strerror(err))
        finally:
            os.close(fd)
        if k >= KEEP:
            (self.dir / f"step-{k - KEEP}.json").unlink()
            (self.dir / f"step-{k - KEEP}.bin").unlink()
