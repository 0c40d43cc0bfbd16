"""The spike-mechanism checks (``dstt.analysis.mechanisms``) on synthetic numpy inputs: each
fires on its planted signature and points at the planted tensors or samples, stays
``unlikely`` on a clean input, says ``unknown`` (and what was missing) without its input, and
rejects malformed input with a typed error."""

from __future__ import annotations

import numpy as np
import pytest

from dstt.analysis.mechanisms import (
    LIKELY,
    UNKNOWN,
    UNLIKELY,
    Finding,
    adam_second_moment,
    attention_logit_growth,
    bad_data,
    g2_from_v,
    logit_bound,
    numerics,
    rank,
    update_too_large,
)
from dstt.errors import ConfigError, DsttError

RNG = np.random.default_rng(0)
NAMES = [f"t{i}" for i in range(10)]


def test_bad_data_points_at_the_corrupted_samples() -> None:
    losses = 0.5 + 0.05 * RNG.standard_normal(16)
    losses[[3, 11]] = [4.1, 3.9]
    f = bad_data(losses, indices=np.arange(100, 116))
    assert f.verdict == LIKELY
    assert f.score > 1
    assert f.points_at == (103, 111)
    assert set(f.evidence["outliers"]) == {103, 111}
    assert "skip" in f.hint


def test_bad_data_is_unlikely_on_a_clean_batch_and_on_a_uniformly_bad_one() -> None:
    clean = 0.5 + 0.05 * RNG.standard_normal(16)
    assert bad_data(clean).verdict == UNLIKELY
    assert bad_data(clean).points_at == ()
    everything = clean * 8  # the whole batch is high: not "a few samples"
    assert bad_data(everything).verdict == UNLIKELY


def test_bad_data_without_per_sample_losses_is_unknown_and_says_so() -> None:
    f = bad_data(None)
    assert f.verdict == UNKNOWN
    assert np.isnan(f.score)
    assert "replay" in (f.missing or "")


def ratios(steps: int = 30) -> np.ndarray:
    return 0.01 * np.exp(0.1 * RNG.standard_normal((steps, len(NAMES))))


def test_update_too_large_fires_when_most_tensors_jump_at_once() -> None:
    r = ratios()
    r[-1, :8] *= 30
    f = update_too_large(r, NAMES)
    assert f.verdict == LIKELY
    assert set(f.points_at) == set(NAMES[:8])
    assert f.evidence["median_factor"] > 10


def test_update_too_large_is_unlikely_when_one_tensor_jumps_or_none() -> None:
    r = ratios()
    assert update_too_large(r, NAMES).verdict == UNLIKELY
    r[-1, 2] *= 30
    f = update_too_large(r, NAMES)
    assert f.verdict == UNLIKELY
    assert f.evidence["jumped"] == 1


def test_update_too_large_needs_a_baseline_and_rejects_a_misshapen_table() -> None:
    assert update_too_large(ratios(3), NAMES).verdict == UNKNOWN
    assert update_too_large(None, NAMES).verdict == UNKNOWN
    nan = np.full((10, len(NAMES)), np.nan)
    assert update_too_large(nan, NAMES).verdict == UNKNOWN
    with pytest.raises(ConfigError, match="steps x tensors"):
        update_too_large(ratios(), NAMES[:3])


def test_logit_bound_is_the_largest_logit_for_unit_rms_inputs() -> None:
    d, heads = 8, 2
    wq = RNG.standard_normal((d, d))
    wk = RNG.standard_normal((d, d))
    dh = d // heads
    want = max(
        np.linalg.norm(wq[h * dh : (h + 1) * dh].T @ wk[h * dh : (h + 1) * dh], 2)
        for h in range(heads)
    )
    assert logit_bound(wq, wk, heads) == pytest.approx(want * d / np.sqrt(dh))
    # grouped-query: one key head serves both query heads
    one = logit_bound(wq, wk[:dh], heads)
    want_gqa = max(np.linalg.norm(wq[h * dh : (h + 1) * dh].T @ wk[:dh], 2) for h in range(heads))
    assert one == pytest.approx(want_gqa * d / np.sqrt(dh))
    with pytest.raises(ConfigError, match="divide"):
        logit_bound(wq, wk, 3)


def test_attention_logit_growth_points_at_the_growing_layer() -> None:
    steps = np.arange(10)
    b = np.full((10, 3), 20.0)
    b[:, 1] = np.geomspace(20, 400, 10)
    f = attention_logit_growth(b, ["l0", "l1", "l2"], steps)
    assert f.verdict == LIKELY
    assert f.points_at == ("l1",)
    assert f.evidence["growth"]["l1"] == pytest.approx(20)


def test_attention_logit_growth_needs_both_growth_and_size() -> None:
    steps = np.arange(10)
    small = np.geomspace(0.1, 10, 10)[:, None]  # grew 100x, still tiny logits
    assert attention_logit_growth(small, ["l0"], steps).verdict == UNLIKELY
    big_flat = np.full((10, 1), 500.0)  # large but not growing
    assert attention_logit_growth(big_flat, ["l0"], steps).verdict == UNLIKELY
    assert attention_logit_growth(None, [], steps).verdict == UNKNOWN


