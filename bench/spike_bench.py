"""Recall and false alarms of the loss-spike rule on generated loss curves (issue 35, item 4).

Pure numpy, no run on disk: ``dstt.analysis.find_spikes`` with its defaults (the rule every
spike consumer uses: ``run.spikes()``, ``dstt log``, the scrubber, ``Retention``/``dstt gc``)
against the rule it replaced (a rolling z-score of the values: mean and std of the 50 values
before, ``z > 4``; kept here verbatim as ``old_rule``).

Curves (fixed seeds): 4 shapes x 8 lengths (50 .. 10,000 steps) x ``--seeds`` seeds, each
once with planted spikes and once clean (the same curve and noise without them):

* ``power``: ``a * (t + t0) ** -b + floor``, a falling power law (the usual LLM loss);
* ``exp``: ``floor + (l0 - floor) * exp(-t / tau)``, a falling exponential;
* ``flat``: a constant level (a loss that stopped improving);
* ``noisy``: a power law with 3-4x the noise, Student-t (heavy tails, df=6).

Noise is multiplicative (log-normal; 1-4 % per step, 5-12 % for ``noisy``). A spike multiplies
the curve's noise-free level by ``m`` (1.5x .. 10x, in buckets) for 1 step (60 %) or a bump
of 2-4 steps, noise included; spikes sit after the curve's first ``max(15, n // 10)`` steps,
at least 30 steps apart. A spike is *found* when a reported spike starts inside it; a *false
alarm* is a reported spike on a clean curve (per 10,000 clean steps). Goal: recall >= 95 %
for spikes >= 2x, <= 1 false alarm per 10,000 clean steps. Also timed: the rule over one
10,000-step curve (best and median of 20; the machine is shared, so noisy).

    python bench/spike_bench.py [--seeds 10] [--json bench/results/spikes.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import source_state
from dstt.analysis import find_spikes

LENGTHS = (50, 100, 200, 500, 1000, 2000, 5000, 10_000)
SHAPES = ("power", "exp", "flat", "noisy")
BUCKETS = ((1.5, 2.0), (2.0, 3.0), (3.0, 5.0), (5.0, 10.0))
Rule = Callable[[np.ndarray, np.ndarray], list[tuple[int, float, float, float, float, int]]]


def old_rule(
    steps: np.ndarray, values: np.ndarray, *, window: int = 50, z: float = 4.0
) -> list[tuple[int, float, float, float, float, int]]:
    """The rule before issue 35: rolling mean/std of the ``window`` values before, ``> z``."""
    min_periods = max(2, window // 4)
    ok = np.isfinite(values)
    steps, values = np.asarray(steps)[ok], np.asarray(values, dtype=np.float64)[ok]
    n = len(values)
    mu_all, sd_all = np.full(n, np.nan), np.full(n, np.nan)
    for i in range(min(n, window)):
        prior = values[:i]
        if len(prior) >= min_periods:
            mu_all[i], sd_all[i] = prior.mean(), prior.std(ddof=1)
    if n > window:
        views = np.lib.stride_tricks.sliding_window_view(values, window)[: n - window]
        mu_all[window:], sd_all[window:] = views.mean(axis=1), views.std(axis=1, ddof=1)
    events: list[tuple[int, float, float, float, float, int]] = []
    last = -2
    for i in np.flatnonzero(np.isfinite(mu_all)).tolist():
        mu, sd = float(mu_all[i]), max(float(sd_all[i]), 1e-12 * max(abs(mu_all[i]), 1.0))
        zi = (float(values[i]) - mu) / sd
        if zi <= z:
            continue
        row = (int(steps[i]), float(values[i]), zi, mu, sd)
        if i == last + 1:
            if zi > events[-1][2]:
                events[-1] = (*row, events[-1][5])
        else:
            events.append((*row, int(steps[i])))
        last = i
    return events


def curve(shape: str, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """``(level, noise factor)`` of one clean curve of ``n`` steps."""
    t = np.arange(1, n + 1, dtype=np.float64)
    if shape in ("power", "noisy"):
        a, b = rng.uniform(4.0, 10.0), rng.uniform(0.2, 0.7)
        level = a * (t + rng.uniform(1.0, 20.0)) ** -b + rng.uniform(0.3, 1.5)
    elif shape == "exp":
        l0, floor = rng.uniform(4.0, 10.0), rng.uniform(0.3, 1.5)
        level = floor + (l0 - floor) * np.exp(-t / (n * rng.uniform(0.05, 0.5)))
    else:
        level = np.full(n, rng.uniform(0.5, 4.0))
    if shape == "noisy":
        eps = rng.uniform(0.05, 0.12) * rng.standard_t(6, n) / np.sqrt(6 / 4)
    else:
        eps = rng.uniform(0.01, 0.04) * rng.standard_normal(n)
    return level, np.exp(eps)


def plant(
    level: np.ndarray, noise: np.ndarray, rng: np.random.Generator
) -> tuple[np.ndarray, list[tuple[int, int, float]]]:
    """The curve with spikes: values and ``(first, last, m)`` (0-based) of each spike."""
    n = len(level)
    values = level * noise
    lo = max(15, n // 10)
    count = 1 + n // 500
    spikes: list[tuple[int, int, float]] = []
    for _ in range(count * 20):
        if len(spikes) == count:
            break
        at = int(rng.integers(lo, n - 4))
        if any(abs(at - a) < 30 for a, _, _ in spikes):
            continue
        b_lo, b_hi = BUCKETS[int(rng.integers(len(BUCKETS)))]
        m = float(rng.uniform(b_lo, b_hi))
        width = 1 if rng.random() < 0.6 else int(rng.integers(2, 5))
        values[at : at + width] = m * level[at : at + width] * noise[at : at + width]
        spikes.append((at, at + width - 1, m))
    return values, sorted(spikes)


def evaluate(rules: dict[str, Rule], seeds: int) -> dict[str, Any]:
    stats: dict[str, Any] = {
        name: {
            "found": {f"{a}-{b}x": 0 for a, b in BUCKETS},
            "planted": {f"{a}-{b}x": 0 for a, b in BUCKETS},
            "found_by_shape_ge2x": dict.fromkeys(SHAPES, 0),
            "found_by_length_ge2x": dict.fromkeys(LENGTHS, 0),
            "planted_by_length_ge2x": dict.fromkeys(LENGTHS, 0),
            "planted_by_shape_ge2x": dict.fromkeys(SHAPES, 0),
            "false_alarms": dict.fromkeys(SHAPES, 0),
            "clean_steps": dict.fromkeys(SHAPES, 0),
            "extra_on_spiky": 0,
            "spiky_steps": 0,
        }
        for name in rules
    }
    curves = 0
    for si, shape in enumerate(SHAPES):
        for li, n in enumerate(LENGTHS):
            for seed in range(seeds):
                rng = np.random.default_rng([35, si, li, seed])
                level, noise = curve(shape, n, rng)
                spiky, planted = plant(level, noise, rng)
                steps = np.arange(1, n + 1)
                curves += 2
                for name, rule in rules.items():
                    st = stats[name]
                    clean = rule(steps, level * noise)
                    st["false_alarms"][shape] += len(clean)
                    st["clean_steps"][shape] += n
                    starts = [e[5] - 1 for e in rule(steps, spiky)]  # 0-based
                    hit = set()
                    for a, b, m in planted:
                        key = next(f"{x}-{y}x" for x, y in BUCKETS if x <= m < y or m == y)
                        st["planted"][key] += 1
                        found = any(a <= s <= b for s in starts)
                        st["found"][key] += found
                        if m >= 2.0:
                            st["planted_by_shape_ge2x"][shape] += 1
                            st["found_by_shape_ge2x"][shape] += found
                            st["planted_by_length_ge2x"][n] += 1
                            st["found_by_length_ge2x"][n] += found
                        hit |= {s for s in starts if a <= s <= b}
                    st["extra_on_spiky"] += len([s for s in starts if s not in hit])
                    st["spiky_steps"] += n
    out: dict[str, Any] = {"curves": curves}
    for name, st in stats.items():
        clean_steps = sum(st["clean_steps"].values())
        ge2_found = sum(v for k, v in st["found"].items() if not k.startswith("1.5"))
        ge2_planted = sum(v for k, v in st["planted"].items() if not k.startswith("1.5"))
        out[name] = {
            "recall": {
                k: round(st["found"][k] / st["planted"][k], 4)
                for k in st["planted"]
                if st["planted"][k]
            },
            "planted": st["planted"],
            "recall_ge2x": round(ge2_found / ge2_planted, 4),
            "recall_ge2x_by_shape": {
                s: round(st["found_by_shape_ge2x"][s] / st["planted_by_shape_ge2x"][s], 4)
                for s in SHAPES
            },
            "recall_ge2x_by_length": {
                str(n): round(st["found_by_length_ge2x"][n] / st["planted_by_length_ge2x"][n], 4)
                for n in LENGTHS
            },
            "false_alarms_per_10k_clean": round(
                10_000 * sum(st["false_alarms"].values()) / clean_steps, 3
            ),
            "false_alarms_per_10k_clean_by_shape": {
                s: round(10_000 * st["false_alarms"][s] / st["clean_steps"][s], 3) for s in SHAPES
            },
            "clean_steps": clean_steps,
            "other_alarms_per_10k_spiky": round(
                10_000 * st["extra_on_spiky"] / st["spiky_steps"], 3
            ),
        }
    return out


def timing(rule: Rule, n: int = 10_000, repeats: int = 20) -> dict[str, float]:
    """Seconds for one ``n``-step curve: the best and the median of ``repeats`` (the best is
    the cost on a quiet machine; this one is shared)."""
    rng = np.random.default_rng(0)
    level, noise = curve("power", n, rng)
    steps, values = np.arange(1, n + 1), level * noise
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        rule(steps, values)
        times.append(time.perf_counter() - t0)
    return {"best": round(min(times), 5), "median": round(float(np.median(times)), 5)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--json", type=Path, default=Path("bench/results/spikes.json"))
    args = ap.parse_args()
    rules: dict[str, Rule] = {
        "default": lambda s, v: find_spikes(s, v),
        "old_window50_z4": lambda s, v: old_rule(s, v, window=50, z=4.0),
    }
    out = evaluate(rules, args.seeds)
    out["seconds_10k_steps"] = {name: timing(rule) for name, rule in rules.items()}
    out["machine"] = {"python": platform.python_version(), "numpy": np.__version__}
    out["source"] = source_state()
    print(json.dumps({k: v for k, v in out.items() if k != "source"}, indent=1))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
