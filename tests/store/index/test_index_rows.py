"""Index rows built from commit headers are what each step's own files say: every raw
tensor's location and checksums, encoded tensors left out, and the write-time summaries —
for a run that mixes flat steps, a layout change, encoded (delta) steps and pruned steps."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

import dstt
from dstt.store import Repository
from dstt.store.format.segment import SCALARS
from dstt.store.index.rows import SUMMARIES, _summaries, rows_from_headers
from dstt.testing.models import TinyGPT, make_batch


def _want(obj: Any) -> dict[str, tuple[list[float], bool, list[float]]]:
    """What a summaries object says per path: the oracle for the vectorised rows."""
    if not (isinstance(obj, dict) and obj.get("columns") == 1):
        return _summaries(obj)
    cols = [np.asarray(obj[f], dtype=np.float64) for f in SCALARS]
    probe = np.asarray(obj["probe"], dtype=np.float64)
    lens = np.asarray(obj["probe_len"]).tolist()
    # (written before exact flat-lane updates: no ``update_exact`` column, estimates)
    exact = np.asarray(obj.get("update_exact", np.zeros(len(lens), bool)), bool).tolist()
    return {
        str(p): (
            [float(c[i]) for c in cols],
            bool(exact[i]),
            probe[i, : int(lens[i])].tolist() if probe.ndim == 2 else [],
        )
        for i, p in enumerate(obj["path"])
    }


def _train(run: Path, steps: int, *, resume: bool, **options: object) -> None:
    torch.manual_seed(0)
    m = TinyGPT(layers=1)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    with dstt.session(m, opt, run=run, every=1, resume=resume, **options) as s:  # type: ignore[arg-type]
        for i in range(s.step, s.step + steps):
            _, loss = m(*make_batch(i))
            loss.backward()
            opt.step()
            opt.zero_grad()


def test_rows_agree_with_every_steps_arrays_table_and_summaries(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _train(run, 5, resume=False)  # flat lane, columnar summaries
    _train(run, 4, resume=True, encoding=dstt.DeltaPolicy(keyframe_every=3, raw_when_busy=False))
    _train(run, 3, resume=True, budget_bytes=64 << 10)  # chunk lane: another table shape
    repo = Repository.open(run)
    repo.gc(keep_last=8)  # the oldest steps are pruned
    r = repo.reader()
    hs = list(r.lineage())
    assert any(h.pruned for h in hs)
    assert not all(h.pruned for h in hs)
    rows = rows_from_headers(r, hs)
    kinds: set[str] = set()
    for i, h in enumerate(hs):
        table = {} if h.pruned else r.arrays(h)
        for path, loc in rows.loc.items():
            rec = table.get(path)
            raw = rec is not None and all(c.encoding == "raw" for c in rec.chunks)
            kinds.update(c.encoding for c in (rec.chunks if rec is not None else ()))
            if not raw:
                assert loc.ids[i] == -1, (h.step, path)
                continue
            dtype, shape, nrows, chunks, dims = loc.layouts[int(loc.ids[i])]
            assert (dtype, shape, nrows, dims) == (rec.dtype, rec.shape, rec.rows, rec.dims)
            assert [
                (rows.files[f] if f >= 0 else rec.chunks[0].key, o, b) for f, o, b in chunks
            ] == [(c.key, c.offset, c.nbytes) for c in rec.chunks]
            assert loc.crc[i, : len(rec.chunks)].tolist() == [c.crc32c for c in rec.chunks]
        assert set(p for p in table if all(c.encoding == "raw" for c in table[p].chunks)) <= set(
            rows.loc
        ), h.step
        want: dict[str, tuple[list[float], bool, list[float]]] = {}
        for name in sorted(h.objects) if not h.pruned else ():
            if name == SUMMARIES or name.startswith(f"{SUMMARIES}/"):
                want.update(_want(r.read_object(h, name)))
        assert bool(rows.s_has[i]) == bool(want), h.step
        for path, (vals, exact, probe) in want.items():
            j = rows.s_paths.index(path)
            np.testing.assert_array_equal(rows.s_val[i, j], np.asarray(vals, np.float64))
            assert bool(rows.s_exact[i, j]) == exact
            got = rows.s_probe[i, j]
            np.testing.assert_array_equal(got[: len(probe)], np.asarray(probe, np.float32))
            assert np.isnan(got[len(probe) :]).all()
    assert {"raw", "xor1"} <= kinds or {"raw", "pred1"} <= kinds  # encoded steps were there
    assert len(SCALARS) == rows.s_val.shape[2]
