"""The scrubber's replay panel explains a spike after replaying it (``run.explain`` with the
panel's replay objects): the planted corrupted samples of a ``bad_data`` scenario are named
in the panel, and a plain step gets no explanation."""

from __future__ import annotations

from pathlib import Path

import dstt
from dstt.testing.spike_scenarios import scenario
from dstt.widgets import scrubber


def test_the_spike_panel_shows_why_the_spike_happened(tmp_path: Path) -> None:
    sc = scenario(tmp_path / "run", "bad_data")
    run = dstt.open(sc.path)
    w = scrubber(run, step=sc.step, replay=sc.replay())
    panel = w.replay
    assert panel is not None
    assert w.model.spike is not None
    panel.button.click()  # what the user's click does
    assert panel.error is None
    ex = panel.explanation
    assert ex is not None
    assert ex.top.mechanism == "bad_data"
    assert ex.top.points_at == sc.points_at
    assert "dstt-replay-explain" in panel.why._dom_classes
    assert "bad_data" in panel.why.value
    assert "<table>" in panel.why.value
    w.model.step = sc.step - 5  # a plain step: a replay, no explanation
    panel.update()
    panel.button.click()
    assert panel.result is not None
    assert panel.result.step == sc.step - 5
    assert panel.explanation is None
    assert panel.why.value == ""
