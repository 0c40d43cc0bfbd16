"""Views are lazy (only the selected chunks are read) and exact (values as written)."""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import xarray as xr
from hypothesis import given, settings
from hypothesis import strategies as st
from inspect_helpers import CountingStorage, new_repo, small_model, write_steps

from dstt.run import open_run
from dstt.store import LocalStorage, Repository

N_LAYERS = 250  # x 4 tensors = 1000 tensors per step


def _big_model(step: int) -> dict[str, np.ndarray]:
    out = {}
    for i in range(N_LAYERS):
        base = np.float32(step * 10_000 + i)
        out[f"params/layers/{i}/attn/q_proj/weight"] = np.full((8, 4), base, np.float32)
        out[f"params/layers/{i}/attn/q_proj/bias"] = np.full((8,), base + 0.5, np.float32)
        out[f"params/layers/{i}/mlp/weight"] = np.full((8, 8), base + 0.25, np.float32)
        out[f"params/layers/{i}/norm/weight"] = np.full((4,), base + 0.75, np.float32)
    return out


def test_selecting_one_layer_reads_only_its_chunks(tmp_path: Path) -> None:
    path = tmp_path / "run"
    write_steps(new_repo(path), [1, 2], _big_model, chunk_bytes=64)
    storage = CountingStorage(LocalStorage(path))
    run = open_run(Repository(storage))
    snap = run.at(1)
    assert len(snap.arrays) == 1000
    tree = snap.layer("layers.7.attn")
    sub = tree["layers/7/attn/q_proj"].isel(weight_0=slice(0, 2))
    assert storage.data_reads() == set()  # building, selecting, isel: no tensor bytes read

    values = {
        name: np.asarray(node["weight"] if name == "w" else node["bias"])
        for name, node in (("w", tree["layers/7/attn/q_proj"]), ("b", tree["layers/7/attn/q_proj"]))
    }
    wanted = {
        (1, p, i)
        for p in ("params/layers/7/attn/q_proj/weight", "params/layers/7/attn/q_proj/bias")
        for i in range(len(snap.arrays[p].chunks))
    }
    # every chunk of the two tensors, at step 1 only: the other 998 tensors of the step, and
    # all of step 2, were never read
    assert storage.chunk_reads() == wanted
    assert storage.data_reads() == {
        "params/layers/7/attn/q_proj/weight",
        "params/layers/7/attn/q_proj/bias",
    }
    assert np.all(values["w"] == 10_000 + 7)
    assert np.all(values["b"] == 10_000 + 7.5)
    assert len(snap.arrays["params/layers/7/attn/q_proj/weight"].chunks) > 1  # several chunks

    storage.reads.clear()
    assert np.all(sub["weight"].values == 10_000 + 7)
    # rows 0..1 live in chunk 0 (4 rows/chunk)
    assert storage.chunk_reads() == {(1, "params/layers/7/attn/q_proj/weight", 0)}


