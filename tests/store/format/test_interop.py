"""A dstt step is plain Zarr v3: zarr-python, xarray and tensorstore read it without dstt.

Format 2 stores every committed step as one stored zip, ``steps/<slot>.zip``, which is a
complete Zarr v3 hierarchy in zarr-python's ``ZipStore`` layout. Each reader runs in a FRESH
interpreter that never imports dstt (checked through ``sys.modules``; bfloat16 then comes in
through dstt's ``zarr.data_type`` entry point only); it dumps what it read to an ``.npz`` file
and the test compares bit-exactly. No reader may emit a warning.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from dstt.store import Repository, save
from dstt.store.format.layout import step_file_key, zarr_chunk_key

from .._util import sample, zip_entry

NAMES = ("params/f", "params/i", "params/scalar", "bf/h")


def _run_child(code: str, *args: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "Warning" not in proc.stderr, proc.stderr[-4000:]  # nothing printed either
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Steps 10, 20 on main; rollback to 10; step 15 on the new timeline (3 slots)."""
    path = tmp_path_factory.mktemp("interop") / "run"
    steps = {}
    for step in (10, 20):
        steps[step] = {
            "params/f": sample("float32", (9, 4), seed=step),
            "params/i": sample("int64", (5,), seed=step + 1),
            "params/scalar": sample("float32", (), seed=step + 2),
            "bf/h": sample("bfloat16", (7, 3), seed=step + 3),
        }
        save(path, step, steps[step], chunk_bytes=64)  # f: 4 rows per chunk, edge chunk of 1
    branch = Repository.open(path).rollback(10).name
    steps[15] = {
        k: sample(str(v.dtype), v.shape, seed=1500 + i)
        for i, (k, v) in enumerate(steps[10].items())
    }
    save(path, 15, steps[15], chunk_bytes=64)
    r = Repository.open(path).reader()
    heads = {h.step: h for tl in r.timelines for h in r.lineage(tl)}
    slots = {step: h.slot for step, h in heads.items()}
    timelines = {step: h.timeline for step, h in heads.items()}
    assert sorted(slots) == [10, 15, 20]
    assert len(set(slots.values())) == 3
    assert timelines == {10: "main", 20: "main", 15: branch}
    zips = {step: path / step_file_key(slot) for step, slot in slots.items()}
    assert all(z.is_file() for z in zips.values())
    return {"path": path, "steps": steps, "slots": slots, "timelines": timelines, "zips": zips}


def test_step_zip_holds_only_zarr_keys(run: dict) -> None:
    """Stored (never compressed) entries, every one a Zarr key: a zarr.json document or a
    chunk under ``<array>/c/`` (dstt's own bytes live in the side file)."""
    chunk = re.compile(r"^(params/(f|i|scalar)|bf/h)/c(/\d+)*$")
    for step, z in run["zips"].items():
        with zipfile.ZipFile(z) as zf:
            infos = zf.infolist()
            assert zf.testzip() is None, step  # every entry's CRC-32 holds
        names = {i.filename for i in infos}
        assert all(i.compress_type == zipfile.ZIP_STORED for i in infos)
        assert {n for n in names if n.endswith("zarr.json")} == {
            "zarr.json",
            "params/zarr.json",
            "bf/zarr.json",
            *(f"{p}/zarr.json" for p in NAMES),
        }
        others = names - {n for n in names if n.endswith("zarr.json")}
        assert others, sorted(others)
        assert all(chunk.match(n) for n in others), sorted(others)
        assert zarr_chunk_key("params/f", (2, 0)) in names  # the 1-row edge chunk
        assert zarr_chunk_key("params/scalar", ()) in names  # 0-d: ".../c"


ZARR_XARRAY = """
    import json, sys, warnings
    import numpy as np, zarr, xarray as xr
    from zarr.storage import ZipStore
    out, zips = sys.argv[1], json.loads(sys.argv[2])
    dstt_before = any(m == "dstt" or m.startswith("dstt.") for m in sys.modules)
    from zarr.core.dtype import data_type_registry
    data_type_registry._lazy_load()  # zarr 3.1: bfloat16 from dstt's entry point
    res, info = {}, {"dstt_before": dstt_before, "steps": {}}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step, path in zips.items():
            g = zarr.open_group(ZipStore(path, mode="r"), mode="r", zarr_format=3)
            dims = {}
            for name in ("params/f", "params/i", "params/scalar", "bf/h"):
                a = g[name]
                v = a[...]
                res[f"zarr_{step}_{name}"] = v.view(np.uint16) if name == "bf/h" else v
                dims[name] = list(a.metadata.dimension_names or [])
            groups = sorted(k for k, _ in g.groups())
            dt = xr.open_datatree(ZipStore(path, mode="r"), engine="zarr", consolidated=False)
            xdims = {}
            for name in ("params/f", "params/i", "params/scalar", "bf/h"):
                v = dt[name]
                res[f"xr_{step}_{name}"] = (v.values.view(np.uint16) if name == "bf/h"
                                            else v.values)
                xdims[name] = list(v.dims)
            info["steps"][step] = {"attrs": g.attrs.asdict(), "xr_attrs": dict(dt.attrs),
                                   "dims": dims, "xr_dims": xdims, "groups": groups,
                                   "xr_groups": sorted(dt.groups)}
    np.savez(out, **{k.replace("/", "_"): v for k, v in res.items()})
    info["warnings"] = [f"{w.category.__name__}: {w.message}" for w in caught]
    info["dstt_modules"] = sorted(m for m in sys.modules if m.startswith("dstt"))
    info["torch"] = "torch" in sys.modules
    print(json.dumps(info))
"""


