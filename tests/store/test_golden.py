"""The pinned on-disk format: a small run committed under ``tests/data/golden/`` is read by
today's reader bit-exactly, and today's writer writes it again byte for byte.

The run (written by :func:`regenerate` through the store API, numpy only) holds what the
format has: a delta chain with predictions (``DeltaPolicy(keyframe_every=3)``, Adam(W)
``exp_avg_sq`` and parameters as ``pred1``), a dedup'd array, a two-rank commit (rank 1's
part), a rollback to a second timeline, a step pruned by gc, index segments, tagged-JSON
objects and every kind of metric. ``expected.npz`` and ``expected.json`` next to it hold what
was written — arrays, objects, metrics, lineage — built from the generator's inputs, never
read back through dstt. Headers hold unix times (commit ``time``, ref ``created``): the
generator runs under a frozen clock (the ``time`` of the two store modules that stamp them),
so the bytes depend on the format alone. ``_dstt/lock`` (a pid and a host) is not kept.

A change to the bytes a writer produces fails :func:`test_regenerating_gives_the_same_bytes`:
bump ``FORMAT_VERSION`` (docs/format.md) and keep a reader for the old bytes, then run
``python tests/store/test_golden.py --regenerate``. Rejected: a golden written once and only
read — a writer drifting from the documented bytes would pass until an old reader met it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import shutil
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest

from dstt import schema
from dstt.errors import StepNotFoundError
from dstt.store import DeltaPolicy, Repository
from dstt.store.codec.predict import adam_predictions
from dstt.store.commit.parts import collect_parts
from dstt.store.maintenance.retention import Retention

try:
    from .._util import same_bits
except ImportError:  # run as a script
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from tests.store._util import same_bits

GOLDEN = Path(__file__).resolve().parents[1] / "data" / "golden"
RUN = GOLDEN / "run"
#: the frozen clock of every header and ref (2026-01-01T00:00:00Z)
CLOCK = 1767225600.0
#: a committed golden stays small (tiny tensors); a test says so
MAX_BYTES = 200_000

P, M, V = "params/layer/w", "optim/exp_avg/layer/w", "optim/exp_avg_sq/layer/w"
B, E, N, X = "params/layer/b", "params/emb", "buffers/count", "params/norm/weight"
HYPER = {"lr": 1e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}


# -- the generator ------------------------------------------------------------------------
class _Adam:
    """AdamW in float32 numpy on noisy gradients: arrays a delta chain and predictions fit."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.p = self.rng.standard_normal((16, 8)).astype(np.float32)
        self.m = np.zeros((16, 8), np.float32)
        self.v = np.zeros((16, 8), np.float32)
        self.t = 0

    def step(self) -> dict[str, np.ndarray]:
        b1, b2 = HYPER["betas"]  # type: ignore[misc]
        lr, eps, wd = float(HYPER["lr"]), float(HYPER["eps"]), float(HYPER["weight_decay"])  # type: ignore[arg-type]
        g = (self.rng.standard_normal(self.p.shape) * 1e-4 + 0.02 * self.p).astype(np.float32)
        self.t += 1
        self.p = self.p * np.float32(1 - lr * wd)
        self.m = self.m + np.float32(1 - b1) * (g - self.m)
        self.v = self.v * np.float32(b2) + np.float32(1 - b2) * g * g
        denom = np.sqrt(self.v) / np.float32(math.sqrt(1 - b2**self.t)) + np.float32(eps)
        self.p = self.p - np.float32(lr / (1 - b1**self.t)) * (self.m / denom)
        return {M: self.m.copy(), V: self.v.copy(), P: self.p.copy()}

    def predictions(self) -> Mapping[str, Any]:
        return adam_predictions(
            param=P,
            exp_avg=M,
            exp_avg_sq=V,
            lr=float(HYPER["lr"]),  # type: ignore[arg-type]
            betas=HYPER["betas"],  # type: ignore[arg-type]
            eps=float(HYPER["eps"]),  # type: ignore[arg-type]
            weight_decay=float(HYPER["weight_decay"]),  # type: ignore[arg-type]
            decoupled=True,
            step=float(self.t),
        )


def put_array(txn: Any, path: str, arr: np.ndarray) -> None:
    """Declare ``arr`` and write its chunks (its own shape: a 0-d array stays 0-d)."""
    dtype = "bfloat16" if arr.dtype == ml_dtypes.bfloat16 else arr.dtype.name
    plan = txn.declare(path, dtype, arr.shape)
    flat = np.ascontiguousarray(arr).reshape(-1).view(np.uint8)
    for i in range(plan.n_chunks):
        start, stop = plan.byte_range(i)
        txn.put_chunk(path, i, flat[start:stop])


