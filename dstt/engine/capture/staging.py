"""Staging: batched device->host (or host->host) copies, and the version guard.

``Copier`` copies source tensors into views of a ring buffer with one batched call: CPU,
``torch._foreach_copy_`` on the copy thread (the GIL released); CUDA, ``non_blocking`` copies
on a side stream that waits on an event of the compute stream, synchronized before a writer
reads. ``VersionGuard`` compares each source's ``_version`` between stage time and the wait
before the next optimizer step; ``verify=True`` adds wrap-around sums of source and copy,
which also catch ``.data`` writes. Rejected alternative: a copy call per chunk into leases of
a slab cache (a Python call, lease and queue item per chunk).
"""

from __future__ import annotations

import operator
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from dstt.engine.tensors._convert import flat_bytes

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping

__all__ = ["Copier", "RaceReport", "Ready", "VersionGuard", "tensor_checksum"]

_MASK = (1 << 64) - 1
_IS_CUDA = operator.attrgetter("is_cuda")


class Ready(Protocol):
    """A batched copy; ``wait`` returns once its bytes are in host memory."""

    def wait(self) -> None: ...


class _Done:
    def wait(self) -> None:
        return None


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

    @torch.no_grad()
    def copy_all(self, dst: list[torch.Tensor], src: list[torch.Tensor]) -> Ready:
        """Copy every ``src`` into its ``dst`` (same shapes) with one batched call; CUDA
        sources go through the side stream of their device (``begin`` first)."""
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
                self._source[p] = tensor_checksum(flat_bytes(t), self.itemsizes[p])

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
            self._source[path] = tensor_checksum(flat_bytes(t), self.itemsizes[path])
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
                now = int(tensor_checksum(flat_bytes(t), self.itemsizes[path])) & _MASK
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