def _zips_arg(run: dict) -> str:
    return json.dumps({str(step): str(z) for step, z in run["zips"].items()})


def test_zarr_and_xarray_read_every_step_without_dstt(run: dict, tmp_path: Path) -> None:
    out = tmp_path / "read.npz"
    info = _run_child(ZARR_XARRAY, str(out), _zips_arg(run))
    assert info["dstt_before"] is False  # the fresh interpreter never imported dstt
    assert info["warnings"] == []
    assert info["torch"] is False
    assert "dstt.store.bfloat16" in info["dstt_modules"]  # only via the entry point
    got = np.load(out)
    dims = {
        "params/f": ["f_0", "f_1"],
        "params/i": ["i_0"],
        "params/scalar": [],
        "bf/h": ["h_0", "h_1"],
    }
    for step, slot in run["slots"].items():
        s = info["steps"][str(step)]
        want_attrs = {
            "dstt": {"format": 2, "step": step, "timeline": run["timelines"][step], "slot": slot}
        }
        assert s["attrs"] == want_attrs, step
        assert s["xr_attrs"] == want_attrs, step
        assert s["dims"] == dims
        assert s["xr_dims"] == dims  # no slot axis any more
        assert s["groups"] == ["bf", "params"]
        assert s["xr_groups"] == ["/", "/bf", "/params"]
        want = run["steps"][step]
        for lib in ("zarr", "xr"):
            for name in NAMES:
                v = got[f"{lib}_{step}_{name.replace('/', '_')}"]
                w = want[name].view(np.uint16) if name == "bf/h" else want[name]
                assert v.dtype == w.dtype, (lib, step, name)
                assert v.shape == w.shape, (lib, step, name)
                assert v.tobytes() == w.tobytes(), (lib, step, name)


BF16 = """
    import json, sys, warnings
    import numpy as np, zarr, xarray as xr
    import zarr.core.dtype as zdt
    from zarr.storage import ZipStore
    out, zips = sys.argv[1], json.loads(sys.argv[2])
    first = next(iter(zips.values()))
    before = None
    try:  # zarr 3.1.6 collects the entry point but never loads it: expected to fail here
        zarr.open_array(ZipStore(first, mode="r"), path="bf/h", mode="r", zarr_format=3)
        before = "ok"
    except Exception as e:
        before = type(e).__name__
    dstt_before = any(m == "dstt" or m.startswith("dstt.") for m in sys.modules)
    zdt.data_type_registry._lazy_load()
    cls = zdt.data_type_registry.get("bfloat16")
    res, dtypes = {}, set()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step, path in zips.items():
            a = zarr.open_array(ZipStore(path, mode="r"), path="bf/h", mode="r",
                                zarr_format=3)
            h = a[:]
            ds = xr.open_dataset(ZipStore(path, mode="r"), engine="zarr", group="bf",
                                 consolidated=False)
            xh = ds["h"].values
            dtypes |= {str(h.dtype), str(xh.dtype)}
            res[f"zarr_{step}"], res[f"xr_{step}"] = h.view(np.uint16), xh.view(np.uint16)
    np.savez(out, **res)
    print(json.dumps({
        "before": before, "dstt_before": dstt_before, "cls": cls.__module__,
        "dtypes": sorted(dtypes), "torch": "torch" in sys.modules,
        "dstt_modules": sorted(m for m in sys.modules if m.startswith("dstt")),
        "warnings": [f"{w.category.__name__}: {w.message}" for w in caught],
    }))
"""


def test_bfloat16_reads_through_the_entry_point(run: dict, tmp_path: Path) -> None:
    out = tmp_path / "bf.npz"
    info = _run_child(BF16, str(out), _zips_arg(run))
    assert info["dstt_before"] is False
    assert info["cls"] == "dstt.store.bfloat16"  # registered by the entry point, not by hand
    assert "dstt.store.bfloat16" in info["dstt_modules"]
    assert info["torch"] is False  # the entry point pulls in no torch
    assert info["dtypes"] == ["bfloat16"]
    assert info["warnings"] == []
    got = np.load(out)
    for lib in ("zarr", "xr"):
        for step in run["slots"]:
            want = run["steps"][step]["bf/h"].view(np.uint16)
            h = got[f"{lib}_{step}"]
            assert h.shape == want.shape, (lib, step)
            assert h.tobytes() == want.tobytes(), (lib, step)
    # informational: zarr 3.1.6 fails before _lazy_load(); a fixed zarr would read it directly
    assert info["before"] in ("ok", "ValueError")


