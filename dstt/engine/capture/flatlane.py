"""The hot path: a whole step copied with one batched copy into one reused host buffer.

A ``FlatPlan`` (the store's ``FlatLayout`` plus typed views per buffer) is made once per set of
captured tensors and reused, so a step costs the training thread a version snapshot and a plan
lookup, the copy thread one ``torch._foreach_copy_`` (CUDA: a side stream into pinned memory),
a writer one ``StepHandle.write``. ``StepBuffers`` is the bounded host cache: a ring of
whole-step buffers allocated once, each released only once its step is written, so a slow
disk makes the copy thread wait (honest backpressure). A step larger than a buffer is a
sequence of ``Segment``s of its one layout. Rejected alternative: a second, chunk-by-chunk
lane for such steps (every write feature existed twice, issue 38).
"""

from __future__ import annotations

import contextlib
import ctypes
import operator
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from dstt.engine.tensors._convert import store_dtype
from dstt.errors import CaptureError

from .summaries import summarized

if TYPE_CHECKING:
    import mmap
    from collections.abc import Callable, Mapping, Sequence

    from dstt.engine.state.dims import DimsOf
    from dstt.store._internal import ArraySpec, FlatLayout

__all__ = ["FlatPlan", "Segment", "StepBuffers", "plan_key", "segments"]


def plan_key(tensors: Mapping[str, torch.Tensor]) -> tuple[str, ...]:
    """The paths a ``FlatPlan`` is looked up by (``FlatPlan.fits`` then checks the dtypes
    and shapes: two list comparisons instead of a tuple per tensor)."""
    return tuple(tensors)


def _order(paths: Sequence[str], tensors: Mapping[str, torch.Tensor]) -> list[str]:
    """Buffer order: parameters first, grouped by dtype (so each dtype's parameters form one
    region the summaries can scan), then everything else as captured."""
    params = [p for p in paths if summarized(p)]
    rest = [p for p in paths if not summarized(p)]
    params.sort(key=lambda p: str(tensors[p].dtype))  # stable: capture order within a dtype
    return params + rest


_DTYPE = operator.attrgetter("dtype")


