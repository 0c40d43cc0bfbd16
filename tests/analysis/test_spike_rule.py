"""The spike rule (``dstt.analysis.find_spikes``) on plain arrays: the reported miss (a 2.8x
jump of a still-falling loss found with the defaults), no alarm on clean falling, flat and
noisy losses, causality (appending steps never removes a finding), bumps, overrides, metrics
that are not positive, and typed errors for bad arguments."""

from __future__ import annotations

import numpy as np
import pytest

from dstt.analysis import SPIKE_WINDOW, SPIKE_Z, find_spikes
from dstt.errors import ConfigError, DsttError
from dstt.inspect.summaries import find_spikes as inspect_find_spikes
from dstt.store._internal import find_spikes as store_find_spikes

STEPS = np.arange(1, 101)


def reported(seed: int = 0, noise: float = 0.06) -> np.ndarray:
    """The report: 100 steps of a loss still falling (~4.9 -> 1.07 at step 69), noisy, and
    3.01 at step 70 (3 of the step's 8 samples random tokens)."""
    rng = np.random.default_rng(seed)
    t = STEPS.astype(np.float64)
    loss = (0.9 + 4.0 * np.exp(-t / 22.0)) * np.exp(noise * rng.standard_normal(100))
    loss[68], loss[69] = 1.07, 3.01
    return loss


def old_rule_misses(values: np.ndarray) -> bool:
    """The rolling z-score of the 50 values before step 70 (the rule this replaces)."""
    prior = values[19:69]
    return bool((values[69] - prior.mean()) / prior.std(ddof=1) < 4.0)


def test_the_reported_jump_of_a_falling_loss_is_found_with_the_defaults() -> None:
    loss = reported()
    assert old_rule_misses(loss)  # the case is the reported one: the old rule missed it
    ((step, value, score, baseline, scale, start),) = find_spikes(STEPS, loss)
    assert (step, start, value) == (70, 70, 3.01)
    assert score > SPIKE_Z
    assert 0.9 < baseline < 1.3  # where the loss would have been
    assert 0 < scale < 0.2


@pytest.mark.parametrize("seed", range(20))
def test_the_reported_case_is_found_whatever_the_noise_draw(seed: int) -> None:
    found = find_spikes(STEPS, reported(seed))
    assert [s[0] for s in found] == [70]


