"""Child of ``test_ranks``: a fork server that runs one multi-rank step per request and SIGKILLs
the step's process at one rank's k-th write.

    python rank_kill_child.py

Reads lines ``RUN WORLD RANK K AFTER STEP`` on stdin. For each it forks a process that opens a
world of WORLD ranks on the run directory RUN — every rank its own ``LocalStorage`` (another
process's view of the run), one thread each (``rank_world``) — and commits STEP. At rank
RANK's K-th write (a step file published, a file written, a folder deleted) the process
SIGKILLs itself, before the write or, with AFTER=1, right after it: every rank dies at once,
as when a node goes down. K=0 kills nothing and prints each rank's writes first (``ops RANK
LABEL|LABEL|...``). The server answers ``killed`` or ``exit CODE`` per request, and exits at
end of input. Forking from this single-threaded process costs milliseconds, where a fresh
interpreter (numpy, the store) costs half a second per trial. The storages sync nothing
(``durability="none"``): a SIGKILL keeps the page cache, so syncs change nothing a reader
sees afterwards (the power-cut tests are what check them), and they cost most of a trial.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable
from typing import Any

from rank_world import close_world, open_world, run_world

from dstt.store import LocalStorage, Storage


def _die() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


class KillAt(LocalStorage):
    """A rank's view of the run that dies at its ``k``-th write (0: never)."""

    def __init__(self, root: str, k: int, after: bool) -> None:
        super().__init__(root, durability="none")
        self.k, self.after = k, after
        self.labels: list[str] = []

    def _op(self, label: str, fn: Callable[[], None]) -> None:
        self.labels.append(label)
        hit = len(self.labels) == self.k
        if hit and not self.after:
            _die()
        fn()
        if hit and self.after:
            _die()

    def write(self, key: str, data: Any) -> None:
        self._op(key, lambda: LocalStorage.write(self, key, data))

    def write_durable(self, key: str, data: Any) -> None:
        self._op(key, lambda: LocalStorage.write_durable(self, key, data))

    def delete(self, key: str) -> None:
        self._op(f"delete {key}", lambda: LocalStorage.delete(self, key))

    def open_blob(self, key: str) -> Any:
        blob = LocalStorage.open_blob(self, key)
        publish = blob.publish

        def counted(*, durable: bool = False) -> None:
            self._op(key, lambda: publish(durable=durable))

        blob.publish = counted  # type: ignore[method-assign]
        return blob


def trial(run: str, world: int, rank: int, k: int, after: bool, step: int) -> None:
    stores: list[Storage] = [KillAt(run, k if r == rank else 0, after) for r in range(world)]
    writers = open_world(stores, session=f"kill-{step}", timeout=30)
    results = run_world(writers, step)
    close_world(writers)
    bad = [(r, x) for r, x in enumerate(results) if isinstance(x, BaseException)]
    if bad:
        print(f"failed {bad}", flush=True)
        os._exit(3)
    if k == 0:
        for r, st in enumerate(stores):
            print(f"ops {r}", "|".join(st.labels), flush=True)  # type: ignore[attr-defined]


def main() -> None:
    for line in sys.stdin:
        run, world, rank, k, after, step = line.split()
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                trial(run, int(world), int(rank), int(k), after == "1", int(step))
            except BaseException as e:
                print(f"failed {type(e).__name__}: {e}", flush=True)
                code = 2
            sys.stdout.flush()
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL:
            print("killed", flush=True)
        else:
            print(f"exit {os.waitstatus_to_exitcode(status)}", flush=True)


if __name__ == "__main__":
    main()
