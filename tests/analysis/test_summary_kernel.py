"""The summary kernel (``dstt.analysis.summary_kernel``) against a plain float64 reference.

The reference is the obvious per-tensor computation: each tensor's elements cast to float64,
the finite ones squared and summed with ``math.fsum`` (correctly rounded), their max |x|, and
the counts of NaN and Inf. Counts, ``maxabs`` and the probed values must equal it exactly.
The sum of squares cannot: the kernel squares in float32 (a float64 tensor: float64) and sums
in that type, so it is held to the rounding bound of that summation, of non-negative terms
(relative, with ``u`` the unit roundoff of the float type):

* a segment under ``LARGE`` elements (``add.reduceat``: numpy's pairwise sum, whose leaves are
  8-way unrolled blocks of 128): ``(ceil(log2 n) + 24) * u``;
* a larger one (a fused ``einsum`` per ``BLOCK``, float64 across blocks): ``(BLOCK + 2) * u``,
  the worst case of a plain float32 sum (random data stays near ``sqrt(n) * u``).

An update's differences are taken in the same type (one more rounding, ``+ 3u``). Each case
also checks the property the lanes rely on: a tensor summarised alone (the chunk lane hands
it over by itself) gives the same bits as inside a buffer of many (the flat lane).
"""

from __future__ import annotations

import math
import pickle
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dstt.analysis import summary_kernel as sk
from dstt.errors import SchemaError

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = [np.dtype(np.float32), np.dtype(np.float16), BF16, np.dtype(np.float64)]


def fsum_squares(v: np.ndarray) -> float:
    """The correctly rounded sum of squares (inf past float64's range)."""
    try:
        return math.fsum(float(a) * float(a) for a in v)
    except OverflowError:
        return math.inf


def close(got: float, want: float, rel: float, tiny: float) -> bool:
    """``got`` within ``rel * want + tiny`` of ``want`` (equal where either is inf)."""
    if math.isinf(want) or math.isinf(got):
        return got == want
    return abs(got - want) <= rel * want + tiny


def reference(x: np.ndarray) -> dict[str, Any]:
    """One tensor's statistics, plainly, in float64."""
    x64 = np.asarray(x, dtype=np.float64).ravel()
    good = x64[np.isfinite(x64)]
    return {
        "sumsq": fsum_squares(good),
        "maxabs": float(np.abs(good).max()) if good.size else 0.0,
        "finite": good.size,
        "nan": int(np.isnan(x64).sum()),
        "inf": int(np.isinf(x64).sum()),
    }


def sum_bound(n: int, dtype: np.dtype[Any]) -> float:
    """The relative bound on a summed square of ``n`` terms (module docstring)."""
    u = float(np.finfo(np.float64 if dtype == np.float64 else np.float32).eps) / 2
    if n >= sk.LARGE:
        return (min(n, sk.BLOCK) + 2) * u
    return (math.ceil(math.log2(max(n, 2))) + 24) * u


def values(rng: np.random.Generator, n: int, dtype: np.dtype[Any], special: float) -> np.ndarray:
    """``n`` values of ``dtype`` over many magnitudes, a ``special`` fraction non-finite or
    at the edges of the type (its max: squares overflow float32 for bf16 and float64)."""
    x = rng.standard_normal(n) * 10.0 ** rng.integers(-6, 6, size=n)
    hit = rng.random(n) < special
    edge = [np.nan, np.inf, -np.inf, 0.0, float(np.finfo(dtype).max), -float(np.finfo(dtype).max)]
    x[hit] = rng.choice(edge, size=int(hit.sum()))
    with np.errstate(over="ignore"):
        return x.astype(dtype)


