"""An index job's stderr pipe is closed however its end is noticed: no ``ResourceWarning``
(``dstt/store/index/job.py``), also end to end under ``python -W error``."""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

from dstt.store.index.job import IndexJob


def test_a_job_found_done_by_poll_still_closes_its_pipe() -> None:
    job = IndexJob(
        subprocess.Popen(
            [sys.executable, "-c", "import sys; sys.stderr.write('boom'); sys.exit(3)"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
    )
    deadline = time.monotonic() + 30
    while not job.done():  # the writer's path: poll on a later commit, then reap
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert not job.ok
    assert job.proc.stderr is not None
    assert job.proc.stderr.closed
    assert job.error == "boom"
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        del job
        gc.collect()
    assert not [w for w in seen if issubclass(w.category, ResourceWarning)]


CHILD = textwrap.dedent("""
    import sys
    import numpy as np
    from dstt.store import Repository

    repo = Repository.create(sys.argv[1], durability="none")
    with repo.writer(index_every=2) as w:
        for step in range(1, 8):
            txn = w.begin(step)
            a = np.full((4, 2), step, np.float32)
            txn.declare("params/w", "float32", a.shape)
            txn.put_chunk("params/w", 0, a.reshape(-1).view(np.uint8))
            txn.commit({"loss": 1.0})
            job = w.index.job
            if job is not None:
                job.proc.wait()  # done before the next commit: that commit reaps it
    print("jobs ok")
""")


def test_a_session_of_index_jobs_leaves_no_unclosed_file(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-W", "error", "-c", CHILD, str(tmp_path / "run")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "jobs ok" in out.stdout
    assert "ResourceWarning" not in out.stderr, out.stderr
