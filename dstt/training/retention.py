"""A session's background retention (``dstt.session(..., retention=dstt.Retention(...))``).

Every ``Retention.every_commits`` captured steps the session hands a gc to one background
thread, which runs it under the session's own writer (it holds the run's lock); the next
commit's metrics say what was pruned (``retention/pruned_steps``, ``retention/freed_bytes``,
``retention/gc_s``). A gc still running when the next is due is not queued twice; a gc error
is a warning at the session's close (nothing is lost, the next gc tries again). Rejected: gc
on the committer thread between commits (the same wait, and a failing gc would look like a
failed commit); gc on the training thread (its cost is the point of doing it elsewhere).
Details: docs/decisions.md, "Module notes".
"""

from __future__ import annotations

import threading
import time
import warnings
from typing import Any

from dstt.errors import ConfigError, DsttWarning
from dstt.store._internal import GcReport, Retention, Writer

__all__ = ["PRUNED_METRIC", "RetentionRunner", "check_policy", "store_writer"]

PRUNED_METRIC = "retention/pruned_steps"
FREED_METRIC = "retention/freed_bytes"
GC_S_METRIC = "retention/gc_s"


def store_writer(writer: Any) -> Writer | None:
    """The exclusive store ``Writer`` behind a session's writer (rank 0's under DeepSpeed),
    or None where this process holds no lock (other ranks: they never gc)."""
    w = getattr(writer, "writer", writer)
    return w if isinstance(w, Writer) and w.exclusive else None


def check_policy(policy: Retention) -> None:
    """A live session detects a spike at the first gc after it, up to ``every_commits`` steps
    later; the steps before the spike must still be among the last ``keep_last`` then."""
    if policy.spike_window and (
        policy.keep_last is None or policy.keep_last < policy.every_commits + policy.spike_window
    ):
        raise ConfigError(
            f"Retention(spike_window={policy.spike_window}, every_commits="
            f"{policy.every_commits}) needs keep_last >= every_commits + spike_window "
            f"({policy.every_commits + policy.spike_window}), got keep_last={policy.keep_last}: "
            "a background gc finds a spike up to every_commits steps after it, and the steps "
            "before it must still be on disk then"
        )


class RetentionRunner:
    """One background thread that runs ``policy`` under ``writer`` when told to."""

    def __init__(self, writer: Writer, policy: Retention) -> None:
        self.writer, self.policy = writer, policy
        self._cond = threading.Condition()
        self._due = False
        self._stop = False
        self._busy = False
        self._sealed = 0
        self._unreported: list[GcReport] = []
        self._unreported_s = 0.0
        #: every finished gc: (report, seconds it took)
        self.runs: list[tuple[GcReport, float]] = []
        self.errors: list[BaseException] = []
        self._thread = threading.Thread(target=self._loop, name="dstt-retention", daemon=True)
        self._thread.start()

    # -- training thread ------------------------------------------------------------------
    def sealed(self) -> None:
        """One more step was handed to the committer; every ``every_commits``: a gc is due."""
        self._sealed += 1
        if self._sealed % self.policy.every_commits == 0:
            with self._cond:  # one flag: a gc still running is followed by one more, once
                self._due = True
                self._cond.notify()

    def take_metrics(self) -> dict[str, Any]:
        """What finished gcs pruned since the last call, as commit metrics ({} if none)."""
        with self._cond:
            reps, secs = self._unreported, self._unreported_s
            self._unreported, self._unreported_s = [], 0.0
        if not reps:
            return {}
        return {
            PRUNED_METRIC: sum(len(r.pruned_steps) for r in reps),
            FREED_METRIC: sum(r.bytes_freed for r in reps),
            GC_S_METRIC: round(secs, 6),
        }

    def wait_idle(self) -> None:
        """Wait until no gc is due or running (the tests; ``close`` lets a running one end)."""
        with self._cond:
            while self._due or self._busy:
                self._cond.wait()

    def close(self, *, final: bool = False) -> None:
        """Let a running gc finish, stop the thread (before the writer closes); ``final``
        (a clean end, every step committed): one last gc here, so the run at rest is within
        the policy's bound. Warn about gc errors (the steps stay on disk: nothing was lost)."""
        with self._cond:
            self._stop = True
            self._due = False
            self._cond.notify_all()
        self._thread.join()
        if final:
            t0 = time.perf_counter()
            try:
                self.runs.append((self.writer.gc(self.policy), time.perf_counter() - t0))
            except Exception as err:  # reported below; the run is intact
                self.errors.append(err)
        if self.errors:
            last = self.errors[-1]
            warnings.warn(
                f"background retention failed {len(self.errors)} time(s), last: "
                f"{type(last).__name__}: {last}; the steps it would have pruned are "
                "still on disk (run `dstt gc` with the same policy)",
                DsttWarning,
                stacklevel=3,
            )

    # -- retention thread -----------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._due and not self._stop:
                    self._cond.wait()
                if self._stop:
                    return
                self._due, self._busy = False, True
            t0 = time.perf_counter()
            try:
                rep = self.writer.gc(self.policy)
            except BaseException as e:  # kept for close(); training goes on
                rep = None
                self.errors.append(e)
            dt = time.perf_counter() - t0
            with self._cond:
                if rep is not None:
                    self.runs.append((rep, dt))
                    self._unreported.append(rep)
                    self._unreported_s += dt
                self._busy = False
                self._cond.notify_all()