@st.composite
def layouts(draw: st.DrawFn) -> tuple[np.ndarray, list[int], list[int], list[np.ndarray]]:
    """A flat array of one dtype holding tensors of random sizes (empty ones too), with
    gaps of garbage between them (zip headers, padding: NaN, Inf, huge values)."""
    dtype = draw(st.sampled_from(DTYPES))
    sizes = draw(st.lists(st.integers(0, 300), min_size=0, max_size=8))
    gaps = draw(st.lists(st.integers(0, 5), min_size=len(sizes), max_size=len(sizes)))
    special = draw(st.sampled_from([0.0, 0.0, 0.02, 0.3]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    parts, starts, pos = [], [], 0
    for n, g in zip(sizes, gaps, strict=True):
        parts.append(values(rng, g, dtype, 1.0))  # garbage between tensors
        pos += g
        starts.append(pos)
        parts.append(values(rng, n, dtype, special))
        pos += n
    parts.append(values(rng, draw(st.integers(0, 5)), dtype, 1.0))
    buf = np.concatenate(parts) if parts else np.empty(0, dtype)
    probes = [np.sort(rng.choice(n, size=min(n, 4), replace=False)) for n in sizes]
    return buf, starts, sizes, probes


def check_stats(got: dict[str, np.ndarray], j: int, x: np.ndarray, probe: np.ndarray) -> None:
    want = reference(x)
    for k in ("finite", "nan", "inf", "maxabs"):
        assert got[k][j] == want[k], k
    kind = np.dtype(sk.as_float(x[:0]).dtype)
    tiny = x.size * float(np.finfo(kind).tiny)  # squares that underflow
    assert close(got["sumsq"][j], want["sumsq"], sum_bound(x.size, kind), tiny)
    k = len(probe)
    assert got["probe_len"][j] == k
    np.testing.assert_array_equal(got["probe"][j, :k], x[probe].astype(np.float64))
    assert np.isnan(got["probe"][j, k:]).all()


@settings(max_examples=150, deadline=None)
@given(layouts(), st.sampled_from([sk.LARGE, 64, 1]), st.sampled_from([sk.BLOCK, 50]))
def test_segment_stats_match_the_float64_reference(
    layout: tuple[np.ndarray, list[int], list[int], list[np.ndarray]], large: int, block: int
) -> None:
    """Every member of a buffer, summed by reduceat runs, fused blocks or a mix (``LARGE``
    lowered), several blocks each (``BLOCK`` lowered): the reference, within the bound; and
    the same bits as the member summarised alone."""
    buf, starts, sizes, probes = layout
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sk, "LARGE", large)
        mp.setattr(sk, "BLOCK", block)
        got = sk.segment_stats(buf, sk.Segments.build(starts, sizes, probes), 6)
        for j, (s, n) in enumerate(zip(starts, sizes, strict=True)):
            x = buf[s : s + n]
            check_stats(got, j, x, probes[j])
            alone = sk.segment_stats(x.copy(), sk.Segments.build([0], [n], [probes[j]]), 6)
            for k, v in alone.items():
                np.testing.assert_array_equal(v[0], got[k][j], err_msg=k)


@settings(max_examples=100, deadline=None)
@given(layouts(), st.integers(0, 2**32 - 1), st.sampled_from([sk.LARGE, 1]))
def test_segment_updates_match_the_float64_reference(
    layout: tuple[np.ndarray, list[int], list[int], list[np.ndarray]], seed: int, large: int
) -> None:
    """The squared distance of each member to the previous step's copy: the float64
    reference within the bound (plus the difference's rounding), NaN where a difference is
    not finite or the member is empty."""
    buf, starts, sizes, probes = layout
    rng = np.random.default_rng(seed)
    step = rng.standard_normal(len(buf)) * 10.0 ** rng.integers(-4, 1)
    with np.errstate(over="ignore", invalid="ignore"):
        new = (buf.astype(np.float64) + step).astype(buf.dtype)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sk, "LARGE", large)
        got = sk.segment_updates(new, buf, sk.Segments.build(starts, sizes, probes))
    for j, (s, n) in enumerate(zip(starts, sizes, strict=True)):
        with np.errstate(invalid="ignore"):  # inf - inf
            d = new[s : s + n].astype(np.float64) - buf[s : s + n].astype(np.float64)
        if n == 0 or not np.isfinite(d).all():
            assert np.isnan(got[j])
            continue
        kind = np.dtype(sk.as_float(buf[:0]).dtype)
        u = float(np.finfo(kind).eps) / 2
        tiny = n * float(np.finfo(kind).tiny)
        assert close(got[j], fsum_squares(d), sum_bound(n, kind) + 3 * u, tiny)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(DTYPES), st.integers(0, 200)), max_size=7), st.data())
