"""The batched encoder of flat steps (``codec/flatdelta.py``): one step mixes every kind of
chunk and reads back bit-exact, and its Python work does not grow with the tensor count."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np

import dstt
from dstt.store import Repository, load
from dstt.store.codec.xor import DeltaPolicy
from dstt.store.format.manifest import dump_arrays

from .._util import flat_buffer, put_flat_arrays

DSTT = str(Path(dstt.__file__).parent)


def _model(n: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    out = {}
    for i in range(n):
        out[f"params/l{i}/w"] = rng.standard_normal((32, 32)).astype(np.float32)
        out[f"params/l{i}/b"] = rng.standard_normal(32).astype(np.float32)
    return out


def _nudge(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k: (v * np.float32(1.0001) if "frozen" not in k else v) for k, v in arrays.items()}


def test_one_step_holds_deltas_dedups_and_keyframes(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    arrays = _model(4, rng)
    arrays["params/frozen"] = rng.standard_normal(1000).astype(np.float32)
    arrays["params/noise"] = rng.standard_normal(1000).astype(np.float32)
    arrays["params/edge"] = rng.standard_normal((7, 33)).astype(np.float32)  # 2 chunks, padded
    run = tmp_path / "run"
    repo = Repository.create(run)
    written = {}
    with repo.writer(encoding=DeltaPolicy(keyframe_every=4), chunk_bytes=512) as w:
        for step in range(1, 7):
            arrays = _nudge(arrays)
            arrays["params/noise"] = rng.standard_normal(1000).astype(np.float32)
            written[step] = {k: v.copy() for k, v in arrays.items()}
            txn = w.begin(step)
            put_flat_arrays(txn, arrays)
            table = txn.columns  # spliced from cached columns, as built array by array:
            assert table.arrays_table() == dump_arrays(txn.slot, table.table())
            txn.commit()
            assert txn.flat_pending is not None  # the batched encoder wrote it
            if step == 2:
                st = txn.stats
                assert st.deltas, st
                assert st.dedups, st
                assert st.keyframes, st
    r = repo.reader()
    kinds: dict[int, dict[str, set[str]]] = {}
    for h in r.lineage():
        kinds[h.step] = {
            p: {
                c.encoding if c.key.startswith(f"steps/{h.slot:012d}") else "dedup"
                for c in a.chunks
            }
            for p, a in r.arrays(h).items()
        }
    assert kinds[2]["params/frozen"] == {"dedup"}
    assert kinds[2]["params/noise"] == {"raw"}  # noise does not compress: a keyframe
    assert kinds[2]["params/l0/w"] == {"xor1"}
    assert kinds[2]["params/edge"] == {"xor1"}
    assert kinds[5]["params/l0/w"] == {"raw"}  # keyframe_every=4: a new chain
    for step, want in written.items():
        got = load(run, step).arrays
        for k, v in want.items():
            assert got[k].dtype == v.dtype, (step, k)
            assert got[k].tobytes() == v.tobytes(), (step, k)
    assert repo.verify().ok


def _calls_per_step(tmp_path: Path, n: int) -> int:
    """dstt's Python calls while one steady delta step is written (numcodecs makes a few
    Python calls per Blosc frame of its own: not counted)."""
    rng = np.random.default_rng(n)
    arrays = _model(n, rng)  # deltas, and one noise tensor per layer: a keyframe every step
    repo = Repository.create(tmp_path / f"run{n}")
    counts = []
    calls = [0]

    def prof(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code.co_filename.startswith(DSTT):
            calls[0] += 1

    with repo.writer(encoding=DeltaPolicy(keyframe_every=50)) as w:
        for step in range(1, 6):
            arrays = _nudge(arrays)
            arrays.update(
                {f"params/l{i}/noise": rng.standard_normal(64).astype(np.float32) for i in range(n)}
            )
            txn = w.begin(step)
            calls[0] = 0
            layout, buf = flat_buffer(w, arrays)
            sys.setprofile(prof)
            try:
                txn.put_flat_chunks(layout, buf)
            finally:
                sys.setprofile(None)
            counts.append(calls[0])
            assert step == 1 or (txn.stats.deltas >= n and txn.stats.keyframes >= n)
            txn.commit()
    return counts[-1]


def test_python_calls_per_step_do_not_grow_with_the_tensor_count(tmp_path: Path) -> None:
    small, large = _calls_per_step(tmp_path, 10), _calls_per_step(tmp_path, 100)
    # 270 more tensors, a third of them keyframes: the per-chunk encoder made ~20-50 calls of
    # its own per chunk (> 4,000 more); batched, a step's calls are C-level maps over
    # columns, and the keyframes' zip headers are built once while the same chunks keyframe
    assert large - small < 20, (small, large)
