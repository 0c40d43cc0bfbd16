"""Child process of ``test_crash``: commits steps in a loop until the parent SIGKILLs it.

Run as a script: ``python crash_child.py RUN DURABILITY``. It continues after the run's head,
prints ``ready N`` before its first commit and ``committed N`` after each ``commit`` returns.
Every step's content is a pure function of the step (``expected``), so the parent can check
what a reader sees without talking to the child.
"""

from __future__ import annotations

import sys
from typing import Any

import ml_dtypes
import numpy as np

CHUNK_BYTES = 2048


def expected(step: int) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Arrays and objects of ``step`` (several chunks, an edge chunk, bf16, 0-d)."""
    rng = np.random.default_rng(step)
    arrays = {
        "params/layers/0/w": rng.standard_normal((40, 32), dtype=np.float32),  # 3 chunks
        "params/layers/0/b": rng.standard_normal(33).astype(ml_dtypes.bfloat16),
        "optim/exp_avg/layers/0/w": rng.integers(-(2**62), 2**62, (9, 7)),
        "optim/step": np.array(step, dtype=np.int64),
    }
    objects = {"meta": {"step": step, "tag": ("x", step), 3: b"\x00" * (step % 5)}}
    return arrays, objects


def commit(w: Any, step: int) -> None:
    arrays, objects = expected(step)
    txn = w.begin(step)
    for path, a in arrays.items():
        name = "bfloat16" if a.dtype == np.dtype(ml_dtypes.bfloat16) else a.dtype.name
        plan = txn.declare(path, name, a.shape)
        flat = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
        for i in range(plan.n_chunks):
            start, stop = plan.byte_range(i)
            txn.put_chunk(path, i, flat[start:stop])
    for name, obj in objects.items():
        txn.put_object(name, obj)
    txn.commit({"loss": 1.0 / (step + 1)})


def main() -> None:
    from dstt.store import LocalStorage, Repository

    path, durability = sys.argv[1], sys.argv[2]
    repo = Repository(LocalStorage(path, durability=durability))  # type: ignore[arg-type]
    with repo.writer(chunk_bytes=CHUNK_BYTES) as w:
        head = w.reader.head()
        step = 0 if head is None else head.step + 1
        print(f"ready {step}", flush=True)
        while True:
            commit(w, step)
            print(f"committed {step}", flush=True)
            step += 1


if __name__ == "__main__":
    main()
