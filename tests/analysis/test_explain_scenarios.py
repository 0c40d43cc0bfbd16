"""``run.explain`` on tiny runs with one spike mechanism planted each
(:mod:`dstt.testing.spike_scenarios`): with the defaults the planted mechanism is ranked first
and its evidence points at the planted tensors or samples; a clean run has no spike and
nothing ``likely``; checks that need replay are ``unknown`` without replay objects and use
them when given; ``Spike.explain`` and ``dstt explain`` give the same answer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import dstt
from dstt.analysis.mechanisms import LIKELY, UNKNOWN
from dstt.cli import main
from dstt.errors import ConfigError, StepNotFoundError
from dstt.run.explain import _heads_of
from dstt.testing.spike_scenarios import HEADS, Scenario, scenario

STORED = ("update_too_large", "attention_logit_growth", "adam_second_moment", "numerics")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Scenario]:
    root = tmp_path_factory.mktemp("scenarios")
    return {m: scenario(root / m, m) for m in (*STORED, "bad_data", "clean")}


@pytest.mark.parametrize("mechanism", STORED)
def test_a_planted_mechanism_is_ranked_first_from_stored_state(
    runs: dict[str, Scenario], mechanism: str
) -> None:
    sc = runs[mechanism]
    ex = dstt.open(sc.path).explain(sc.step)
    assert ex.step == sc.step
    assert ex.top.mechanism == mechanism, str(ex)
    assert ex.top.verdict == LIKELY
    assert [f.mechanism for f in ex.likely] == [mechanism], str(ex)
    assert set(sc.points_at) <= set(ex.top.points_at), (sc.points_at, ex.top.points_at)
    assert ex.top.read, "a finding says what it read"
    assert ex.top.hint
    assert ex.finding("bad_data").verdict == UNKNOWN  # needs replay: not a guess
    assert "replay" in (ex.finding("bad_data").missing or "")


def test_adam_points_only_at_the_quiet_layer(runs: dict[str, Scenario]) -> None:
    sc = runs["adam_second_moment"]
    top = dstt.open(sc.path).explain(sc.step).top
    assert set(top.points_at) == set(sc.points_at)
    assert "exp_avg_sq" in top.evidence["g_from"]


def test_update_too_large_names_most_tensors(runs: dict[str, Scenario]) -> None:
    sc = runs["update_too_large"]
    top = dstt.open(sc.path).explain(sc.step).top
    assert top.evidence["share"] >= 0.9
    assert top.evidence["median_factor"] > 5


def test_numerics_is_explained_without_a_finite_spike(runs: dict[str, Scenario]) -> None:
    """The loss turns NaN (the spike rule skips it): explain() picks the first NaN loss."""
    sc = runs["numerics"]
    run = dstt.open(sc.path)
    ex = run.explain()
    assert ex.step == sc.step
    assert ex.top.points_at == sc.points_at
    assert ex.top.evidence["first_nonfinite_step"] == sc.step - 1


def test_bad_data_is_found_with_replay_and_names_the_samples(runs: dict[str, Scenario]) -> None:
    sc = runs["bad_data"]
    run = dstt.open(sc.path)
    spikes = run.spikes()
    assert [s.start for s in spikes] == [sc.step]
    plain = spikes[0].explain()
    assert not plain.likely, str(plain)  # nothing stored explains bad data: no guess
    assert plain.top.mechanism == "bad_data"
    assert plain.top.verdict == UNKNOWN
    ex = spikes[0].explain(replay=sc.replay())
    assert ex.replayed
    assert ex.top.mechanism == "bad_data", str(ex)
    assert ex.top.verdict == LIKELY
    assert ex.top.points_at == sc.points_at
    assert set(ex.top.evidence["outliers"]) == set(sc.points_at)
    assert [f.mechanism for f in ex.likely] == ["bad_data"]


def test_replay_does_not_blame_the_data_for_an_lr_spike(runs: dict[str, Scenario]) -> None:
    sc = runs["update_too_large"]
    ex = dstt.open(sc.path).explain(sc.step, replay=sc.replay())
    assert ex.top.mechanism == "update_too_large"
    assert ex.finding("bad_data").verdict != LIKELY
    assert "replay" in ex.finding("adam_second_moment").evidence["g_from"]


def test_a_clean_run_has_no_spike_and_nothing_likely(runs: dict[str, Scenario]) -> None:
    sc = runs["clean"]
    run = dstt.open(sc.path)
    assert run.spikes() == []
    ex = run.explain(30)
    assert ex.likely == [], str(ex)
    with pytest.raises(StepNotFoundError, match="no spike"):
        run.explain()


def test_the_explanation_reads_and_renders(runs: dict[str, Scenario]) -> None:
    sc = runs["update_too_large"]
    ex = dstt.open(sc.path).explain(sc.step)
    text = repr(ex)
    assert "update_too_large: likely" in text
    assert "hint:" in text
    html = ex._repr_html_()
    assert "<table>" in html
    assert "update_too_large" in html
    with pytest.raises(ConfigError, match="checked"):
        ex.finding("astrology")


def test_bad_arguments_are_typed_errors(runs: dict[str, Scenario]) -> None:
    run = dstt.open(runs["clean"].path)
    with pytest.raises(ConfigError, match="lookback"):
        run.explain(30, lookback=1)
    with pytest.raises(ConfigError, match="replay"):
        run.explain(30, replay=[1, 2])  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="Spike"):
        run.explain("30")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"run\.explain"):
        dstt.open(runs["bad_data"].path).spikes()[0].__class__(1, 1.0, 1.0, 1.0, 1.0).explain()


def test_the_cli_prints_the_same_ranking(
    runs: dict[str, Scenario], capsys: pytest.CaptureFixture[str]
) -> None:
    sc = runs["adam_second_moment"]
    assert main(["explain", sc.path, "--step", str(sc.step), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["findings"][0]["mechanism"] == "adam_second_moment"
    assert doc["findings"][0]["verdict"] == LIKELY
    assert main(["explain", sc.path, "--step", str(sc.step)]) == 0
    assert "1. adam_second_moment: likely" in capsys.readouterr().out
    assert main(["explain", str(Path(runs["clean"].path))]) == 2
    assert "no spike" in capsys.readouterr().err


def test_the_attention_check_splits_heads_as_the_session_recorded_them(
    runs: dict[str, Scenario],
) -> None:
    sc = runs["attention_logit_growth"]
    run = dstt.open(sc.path)
    f = run.explain(sc.step).finding("attention_logit_growth")
    assert f.evidence["heads"] == {"layers.0": HEADS, "layers.1": HEADS}
    assert f.evidence["heads_from"]["layers.0"] == "model/heads of layers.0"
    assert any("model/heads" in r for r in f.read)
    one = run.explain(sc.step, heads=1).finding("attention_logit_growth")  # heads= wins
    assert one.evidence["heads"] == {"layers.0": 1, "layers.1": 1}
    assert one.evidence["heads_from"]["layers.0"] == "heads="
    assert not any("model/heads" in r for r in one.read)
    assert f.evidence["bound"] != one.evidence["bound"]


def test_head_counts_come_from_the_layer_its_ancestors_or_the_config() -> None:
    stored = {"model.layers.0.attn": {"head_dim": 8}, "model": {"heads": 3}}
    assert _heads_of("model.layers.0.attn", 32, None, stored, 6) == (
        4,
        "model/heads of model.layers.0.attn (head_dim 8)",
    )
    assert _heads_of("model.layers.1.attn", 32, None, stored, 6) == (3, "model/heads of model")
    assert _heads_of("x.attn", 32, None, stored, 6) == (6, "model/config")
    n, why = _heads_of("x.attn", 32, None, {}, None)
    assert n is None
    assert why.startswith("unknown")
    assert _heads_of("model.layers.0.attn", 32, 2, stored, 6) == (2, "heads=")
