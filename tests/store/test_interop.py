"""A dstt run is plain Zarr v3: zarr-python, xarray and tensorstore read it without dstt.

Each reader runs in a FRESH interpreter that never imports dstt (checked through
``sys.modules``); it dumps what it read to an ``.npz`` file and the test compares bit-exactly.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from dstt.store import Repository, save
from dstt.store.layout import chunk_key

from ._util import sample


def _run_child(code: str, *args: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Steps 10, 20 on main; rollback to 10; step 15 on the new timeline (3 slots)."""
    path = tmp_path_factory.mktemp("interop") / "run"
    steps = {}
    for step in (10, 20):
        steps[step] = {"params/f": sample("float32", (9, 4), seed=step),
                       "params/i": sample("int64", (5,), seed=step + 1),
                       "params/scalar": sample("float32", (), seed=step + 2),
                       "bf/h": sample("bfloat16", (7, 3), seed=step + 3)}
        save(path, step, steps[step], chunk_bytes=64)  # f: 4 rows per chunk, edge chunk of 1
    Repository.open(path).rollback(10)
    steps[15] = {k: sample(str(v.dtype), v.shape, seed=1500 + i)
                 for i, (k, v) in enumerate(steps[10].items())}
    save(path, 15, steps[15], chunk_bytes=64)
    r = Repository.open(path).reader()
    slots = {h.step: h.slot for tl in r.timelines for h in r.lineage(tl)}
    assert sorted(slots) == [10, 15, 20] and len(set(slots.values())) == 3
    return {"path": path, "steps": steps, "slots": slots}


ZARR_XARRAY = """
    import json, sys
    import numpy as np, zarr, xarray as xr
    run, out = sys.argv[1], sys.argv[2]
    res = {}
    for name in ("f", "i", "scalar"):
        a = zarr.open_array(f"{run}/params/{name}", mode="r", zarr_format=3)
        res[f"zarr_{name}"] = a[:]
    res["zarr_step"] = zarr.open_array(f"{run}/step", mode="r", zarr_format=3)[:]
    ds = xr.open_zarr(f"{run}/params", zarr_format=3, consolidated=False)
    for name in ("f", "i", "scalar"):
        res[f"xr_{name}"] = ds[name].values
    root = xr.open_zarr(run, zarr_format=3, consolidated=False)
    res["xr_step"] = root["step"].values
    np.savez(out, **res)
    print(json.dumps({"dims": {k: list(v.dims) for k, v in ds.data_vars.items()},
                      "dstt": any(m == "dstt" or m.startswith("dstt.") for m in sys.modules)}))
"""


def test_zarr_and_xarray_read_without_dstt(run: dict, tmp_path: Path) -> None:
    out = tmp_path / "read.npz"
    info = _run_child(ZARR_XARRAY, str(run["path"]), str(out))
    assert info["dstt"] is False  # the fresh interpreter never imported dstt
    assert info["dims"]["f"] == ["slot", "f_0", "f_1"] and info["dims"]["scalar"] == ["slot"]
    got = np.load(out)
    cap = Repository.open(run["path"]).slot_capacity()
    for lib in ("zarr", "xr"):
        f, i, sc = got[f"{lib}_f"], got[f"{lib}_i"], got[f"{lib}_scalar"]
        assert f.shape == (cap, 9, 4) and f.dtype == np.float32
        assert i.shape == (cap, 5) and i.dtype == np.int64
        for step, slot in run["slots"].items():
            want = run["steps"][step]
            assert f[slot].tobytes() == want["params/f"].tobytes(), (lib, step)
            assert i[slot].tobytes() == want["params/i"].tobytes(), (lib, step)
            assert sc[slot].tobytes() == want["params/scalar"].tobytes(), (lib, step)
        unused = sorted(set(range(cap)) - set(run["slots"].values()))
        assert np.isnan(f[unused]).all()  # fill value NaN for slots never written
        step = got[f"{lib}_step"]
        assert step.dtype == np.int64 and step.shape == (cap,)
        assert {int(step[s]) for s in unused} == {-1}
        assert {int(step[slot]): slot for slot in run["slots"].values()} == {
            st: sl for st, sl in run["slots"].items()}