def test_trajectory_over_100_steps_equals_written_values(tmp_path: Path) -> None:
    path = tmp_path / "run"
    written: dict[int, dict[str, np.ndarray]] = {}

    def arrays(step: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(step)
        a = {
            "params/layers/0/attn/q_proj/weight": rng.standard_normal((12, 5)).astype(np.float32),
            "params/layers/0/attn/q_proj/bias": rng.standard_normal(12).astype(ml_dtypes.bfloat16),
        }
        if step >= 50:  # an optimizer state that appears later
            a["optim/exp_avg/layers/0/attn/q_proj/weight"] = np.full((12, 5), step, np.float32)
        written[step] = a
        return a

    write_steps(new_repo(path), list(range(100)), arrays, chunk_bytes=40)
    run = open_run(path)
    traj = run.trajectory("layers.0.attn.q_proj.weight", steps=slice(0, 99))
    assert traj.dims == ("step", "weight_0", "weight_1")
    assert list(traj["step"].values) == list(range(100))
    expect = np.stack([written[s]["params/layers/0/attn/q_proj/weight"] for s in range(100)])
    np.testing.assert_array_equal(traj.values, expect)
    np.testing.assert_array_equal(
        traj.sel(step=slice(10, 20)).isel(weight_1=[4, 0]).values, expect[10:21][:, :, [4, 0]]
    )
    bias = run.trajectory("layers.0.attn.q_proj.bias", steps=range(0, 100, 7))
    np.testing.assert_array_equal(
        bias.values,
        np.stack([written[s]["params/layers/0/attn/q_proj/bias"] for s in range(0, 100, 7)]).astype(
            np.float32
        ),
    )
    opt = run.trajectory("layers.0.attn.q_proj.weight", state="exp_avg", steps=slice(45, 55))
    assert np.isnan(opt.sel(step=slice(45, 49)).values).all()
    np.testing.assert_array_equal(opt.sel(step=52).values, np.full((12, 5), 52, np.float32))


def test_trajectory_follows_the_timeline_lineage(tmp_path: Path) -> None:
    path = tmp_path / "run"
    repo = new_repo(path)
    write_steps(repo, list(range(1, 11)), lambda s: {"params/w": np.full(3, s, np.float32)})
    run = open_run(path)
    new = run.rollback(to=5)
    assert run.timeline == new
    assert run.steps == [1, 2, 3, 4, 5]
    write_steps(repo, [6, 7, 8], lambda s: {"params/w": np.full(3, -s, np.float32)})
    run.refresh()
    cur = run.trajectory("w")
    assert list(cur["step"].values) == list(range(1, 9))
    np.testing.assert_array_equal(cur.values[:, 0], [1, 2, 3, 4, 5, -6, -7, -8])
    old = run.trajectory("w", timeline="main")
    np.testing.assert_array_equal(old.values[:, 0], np.arange(1, 11))


def test_bfloat16_is_shown_exactly_as_float32(tmp_path: Path) -> None:
    bits = np.arange(0, 1 << 16, dtype=np.uint16)  # every bfloat16 bit pattern
    arr = bits.view(ml_dtypes.bfloat16).reshape(256, 256)
    path = tmp_path / "run"
    write_steps(new_repo(path), [1], lambda s: {"params/w": arr}, chunk_bytes=1000)
    snap = open_run(path).at(1)
    view = snap.tensor("w")
    assert view.dtype == np.float32
    assert view.attrs["store_dtype"] == "bfloat16"
    got = view.values
    expect = arr.astype(np.float32)
    nan = np.isnan(expect)
    assert (np.isnan(got) == nan).all()
    np.testing.assert_array_equal(got.view(np.uint32)[~nan], expect.view(np.uint32)[~nan])
    # float32 is exactly the bf16 bits shifted left by 16
    np.testing.assert_array_equal(got.view(np.uint32)[~nan] >> 16, bits.reshape(256, 256)[~nan])
    finite = view.where(np.isfinite(view))
    assert float(finite.max()) == float(ml_dtypes.finfo(ml_dtypes.bfloat16).max)
    native = snap.to_numpy("w", native=True)
    assert native.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(native.view(np.uint16), arr.view(np.uint16))


def _outer_key(draw: st.DrawFn, n: int) -> object:
    kind = draw(st.sampled_from(["int", "slice", "array"]))
    if kind == "int":
        return draw(st.integers(-n, n - 1))
    if kind == "slice":
        start = draw(st.none() | st.integers(-n - 2, n + 2))
        stop = draw(st.none() | st.integers(-n - 2, n + 2))
        step = draw(st.none() | st.integers(1, 4) | st.integers(-4, -1))
        if step is not None and step < 0 and start is not None and start < -n:
            # xarray 2026.9's LazilyIndexedArray itself mis-composes a negative-step slice
            # starting before -n (it returns every element; numpy returns none), for any
            # lazy backend; clamp so the test exercises dstt, not that upstream bug
            start = -n
        return slice(start, stop, step)
    return draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=6))


