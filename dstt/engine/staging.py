"""Staging: a fixed host cache, device→host (or host→host) chunk copies, and the version guard.

``HostCache`` allocates its byte budget **once** (pinned when CUDA is available) and hands out
leases from a ring of equal slabs. Chunks are packed into the open slab until it is full; a slab
returns to the ring when every chunk in it has been written. A chunk never spans slabs, so a
slab is at least as large as the largest chunk, and the cache can be much smaller than the
largest tensor (tensors are copied chunk by chunk). When every slab is in use, ``reserve``
blocks: that is the honest backpressure of a disk slower than training.
Rejected alternatives: one slab per chunk (a model of many small tensors would burn a whole slab
per bias vector) and a fresh allocation per step (6-12 GB/s into a reused buffer vs ~1 GB/s
into fresh pages on this machine, and the RAM blow-ups users report for DCP/Orbax).

``Copier`` copies one byte range of a source tensor into a lease. CPU: a plain ``copy_`` on the
engine's copy thread (torch releases the GIL). CUDA: ``non_blocking`` copies on a side stream
that first waits on an event recorded on the compute stream at stage time; each chunk gets its
own event, which the writer thread synchronizes before touching the bytes.

``VersionGuard`` records every source tensor's ``_version`` at stage time and compares at the
wait before the next optimizer step; ``verify=True`` adds a wrap-around integer sum of the
source (at stage and at the wait) and of the copied bytes, which also catches ``.data`` writes
that bypass the version counter.
"""

from __future__ import annotations

import operator
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping

__all__ = [
    "CacheClosedError",
    "Copier",
    "HostCache",
    "Lease",
    "RaceReport",
    "Ready",
    "VersionGuard",
    "tensor_checksum",
]

_ALIGN = 64
_MASK = (1 << 64) - 1
_IS_CUDA = operator.attrgetter("is_cuda")


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


class CacheClosedError(RuntimeError):
    """The cache was closed while a reservation waited (engine shutting down)."""


class _Slab:
    __slots__ = ("buf", "index", "refs", "sealed", "used")

    def __init__(self, index: int, buf: torch.Tensor) -> None:
        self.index, self.buf = index, buf
        self.used = self.refs = 0
        self.sealed = False


class Lease:
    """A byte range of the cache holding one chunk until ``HostCache.release``."""

    __slots__ = ("nbytes", "slab", "view", "waited_s")

    def __init__(self, slab: _Slab, view: torch.Tensor, nbytes: int, waited_s: float) -> None:
        self.slab, self.view, self.nbytes, self.waited_s = slab, view, nbytes, waited_s


