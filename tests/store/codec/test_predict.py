"""Predictive coding (``pred1``): Adam(W) ``exp_avg_sq`` and parameters stored as the XOR of
their bytes and a prediction from the update rule. Every slot must reconstruct bit-exactly —
whatever the prediction's quality — reads stay within the group's keyframe window, and gc,
rollback and a crash mid-commit keep every committed step readable."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from dstt.store import Repository, load
from dstt.store.codec.predict import PREDICTORS, Prediction, adam_predictions, predict
from dstt.store.codec.xor import DeltaPolicy
from dstt.store.commit.transaction import Transaction
from dstt.store.format.layout import step_file_key
from dstt.store.format.manifest import arrays_from_json, arrays_json, dump_arrays
from dstt.store.format.records import ArrayRecord, ChunkRecord

from .._util import (  # noqa: F401  (write_how: a fixture)
    WRITE,
    crash_at_every_write,
    put_array,
    put_flat_arrays,
    write_how,
)

P, M, V = "params/w", "optim/exp_avg/w", "optim/exp_avg_sq/w"
HYPER = {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}


class _Adam:
    """AdamW in float32 numpy, on noisy gradients (the store never sees how it was made)."""

    def __init__(self, seed: int, shape: tuple[int, ...] = (240, 50)) -> None:
        self.rng = np.random.default_rng(seed)
        self.p = self.rng.standard_normal(shape).astype(np.float32)
        self.m = np.zeros(shape, np.float32)
        self.v = np.zeros(shape, np.float32)
        self.t = 0

    def step(self) -> dict[str, np.ndarray]:
        b1, b2 = HYPER["betas"]
        lr, eps, wd = HYPER["lr"], HYPER["eps"], HYPER["weight_decay"]
        g = (self.rng.standard_normal(self.p.shape) * 0.01 + 0.02 * self.p).astype(np.float32)
        self.t += 1
        self.p = self.p * np.float32(1 - lr * wd)
        self.m = self.m + np.float32(1 - b1) * (g - self.m)
        self.v = self.v * np.float32(b2) + np.float32(1 - b2) * g * g
        denom = np.sqrt(self.v) / np.float32(math.sqrt(1 - b2**self.t)) + np.float32(eps)
        self.p = self.p - np.float32(lr / (1 - b1**self.t)) * (self.m / denom)
        return {M: self.m.copy(), V: self.v.copy(), P: self.p.copy()}

    def predictions(self, **over: float) -> dict[str, Prediction]:
        h = {**HYPER, **over}
        return dict(
            adam_predictions(
                param=P,
                exp_avg=M,
                exp_avg_sq=V,
                lr=h["lr"],
                betas=h["betas"],
                eps=h["eps"],  # type: ignore[arg-type]
                weight_decay=h["weight_decay"],
                decoupled=True,
                step=float(self.t),
            )
        )


pytestmark = pytest.mark.usefixtures("write_how")
#: in-flight bases are the engine's, which writes flat steps: a step fed chunk by chunk is
#: staged and encoded at its commit, so its base is the step committed before it
FLAT_ONLY = pytest.mark.parametrize("write_how", ["flat"], indirect=True)


def _put(txn: Transaction, arrays: dict[str, np.ndarray], preds: dict[str, Prediction]) -> None:
    txn.predict(preds)
    if WRITE["how"] == "flat":
        put_flat_arrays(txn, {n: arrays[n] for n in (P, M, V)})
        # an encoded step's spliced table is the table built array by array, byte for byte
        assert txn.columns.arrays_table() == dump_arrays(txn.slot, txn.columns.table())
        return
    for name in (M, V, P):  # inputs before the arrays predicted from them
        put_array(txn, name, arrays[name])


def _commit(
    w,
    step: int,
    arrays: dict[str, np.ndarray],  # type: ignore[no-untyped-def]
    preds: dict[str, Prediction],
):
    txn = w.begin(step)
    _put(txn, arrays, preds)  # inputs before the arrays predicted from them
    txn.commit()
    return txn


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def _train(
    repo: Repository, steps: int, *, seed: int = 0, policy: DeltaPolicy | None = None, **over: float
) -> tuple[dict[int, dict[str, np.ndarray]], list]:  # type: ignore[type-arg]
    t = _Adam(seed)
    written, stats = {}, []
    with repo.writer(encoding=policy or DeltaPolicy(keyframe_every=6), chunk_bytes=16384) as w:
        for step in range(1, steps + 1):
            arrays = t.step()
            written[step] = arrays
            stats.append(_commit(w, step, arrays, t.predictions(**over)).stats)
    return written, stats


def _reads(r, h, path: str, i: int) -> set[tuple[str, int]]:  # type: ignore[no-untyped-def]
    """Every (array, slot) whose chunk ``i`` reconstructing ``path`` at ``h`` reads."""
    out: set[tuple[str, int]] = set()
    todo = [(path, h.slot)]
    while todo:
        p, slot = todo.pop()
        if (p, slot) in out:
            continue
        out.add((p, slot))
        c = r.arrays(r.header(slot))[p].chunks[i]
        if c.base is not None:
            todo.append((p, c.base))
        todo.extend(c.inputs)
    return out


def test_every_slot_is_bit_exact_and_small(tmp_path: Path) -> None:
    repo = Repository.create(tmp_path / "run")
    written, stats = _train(repo, 20)
    r = repo.reader()
    encodings = {c.encoding for h in r.lineage() for a in r.arrays(h).values() for c in a.chunks}
    assert "pred1" in encodings
    for step, arrays in written.items():
        got = load(tmp_path / "run", step).arrays
        for name, a in arrays.items():
            assert _same(got[name], a), (step, name)
    assert repo.verify().ok
    # a step between keyframes costs about one array (exp_avg) instead of three
    between = [s for s in stats[1:] if s.keyframes <= s.deltas]
    assert between
    assert max(s.written_bytes / s.raw_bytes for s in between) < 0.5


def test_a_wrong_prediction_costs_bytes_not_correctness(tmp_path: Path) -> None:
    repo = Repository.create(tmp_path / "run")
    written, stats = _train(
        repo, 8, policy=DeltaPolicy(keyframe_every=6, min_ratio=1.0), lr=5.0, betas=(0.1, 0.2)
    )
    r = repo.reader()
    assert any(c.encoding == "pred1" for h in r.lineage() for c in r.arrays(h)[P].chunks)
    assert min(s.written_bytes / s.raw_bytes for s in stats[1:]) > 0.6  # it did cost bytes
    for step, arrays in written.items():
        got = load(tmp_path / "run", step).arrays
        assert all(_same(got[n], a) for n, a in arrays.items()), step


def test_reads_stay_inside_the_keyframe_window(tmp_path: Path) -> None:
    repo = Repository.create(tmp_path / "run")
    k = 5
    _train(repo, 17, policy=DeltaPolicy(keyframe_every=k))
    r = repo.reader()
    for h in r.lineage():
        rec = r.arrays(h)[P]
        for i in range(len(rec.chunks)):
            reads = _reads(r, h, P, i)
            slots = {s for _, s in reads}
            assert max(slots) == h.slot, (h.step, i, slots)
            assert h.slot - min(slots) <= k - 1, (h.step, i, slots)
            for name in (P, M, V):  # at most K chunk reads of each tensor
                assert sum(1 for p, _ in reads if p == name) <= k


def test_gc_keeps_the_inputs_of_kept_slots(tmp_path: Path) -> None:
    run = tmp_path / "run"
    repo = Repository.create(run)
    written, _ = _train(repo, 19, policy=DeltaPolicy(keyframe_every=7))
    report = repo.gc(keep_last=2)
    assert report.pruned_steps
    assert repo.verify().ok
    for step in (18, 19):
        got = load(run, step).arrays
        assert all(_same(got[n], a) for n, a in written[step].items())


def test_predictions_never_chain_across_timelines(tmp_path: Path) -> None:
    run = tmp_path / "run"
    repo = Repository.create(run)
    main, _ = _train(repo, 10, policy=DeltaPolicy(keyframe_every=20))
    repo.rollback(4)
    t = _Adam(9)
    branch = {}
    with repo.writer(encoding=DeltaPolicy(keyframe_every=20), chunk_bytes=16384) as w:
        for step in range(5, 12):
            branch[step] = t.step()
            _commit(w, step, branch[step], t.predictions())
    r = repo.reader()
    line = {h.slot for h in r.lineage()}
    for h in r.lineage():
        for rec in r.arrays(h).values():
            for c in rec.chunks:
                assert set(c.slots) <= line  # only ancestors on this lineage
    for step, arrays in main.items():
        got = load(run, step, timeline="main").arrays
        assert all(_same(got[n], a) for n, a in arrays.items())
    for step, arrays in branch.items():
        got = load(run, step).arrays
        assert all(_same(got[n], a) for n, a in arrays.items())


def test_predicted_slots_read_as_missing_by_plain_zarr(tmp_path: Path) -> None:
    import zarr
    from zarr.storage import ZipStore

    run = tmp_path / "run"
    repo = Repository.create(run)
    written, _ = _train(repo, 3)
    r = repo.reader()
    assert {c.encoding for c in r.arrays(r.find(3))[P].chunks} == {"pred1"}

    def plain(step: int) -> np.ndarray:
        zkey = step_file_key(r.find(step).slot)
        a = zarr.open_array(ZipStore(run / zkey, mode="r"), path=P, mode="r", zarr_format=3)
        return np.asarray(a[...])

    assert np.array_equal(plain(1), written[1][P])  # keyframe
    assert np.isnan(plain(3)).all()  # prediction residual: not a Zarr chunk


def test_crash_at_every_write_of_a_predicted_commit() -> None:
    t = _Adam(6, shape=(64, 32))
    steps = [(t.step(), t.predictions()) for _ in range(3)]
    k, saw_delta = crash_at_every_write(
        lambda w, step: _commit(w, step, *steps[step - 1]),
        lambda step: steps[step - 1][0],
        encoding=DeltaPolicy(keyframe_every=8),
        chunk_bytes=4096,
    )
    assert k == 5
    assert saw_delta  # cut before each of its 4 writes (step, side, header, ref)


def test_sgd_momentum_parameters_cost_almost_nothing(tmp_path: Path) -> None:
    from dstt.store.codec.predict import sgd_predictions

    run = tmp_path / "run"
    repo = Repository.create(run)
    rng = np.random.default_rng(3)
    p = rng.standard_normal((200, 64)).astype(np.float32)
    buf = np.zeros_like(p)
    lr, mom = np.float32(0.05), np.float32(0.9)
    written, stats = {}, []
    with repo.writer(encoding=DeltaPolicy(keyframe_every=10), chunk_bytes=16384) as w:
        for step in range(1, 8):
            g = (rng.standard_normal(p.shape) * 0.01).astype(np.float32)
            buf = buf * mom + g
            p = p - lr * buf
            arrays = {"optim/momentum_buffer/w": buf.copy(), P: p.copy()}
            written[step] = arrays
            txn = w.begin(step)
            txn.predict(
                sgd_predictions(param=P, momentum_buffer="optim/momentum_buffer/w", lr=float(lr))
            )
            for name, a in arrays.items():  # the buffer first: the parameter reads it
                plan = txn.declare(name, "float32", a.shape)
                flat = a.reshape(-1).view(np.uint8)
                for i in range(plan.n_chunks):
                    lo, hi = plan.byte_range(i)
                    txn.put_chunk(name, i, flat[lo:hi])
            txn.commit()
            stats.append(txn.stats)
    for step, arrays in written.items():
        got = load(run, step).arrays
        assert all(_same(got[n], a) for n, a in arrays.items()), step
    r = repo.reader()
    last = r.arrays(r.head())[P]  # type: ignore[arg-type]
    assert {c.encoding for c in last.chunks} == {"pred1"}
    assert sum(c.nbytes for c in last.chunks) < p.nbytes / 50  # exact: all residual bits zero


def test_pred_records_round_trip_and_reject_garbage() -> None:
    rec = ChunkRecord(
        "p/d.3.0",
        99,
        7,
        "pred1",
        2,
        11,
        "adam_p",
        (("optim/exp_avg/w", 3), ("optim/exp_avg_sq/w", 3)),
        (0.5, 1.0, 1e-8, 0.1),
    )
    arr = ArrayRecord("w", "float32", (4,), 4, (rec,))
    doc = json.loads(json.dumps(arrays_json({"w": arr})))  # the arrays table's columns
    again = arrays_from_json(doc)["w"].chunks[0]
    assert again == rec
    assert again.slots == (2, 3, 3)
    doc["codecs"]["0"][0] = "pred9"
    with pytest.raises(ValueError, match="unknown chunk codec"):
        arrays_from_json(doc)


def test_prediction_specs_are_checked() -> None:
    with pytest.raises(ValueError, match="unknown predictor"):
        Prediction("nope", (), (), ())
    with pytest.raises(ValueError, match="takes inputs"):
        Prediction("adam_v", (("cur", M),), (0.9, 0.1, 0.95, 0.05), (M, V))
    with pytest.raises(ValueError, match="coefficients"):
        Prediction("adam_v", (("cur", M), ("prev", M)), (0.9,), (M, V))
    with pytest.raises(ValueError, match="finite"):
        Prediction("adam_v", (("cur", M), ("prev", M)), (0.9, 0.1, math.inf, 0.05), (M, V))
    assert (
        adam_predictions(
            param=P,
            exp_avg=M,
            exp_avg_sq=V,
            lr=1e-3,
            betas=(1.0, 0.9),
            eps=1e-8,
            weight_decay=0.0,
            decoupled=False,
            step=1,
        )
        == {}
    )
    with pytest.raises(ValueError, match="do not match"):
        predict(
            "adam_v",
            np.zeros(8, np.uint8),
            [np.zeros(8, np.uint8), np.zeros(4, np.uint8)],
            (0.9, 0.1, 0.95, 0.05),
        )
    assert set(PREDICTORS) == {"adam_v", "adam_p", "sgd_p"}


def test_predictions_are_reproducible_float32_arithmetic() -> None:
    """The reader recomputes the writer's prediction: it must be plain float32 IEEE ops."""
    rng = np.random.default_rng(1)
    v, m, m0 = (rng.random(1000, dtype=np.float32) for _ in range(3))
    c = (0.9, 0.1, 0.95, 0.05)
    got = predict("adam_v", v.view(np.uint8), [m.view(np.uint8), m0.view(np.uint8)], c)
    f = np.float32
    g = (m - f(0.9) * m0) / f(0.1)
    want = v * f(0.95) + (g * g) * f(0.05)
    assert got.tobytes() == want.astype(np.float32).tobytes()


