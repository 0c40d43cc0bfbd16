"""How much ``every="auto"`` may slow training: a budget of ``share`` of the run's wall time.

Storing costs the CPU of the engine — its copy, writer and commit threads, the flusher
process — and the training thread's own waits (a copy at stage). On cores that all train,
that CPU is taken from training. Each step earns ``share`` of its wall time; the engine's
cost since the last step is spent; a step is stored only while the balance is not negative,
so over a run storing takes about ``share`` of the time (issue 39: <= 1.10x none).
Rejected: timing the steps with a store in flight against the quiet ones — a step's time
varies by tens of percent from one to the next on a shared machine, and a disk slower than
training leaves no quiet step to compare with; and the writer threads' CPU alone, which
misses the copy and the flusher process (seven times the writer threads' share, measured).
"""

from __future__ import annotations

import contextlib
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Iterable

__all__ = ["AUTO_OVERHEAD", "OverheadBudget", "cpu_seconds"]

#: the share of training's wall time ``every="auto"`` may spend on storing steps
AUTO_OVERHEAD = 0.05
#: the most credit a stretch of light steps banks (a few stored steps' cost at most)
_CAP_S = 1.0
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


class OverheadBudget:
    """The balance of time storing may still take. ``tick`` at each step with the clock and
    the engine's cumulative cost (seconds); ``allows`` before storing one. Pure: the caller
    passes the readings."""

    def __init__(self, share: float = AUTO_OVERHEAD) -> None:
        if not 0.0 < share <= 1.0:
            raise ValueError(f"share must be in (0, 1], got {share!r}")
        self.share = share
        self.balance = 0.0
        self.spent_s = 0.0  # what storing cost so far
        self._last: tuple[float, float] | None = None

    def tick(self, now: float, cost_s: float) -> None:
        """A step ended at ``now``; ``cost_s``: the engine's cost so far (cumulative)."""
        last, self._last = self._last, (now, cost_s)
        if last is None:
            return
        spent = max(0.0, cost_s - last[1])
        self.spent_s += spent
        self.balance = min(_CAP_S, self.balance + self.share * max(0.0, now - last[0]) - spent)

    def allows(self) -> bool:
        """Whether a step may be stored now without going over budget."""
        return self.balance >= 0.0


def cpu_seconds(threads: Iterable[int | None], pids: Iterable[int] = ()) -> float | None:
    """User + system CPU seconds of these threads of this process (native ids) and of these
    processes, from ``/proc``; None where ``/proc`` cannot tell (not Linux)."""
    total = 0.0
    paths = [f"/proc/self/task/{t}/stat" for t in threads if t] + [f"/proc/{p}/stat" for p in pids]
    for path in paths:
        try:
            with open(path) as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            if not os.path.isdir("/proc/self/task"):
                return None
            continue  # a thread or process that ended: its CPU was counted before
        with contextlib.suppress(IndexError, ValueError):
            total += (int(fields[11]) + int(fields[12])) / _TICK
    return total
