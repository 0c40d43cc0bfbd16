"""``dstt.plots.explanation``: each panel draws exactly its finding's evidence arrays (bar
heights, heat-map cells, curve points read back from the artists), highlights what the finding
points at, and a panel whose check was ``unknown`` says so with no axes instead of an empty
plot. Findings come from the real checks on small synthetic arrays; one test draws a planted
scenario's explanation end to end."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import dstt
from dstt.analysis.mechanisms import (
    LIKELY,
    adam_second_moment,
    attention_logit_growth,
    bad_data,
    numerics,
    rank,
    update_too_large,
)
from dstt.plots.explain import MAX_TENSORS, PANELS, explanation, peak_rho
from dstt.run.explain import Explanation

matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")
from matplotlib.colors import to_rgba  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

RED = to_rgba("tab:red")
RNG = np.random.default_rng(3)


def make_explanation(tensors: int = 6) -> Explanation:
    names = [f"t{i}" for i in range(tensors)]
    steps = list(range(80, 100))
    losses = 0.5 + 0.02 * RNG.standard_normal(8)
    losses[[2, 5]] = [3.0, 2.5]
    ratios = 0.01 * np.exp(0.1 * RNG.standard_normal((len(steps), tensors)))
    ratios[-1] *= 40
    bounds = np.outer(np.linspace(1.0, 80.0, 8), [1.0, 0.5])
    rho = np.exp(0.2 * RNG.standard_normal((12, tensors)))
    rho[-1, 1] = 5e3
    findings = [
        bad_data(losses, np.arange(200, 208)),
        update_too_large(ratios, names, steps=steps),
        attention_logit_growth(bounds, ["layers.0", "layers.1"], list(range(90, 98))),
        adam_second_moment(rho, names, list(range(88, 100))),
        numerics(steps, None, None, []),
    ]
    return Explanation(100, 99, 98, rank(findings), "main", replayed=True)


def test_each_panel_draws_its_findings_evidence() -> None:
    ex = make_explanation()
    out = explanation(ex, fig=Figure())
    assert list(out.axes) == list(PANELS)
    assert out.unknown == {}
    for title, mechanism in PANELS.items():
        assert ex.finding(mechanism).verdict in out.axes[title].get_title()

    ev = ex.finding("bad_data").evidence
    bars = out.artists["per-sample losses"]["bars"]
    np.testing.assert_allclose([b.get_height() for b in bars], ev["losses"])
    red = [i for i, b in zip(ev["indices"], bars, strict=True) if b.get_facecolor() == RED]
    assert red == [202, 205] == sorted(ex.finding("bad_data").points_at)

    ev = ex.finding("update_too_large").evidence
    mesh = out.artists["update ratio"]["mesh"]
    shown = out.artists["update ratio"]["tensors"]
    assert shown == ev["names"]
    np.testing.assert_allclose(mesh.get_array().reshape(len(shown), -1), np.array(ev["ratios"]).T)
    assert [m.get_xdata()[0] for m in out.artists["update ratio"]["marks"]] == [ex.cause]

    ev = ex.finding("attention_logit_growth").evidence
    lines = out.artists["attention logit bound"]["lines"]
    assert set(lines) == {"layers.0", "layers.1"}
    for layer, line in lines.items():
        np.testing.assert_array_equal(line.get_xdata(), ev["steps"])
        np.testing.assert_allclose(line.get_ydata(), ev["bound"][layer])
    assert "projection as one head" in out.axes["attention logit bound"].get_ylabel()

    f = ex.finding("adam_second_moment")
    art = out.artists["g²/v"]
    peak = peak_rho(np.array(f.evidence["rho"]), f.evidence["recent"])
    widths = dict(zip(art["tensors"], (b.get_width() for b in art["bars"]), strict=True))
    names = f.evidence["names"]
    assert widths == pytest.approx({n: peak[names.index(n)] for n in names})
    assert art["tensors"][0] == "t1"
    assert f.points_at == ("t1",)
    assert art["bars"][0].get_facecolor() == RED
    assert all(b.get_facecolor() != RED for b in art["bars"][1:])


def test_a_panel_whose_check_was_unknown_says_so_and_draws_nothing() -> None:
    findings = [
        bad_data(None),
        update_too_large(None, []),
        attention_logit_growth(None, [], []),
        adam_second_moment(None, [], []),
    ]
    ex = Explanation(10, 9, 8, rank(findings), "main")
    out = explanation(ex, fig=Figure())
    assert set(out.unknown) == set(PANELS)
    for title, mechanism in PANELS.items():
        ax = out.axes[title]
        missing = ex.finding(mechanism).missing
        assert out.unknown[title] == missing
        assert out.artists[title]["text"].get_text() == f"unknown: {missing}"
        assert not ax.axison
        assert not ax.lines
        assert not ax.patches
        assert not ax.collections
        assert not ax.images
    assert "replay" in out.unknown["per-sample losses"]


def test_a_mechanism_that_was_not_checked_is_not_drawn() -> None:
    ex = make_explanation()
    ex = Explanation(ex.step, ex.cause, ex.parent, [ex.finding("bad_data")], ex.timeline)
    out = explanation(ex, fig=Figure())
    assert set(out.unknown) == set(PANELS) - {"per-sample losses"}
    assert all("not checked" in why for why in out.unknown.values())


def test_many_tensors_keep_the_ones_pointed_at() -> None:
    ex = make_explanation(tensors=3 * MAX_TENSORS)
    out = explanation(ex, fig=Figure())
    for title, mechanism in (("update ratio", "update_too_large"), ("g²/v", "adam_second_moment")):
        shown = out.artists[title]["tensors"]
        assert len(shown) == MAX_TENSORS
        f = ex.finding(mechanism)
        assert set(f.points_at[:MAX_TENSORS]) <= set(shown)


def test_a_planted_bad_batch_is_drawn_from_its_replay(tmp_path: Path) -> None:
    from dstt.testing.spike_scenarios import scenario

    sc = scenario(tmp_path / "bad", "bad_data", steps=16, at=16)
    ex = dstt.open(sc.path).explain(sc.step, replay=sc.replay())
    assert ex.top.mechanism == "bad_data"
    assert ex.top.verdict == LIKELY
    out = explanation(ex, fig=Figure())
    bars = out.artists["per-sample losses"]["bars"]
    idx = ex.top.evidence["indices"]
    red = {i for i, b in zip(idx, bars, strict=True) if b.get_facecolor() == RED}
    assert red == set(sc.points_at)
    assert "per-sample losses" not in out.unknown
    assert "(4 heads)" in out.axes["attention logit bound"].get_ylabel()  # model/heads
    mesh = out.artists["update ratio"]["mesh"]
    ratios = np.array(ex.finding("update_too_large").evidence["ratios"], dtype=float)
    np.testing.assert_allclose(
        np.ma.filled(mesh.get_array(), np.nan).reshape(ratios.shape[1], -1),
        np.where(ratios > 0, ratios, np.nan).T,
    )