@FLAT_ONLY
def test_a_step_in_flight_is_the_base_of_the_next(tmp_path: Path) -> None:
    """Overlapped steps (the engine stages k+1 before k commits) predict from k, not k-1."""
    run = tmp_path / "run"
    repo = Repository.create(run)
    t = _Adam(11)
    steps = [(t.step(), t.predictions()) for _ in range(5)]
    with repo.writer(
        encoding=DeltaPolicy(keyframe_every=20), chunk_bytes=16384, inflight_bases=True
    ) as w:
        prev = w.begin(1)
        _put(prev, *steps[0])
        for step in range(2, 6):
            txn = w.begin(step)
            _put(txn, *steps[step - 1])  # written while the previous step is uncommitted
            assert txn.deps == {prev.slot}
            prev.commit()
            prev = txn
        prev.commit()
    r = repo.reader()
    for h in r.lineage()[1:]:
        for c in r.arrays(h)[P].chunks:
            assert c.encoding == "pred1"
            assert c.base == h.slot - 1
    for step, (arrays, _) in enumerate(steps, start=1):
        got = load(run, step).arrays
        assert all(_same(got[n], a) for n, a in arrays.items()), step


@FLAT_ONLY
def test_a_step_based_on_a_failed_step_is_not_committed(tmp_path: Path) -> None:
    from dstt.errors import DsttError

    run = tmp_path / "run"
    repo = Repository.create(run)
    t = _Adam(12)
    steps = [(t.step(), t.predictions()) for _ in range(4)]
    with repo.writer(
        encoding=DeltaPolicy(keyframe_every=20), chunk_bytes=16384, inflight_bases=True
    ) as w:
        _commit(w, 1, *steps[0])
        doomed = w.begin(2)
        _put(doomed, *steps[1])
        based = w.begin(3)
        _put(based, *steps[2])  # encoded against step 2, which is still in flight
        assert based.deps == {doomed.slot}
        doomed.abort()  # e.g. its commit failed
        with pytest.raises(DsttError, match="did not commit"):
            based.commit()
        based.abort()
        later = w.begin(4)  # starts from the last committed step again
        _put(later, *steps[3])
        assert later.deps == set()
        later.commit()
    r = repo.reader()
    assert [h.step for h in r.lineage()] == [1, 4]
    got = load(run, 4).arrays
    assert all(_same(got[n], a) for n, a in steps[3][0].items())
    assert repo.verify().ok