def _arrays(adam: _Adam, step: int) -> dict[str, np.ndarray]:
    out = adam.step()  # inputs (exp_avg) before what is predicted from them
    out[B] = (np.arange(5, dtype=np.float32) * step / 7).astype(ml_dtypes.bfloat16)
    out[E] = np.linspace(-1, 1, 12, dtype=np.float16).reshape(4, 3)  # never changes: dedup
    out[N] = np.array(step * 1000, dtype=np.int64)  # 0-d
    x = np.ones(64, np.float32)  # a few elements change per step: an xor1 delta
    x[: step * 3] += np.float32(step) / 1024
    out[X] = x
    return out


def _objects(step: int, timeline: str) -> dict[str, Any]:
    """Objects of every declared kind a plain step has; tagged JSON (tuples, bytes, arrays,
    non-string keys, NaN) included."""
    return {
        schema.SUMMARIES_OBJECT: {P: {"l2": float(step), "nan": 0}},
        schema.OPTIM_STATE_OBJECT: {"format": 2, "params": {"layer.w": {"arrays": ["exp_avg"]}}},
        schema.OPTIM_GROUPS_OBJECT: [{"lr": 0.01, "betas": (0.9, 0.95)}],
        schema.SCHEDULER_OBJECT: {"last_epoch": step, "_last_lr": [0.01 / step]},
        schema.RNG_OBJECT: {
            "seed": (step, timeline),
            "raw": bytes(range(step, step + 8)),
            "state": np.arange(4, dtype=np.uint32) + step,
        },
        schema.DATA_OBJECT: {"epoch": 0, "index": step * 4, 1: "int key", "inf": math.nan},
    }


def _metrics(step: int) -> dict[str, Any]:
    return {"loss": 4.0 / step, "lr": 0.01, "nan": math.nan, "phase": "warmup", "ok": True}


def _commit(w: Any, step: int, adam: _Adam, written: dict[str, Any], tl: str) -> None:
    arrays = _arrays(adam, step)
    objects = _objects(step, tl)
    txn = w.begin(step)
    txn.predict(adam.predictions())
    for path, a in arrays.items():
        put_array(txn, path, a)
    for name, obj in objects.items():
        txn.put_object(name, obj)
    txn.commit(_metrics(step))
    written[f"{tl}/{step}"] = {"arrays": arrays, "objects": objects, "metrics": _metrics(step)}


def _two_ranks(repo: Repository, step: int, written: dict[str, Any]) -> None:
    """Step ``step`` written by two ranks into one slot: rank 1 prepares its part, rank 0
    merges it (``commit/parts.py``)."""
    a0 = np.arange(10, dtype=np.float32) + step
    a1 = np.arange(7, dtype=np.int32) * -1 - step
    with (
        repo.writer(chunk_bytes=64) as w0,
        repo.writer(chunk_bytes=64, exclusive=False, rank=1) as w1,
    ):
        slot = w0.next_slot
        t1 = w1.begin(step, slot=slot)
        put_array(t1, "zero/r1/flat", a1)
        t1.put_object(f"{schema.RNG_OBJECT}/r1", {"seed": 1})
        t1.prepare(rank=1, world=2, session="golden", metrics={"loss": 9.0})
        t0 = w0.begin(step, slot=slot)
        put_array(t0, "zero/r0/flat", a0)
        t0.put_object(f"{schema.RNG_OBJECT}/r0", {"seed": 0})
        parts = collect_parts(
            repo.storage, slot=slot, step=step, ranks=[1], world=2, session="golden", timeout=30
        )
        t0.commit({"loss": 1.0}, parts=parts)
    written[f"main/{step}"] = {
        "arrays": {"zero/r0/flat": a0, "zero/r1/flat": a1},
        "objects": {f"{schema.RNG_OBJECT}/r0": {"seed": 0}, f"{schema.RNG_OBJECT}/r1": {"seed": 1}},
        "metrics": {"loss": 1.0},
    }


class _FrozenTime:
    """The ``time`` module with a stopped ``time()``."""

    @staticmethod
    def time() -> float:
        return CLOCK

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