def clean(shape: str, n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(1, n + 1, dtype=np.float64)
    if shape == "power":
        level = 8.0 * (t + 5.0) ** -0.5 + 0.8
    elif shape == "exp":
        level = 0.5 + 7.0 * np.exp(-t / (0.2 * n))
    else:
        level = np.full(n, 2.3)
    sigma = 0.08 if shape == "noisy" else 0.03
    if shape == "noisy":
        level = 8.0 * (t + 5.0) ** -0.5 + 0.8
    return level * np.exp(sigma * rng.standard_normal(n))


@pytest.mark.parametrize("shape", ["power", "exp", "flat", "noisy"])
@pytest.mark.parametrize("n", [50, 500, 5000])
def test_clean_losses_have_no_spikes(shape: str, n: int) -> None:
    for seed in range(3):
        assert find_spikes(np.arange(1, n + 1), clean(shape, n, seed)) == []


def test_a_smooth_falling_curve_without_noise_has_none() -> None:
    t = np.arange(1, 2001, dtype=np.float64)
    assert find_spikes(t, 10.0 * t**-0.3) == []
    assert find_spikes(t, np.full(2000, 1.5)) == []  # flat: the scale's floor, no 0/0


def test_appending_steps_never_removes_an_earlier_finding() -> None:
    rng = np.random.default_rng(7)
    n = 3000
    t = np.arange(1, n + 1)
    loss = clean("power", n, 1)
    at = rng.choice(np.arange(40, n - 5), size=25, replace=False)
    loss[at] *= rng.uniform(1.5, 6.0, size=25)
    full = find_spikes(t, loss)
    full_starts = {s[5] for s in full}
    assert len(full_starts) >= 20
    for cut in (60, 200, 777, 1500, 2999):
        part = find_spikes(t[:cut], loss[:cut])
        assert {s[5] for s in part} <= full_starts
        # and every spike that ended before the cut is reported identically
        done = [s for s in full if s[0] < cut - 1]
        assert [s[5] for s in part if s[0] < cut - 1] == [s[5] for s in done]


def test_a_few_step_bump_is_one_spike_at_its_peak() -> None:
    loss = clean("power", 300, 3)
    loss[150:153] *= [2.0, 4.0, 3.0]
    ((step, _, _, _, _, start),) = find_spikes(np.arange(1, 301), loss)
    assert (start, step) == (151, 152)


def test_an_earlier_spike_does_not_hide_the_next() -> None:
    loss = clean("exp", 400, 4)
    loss[[120, 128, 135]] *= [5.0, 2.5, 2.5]
    assert [s[0] for s in find_spikes(np.arange(1, 401), loss)] == [121, 129, 136]


def test_window_and_z_overrides_still_mean_something() -> None:
    loss = reported()
    assert find_spikes(STEPS, loss, z=1000.0) == []
    assert [s[0] for s in find_spikes(STEPS, loss, window=20, z=5.0)] == [70]
    # a short window starts testing earlier: a jump at step 9 needs min_periods <= 7
    early = np.r_[np.linspace(4.0, 3.0, 8), 9.0, np.linspace(3.0, 2.5, 30)]
    assert find_spikes(np.arange(1, 40), early) == []
    assert [s[0] for s in find_spikes(np.arange(1, 40), early, window=6)] == [9]


def test_nan_values_are_skipped_and_steps_kept() -> None:
    loss = reported()
    loss[[10, 40, 80]] = np.nan
    assert [s[0] for s in find_spikes(STEPS * 10, loss)] == [700]


def test_a_metric_that_is_not_positive_is_tested_on_its_values() -> None:
    rng = np.random.default_rng(5)
    reward = -1.0 + 0.02 * rng.standard_normal(200)  # negative throughout: no log
    reward[120] = 0.5
    assert [s[0] for s in find_spikes(np.arange(200), reward)] == [120]
    mixed = np.r_[clean("flat", 100, 6), 0.0, clean("flat", 100, 7)]
    mixed[60], mixed[170] = 9.0, 9.0  # one before the first value <= 0, one after
    assert [s[0] for s in find_spikes(np.arange(201), mixed)] == [60, 170]


def test_short_and_empty_inputs() -> None:
    assert find_spikes(np.arange(0), np.arange(0.0)) == []
    assert find_spikes(np.arange(1), np.ones(1)) == []
    assert find_spikes(np.arange(11), np.r_[np.ones(10), 50.0]) == []  # too little history


@pytest.mark.parametrize(
    ("kw", "what"),
    [
        ({"window": 1}, "window must be an int >= 2"),
        ({"window": 2.5}, "window must be an int >= 2"),
        ({"z": 0}, "z must be a positive number"),
        ({"z": float("nan")}, "z must be a positive number"),
        ({"min_periods": 1}, "min_periods must be an int >= 2"),
        ({"window": "50"}, "window must be an int >= 2"),
    ],
)
def test_bad_arguments_raise_a_typed_error(kw: dict[str, float], what: str) -> None:
    with pytest.raises(ConfigError, match=what) as e:
        find_spikes(STEPS, reported(), **kw)  # type: ignore[arg-type]
    assert isinstance(e.value, DsttError)
    assert isinstance(e.value, ValueError)


def test_the_rule_is_importable_where_it_was() -> None:
    assert store_find_spikes is find_spikes is inspect_find_spikes
    assert SPIKE_WINDOW == 100
    assert SPIKE_Z == 6.0