@FLAT_ONLY
def test_committing_out_of_order_is_refused(tmp_path: Path) -> None:
    from dstt.errors import DsttError

    repo = Repository.create(tmp_path / "run")
    t = _Adam(13)
    with repo.writer(encoding=DeltaPolicy(), chunk_bytes=16384, inflight_bases=True) as w:
        _commit(w, 1, t.step(), t.predictions())
        first = w.begin(2)
        _put(first, t.step(), t.predictions())
        second = w.begin(3)
        _put(second, t.step(), t.predictions())
        with pytest.raises(DsttError, match="commit steps in order"):
            second.commit()
        first.commit()


def test_a_step_written_raw_is_the_base_of_the_next(tmp_path: Path) -> None:
    """A raw-fallback step (the governor chose raw) is a keyframe: the next step predicts
    from it rather than from an older step."""
    run = tmp_path / "run"
    repo = Repository.create(run)
    t = _Adam(14)
    steps = [(t.step(), t.predictions()) for _ in range(3)]
    with repo.writer(encoding=DeltaPolicy(keyframe_every=20), chunk_bytes=16384) as w:
        _commit(w, 1, *steps[0])
        raw = w.begin(2)
        raw.encode = False
        _put(raw, *steps[1])
        raw.commit()
        assert raw.stats.raw_fallback
        assert raw.stats.deltas == 0
        _commit(w, 3, *steps[2])
    r = repo.reader()
    h = r.find(3)
    for c in r.arrays(h)[P].chunks:
        assert c.encoding == "pred1"
        assert c.base == raw.slot
    for step, (arrays, _) in enumerate(steps, start=1):
        got = load(run, step).arrays
        assert all(_same(got[n], a) for n, a in arrays.items())