@contextmanager
def _frozen_clock() -> Iterator[None]:
    """``time.time()`` of the modules that stamp headers and refs returns :data:`CLOCK`."""
    import dstt.store.commit.writer as writer_mod
    import dstt.store.repository as repo_mod

    mods = (writer_mod, repo_mod)
    saved = [m.time for m in mods]
    for m in mods:
        m.time = _FrozenTime()  # type: ignore[assignment]
    try:
        yield
    finally:
        for m, t in zip(mods, saved, strict=True):
            m.time = t  # type: ignore[assignment]


def write_run(run: Path) -> dict[str, Any]:
    """Write the golden run at ``run`` (must not exist); return what was written, by
    ``"<timeline>/<step>"``."""
    written: dict[str, Any] = {}
    policy = DeltaPolicy(keyframe_every=3, raw_when_busy=False)
    with _frozen_clock():
        repo = Repository.create(run)
        adam = _Adam(0)
        with repo.writer(encoding=policy, chunk_bytes=256, index_every=4) as w:
            for step in range(1, 6):  # slots 0-4: keyframe, delta/prediction, ...
                _commit(w, step, adam, written, "main")
        _two_ranks(repo, 6, written)  # slot 5
        branch = repo.rollback(3, skip_data=2).name  # main-from-3, based on slot 2
        adam = _Adam(1)
        for _ in range(3):
            adam.step()
        with repo.writer(encoding=policy, chunk_bytes=256, index_every=4) as w:
            for step in (4, 5):  # slots 6, 7
                _commit(w, step, adam, written, branch)
        repo.gc(retention=Retention(keep_last=1))  # prunes main's steps 4 and 5
    (run / "_dstt" / "lock").unlink(missing_ok=True)
    return written