def test_a_digest_of_a_byte_buffer_is_each_region_s_segment_stats(
    specs: list[tuple[np.dtype[Any], int]], data: st.DataObject
) -> None:
    """``digest`` over a byte buffer of several dtype regions (64-byte aligned tensors, zero
    padding between them) gives each tensor what ``segment_stats`` gives it alone, and a
    digest with a token compares with the previous token's copy."""
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    pos, items, arrays = 0, [], []
    for i, (dt, n) in enumerate(specs):
        pos = (pos + 63) // 64 * 64
        probe = np.sort(rng.choice(n, size=min(n, 3), replace=False))
        arrays.append(values(rng, n, dt, 0.05))
        items.append((f"params/t{i}", dt, pos, n, probe))
        pos += n * dt.itemsize
    buf = np.zeros(pos + 64, np.uint8)
    for (_, _, off, _, _), a in zip(items, arrays, strict=True):
        buf[off : off + a.nbytes] = a.view(np.uint8)
    plan = pickle.loads(pickle.dumps(sk.DigestPlan(items, 3)))  # as the flusher gets it
    got = sk.digest(plan, buf, token=5)
    assert got["prev_token"] == -1
    assert np.isnan(got["upd_sumsq"]).all()
    for j, (a, it) in enumerate(zip(arrays, items, strict=True)):
        alone = sk.segment_stats(a, sk.Segments.build([0], [a.size], [it[4]]), 3)
        for k, v in alone.items():
            np.testing.assert_array_equal(v[0], got[k][j], err_msg=k)
    again = sk.digest(plan, buf, token=6)
    assert again["prev_token"] == 5
    fin = [j for j, a in enumerate(arrays) if a.size and np.isfinite(a.astype(float)).all()]
    assert (again["upd_sumsq"][fin] == 0).all()


def test_finish_columns_reads_the_stats_as_documented() -> None:
    """l2, rms and maxabs from the sums (NaN without a finite element); the update exact
    where the parent's distance is known, else estimated from the probes, else NaN."""
    st_ = {
        "sumsq": np.array([25.0, 0.0, 8.0]),
        "maxabs": np.array([4.0, 0.0, 2.0]),
        "finite": np.array([2, 0, 2]),
        "nan": np.array([0, 3, 0]),
        "inf": np.array([0, 0, 0]),
        "probe": np.array([[3.0, 4.0], [np.nan, np.nan], [2.0, np.nan]]),
        "probe_len": np.array([2, 2, 1]),
    }
    prev = np.array([[3.0, 3.0], [np.nan, np.nan], [1.0, np.nan]])
    out = sk.finish_columns(np.array([2, 3, 2]), st_, prev, np.array([np.nan, np.nan, 9.0]))
    np.testing.assert_array_equal(out["l2"], [5.0, 0.0, math.sqrt(8.0)])
    np.testing.assert_array_equal(out["rms"][[0, 2]], [math.sqrt(12.5), 2.0])
    assert np.isnan(out["rms"][1])
    assert np.isnan(out["maxabs"][1])
    assert out["update_l2"][0] == pytest.approx(math.sqrt(2 / 2 * 1.0))  # estimated
    assert np.isnan(out["update_l2"][1])  # no finite probe: unknown
    assert out["update_l2"][2] == 3.0  # exact
    np.testing.assert_array_equal(out["update_exact"], [False, False, True])
    assert out["update_ratio"][2] == pytest.approx(3.0 / math.sqrt(8.0))


def test_probes_are_fixed_per_path() -> None:
    idx = sk.probe_indices("params/layers/0/w", 10_000)
    assert len(set(idx.tolist())) == sk.PROBE_SIZE
    assert idx.max() < 10_000
    assert list(idx) == sorted(idx)
    np.testing.assert_array_equal(idx, sk.probe_indices("params/layers/0/w", 10_000))
    assert not np.array_equal(idx, sk.probe_indices("params/layers/1/w", 10_000))
    assert len(sk.probe_indices("params/b", 3)) == 3


@pytest.mark.parametrize(
    ("starts", "sizes", "probes", "match"),
    [
        ([0, 5], [10, 4], [np.arange(0), np.arange(0)], "overlap"),
        ([8, 0], [2, 2], [np.arange(0), np.arange(0)], "overlap"),
        ([0], [4], [np.array([4])], "inside their own tensor"),
        ([0], [4], [], "inside their own tensor"),
    ],
)
def test_bad_segments_are_refused(
    starts: list[int], sizes: list[int], probes: list[np.ndarray], match: str
) -> None:
    with pytest.raises(SchemaError, match=match):
        sk.Segments.build(starts, sizes, probes)
