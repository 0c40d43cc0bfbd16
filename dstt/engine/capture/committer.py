"""The committer thread: in step order, a step's last objects, its summaries and its commit.

It takes each staged step in order, waits until it is copied, sealed (boundary objects, race
check) and written, stores its last objects and its write-time summaries (finished here, in
step order, because an update estimate compares with the previous *committed* step), commits
it or aborts it on any failure, and hands its metrics back. A step's objects go with its
commit (``StepHandle.put_object``), so the flusher process writes them. Rejected alternative:
committing from whichever writer finishes a step last (commits must follow step order, and a
second ordering mechanism would be needed).
"""

from __future__ import annotations

import errno
import queue
import threading
import time
import warnings
from typing import TYPE_CHECKING, Any

from dstt.store._internal import Encoded

if TYPE_CHECKING:
    from collections.abc import Callable

    from .flight import Flight
    from .governor import EncodeGovernor
    from .summaries import SummaryBook

__all__ = ["Committer", "out_of_room"]

#: the errors of a disk (or a quota, or a file size limit) with no room left
NO_ROOM = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})


def out_of_room(error: BaseException | None) -> bool:
    """Whether ``error`` says the storage has no room left (ENOSPC, EDQUOT, EFBIG)."""
    return isinstance(error, OSError) and error.errno in NO_ROOM


class Committer:
    """One thread committing staged steps in order."""

    def __init__(
        self,
        *,
        book: SummaryBook | None,
        summaries_object: str,
        governor: EncodeGovernor | None,
        record: Callable[[Flight], None],
        make_room: Callable[[Flight], bool] | None = None,
    ) -> None:
        """``make_room``: called when a step's commit found no room left; frees the space of
        a newer step (dropping it) and says whether it did — the commit is then tried again,
        so the oldest step commits first."""
        self._book, self.summaries_object = book, summaries_object
        self._governor, self._record = governor, record
        self._make_room = make_room
        self._pickled: set[str] = set()  # objects warned about (stored with pickle)
        self._q: queue.SimpleQueue[Flight | None] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._loop, name="dstt-commit", daemon=True)
        self.thread.start()

    def put(self, f: Flight) -> None:
        """Commit ``f`` after the steps put before it."""
        self._q.put(f)

    def close(self) -> None:
        """Stop after the steps already put."""
        self._q.put(None)
        self.thread.join()

    def _warn_pickled(self, f: Flight) -> None:
        """Warn once per name of an object the commit had to pickle (not plain data)."""
        objects = f.header.objects if f.header is not None else {}
        for name, obj in (*f.objects.items(), *f.seal_objects.items()):
            rec = objects.get(name)
            if (
                rec is not None
                and rec.encoding == "pickle"
                and not isinstance(obj, Encoded)
                and name not in self._pickled
            ):
                self._pickled.add(name)
                warnings.warn(
                    f"object {name!r} is not plain data; storing it with pickle (reading "
                    "it back needs trusted=True)",
                    RuntimeWarning,
                    stacklevel=2,
                )

    def _loop(self) -> None:
        while True:
            f = self._q.get()
            if f is None:
                return
            try:
                self._finish(f)
            except BaseException as e:  # pragma: no cover - _finish records its own errors
                f.fail(e)
            finally:
                f.done.set()

    def _finish(self, f: Flight) -> None:
        f.copied.wait()
        f.wait_sealed()
        h = f.handle
        if not f.dead:
            assert h is not None  # (begun by the copy thread, or the flight failed)
            for name, obj in f.seal_objects.items():
                try:
                    h.put_object(name, obj)
                except BaseException as e:
                    f.fail(e)
                    break
        f.wait_writes()
        if not f.dead and (f.summaries or f.flat_stats):
            assert h is not None
            try:
                summaries = self._flat_summaries(f) if f.flat_stats else self._summaries(f)
                h.put_object(self.summaries_object, summaries)
            except BaseException as e:
                f.fail(e)
        if not f.dead:
            assert h is not None
            try:
                t0 = time.perf_counter()
                f.header = h.commit(f.metrics_now(), retry=lambda e: self._retry(f, e))
                f.committed = True
                if self._book is not None:  # the parent of the next step's update
                    self._book.committed(f.digest_token if f.flat_stats else -1)
                self._observe(f, time.perf_counter() - t0)
                self._warn_pickled(f)
            except BaseException as e:
                f.fail(e)
        if f.dead and h is not None:
            try:
                h.abort()
            except BaseException as e:  # pragma: no cover - abort touches no storage
                f.error.add_note(f"aborting the step also failed: {e!r}")  # type: ignore[union-attr]
        self._record(f)

    def _retry(self, f: Flight, error: BaseException) -> bool:
        """Run ``f``'s failed commit again? Where the disk had no room for it, after each
        newer step ``make_room`` dropped (bounded: a step is dropped once), so that on a
        filling disk the oldest steps commit and the newest give way."""
        return out_of_room(error) and self._make_room is not None and self._make_room(f)

    def _observe(self, f: Flight, commit_s: float) -> None:
        """Tell the encode governor what this step's flush cost (CPU, and waiting for the
        disk: writer time off the CPU plus the commit, whose barrier waits for the disk)."""
        if self._governor is None:
            return
        assert f.handle is not None
        st = f.handle.stats
        if f.encode and not (st.deltas or st.dedups):
            return  # keyframes only (a first step, a new chain): says nothing about encoding
        self._governor.observe(
            f.encode, f.cpu_s, max(0.0, f.wall_s - f.cpu_s) + commit_s, st.written_bytes
        )

    def _summaries(self, f: Flight) -> dict[str, Any]:
        """Finish the write-time summaries of ``f`` (committer thread, in step order, so the
        update estimate compares with the previous *committed* step's probe)."""
        assert self._book is not None
        out = {}
        for path, acc in f.summaries.items():
            acc.prev_probe = self._book.accumulator(path, acc.numel).prev_probe
            out[path] = self._book.finish(path, acc)
        return out

    def _flat_summaries(self, f: Flight) -> dict[str, Any]:
        assert self._book is not None
        st = dict(f.flat_stats)
        return self._book.finish_columns(st.pop("paths"), st.pop("numel"), st)
