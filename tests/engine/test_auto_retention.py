"""Retention and gc with light steps (``every="auto"``): a light step the policy keeps stays
rebuildable (its base and the commit carrying its record stay); what gc strands, it names."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import dstt
from dstt.errors import ReplayError, StepNotFoundError

from .test_auto import DATA, _auto_run, _loss, _model


def _rebuildable(run: Any, steps: list[int]) -> set[int]:
    """The light ``steps`` of ``run`` a rebuild still reaches (losses bit for bit)."""
    ok = set()
    for k in steps:
        m = _model()
        opt = torch.optim.Adam(m.parameters(), lr=1e-2)
        try:
            got = run.rebuild(k, m, opt, dataset=DATA, loss_fn=_loss)
        except (StepNotFoundError, ReplayError):
            continue
        assert got.faithful
        ok.add(k)
    return ok


@pytest.fixture
def auto_run() -> Any:
    """An every="auto" run with light steps in more than one gap (fresh per test: gc)."""
    _, run, _ = _auto_run(max_gap=3, min_light=5)
    return run


def test_keep_last_counts_light_steps_and_keeps_them_rebuildable(auto_run: Any) -> None:
    run = auto_run
    light = sorted(run.light_steps())
    every = sorted([*run.steps, *light])
    tail = every[-8:]  # the last 8 steps, stored or light
    report = run.gc(retention=dstt.Retention(keep_last=8))
    run.refresh()
    assert report.pruned_steps  # the policy pruned something
    kept_light = [k for k in light if k in tail]
    assert _rebuildable(run, kept_light) == set(kept_light)
    # what is not rebuildable any more is exactly what the report names
    lost = set(light) - _rebuildable(run, light)
    assert lost  # the light steps before the tail's bases
    assert {k for _, k in report.stranded_light} == lost
    assert not lost & set(tail)


def test_a_pinned_light_step_keeps_its_base_and_its_record(auto_run: Any) -> None:
    run = auto_run
    light = sorted(run.light_steps())
    k = light[0]
    base = max(s for s in run.steps if s < k)
    carrier = min(s for s in run.steps if s > k)
    report = run.gc(retention=dstt.Retention(keep_last=1, keep_steps=(k,)))
    run.refresh()
    assert base in run.steps
    assert carrier in run.steps
    assert k not in {s for _, s in report.stranded_light}
    assert _rebuildable(run, [k]) == {k}


def test_keep_light_false_prunes_bases_and_reports_exactly_the_stranded(auto_run: Any) -> None:
    run = auto_run
    light = sorted(run.light_steps())
    dry = run.gc(retention=dstt.Retention(keep_last=2, keep_light=False), dry_run=True)
    report = run.gc(retention=dstt.Retention(keep_last=2, keep_light=False))
    run.refresh()
    assert dry.stranded_light == report.stranded_light
    stranded = {k for _, k in report.stranded_light}
    assert stranded  # the last two stored steps keep few of the light steps' bases
    assert _rebuildable(run, light) == set(light) - stranded


def test_keep_light_must_be_a_bool() -> None:
    with pytest.raises(ValueError, match="keep_light"):
        dstt.Retention(keep_last=2, keep_light="yes")  # type: ignore[arg-type]