TENSORSTORE = """
    import json, sys, warnings
    import numpy as np, tensorstore as ts
    out, zips = sys.argv[1], json.loads(sys.argv[2])
    res = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step, path in zips.items():
            for name in ("params/f", "params/i", "params/scalar", "bf/h"):
                spec = {"driver": "zarr3",
                        "kvstore": {"driver": "zip", "base": "file://" + path,
                                    "path": name + "/"}}
                t = ts.open(spec, read=True).result()
                v = t.read().result()
                key = f"{step}_{name.replace('/', '_')}"
                res[key] = v.view(np.uint16) if name == "bf/h" else v
                res[key + "_dtype"] = np.array(str(t.dtype))
    np.savez(out, **res)
    print(json.dumps({"dstt": any(m == "dstt" or m.startswith("dstt.") for m in sys.modules),
                      "warnings": [f"{w.category.__name__}: {w.message}" for w in caught]}))
"""


def test_tensorstore_reads_every_step_zip(run: dict, tmp_path: Path) -> None:
    pytest.importorskip("tensorstore")
    out = tmp_path / "ts.npz"
    zips = json.loads(_zips_arg(run))
    assert all(Path(p).is_absolute() for p in zips.values())  # file:// + absolute path
    info = _run_child(TENSORSTORE, str(out), json.dumps(zips))
    assert info["dstt"] is False
    assert info["warnings"] == []
    got = np.load(out)
    for step in run["slots"]:
        want = run["steps"][step]
        for name, dt in (
            ("params/f", "float32"),
            ("params/i", "int64"),
            ("params/scalar", "float32"),
            ("bf/h", "bfloat16"),
        ):
            key = f"{step}_{name.replace('/', '_')}"
            assert dt in str(got[key + "_dtype"]), (step, name)
            w = want[name].view(np.uint16) if name == "bf/h" else want[name]
            assert got[key].shape == w.shape, (step, name)
            assert got[key].tobytes() == w.tobytes(), (step, name)


CORRUPT = """
    import json, sys, zarr
    from zarr.storage import ZipStore
    a = zarr.open_array(ZipStore(sys.argv[1], mode="r"), path="params/f", mode="r",
                        zarr_format=3)
    try:
        a[int(sys.argv[2])]
        print(json.dumps({"error": None}))
    except Exception as e:
        print(json.dumps({"error": type(e).__name__, "msg": str(e)[:200]}))
"""


def test_zarr_itself_checks_the_chunk_crc32c(run: dict, tmp_path: Path) -> None:
    """A damaged chunk is caught by plain zarr twice over: by the zip entry's CRC-32, and —
    even when the zip is rebuilt around the damage with a fresh CRC-32 — by the crc32c codec
    declared in the array's zarr.json."""
    src = run["zips"][20]
    name = zarr_chunk_key("params/f", (1, 0))  # rows 4..7
    r = Repository.open(run["path"]).reader()
    rec = r.arrays(r.find(20, "main"))["params/f"].chunks[1]
    offset, size = zip_entry(src, name)
    assert (rec.offset, rec.nbytes) == (offset, size)
    # 1. a flipped bit in place: the zip entry no longer matches its CRC-32
    flipped = tmp_path / "flipped.zip"
    shutil.copyfile(src, flipped)
    data = bytearray(flipped.read_bytes())
    data[offset + 5] ^= 0x10
    flipped.write_bytes(bytes(data))
    info = _run_child(CORRUPT, str(flipped), "5")
    assert info["error"] is not None, info
    assert "crc" in info["msg"].lower(), info
    # 2. the same damage in a rebuilt zip with valid CRC-32s: zarr's crc32c codec catches it
    rebuilt = tmp_path / "rebuilt.zip"
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(rebuilt, "w", zipfile.ZIP_STORED) as zout:
        for item in zin.infolist():
            body = zin.read(item.filename)
            if item.filename == name:
                body = bytes(data[offset : offset + size])
            zout.writestr(item.filename, body)
    with zipfile.ZipFile(rebuilt) as z:
        assert z.testzip() is None  # the container itself is sound now
    info = _run_child(CORRUPT, str(rebuilt), "5")
    assert info["error"] is not None, info
    assert "checksum" in info["msg"].lower(), info
    # the other chunks of the damaged step, and the undamaged steps, read fine
    assert _run_child(CORRUPT, str(rebuilt), "0")["error"] is None
    assert _run_child(CORRUPT, str(run["zips"][10]), "5")["error"] is None


def test_bfloat16_dtype_class_matches_ml_dtypes() -> None:
    from dstt.store.bfloat16 import BFloat16

    d = BFloat16()
    assert d.to_native_dtype() == np.dtype(ml_dtypes.bfloat16)
    assert d.item_size == 2
    assert BFloat16.from_native_dtype(np.dtype(ml_dtypes.bfloat16)) == d
