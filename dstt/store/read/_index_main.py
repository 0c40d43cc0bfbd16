"""``python -m dstt.store.read._index_main``: an index job (``store/index/job.py``): the job's
``{"run", "slots", "every"}`` on stdin, exit status 0 once the segment (and any merge) is
written. A module of its own so that running it does not re-execute a module the package
``dstt.store`` already imported (runpy warns about that, on the child's stderr)."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import signal
import sys

from dstt.store.index.writer import flush_rows
from dstt.store.storage.local import LocalStorage

from .reader import Reader


def _lower_priority() -> None:
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        with contextlib.suppress(OSError):
            os.nice(19)


def main() -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the writer that started the job decides
    _lower_priority()
    gc.disable()  # a short life of many small objects: the collector would only cost
    job = json.loads(sys.stdin.buffer.read())
    storage = LocalStorage(job["run"])
    reader = Reader(storage)
    index = reader.index.load()
    pending = {int(s): reader.header(int(s)) for s in job["slots"]}
    flush_rows(storage, reader, index, pending, int(job["every"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
