"""Write-time summaries agree with the stored tensors at every step, on every write path.

A step's summaries are computed from the host copy its bytes were written from — in the
flusher process (flat lane, raw steps), in this process's writer threads (flat lane without a
flusher, or a step the writer encodes) or per chunk (a state larger than half the budget,
written in segments of its layout). Each path hands its own buffer to the one kernel
(``dstt.analysis.summary_kernel``), so each is checked here on its own, at every step, and the
lanes against each other (bit-equal where a tensor is one chunk): ``l2``, ``rms``, ``maxabs``,
NaN/Inf, the probe values and ``update_l2`` (exact for a whole step, which keeps the parent's
copy where it digests; estimated from the probes for a segmented step) must equal what the
committed tensors of that step (and the one before) give. A summary taken from the wrong
buffer — the ring's other step, a stale or a zeroed one — fails at once.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from dstt.analysis.summary_kernel import probe_indices
from dstt.inspect.summaries import summary_rows
from dstt.store import DeltaPolicy, Repository
from dstt.training import session

from ._helpers import MLP, committed_steps, mlp_batch, stored, train_step

STEPS = 6
D_IN = HIDDEN = 48  # parameters and Adam state ~ 30 KiB: flat lane under the default budget
CHUNK_BUDGET = 16 * 1024  # under twice the state: in segments

#: name -> (flusher process, encoded, lane)
PATHS = {
    "flusher-raw-flat": (True, False, "flat"),
    "flusher-encoded-flat": (True, True, "flat"),  # deltas here, the keyframe in the flusher
    "threads-raw-flat": (False, False, "flat"),
    "threads-encoded-flat": (False, True, "flat"),
    "raw-segments": (False, False, "segments"),
    "encoded-segments": (False, True, "segments"),
}


def expected_update(prev: np.ndarray, cur: np.ndarray, path: str, exact: bool) -> float:
    if exact:
        return float(np.linalg.norm(cur - prev))
    idx = probe_indices(path, cur.size)
    d = cur.reshape(-1)[idx] - prev.reshape(-1)[idx]
    return math.sqrt(cur.size / len(idx) * float(np.dot(d, d)))


@pytest.mark.parametrize("name", list(PATHS))
def test_summaries_match_the_stored_tensors_at_every_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    flusher, encoded, lane = PATHS[name]
    monkeypatch.setenv("DSTT_FLUSHER", "1" if flusher else "0")
    torch.manual_seed(0)
    m = MLP(d_in=D_IN, hidden=HIDDEN)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    options: dict = {"budget_bytes": CHUNK_BUDGET} if lane == "segments" else {}
    if encoded:
        options["encoding"] = DeltaPolicy(raw_when_busy=False)  # every step it can, encoded
    run = tmp_path / "run"
    with session(m, opt, run=run, **options) as s:
        for i in range(STEPS):
            if encoded and i == 2:
                s.keyframe()  # one step written whole (raw: by the flusher where one runs)
            train_step(m, opt, *mlp_batch(i, d_in=D_IN))
            if i == 0 and flusher:  # the later steps go to the child (not served here
                s.wait()  # while it starts): step 1 copied, the flusher is made
                fl = s._pipeline.sink.flusher if s._pipeline is not None else None
                assert fl is None or fl.wait_ready(120), name
        pipe = s._pipeline
        assert pipe is not None
        # the path this case is about is the one that ran
        assert (pipe.sink.flusher is not None and not pipe.sink.flusher.dead) == flusher, name
    assert pipe.steps is not None
    segmented = s.metrics[-1].bytes > pipe.steps.nbytes
    assert segmented == (lane == "segments"), name
    assert pipe.steps.capacity <= pipe.budget_bytes  # the ring never grows past the budget
    repo = Repository.open(run)
    assert committed_steps(repo) == list(range(1, STEPS + 1))
    r = repo.reader()
    encoded_steps = 0
    for h in r.lineage():
        summ = summary_rows(r.read_object(h, "summaries"))
        params = sorted(p for p in r.arrays(h) if p.startswith("params/"))
        assert sorted(summ) == params, h.step
        deltas = any(c.encoding != "raw" for p in params for c in r.arrays(h)[p].chunks)
        encoded_steps += deltas
        if encoded and h.step == 3:
            assert not deltas  # the keyframe: written whole
        for path in params:
            cur = stored(repo, h.step, path).double().numpy()
            row, where = summ[path], f"{name}: step {h.step}, {path}"
            assert row["l2"] == pytest.approx(np.linalg.norm(cur), rel=1e-6), where
            assert row["rms"] == pytest.approx(np.sqrt(np.mean(cur * cur)), rel=1e-6), where
            assert row["maxabs"] == float(np.abs(cur).max()), where
            assert (row["nan"], row["inf"]) == (0, 0), where
            idx = probe_indices(path, cur.size)
            assert row["probe"] == cur.reshape(-1)[idx].tolist(), where
            if h.step == 1:
                assert row["update_l2"] is None, where
                continue
            # a whole step compares with its parent's whole copy; a segmented one estimates
            assert row["update_exact"] is (lane == "flat"), where
            prev = stored(repo, h.step - 1, path).double().numpy()
            want = expected_update(prev, cur, path, bool(row["update_exact"]))
            assert row["update_l2"] == pytest.approx(want, rel=1e-5), where
            assert want > 0, where  # the optimizer moved it: a real comparison
    assert (encoded_steps > 0) == encoded, name


#: the fields every lane computes from the same tensor with the same kernel call
SAME_BITS = ("l2", "rms", "maxabs", "nan", "inf", "probe")
#: under twice the state (the chunk lane), its chunks (a quarter of it) hold each tensor
#: whole: a tensor cut into chunks sums its chunks' partials, equal only to ~1e-7
WHOLE_CHUNK_BUDGET = 40 * 1024


def _summaries_by_lane(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> dict[int, dict[str, dict[str, object]]]:
    """Train the same seeded steps through one path of ``PATHS``; every step's summaries."""
    flusher, _, lane = PATHS[name]
    monkeypatch.setenv("DSTT_FLUSHER", "1" if flusher else "0")
    torch.manual_seed(0)
    m = MLP(d_in=D_IN, hidden=HIDDEN)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    options: dict = {"budget_bytes": WHOLE_CHUNK_BUDGET} if lane == "segments" else {}
    with session(m, opt, run=tmp_path / name, **options) as s:
        for i in range(STEPS):
            train_step(m, opt, *mlp_batch(i, d_in=D_IN))
        pipe = s._pipeline
    assert pipe is not None
    assert pipe.steps is not None
    assert (s.metrics[-1].bytes > pipe.steps.nbytes) == (lane == "segments"), name
    r = Repository.open(tmp_path / name).reader()
    out = {}
    for h in r.lineage():
        arrays = r.arrays(h)
        assert all(len(arrays[p].chunks) == 1 for p in arrays if p.startswith("params/"))
        out[h.step] = summary_rows(r.read_object(h, "summaries"))
    return out


def test_every_lane_stores_the_same_summary_bits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One seeded run captured in segments (per chunk, the engine's writer threads), and
    whole by the flusher process and by the writer threads: the same tensors give
    bit-equal l2, rms, maxabs, NaN/Inf counts and probes (one kernel; a tensor's numbers
    do not depend on its neighbours in a buffer). The updates differ by design: exact for
    a whole step, estimated for a segmented one."""
    runs = {
        n: _summaries_by_lane(tmp_path, monkeypatch, n)
        for n in ("raw-segments", "flusher-raw-flat", "threads-raw-flat")
    }
    chunk = runs.pop("raw-segments")
    assert sorted(chunk) == list(range(1, STEPS + 1))
    for name, flat in runs.items():
        assert sorted(flat) == sorted(chunk), name
        for step, rows in chunk.items():
            assert sorted(flat[step]) == sorted(rows), (name, step)
            for path, row in rows.items():
                got = {f: flat[step][path][f] for f in SAME_BITS}
                assert got == {f: row[f] for f in SAME_BITS}, (name, step, path)