def test_g2_from_v_inverts_the_second_moment_update() -> None:
    v0 = RNG.random(50)
    g = RNG.standard_normal(50)
    v1 = 0.999 * v0 + 0.001 * g**2
    np.testing.assert_allclose(g2_from_v(v0, v1, 0.999), g**2, rtol=1e-6, atol=1e-9)
    with pytest.raises(ConfigError, match="beta2"):
        g2_from_v(v0, v1, 1.0)


def test_adam_second_moment_fires_after_a_quiet_stretch() -> None:
    steps = np.arange(20)
    rho = np.exp(0.2 * RNG.standard_normal((20, len(NAMES))))
    rho[-2:, 4] = [3e4, 900.0]
    f = adam_second_moment(rho, NAMES, steps, source="replay")
    assert f.verdict == LIKELY
    assert f.points_at == ("t4",)
    assert f.evidence["g_from"] == "replay"
    assert f.evidence["peak"]["t4"] == pytest.approx(3e4)


def test_adam_second_moment_is_unlikely_without_a_quiet_stretch_or_a_jump() -> None:
    steps = np.arange(20)
    rho = np.exp(0.2 * RNG.standard_normal((20, len(NAMES))))
    assert adam_second_moment(rho, NAMES, steps).verdict == UNLIKELY
    loud = rho * 500  # g²/v large all along: never quiet, no decoupling
    assert adam_second_moment(loud, NAMES, steps).verdict == UNLIKELY
    assert adam_second_moment(None, NAMES, steps).verdict == UNKNOWN
    assert adam_second_moment(rho[:2], NAMES, steps[:2]).verdict == UNKNOWN


def test_numerics_points_at_the_first_nonfinite_tensor() -> None:
    steps = np.arange(5)
    nf = np.zeros((5, 3))
    nf[3, 2] = 1
    nf[4, :] = 5
    f = numerics(steps, np.array([1, 1, 1, 1, np.nan]), nf, ["a", "b", "c"])
    assert f.verdict == LIKELY
    assert f.points_at == ("c",)
    assert f.evidence["first_nonfinite_step"] == 3
    assert f.evidence["nonfinite_loss_step"] == 4


def test_numerics_sees_a_loss_scale_collapse_and_a_clean_window() -> None:
    steps = np.arange(6)
    loss = np.ones(6)
    clean = numerics(steps, loss, np.zeros((6, 1)), ["a"])
    assert clean.verdict == UNLIKELY
    scale = np.array([2.0**16, 2.0**16, 2.0**15, 2.0**12, 2.0**10, 2.0**9])
    f = numerics(steps, loss, None, ["a"], loss_scale=scale)
    assert f.verdict == LIKELY
    assert f.evidence["loss_scale_drop"] == 128
    assert numerics(steps, None, None, ["a"]).verdict == UNKNOWN


def test_rank_puts_likely_first_then_unknown_then_unlikely() -> None:
    fs = [
        Finding("a", UNLIKELY, 0.5),
        Finding("b", UNKNOWN, float("nan")),
        Finding("c", LIKELY, 2.0),
        Finding("d", LIKELY, 5.0),
    ]
    assert [f.mechanism for f in rank(fs)] == ["d", "c", "b", "a"]
    assert "unknown" in str(fs[1])
    assert "likely (score 5" in str(fs[3])


def test_bad_arguments_are_typed_errors() -> None:
    with pytest.raises(ConfigError) as e:
        bad_data(np.ones(4), z=-1)
    assert isinstance(e.value, DsttError)
    assert isinstance(e.value, ValueError)
    with pytest.raises(ConfigError, match="differ in length"):
        bad_data(np.ones(4), indices=[1, 2])


def test_findings_keep_the_arrays_they_judged() -> None:
    """What :mod:`dstt.plots.explain` draws: the very arrays each check decided on."""
    losses = 0.5 + 0.05 * RNG.standard_normal(8)
    f = bad_data(losses, indices=np.arange(40, 48))
    np.testing.assert_array_equal(f.evidence["losses"], losses)
    assert f.evidence["indices"] == list(range(40, 48))
    r = ratios(6)
    f = update_too_large(r, NAMES, steps=range(10, 16))
    np.testing.assert_array_equal(f.evidence["ratios"], r)
    assert f.evidence["steps"] == list(range(10, 16))
    assert f.evidence["names"] == NAMES
    with pytest.raises(ConfigError, match="label the rows"):
        update_too_large(r, NAMES, steps=range(5))
    rho = np.exp(RNG.standard_normal((8, len(NAMES))))
    f = adam_second_moment(rho, NAMES, range(8))
    np.testing.assert_array_equal(f.evidence["rho"], rho)
    assert f.evidence["names"] == NAMES
    assert f.evidence["recent"] == 3


def test_one_heads_growth_is_seen_per_head_and_can_vanish_in_the_whole_projection() -> None:
    """Why the attention check splits heads: two heads whose ``W_q^h W_k^hᵀ`` cancel in the
    sum over heads have a large logit each, and the whole projection shows none."""
    d, dh, a = 8, 4, 5.0
    e = np.eye(d)[:dh]  # dh x d
    wq = np.vstack([a * e, a * e])
    wk = np.vstack([a * e, -a * e])
    assert logit_bound(wq, wk, 2) == pytest.approx(a * a * d / np.sqrt(dh))
    assert logit_bound(wq, wk, 1) == pytest.approx(0.0, abs=1e-9)