@dataclass
class FlatPlan:
    """One cached layout of a step's tensors and the copy views into each buffer."""

    layout: FlatLayout
    order: list[str]  # buffer order of the paths
    dtypes: list[torch.dtype]
    shapes: list[torch.Size]
    nbytes: int
    cuda: bool  # some tensor lives on a CUDA device (pinned buffers, side-stream copies)
    #: dtypes and shapes in the order of the tensors it was built from
    given_dtypes: list[torch.dtype] = field(default_factory=list)
    given_shapes: list[torch.Size] = field(default_factory=list)
    _views: dict[int, list[torch.Tensor]] = field(default_factory=dict)

    @classmethod
    def build(
        cls,
        lay_out: Callable[[Sequence[ArraySpec]], FlatLayout],
        tensors: Mapping[str, torch.Tensor],
        dims: DimsOf | None = None,
        order: list[str] | None = None,
    ) -> FlatPlan:
        """``lay_out``: the sink's ``layout``; ``dims``: store path -> shape to dimension
        names (``dstt.engine.state.dims``);
        ``order``: the paths in buffer order (default: parameters first, by dtype)."""
        order = _order(list(tensors), tensors) if order is None else order
        specs: list[ArraySpec] = [
            (p, store_dtype(tensors[p].dtype, what=f"tensor {p!r}"), tuple(tensors[p].shape))
            for p in order
        ]
        if dims is not None:
            names = dims({p: tuple(t.shape) for p, t in tensors.items()})
            specs = [(*s, names.get(s[0])) for s in specs]
        layout = lay_out(specs)
        return cls(
            layout,
            order,
            [tensors[p].dtype for p in order],
            [tensors[p].shape for p in order],
            layout.nbytes,
            any(t.is_cuda for t in tensors.values()),
            [t.dtype for t in tensors.values()],
            [t.shape for t in tensors.values()],
        )

    def fits(self, tensors: Mapping[str, torch.Tensor]) -> bool:
        """Whether ``tensors`` (the same paths in the same order) still match this plan."""
        values = tensors.values()  # Tensor.size through map: 4x cheaper than .shape
        return (
            list(map(torch.Tensor.size, values)) == self.given_shapes
            and list(map(_DTYPE, values)) == self.given_dtypes
        )

    def views(self, index: int, buf: torch.Tensor) -> list[torch.Tensor]:
        """Typed views of buffer ``index`` where each tensor is copied (cached per buffer)."""
        v = self._views.get(index)
        if v is None:
            v = []
            for a, dt, shape in zip(self.layout.arrays, self.dtypes, self.shapes, strict=True):
                v.append(buf[a.offset : a.offset + a.nbytes].view(dt).view(shape))
            self._views[index] = v
        return v

    def sources(self, tensors: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
        # copied under no_grad: no detach needed; a C-level map, no Python line per tensor
        return list(map(tensors.__getitem__, self.order))


@dataclass(frozen=True)
class Segment:
    """Bytes ``[start, stop)`` of a step's ``FlatLayout`` that one ring buffer holds, cut at
    chunk boundaries: chunks ``[lo, hi)`` of ``layout.chunks``, and per array the part of its
    bytes copied (array index, first byte, end byte; at ``offset + first - start``)."""

    start: int
    stop: int
    lo: int
    hi: int
    parts: tuple[tuple[int, int, int], ...]


def segments(layout: FlatLayout, nbytes: int) -> list[Segment]:
    """``layout`` cut into segments of at most ``nbytes`` each (a tensor larger than that
    splits at its chunk boundaries); a chunk larger than ``nbytes`` is a ``CaptureError``."""
    chunks, arrays = layout.chunks, layout.arrays
    out: list[Segment] = []
    j, n = 0, len(chunks)
    while j < n:
        start = chunks[j][2]
        if chunks[j][3] - start > nbytes:
            raise CaptureError(
                f"a chunk of {chunks[j][3] - start} bytes ({chunks[j][4]!r}) does not fit a "
                f"host buffer of {nbytes} bytes; raise budget_bytes to at least twice that"
            )
        hi = j + 1
        while hi < n and chunks[hi][3] - start <= nbytes:
            hi += 1
        parts: list[tuple[int, int, int]] = []
        for k, _, s, e, _, _ in chunks[j:hi]:
            off = arrays[k].offset
            if parts and parts[-1][0] == k and parts[-1][2] == s - off:
                parts[-1] = (k, parts[-1][1], e - off)
            else:
                parts.append((k, s - off, e - off))
        out.append(Segment(start, chunks[hi - 1][3], j, hi, tuple(parts)))
        j = hi
    return out


class StepBuffers:
    """A fixed ring of whole-step host buffers (pinned when copying from CUDA)."""

    def __init__(
        self, nbytes: int, count: int, *, pin: bool = False, memory: list[mmap.mmap] | None = None
    ) -> None:
        """``memory``: ``count`` writable buffers of ``nbytes`` to use (the flusher's shared
        memory, zero-filled) instead of allocating."""
        if count < 1:
            raise ValueError("StepBuffers needs at least one buffer")
        self.nbytes, self.count, self.pinned = nbytes, count, pin
        #: buffers this ring page-locked with ``cudaHostRegister``: unregistered at ``close``,
        #: before their shared memory is unmapped (a range left registered poisons every later
        #: registration or pinned allocation the kernel maps over it: cudaErrorAlreadyMapped)
        self._registered: list[torch.Tensor] = []
        if memory is not None:
            self.buffers = [torch.frombuffer(m, dtype=torch.uint8, count=nbytes) for m in memory]
            if pin:
                for b in self.buffers:
                    if not _register_pinned(b):
                        break
                    self._registered.append(b)
                self.pinned = len(self._registered) == len(self.buffers)
        else:
            # zeroed once: padding between tensors stays zero (the summaries scan across it)
            self.buffers = [
                torch.zeros(nbytes, dtype=torch.uint8, pin_memory=pin) for _ in range(count)
            ]
        self._free = list(range(count))
        self._cond = threading.Condition()
        #: called with True when a step takes the last free buffer (the writer is behind) and
        #: with False once every buffer is free again (the flusher's priority follows it)
        self.on_pressure: Callable[[bool], None] | None = None
        self._pressed = False
        self._closed = False
        self.stall_s = 0.0
        self.peak_bytes = 0  # the most bytes held at once

    @property
    def capacity(self) -> int:
        return self.nbytes * self.count

    @property
    def in_use(self) -> int:
        with self._cond:
            return self.count - len(self._free)

    def acquire(self) -> tuple[int, float]:
        """A free buffer's index and the seconds waited for it (blocks while none is free)."""
        t0 = time.perf_counter()
        with self._cond:
            while not self._free:
                if self._closed:
                    raise RuntimeError("step buffers closed")
                self._cond.wait()
            if self._closed:
                raise RuntimeError("step buffers closed")
            waited = time.perf_counter() - t0
            self.stall_s += waited
            index = self._free.pop(0)
            self.peak_bytes = max(self.peak_bytes, (self.count - len(self._free)) * self.nbytes)
            if not self._free and self.on_pressure is not None and not self._pressed:
                self._pressed = True  # the last free buffer: the writer is behind, let it
                self.on_pressure(True)  # catch up before a step has to wait for it
            return index, waited

    def release(self, index: int) -> None:
        with self._cond:
            self._free.append(index)
            if self._pressed and len(self._free) == self.count:  # caught up: all free
                self._pressed = False
                if self.on_pressure is not None:
                    self.on_pressure(False)
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            registered, self._registered = self._registered, []
        if registered:
            torch.cuda.synchronize()  # no copy into them is left in flight
            for b in registered:
                _unregister_pinned(b)


def _register_pinned(buf: torch.Tensor) -> bool:
    """Page-lock shared memory for the CUDA driver (so device copies into it are async);
    False where that is refused (the copies then still work, synchronously staged)."""
    try:
        rc = torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), buf.numel(), 0)
    except (RuntimeError, AttributeError):
        return False
    if int(rc) != 0:
        _clear_cuda_error()
        return False
    return True


def _unregister_pinned(buf: torch.Tensor) -> None:
    with contextlib.suppress(RuntimeError, AttributeError):
        if int(torch.cuda.cudart().cudaHostUnregister(buf.data_ptr())) != 0:
            _clear_cuda_error()


def _clear_cuda_error() -> None:
    """Reset the CUDA runtime's last error after a refused call of ours: left pending, it is
    what the next kernel launch anywhere in the process reports as its own failure. torch
    binds no ``cudaGetLastError``, so call the runtime library the process already loaded."""
    try:
        with open("/proc/self/maps") as f:
            libs = {line.split()[-1] for line in f if "libcudart" in line}
        for lib in sorted(libs):
            ctypes.CDLL(lib).cudaGetLastError()
            return
    except (OSError, AttributeError):
        pass