@st.composite
def _keys(draw: st.DrawFn) -> tuple[object, object]:
    return _outer_key(draw, 16), _outer_key(draw, 8)


@pytest.fixture(scope="module")
def indexed_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("idx") / "run"
    write_steps(new_repo(path), [1, 2, 3], lambda s: small_model(s), chunk_bytes=64)
    return path


@settings(max_examples=60, deadline=None)
@given(key=_keys())
def test_outer_indexing_matches_numpy(indexed_run: Path, key: tuple[object, object]) -> None:
    run = open_run(indexed_run)
    expect = small_model(2)["params/layers/1/attn/q_proj/weight"]
    da = run.at(2).tensor("layers.1.attn.q_proj.weight")
    k0, k1 = key
    got = da.isel(weight_0=k0, weight_1=k1).values
    e = expect[k0] if not isinstance(k0, list) else expect[np.array(k0)]
    e = e[..., k1] if not isinstance(k1, list) else e[..., np.array(k1)]
    np.testing.assert_array_equal(got, e)
    traj = run.trajectory("layers.1.attn.q_proj.weight")
    t = traj.isel(step=[2, 1], weight_0=k0, weight_1=k1).values
    np.testing.assert_array_equal(t[1], e)


def test_layer_tree_mirrors_module_paths(small_run: Path) -> None:
    snap = open_run(small_run).at(3)
    tree = snap.layer("attn.0")  # rule 3: 'attn' and '0' in any order -> layers.0.attn
    assert set(tree["layers/0/attn/q_proj"].data_vars) == {"weight", "bias"}
    assert "1" not in tree["layers"].children
    assert int(tree["step"]) == 3
    assert tree.attrs["timeline"] == "main"  # step at the root
    w = tree["layers/0/attn/q_proj"]["weight"]
    np.testing.assert_array_equal(
        w.values, small_model(3)["params/layers/0/attn/q_proj/weight"].astype(np.float32)
    )
    with_opt = snap.layer("layers.0.attn", optim=True)
    assert "weight" in with_opt["optim/exp_avg/layers/0/attn/q_proj"].data_vars
    everything = snap.tree()
    assert {"emb", "layers"} <= set(everything.children)
    assert "mask" in everything["layers/0"].data_vars  # buffers sit beside parameters
    assert float(everything["scale"]) == 3.0
    with pytest.raises(KeyError, match="matches no tensor"):
        snap.layer("decoder.99")


def test_same_param_name_in_parent_and_child_module(tmp_path: Path) -> None:
    path = tmp_path / "run"
    write_steps(
        new_repo(path),
        [1],
        lambda s: {
            "params/block/weight": np.zeros(3, np.float32),
            "params/block/sub/weight": np.ones((5, 2), np.float32),
        },
    )
    tree = open_run(path).at(1).layer("block")
    assert tree["block"]["weight"].dims == ("weight_0",)
    assert tree["block/sub"]["weight"].dims == ("block.sub.weight_0", "block.sub.weight_1")
    assert float(tree["block/sub"]["weight"].sum()) == 10.0


def test_chunks_option_needs_dask(small_run: Path) -> None:
    snap = open_run(small_run).at(1)
    try:
        import dask.array as dsa
    except ImportError:
        with pytest.raises(ImportError, match="dask"):
            snap.tensor("emb.weight", chunks={})
    else:
        da = snap.tensor("emb.weight", chunks={})
        assert isinstance(da.data, dsa.Array)
        np.testing.assert_array_equal(da.values, small_model(1)["params/emb/weight"])


def test_xarray_reductions_work_on_views(small_run: Path) -> None:
    traj = open_run(small_run).trajectory("layers.0.attn.q_proj.weight")
    means = traj.mean(dim=["weight_0", "weight_1"])
    expect = [
        small_model(s)["params/layers/0/attn/q_proj/weight"].astype(np.float32).mean()
        for s in range(1, 6)
    ]
    np.testing.assert_allclose(means.values, expect, rtol=1e-6)
    assert isinstance(means, xr.DataArray)
    assert means.dims == ("step",)