# -- expected values, independent of dstt's encoding ---------------------------------------
def _plain(obj: Any, arrays: dict[str, np.ndarray], where: str) -> Any:
    """``obj`` as JSON: tuples, bytes, non-string keys, NaN and arrays tagged (``__tuple__``
    ...; an array's bytes go to ``expected.npz`` under ``where``)."""
    if isinstance(obj, tuple):
        return {"__tuple__": [_plain(v, arrays, f"{where}/{i}") for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [_plain(v, arrays, f"{where}/{i}") for i, v in enumerate(obj)]
    if isinstance(obj, bytes):
        return {"__bytes__": obj.hex()}
    if isinstance(obj, float) and math.isnan(obj):
        return {"__float__": "nan"}
    if isinstance(obj, np.ndarray):
        arrays[where] = obj
        return {"__ndarray__": where}
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj):
            return {k: _plain(v, arrays, f"{where}/{k}") for k, v in obj.items()}
        return {
            "__dict__": [
                [_plain(k, arrays, where), _plain(v, arrays, f"{where}/{k}")]
                for k, v in obj.items()
            ]
        }
    return obj


def _unplain(doc: Any, arrays: Mapping[str, np.ndarray]) -> Any:
    if isinstance(doc, list):
        return [_unplain(v, arrays) for v in doc]
    if not isinstance(doc, dict):
        return doc
    if len(doc) == 1:
        ((tag, val),) = doc.items()
        if tag == "__tuple__":
            return tuple(_unplain(v, arrays) for v in val)
        if tag == "__bytes__":
            return bytes.fromhex(val)
        if tag == "__float__":
            return math.nan
        if tag == "__ndarray__":
            return arrays[val]
        if tag == "__dict__":
            return {_unplain(k, arrays): _unplain(v, arrays) for k, v in val}
    return {k: _unplain(v, arrays) for k, v in doc.items()}


def _tree_digest(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def regenerate(golden: Path = GOLDEN) -> None:
    """Write the golden run and its expected values under ``golden`` (replacing them)."""
    shutil.rmtree(golden / "run", ignore_errors=True)
    golden.mkdir(parents=True, exist_ok=True)
    written = write_run(golden / "run")
    arrays: dict[str, np.ndarray] = {}
    steps = {}
    for key, w in written.items():
        for path, a in w["arrays"].items():
            arrays[f"{key}/{path}"] = a
        steps[key] = {
            "arrays": sorted(w["arrays"]),
            "objects": _plain(w["objects"], arrays, f"{key}/objects"),
            "metrics": _plain(w["metrics"], arrays, f"{key}/metrics"),
        }
    r = Repository.open(golden / "run").reader()
    lineage = {
        tl: [[h.step, h.slot, h.pruned] for h in r.lineage(tl)] for tl in sorted(r.timelines)
    }
    bf16 = sorted(k for k, a in arrays.items() if a.dtype == ml_dtypes.bfloat16)
    doc = {
        "format": 2,
        "steps": steps,
        "lineage": lineage,
        "head": r.current_timeline,
        "bfloat16": bf16,
    }
    (golden / "expected.json").write_text(json.dumps(doc, indent=1) + "\n")
    with open(golden / "expected.npz", "wb") as f:  # (np.savez dates entries 1980: reproducible)
        np.savez(f, **{k: _npz_safe(v) for k, v in sorted(arrays.items())})


def _npz_safe(a: np.ndarray) -> np.ndarray:
    """bfloat16 is stored as its bits (npz knows no bfloat16); :func:`_expected` undoes it."""
    return a.view(np.uint16) if a.dtype == ml_dtypes.bfloat16 else a


# -- the tests ----------------------------------------------------------------------------
def _expected() -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    doc = json.loads((GOLDEN / "expected.json").read_text())
    with np.load(GOLDEN / "expected.npz") as z:
        arrays = {k: z[k] for k in z.files}
    for k in doc["bfloat16"]:
        arrays[k] = arrays[k].view(ml_dtypes.bfloat16)
    return doc, arrays


def _same(got: Any, want: Any) -> bool:
    """Equal values, types included: NaN equals NaN, arrays bit for bit."""
    if isinstance(want, np.ndarray):
        return isinstance(got, np.ndarray) and same_bits(got, want)
    if isinstance(want, float) and math.isnan(want):
        return isinstance(got, float) and math.isnan(got)
    if isinstance(want, dict):
        return (
            isinstance(got, dict)
            and list(got) == list(want)
            and all(_same(got[k], want[k]) for k in want)
        )
    if isinstance(want, list | tuple):
        return (
            type(got) is type(want)
            and len(got) == len(want)
            and all(_same(g, w) for g, w in zip(got, want, strict=True))
        )
    return type(got) is type(want) and got == want


@pytest.fixture
def golden_run(tmp_path: Path) -> Path:
    """A copy of the golden run: opening a run may write (a lock file, index rows)."""
    run = tmp_path / "run"
    shutil.copytree(RUN, run)
    return run


def test_the_golden_run_is_small_and_complete() -> None:
    """Under 200 KB, and holding every structure it is there to pin."""
    files = [p for p in GOLDEN.rglob("*") if p.is_file()]
    assert sum(p.stat().st_size for p in files) < MAX_BYTES
    r = Repository.open(RUN).reader()
    assert sorted(r.timelines) == ["main", "main-from-3"]
    encodings = {
        c.encoding
        for tl in r.timelines
        for h in r.lineage(tl)
        if not h.pruned
        for a in r.arrays(h).values()
        for c in a.chunks
    }
    assert encodings == {"raw", "xor1", "pred1"}
    assert [h.step for h in r.lineage("main") if h.pruned] == [4, 5]
    assert (RUN / "steps" / "000000000005.r00001.zip").is_file()  # rank 1's share
    assert list((RUN / "_dstt" / "index").glob("*.idx"))
    assert not (RUN / "_dstt" / "lock").exists()


def test_reads_bit_exactly(golden_run: Path) -> None:
    """Today's reader gives back every array, object and metric written, on the lineage
    written; pruned steps are tombstones."""
    doc, arrays = _expected()
    assert doc["format"] == 2
    r = Repository.open(golden_run).reader()
    assert r.current_timeline == doc["head"]
    lineage = {
        tl: [[h.step, h.slot, h.pruned] for h in r.lineage(tl)] for tl in sorted(r.timelines)
    }
    assert lineage == doc["lineage"]
    # a commit is named by the timeline it was written on ("main-from-3" reaches main's 1-3)
    live = {
        f"{h.timeline}/{h.step}": h for tl in r.timelines for h in r.lineage(tl) if not h.pruned
    }
    assert set(live) <= set(doc["steps"])
    for key, h in sorted(live.items()):
        want = doc["steps"][key]
        assert sorted(r.arrays(h)) == want["arrays"], key
        for path in want["arrays"]:
            assert same_bits(r.read_array(h, path), arrays[f"{key}/{path}"]), (key, path)
        objects = _unplain(want["objects"], arrays)
        assert sorted(h.objects) == sorted(objects), key
        for name, obj in objects.items():
            assert _same(r.read_object(h, name), obj), (key, name)
        metrics = _unplain(want["metrics"], arrays)  # (a header's keys are sorted)
        assert _same(dict(sorted(h.metrics.items())), dict(sorted(metrics.items()))), key
        assert h.time == CLOCK
    for tl, rows in lineage.items():
        for step, _, pruned in rows:
            if pruned:
                with pytest.raises(StepNotFoundError):
                    r.find(step, tl)


def test_verify_is_clean(golden_run: Path) -> None:
    """Every envelope, table, chunk (encoded ones reconstructed), object, zip entry and
    index row of the golden run checks out."""
    report = Repository.open(golden_run).verify()
    assert report.ok, report
    assert report.commits >= 8


def test_regenerating_gives_the_same_bytes(tmp_path: Path) -> None:
    """Today's writer writes the golden run byte for byte. If this fails, the bytes changed:
    bump the format version (and read the old one), then ``--regenerate``."""
    regenerate(tmp_path / "golden")
    got, want = _tree_digest(tmp_path / "golden"), _tree_digest(GOLDEN)
    changed = sorted(k for k in got.keys() | want.keys() if got.get(k) != want.get(k))
    assert changed == [], (
        f"today's writer writes other bytes than the golden run in {changed}: a format change "
        "(bump FORMAT_VERSION, keep a reader of format 2, --regenerate), or a new clock or "
        "random input the generator must pin"
    )


_ZARR_CHILD = """
import json, sys, warnings
import numpy as np, zarr
from zarr.storage import ZipStore
out, zips = sys.argv[1], json.loads(sys.argv[2])
dstt_before = any(m == "dstt" or m.startswith("dstt.") for m in sys.modules)
from zarr.core.dtype import data_type_registry
data_type_registry._lazy_load()  # zarr <= 3.4.0: bfloat16 from dstt's entry point
res = {}
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for key, path in zips.items():
        g = zarr.open_group(ZipStore(path, mode="r"), mode="r", zarr_format=3)
        for name, node in g.members(max_depth=None):
            if isinstance(node, zarr.Array):
                v = node[...]
                res[f"{key}/{name}"] = v.view(np.uint16) if str(v.dtype) == "bfloat16" else v
np.savez(out, **res)
print(json.dumps({"dstt_before": dstt_before, "warnings": [str(w.message) for w in caught],
                  "dstt": sorted(m for m in sys.modules if m.startswith("dstt"))}))
"""


def test_zarr_python_reads_the_golden_step_files_without_dstt(tmp_path: Path) -> None:
    """Step files whose chunks are all their own (keyframes, both ranks' shares) read in a
    fresh interpreter through zarr-python alone, bit-exactly and without a warning."""
    doc, arrays = _expected()
    zips = {
        "main/1": RUN / "steps" / "000000000000.zip",
        "main-from-3/4": RUN / "steps" / "000000000006.zip",
        "main/6": RUN / "steps" / "000000000005.zip",
        "main/6#r1": RUN / "steps" / "000000000005.r00001.zip",
    }
    out = tmp_path / "zarr.npz"
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            textwrap.dedent(_ZARR_CHILD),
            str(out),
            json.dumps({k: str(v) for k, v in zips.items()}),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    info = json.loads(proc.stdout.strip().splitlines()[-1])
    assert info["dstt_before"] is False
    assert info["warnings"] == []
    # dstt only as zarr's bfloat16 entry point loads it: none of its readers (dstt._lazy is
    # the stdlib-only helper behind dstt.store's lazy names)
    allowed = {"dstt", "dstt._lazy", "dstt.errors", "dstt.store", "dstt.store.bfloat16"}
    assert set(info["dstt"]) <= allowed
    with np.load(out) as z:
        got = {k: z[k] for k in z.files}
    want: dict[str, np.ndarray] = {}
    for key in zips:
        step_key = key.split("#")[0]
        for path in doc["steps"][step_key]["arrays"]:
            if (key, path) in {("main/6", "zero/r1/flat"), ("main/6#r1", "zero/r0/flat")}:
                continue  # the other rank's share
            a = arrays[f"{step_key}/{path}"]
            want[f"{key}/{path}"] = a.view(np.uint16) if a.dtype == ml_dtypes.bfloat16 else a
    assert sorted(got) == sorted(want)
    for k, a in want.items():
        assert same_bits(got[k], a), k


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--regenerate", action="store_true", help="rewrite tests/data/golden/")
    if not ap.parse_args().regenerate:
        ap.error("pass --regenerate to rewrite the golden run (the tests run under pytest)")
    regenerate()
    print(
        f"wrote {GOLDEN}: {sum(p.stat().st_size for p in GOLDEN.rglob('*') if p.is_file())} bytes"
    )
