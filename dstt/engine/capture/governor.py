"""Whether the writers encode a step (``DeltaPolicy``) or write it raw: whichever flushes faster.

A flush takes about ``max(writer CPU / cores the writers get, time waiting for the disk)``;
encoding raises the first and lowers the second. The governor keeps running estimates per
mode (writer CPU, bytes per step) and one of the disk's speed, and encodes only when the
encoded estimate is no worse, so encoding never makes backpressure worse than raw. It
re-measures the other mode every ``retry_every`` steps (the interval doubles while the choice
holds) and measures the cores the writers really get, not the idle ones. A raw step says so
in ``StepMetrics.raw_fallback``. Rejected alternatives: falling back while a backlog exists
(a slow disk always has one, exactly when fewer bytes help) and "encode while it fits between
two steps" (it approved itself). Measurements: docs/decisions.md, "Module notes".
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from dataclasses import dataclass

import torch

__all__ = ["EncodeGovernor"]

#: the shortest wall time over which the process's CPU use is sampled (seconds)
_SAMPLE_S = 0.25


@dataclass
class _Mode:
    """Running estimates for one mode: writer CPU and bytes written per step."""

    cpu: float | None = None
    bytes: float | None = None

    def add(self, cpu: float, nbytes: int) -> None:
        self.cpu = cpu if self.cpu is None else 0.5 * self.cpu + 0.5 * cpu
        self.bytes = nbytes if self.bytes is None else 0.5 * self.bytes + 0.5 * nbytes


class EncodeGovernor:
    """Thread-safe: ``decide`` on the training thread, ``observe`` on the committer."""

    def __init__(
        self,
        writers: int,
        *,
        enabled: bool = True,
        retry_every: int = 8,
        cores: int | None = None,
        train_threads: int | None = None,
        window: int = 16,
    ) -> None:
        if cores is None:  # this machine, and until measured, training on torch's threads
            cores = os.cpu_count() or 1
            if train_threads is None:
                train_threads = torch.get_num_threads()
        self.writers, self.cores = writers, cores
        #: CPU-seconds per second the writers can get: their threads, at most the cores
        #: training leaves (``train_threads`` of them, one if not given, until measured: on a
        #: GPU node torch's threads are mostly idle, and the first raw steps show it)
        self.capacity = max(0.25, float(min(writers, cores - (train_threads or 1))))
        self._sample = (time.perf_counter(), time.process_time())
        self._writer_cpu = 0.0  # writer CPU observed since the sample
        self._sample_encoded = False  # an encoded step was observed since the sample
        self.enabled = enabled
        self.retry_every = max(1, retry_every)
        self._mu = threading.Lock()
        self._enc, self._raw = _Mode(), _Mode()
        #: (bytes written, seconds waited for the disk) of recent steps of either mode: the
        #: disk's speed, pooled (a step's barrier also waits for what earlier steps left)
        self._disk: deque[tuple[int, float]] = deque(maxlen=window)
        #: the same, raw steps only: what an encoded step waits for includes the interpreter
        #: lock and the CPU its Python needs, which says nothing about the disk
        self._raw_disk: deque[tuple[int, float]] = deque(maxlen=window)
        self._since_other = 0  # steps since the mode not chosen was last measured
        self._interval = self.retry_every  # steps between re-measures (doubles, see above)
        self._best: bool | None = None  # the choice the last decision made
        self._raw_probe = False  # a raw step was staged to measure raw
        self._enc_probes = 0  # encoded steps staged before encoding was measured

    def _seconds(self, m: _Mode) -> float | None:
        if m.cpu is None or m.bytes is None:
            return None
        pool = self._raw_disk or self._disk
        waited = sum(w for _, w in pool)
        disk = m.bytes * waited / max(1, sum(b for b, _ in pool))
        return max(m.cpu / self.capacity, disk)

    def decide(self) -> bool:
        """At stage time: encode this step?"""
        with self._mu:
            if not self.enabled:
                return True
            enc, raw = self._seconds(self._enc), self._seconds(self._raw)
            if enc is None:  # measure encoding first: two steps (bases, then deltas), then
                self._enc_probes += 1  # raw until measured (again every retry_every steps)
                return self._enc_probes <= 2 or (self._enc_probes - 2) % self.retry_every == 0
            if raw is None:  # then one raw step to compare with (commits lag behind stages:
                first = not self._raw_probe  # probe once, encode until it is measured)
                self._raw_probe = True
                return not first
            best = enc <= raw
            if best != self._best:  # the choice changed: re-measure at the base rate again
                self._best, self._interval, self._since_other = best, self.retry_every, 0
            self._since_other += 1
            if self._since_other >= self._interval:
                self._since_other = 0
                self._interval = min(2 * self._interval, 8 * self.retry_every)
                return not best
            return best

    def observe(
        self, encoded: bool, writer_cpu_s: float, wait_s: float, written_bytes: int
    ) -> None:
        """After a step committed: its writer CPU, the seconds it waited for the disk, and
        the bytes it wrote."""
        with self._mu:
            (self._enc if encoded else self._raw).add(writer_cpu_s, written_bytes)
            self._disk.append((written_bytes, max(0.0, wait_s)))
            if not encoded:
                self._raw_disk.append((written_bytes, max(0.0, wait_s)))
            self._writer_cpu += writer_cpu_s
            self._sample_encoded |= encoded
            self._measure_capacity()

    def _measure_capacity(self) -> None:
        """The cores this process keeps busy besides its writers, sampled; the writers get
        what is left (module docstring)."""
        now, cpu = time.perf_counter(), time.process_time()
        t0, c0 = self._sample
        if now - t0 < _SAMPLE_S:
            return
        # only while the writers wrote raw: encoding Python takes CPU (and the interpreter
        # lock) from training, which then seems to need fewer cores than it does
        if not self._sample_encoded:
            busy = max(0.0, (cpu - c0 - self._writer_cpu) / (now - t0))
            self.capacity = max(0.25, min(float(self.writers), self.cores - busy))
        self._sample, self._writer_cpu, self._sample_encoded = (now, cpu), 0.0, False

    def estimates(self) -> dict[str, float | None]:
        """Estimated flush seconds per step of each mode (None: not measured yet)."""
        with self._mu:
            return {"encoded": self._seconds(self._enc), "raw": self._seconds(self._raw)}