class HostCache:
    """A fixed ring of host slabs; ``reserve`` blocks while all of them are in use."""

    def __init__(self, capacity_bytes: int, slab_bytes: int, *, pin: bool = False) -> None:
        slab_bytes = _align(max(1, slab_bytes))
        n = capacity_bytes // slab_bytes
        if n < 1:
            raise ValueError(
                f"a cache of {capacity_bytes} bytes cannot hold one slab of {slab_bytes} bytes"
            )
        self.slab_bytes, self.n_slabs = slab_bytes, n
        self.pinned = pin
        self._buf = torch.empty(n * slab_bytes, dtype=torch.uint8, pin_memory=pin)
        self._slabs = [_Slab(i, self._buf[i * slab_bytes : (i + 1) * slab_bytes]) for i in range(n)]
        self._free: deque[_Slab] = deque(self._slabs)
        self._current: _Slab | None = None
        self._cond = threading.Condition()
        self._closed = False
        self.leased_bytes = 0
        self.peak_bytes = 0
        self.stall_s = 0.0

    @property
    def capacity(self) -> int:
        return self.slab_bytes * self.n_slabs

    @property
    def slabs_in_use(self) -> int:
        with self._cond:
            return self.n_slabs - len(self._free)

    def reserve(self, nbytes: int) -> Lease:
        """A lease of ``nbytes`` (≤ ``slab_bytes``); blocks until a slab is free."""
        if nbytes > self.slab_bytes:
            raise ValueError(f"chunk of {nbytes} bytes does not fit a {self.slab_bytes}-byte slab")
        waited = 0.0
        with self._cond:
            cur = self._current
            if cur is None or cur.used + nbytes > self.slab_bytes:
                if cur is not None:
                    self._seal_locked(cur)
                t0 = time.perf_counter()
                while not self._free:
                    if self._closed:
                        raise CacheClosedError("host cache closed")
                    self._cond.wait()
                waited = time.perf_counter() - t0
                self.stall_s += waited
                cur = self._free.popleft()
                cur.used, cur.refs, cur.sealed = 0, 0, False
                self._current = cur
            if self._closed:
                raise CacheClosedError("host cache closed")
            off = cur.used
            cur.used = min(self.slab_bytes, off + _align(nbytes))
            cur.refs += 1
            self.leased_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.leased_bytes)
            return Lease(cur, cur.buf[off : off + nbytes], nbytes, waited)

    def release(self, lease: Lease) -> None:
        with self._cond:
            s = lease.slab
            s.refs -= 1
            self.leased_bytes -= lease.nbytes
            if s.refs == 0:
                if s is self._current:
                    s.used = 0  # empty and still open: pack again from the start
                elif s.sealed:
                    self._free.append(s)
                    self._cond.notify_all()

    def seal(self) -> None:
        """Close the open slab (end of a step) so it is recycled once its chunks are written."""
        with self._cond:
            if self._current is not None:
                self._seal_locked(self._current)

    def _seal_locked(self, s: _Slab) -> None:
        s.sealed = True
        self._current = None
        if s.refs == 0:
            self._free.append(s)
            self._cond.notify_all()

    def close(self) -> None:
        """Wake and fail every waiting ``reserve`` (shutdown)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()


class Ready(Protocol):
    """A copied chunk; ``wait`` returns once its bytes are in host memory."""

    def wait(self) -> None: ...


class _Done:
    def wait(self) -> None:
        return None


class _EventReady:
    __slots__ = ("event",)

    def __init__(self, event: torch.cuda.Event) -> None:
        self.event = event

    def wait(self) -> None:
        self.event.synchronize()


DONE: Ready = _Done()


class Copier:
    """Copies byte ranges of (flat uint8 views of) source tensors into cache leases."""

    def __init__(self) -> None:
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    @staticmethod
    def mark(tensors: Iterable[torch.Tensor]) -> dict[torch.device, torch.cuda.Event]:
        """On the training thread at stage time: an event on each compute stream involved."""
        marks: dict[torch.device, torch.cuda.Event] = {}
        for t in tensors:
            if t.is_cuda and t.device not in marks:
                ev = torch.cuda.Event()
                ev.record(torch.cuda.current_stream(t.device))
                marks[t.device] = ev
        return marks

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        s = self._streams.get(device)
        if s is None:
            s = self._streams[device] = torch.cuda.Stream(device=device)
        return s

    def begin(self, marks: Mapping[torch.device, torch.cuda.Event]) -> None:
        """On the copy thread: side streams wait for the compute work of the staged step."""
        for dev, ev in marks.items():
            self._stream(dev).wait_event(ev)

    def copy(self, src: torch.Tensor, start: int, stop: int, lease: Lease) -> Ready:
        part = src[start:stop]
        if part.is_cuda:
            stream = self._stream(part.device)
            with torch.cuda.stream(stream):
                lease.view.copy_(part, non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(stream)
            return _EventReady(ev)
        lease.view.copy_(part)
        return DONE

    def copy_all(self, dst: list[torch.Tensor], src: list[torch.Tensor]) -> Ready:
        """Copy every ``src`` into its ``dst`` (same shapes) with one batched call; CUDA
        sources go through the side stream of their device (``begin`` first)."""
        with torch.no_grad():
            return self._copy_all(dst, src)

    def _copy_all(self, dst: list[torch.Tensor], src: list[torch.Tensor]) -> Ready:
        if not any(map(_IS_CUDA, src)):  # C-level: no Python line per tensor on the host
            torch._foreach_copy_(dst, src)
            return DONE
        devices = {t.device for t in src if t.is_cuda}
        events = []
        for dev in devices:
            idx = [i for i, t in enumerate(src) if t.device == dev]
            stream = self._stream(dev)
            with torch.cuda.stream(stream):
                torch._foreach_copy_(
                    [dst[i] for i in idx], [src[i] for i in idx], non_blocking=True
                )
                ev = torch.cuda.Event()
                ev.record(stream)
            events.append(ev)
        host = [i for i, t in enumerate(src) if not t.is_cuda]
        if host:
            torch._foreach_copy_([dst[i] for i in host], [src[i] for i in host])
        return _Events(events)


class _Events:
    __slots__ = ("events",)

    def __init__(self, events: list[torch.cuda.Event]) -> None:
        self.events = events

    def wait(self) -> None:
        for ev in self.events:
            ev.synchronize()


_WORD = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def tensor_checksum(flat: torch.Tensor, itemsize: int) -> torch.Tensor:
    """Wrap-around int64 sum of the element words of a flat uint8 view (0-d, on its device).

    Additive over chunks that start at element boundaries, so the copy's chunk sums add up to
    the source's sum. Integer words make NaN payloads and -0.0 count like any other bits.
    """
    if flat.numel() == 0:
        return torch.zeros((), dtype=torch.int64, device=flat.device)
    return flat.view(_WORD[itemsize]).sum(dtype=torch.int64)


@dataclass(frozen=True)
class RaceReport:
    """A tensor found modified between stage and wait."""

    path: str
    reason: str


class VersionGuard:
    """Detects in-place writes to source tensors between stage time and the wait."""

    def __init__(
        self,
        tensors: Mapping[str, torch.Tensor],
        itemsizes: Mapping[str, int],
        *,
        verify: bool = False,
    ) -> None:
        self.verify = verify
        #: the paths and their versions at stage time, as two lists: a step's check is then
        #: one C-level pass and one list comparison while nothing raced (the usual case)
        self._paths = list(tensors)
        self._before = list(map(_VERSION, tensors.values()))
        self.itemsizes = dict(itemsizes)
        self._source: dict[str, torch.Tensor] = {}
        self._copied: dict[str, int] = {}
        self._lock = threading.Lock()
        if verify:
            for p, t in tensors.items():
                self._source[p] = tensor_checksum(_flat(t), self.itemsizes[p])

    def add_copy(self, path: str, view: torch.Tensor) -> None:
        """Account one copied chunk (``verify`` mode; call once its bytes are on the host)."""
        s = int(tensor_checksum(view, self.itemsizes[path])) & _MASK
        with self._lock:
            self._copied[path] = (self._copied.get(path, 0) + s) & _MASK

    @property
    def versions(self) -> dict[str, int]:
        """Each tensor's version at stage time (or at its last ``reset``)."""
        return dict(zip(self._paths, self._before, strict=True))

    def reset(self, path: str, t: torch.Tensor) -> None:
        """Re-arm one tensor after a synchronous recopy."""
        self._before[self._paths.index(path)] = _VERSION(t)
        if self.verify:
            self._source[path] = tensor_checksum(_flat(t), self.itemsizes[path])
            with self._lock:
                self._copied.pop(path, None)

    def check(self, tensors: Mapping[str, torch.Tensor]) -> list[RaceReport]:
        if (
            not self.verify
            and len(tensors) == len(self._paths)
            and list(map(_VERSION, tensors.values())) == self._before
        ):
            return []  # the same tensors (a flight's own dict), none written since stage
        out: list[RaceReport] = []
        versions = self.versions
        for path, t in tensors.items():
            before = versions.get(path)
            if before is not None and (version := _VERSION(t)) != before:
                out.append(RaceReport(path, f"in-place write (version {before} -> {version})"))
                continue
            if self.verify and path in self._source:
                staged = int(self._source[path]) & _MASK
                now = int(tensor_checksum(_flat(t), self.itemsizes[path])) & _MASK
                with self._lock:
                    copied = self._copied.get(path, 0)
                if now != staged or copied != staged:
                    out.append(
                        RaceReport(
                            path,
                            "contents changed without a version bump "
                            "(a .data or out-of-autograd write)",
                        )
                    )
        return out


# a tensor's version counter (bumped by every in-place write); torch has no public accessor
_VERSION = operator.attrgetter("_version")


def _flat(t: torch.Tensor) -> torch.Tensor:
    flat = t.detach().reshape(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)