BF16 = """
    import json, sys
    import numpy as np, zarr, xarray as xr
    import zarr.core.dtype as zdt
    run, out = sys.argv[1], sys.argv[2]
    before = None
    try:  # zarr 3.1.6 collects the entry point but never loads it: expected to fail here
        zarr.open_array(f"{run}/bf/h", mode="r", zarr_format=3)
        before = "ok"
    except Exception as e:
        before = type(e).__name__
    dstt_before = any(m == "dstt" or m.startswith("dstt.") for m in sys.modules)
    zdt.data_type_registry._lazy_load()
    cls = zdt.data_type_registry.get("bfloat16")
    a = zarr.open_array(f"{run}/bf/h", mode="r", zarr_format=3)
    h = a[:]
    ds = xr.open_zarr(f"{run}/bf", zarr_format=3, consolidated=False)
    xh = ds["h"].values
    np.savez(out, zarr_h=h.view(np.uint16), xr_h=xh.view(np.uint16))
    print(json.dumps({
        "before": before, "dstt_before": dstt_before, "cls": cls.__module__,
        "zarr_dtype": str(h.dtype), "xr_dtype": str(xh.dtype),
        "torch": "torch" in sys.modules,
        "dstt_modules": sorted(m for m in sys.modules if m.startswith("dstt")),
    }))
"""


def test_bfloat16_reads_through_the_entry_point(run: dict, tmp_path: Path) -> None:
    out = tmp_path / "bf.npz"
    info = _run_child(BF16, str(run["path"]), str(out))
    assert info["dstt_before"] is False
    assert info["cls"] == "dstt.store.bfloat16"  # registered by the entry point, not by hand
    assert "dstt.store.bfloat16" in info["dstt_modules"]
    assert info["torch"] is False  # the entry point pulls in no torch
    assert info["zarr_dtype"] == "bfloat16" and info["xr_dtype"] == "bfloat16"
    got = np.load(out)
    for lib in ("zarr", "xr"):
        h = got[f"{lib}_h"]
        for step, slot in run["slots"].items():
            assert h[slot].tobytes() == run["steps"][step]["bf/h"].tobytes(), (lib, step)
    # informational: zarr 3.1.6 fails before _lazy_load(); a fixed zarr would read it directly
    assert info["before"] in ("ok", "ValueError")


TENSORSTORE = """
    import json, sys
    import numpy as np, tensorstore as ts
    run, out = sys.argv[1], sys.argv[2]
    res = {}
    for name in ("params/f", "bf/h", "step"):
        t = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": f"{run}/{name}"}},
                    read=True).result()
        v = t.read().result()
        res[name.replace("/", "_")] = v.view(np.uint16) if name == "bf/h" else v
        res[name.replace("/", "_") + "_dtype"] = np.array(str(t.dtype))
    np.savez(out, **res)
    print(json.dumps({"dstt": any(m == "dstt" or m.startswith("dstt.") for m in sys.modules)}))
"""


def test_tensorstore_reads_float32_and_bfloat16(run: dict, tmp_path: Path) -> None:
    pytest.importorskip("tensorstore")
    out = tmp_path / "ts.npz"
    info = _run_child(TENSORSTORE, str(run["path"]), str(out))
    assert info["dstt"] is False
    got = np.load(out)
    assert "float32" in str(got["params_f_dtype"]) and "bfloat16" in str(got["bf_h_dtype"])
    for step, slot in run["slots"].items():
        want = run["steps"][step]
        assert got["params_f"][slot].tobytes() == want["params/f"].tobytes()
        assert got["bf_h"][slot].tobytes() == want["bf/h"].view(np.uint16).tobytes()
        assert int(got["step"][slot]) == step


CORRUPT = """
    import json, sys, zarr
    a = zarr.open_array(sys.argv[1], mode="r", zarr_format=3)
    try:
        a[int(sys.argv[2])]
        print(json.dumps({"error": None}))
    except Exception as e:
        print(json.dumps({"error": type(e).__name__, "msg": str(e)[:200]}))
"""


def test_zarr_itself_checks_the_chunk_crc32c(run: dict, tmp_path: Path) -> None:
    """The crc32c codec is declared in zarr.json, so plain zarr detects a damaged chunk too."""
    copy = tmp_path / "run"
    shutil.copytree(run["path"], copy)
    slot = run["slots"][20]
    f = copy / chunk_key("params/f", slot, (1, 0))
    data = bytearray(f.read_bytes())
    data[5] ^= 0x10
    f.write_bytes(bytes(data))
    info = _run_child(CORRUPT, str(copy / "params" / "f"), str(slot))
    assert info["error"] is not None and "checksum" in info["msg"].lower(), info
    clean = _run_child(CORRUPT, str(copy / "params" / "f"), str(run["slots"][10]))
    assert clean["error"] is None


def test_bfloat16_dtype_class_matches_ml_dtypes() -> None:
    from dstt.store.bfloat16 import BFloat16

    d = BFloat16()
    assert d.to_native_dtype() == np.dtype(ml_dtypes.bfloat16) and d.item_size == 2
    assert BFloat16.from_native_dtype(np.dtype(ml_dtypes.bfloat16)) == d
