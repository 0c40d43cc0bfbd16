"""A world of ranks over one run, without torch: real ``RankWriter``s, one thread per rank.

What the engine's ``open_ranks`` does across processes — rank 0 opens the exclusive writer,
removes votes a crashed session left and names the first slot; every other rank opens a part
writer on its own storage handle — done from threads (of the test, or of ``rank_kill_child``).
Every rank owns its own arrays and one object, each a pure function of (step, rank), so a
check needs no word from the ranks. Imported by the tests and, as a plain module, by the
child script.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import ml_dtypes
import numpy as np

from dstt.store._internal import RankInfo, RankWriter, Repository, Storage, remove_parts

CHUNK_BYTES = 256  # params/r<k>/w spans two chunks, the last one an edge chunk


def rank_arrays(step: int, rank: int) -> dict[str, np.ndarray]:
    """The arrays rank ``rank`` owns at ``step`` (float32 in two chunks, bf16, 0-d int64)."""
    rng = np.random.default_rng(1000 * rank + step)
    return {
        f"params/r{rank}/w": rng.standard_normal((12, 10), dtype=np.float32),
        f"params/r{rank}/b": rng.standard_normal(33).astype(ml_dtypes.bfloat16),
        f"optim/r{rank}/step": np.array(10 * step + rank, dtype=np.int64),
    }


def rank_objects(step: int, rank: int) -> dict[str, Any]:
    return {f"rng/r{rank}": {"step": step, "rank": rank}}


def world_arrays(step: int, world: int) -> dict[str, np.ndarray]:
    """Every array a commit of ``step`` by ``world`` ranks holds."""
    return {p: a for r in range(world) for p, a in rank_arrays(step, r).items()}


def world_objects(step: int, world: int) -> dict[str, Any]:
    return {n: o for r in range(world) for n, o in rank_objects(step, r).items()}


def open_world(
    stores: Sequence[Storage], *, session: str, timeout: float = 30.0
) -> list[RankWriter]:
    """One ``RankWriter`` per storage handle (rank = position), as ``open_ranks`` opens them."""
    world = len(stores)
    out: list[RankWriter] = []
    try:
        w0 = Repository(stores[0]).writer(chunk_bytes=CHUNK_BYTES)
        out.append(
            RankWriter(
                w0, RankInfo(0, world), base_slot=w0.next_slot, session=session, timeout=timeout
            )
        )
        remove_parts(stores[0])
        for r in range(1, world):
            w = Repository(stores[r]).writer(chunk_bytes=CHUNK_BYTES, exclusive=False, rank=r)
            out.append(
                RankWriter(
                    w,
                    RankInfo(r, world),
                    base_slot=out[0].base_slot,
                    session=session,
                    timeout=timeout,
                )
            )
    except BaseException:
        close_world(out)
        raise
    return out


def close_world(writers: Sequence[RankWriter]) -> None:
    """Close every rank's writer (after a power cut a close may fail: that is the cut)."""
    for rw in writers:
        with contextlib.suppress(Exception):
            rw.close()


def put_tensor(txn: Any, path: str, a: np.ndarray) -> None:
    """Declare ``a`` and write its chunks, last chunk first."""
    name = "bfloat16" if a.dtype == np.dtype(ml_dtypes.bfloat16) else a.dtype.name
    plan = txn.declare(path, name, a.shape)
    flat = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
    for i in reversed(range(plan.n_chunks)):
        start, stop = plan.byte_range(i)
        txn.put_chunk(path, i, flat[start:stop])


def rank_step(rw: RankWriter, step: int, hold: threading.Event | None = None) -> Any:
    """One rank's share of ``step``: its arrays and object, then ``commit`` (rank 0: the
    merged commit's header; others: their part). ``hold``: wait for it before committing."""
    r = rw.info.rank
    txn = rw.begin(step)
    try:
        for path, a in rank_arrays(step, r).items():
            put_tensor(txn, path, a)
        for name, obj in rank_objects(step, r).items():
            txn.put_object(name, obj)
        if hold is not None:
            hold.wait()
    except BaseException:
        txn.abort()
        raise
    return txn.commit({"loss": float(step), "rank": float(r)})


class WorldStep:
    """Every rank's ``rank_step`` running in its own thread; ``join`` returns each rank's
    result (header or part) or the exception it raised."""

    def __init__(
        self,
        writers: Sequence[RankWriter],
        step: int,
        *,
        hold: Mapping[int, threading.Event] | None = None,
    ) -> None:
        self.results: list[Any] = [None] * len(writers)
        self.done = [threading.Event() for _ in writers]

        def one(i: int) -> None:
            try:
                self.results[i] = rank_step(writers[i], step, (hold or {}).get(i))
            except BaseException as e:  # handed to the caller, which asserts on it
                self.results[i] = e
            finally:
                self.done[i].set()

        self.threads = [
            threading.Thread(target=one, args=(i,), name=f"rank-{i}", daemon=True)
            for i in range(len(writers))
        ]
        for t in self.threads:
            t.start()

    def join(self, timeout: float = 60.0) -> list[Any]:
        for t in self.threads:
            t.join(timeout)
            if t.is_alive():
                raise AssertionError(f"{t.name} still runs after {timeout} s (a hang)")
        return self.results


def run_world(writers: Sequence[RankWriter], step: int) -> list[Any]:
    """One step of every rank, each in its own thread; each rank's result or exception."""
    return WorldStep(writers, step).join()
