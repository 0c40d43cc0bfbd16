"""``every="auto"``: store what a slow disk can take, record the rest as light steps, and
rebuild any light step bit for bit by replay from the stored step before it."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import dstt
from dstt.engine.capture.light import LIGHT_OBJECT
from dstt.engine.state.torch_state import discover
from dstt.errors import ConfigError, ReplayError, StepNotFoundError
from dstt.schema import BATCHES_OBJECT
from dstt.store._internal import Repository
from dstt.store.storage.memory import FaultyStorage, MemoryStorage
from dstt.training import SessionOptions, session

from ._helpers import same_bits, stored

STEPS = 24
DATA = torch.utils.data.TensorDataset(
    torch.randn(STEPS * 4, 8, generator=torch.Generator().manual_seed(1)),
    torch.randn(STEPS * 4, 4, generator=torch.Generator().manual_seed(2)),
)


def _model(dropout: float = 0.0) -> torch.nn.Module:
    torch.manual_seed(0)
    layers = [torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)]
    if dropout:
        layers.insert(2, torch.nn.Dropout(dropout))  # draws from the global RNG each forward
    return torch.nn.Sequential(*layers)


def _schedule(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0 / (1.0 + 0.3 * k))


def _loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


def _train(
    repo: Repository,
    *,
    every: int | str,
    shift: int = 0,
    log_scale: float = 1.0,
    rich: bool = False,
    **options: Any,
) -> dstt.training.Session:
    """A plain loop over ``DATA`` in batches of 4 for ``STEPS`` steps, logging its loss;
    ``shift``: train on the samples ``shift`` further on than the ones drawn (and recorded);
    ``rich``: with dropout (the RNG) and an LR scheduler stepped every step."""
    m = _model(dropout=0.2 if rich else 0.0)
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    sched = _schedule(opt) if rich else None
    loader = torch.utils.data.DataLoader(DATA, batch_size=4)
    with session(m, opt, run=repo, every=every, scheduler=sched, **options) as s:  # type: ignore[arg-type]
        for x, y in s.data(loader):
            if shift:
                i = s.step * 4 + shift
                x, y = DATA[i : i + 4]
            loss = _loss(m, (x, y))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if sched is not None:
                sched.step()
            s.log(loss=loss * log_scale)
            if s.step >= STEPS:
                break
    return s


def _slow(delay: float, path: Path | None = None) -> tuple[Repository, Repository]:
    """(a repository on a storage whose writes take ``delay`` s, the same one unslowed); in
    memory, or in the directory ``path``."""
    inner = MemoryStorage() if path is None else Repository.create(path).storage
    if path is None:
        Repository.create(inner)
    slow = FaultyStorage(inner, on_write=lambda key: time.sleep(delay))
    return Repository(slow), Repository(inner)


def _auto_run(
    delay: float = 0.02, path: Path | None = None, min_light: int = 1, **options: Any
) -> tuple[dstt.training.Session, Any, Repository]:
    for attempt in range(3):  # a fast machine may keep up now and then: retry until it does not
        slow, inner = _slow(delay, None if path is None else path / f"run{attempt}")
        s = _train(slow, every="auto", max_backlog=2, **options)
        run = dstt.open(inner)
        if len(run.light_steps()) >= min_light:
            return s, run, inner
        delay *= 4
    raise AssertionError("the slowed storage never made the engine busy")


def test_auto_stores_a_fraction_and_every_step_keeps_its_metrics() -> None:
    s, run, _ = _auto_run()
    light = run.light_steps()
    assert 0 < len(run.steps) < STEPS
    assert sorted([*run.steps, *light]) == list(range(1, STEPS + 1))
    # the session's metrics say which steps were stored
    by_step = {m.step: m.stored for m in s.metrics}
    assert sorted(by_step) == list(range(1, STEPS + 1))
    assert {k for k, st in by_step.items() if not st} == set(light)
    assert all(m.committed for m in s.metrics if m.stored)
    # every step's loss is visible, light ones included
    metrics = run.metrics()
    assert list(metrics.steps) == list(range(1, STEPS + 1))
    assert not np.isnan(metrics.column("loss")).any()
    # each light step's fingerprint is the exact bits of the loss it logged
    losses = dict(zip(metrics.steps.tolist(), metrics.column("loss").tolist(), strict=True))
    from dstt.engine.capture.light import loss_of

    assert all(bits is not None and loss_of(bits) == losses[k] for k, bits in light.items())


def test_a_light_step_costs_under_a_kilobyte_in_existing_files() -> None:
    _, run, inner = _auto_run()
    light = run.light_steps()
    r = inner.reader()
    total = 0
    for h in run.commits():
        if LIGHT_OBJECT not in h.objects:
            continue
        rec = r.read_object(h, LIGHT_OBJECT)
        total += len(json.dumps(rec))
        mine = set(rec["steps"])
        hist = r.read_object(h, "metrics/history")
        total += sum(
            len(json.dumps(v))
            for k, t, v in zip(hist["steps"], hist["time"], hist["metrics"], strict=True)
            if k in mine
        ) + 8 * len(mine)
        batches = r.read_object(h, BATCHES_OBJECT)
        total += sum(
            len(json.dumps(b))
            for k, b in zip(batches["steps"], batches["batches"], strict=True)
            if k in mine
        )
    per_step = total / len(light)
    assert 0 < per_step <= 1024, per_step
    # no file per light step: the light steps' records are objects of stored commits
    assert all(LIGHT_OBJECT in h.objects for h in run.commits() if h.step - 1 in light)


def test_max_gap_bounds_the_light_steps_between_stored_ones() -> None:
    _, run, _ = _auto_run(delay=0.05, max_gap=2)
    stored_steps = run.steps
    gaps = [b - a - 1 for a, b in zip([0, *stored_steps], stored_steps, strict=False)]
    assert max(gaps) <= 2
    assert run.light_steps()


@pytest.mark.parametrize("rich", [False, True], ids=["plain", "dropout+scheduler"])
def test_a_rebuilt_light_step_equals_the_reference_run_bit_for_bit(rich: bool) -> None:
    ref = MemoryStorage()
    Repository.create(ref)
    _train(Repository(ref), every=1, rich=rich)
    ref_repo = Repository(ref)
    _, run, _ = _auto_run(max_gap=4, rich=rich)
    light = sorted(run.light_steps())
    for k in light[:3] + light[-2:]:
        m = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
        if rich:
            m.insert(2, torch.nn.Dropout(0.2))
        opt = torch.optim.Adam(m.parameters(), lr=1e-2)
        sched = _schedule(opt) if rich else None
        got = run.rebuild(k, m, opt, scheduler=sched, dataset=DATA, loss_fn=_loss)
        if sched is not None:
            assert sched.last_epoch == k
        assert got.step == k
        assert got.base == max(s for s in run.steps if s < k)
        assert got.checked == list(range(got.base + 1, k + 1))
        assert got.faithful
        tensors = discover(m, opt).step_state.tensors()
        paths = ref_repo.reader().arrays(ref_repo.reader().find(k))
        assert set(paths) == set(tensors)
        for path in paths:  # params and optimizer state
            assert same_bits(tensors[path], stored(ref_repo, k, path)), (k, path)


def test_check_next_replays_on_to_the_next_stored_step_and_matches_it() -> None:
    _, run, _ = _auto_run(max_gap=4)
    light = run.light_steps()
    k = min(light)
    m_next = min(s for s in run.steps if s > k)
    m = _model()
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    got = run.rebuild(k, m, opt, dataset=DATA, loss_fn=_loss, check_next=True)
    assert got.landed == m_next
    assert got.checked == list(range(got.base + 1, k + 1))
    # the objects end at k, not at the stored step the check went on to
    m2 = _model()
    opt2 = torch.optim.Adam(m2.parameters(), lr=1e-2)
    run.rebuild(k, m2, opt2, dataset=DATA, loss_fn=_loss)
    mine, plain = discover(m, opt).step_state.tensors(), discover(m2, opt2).step_state.tensors()
    assert set(mine) == set(plain)
    assert all(same_bits(mine[p], plain[p]) for p in mine)

    # a clipping training did not do: the first light step's loss (computed on the stored
    # weights) still matches, but the chain no longer lands on the next stored step
    def clip() -> None:
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1e-3)

    with pytest.raises(ReplayError, match=r"chain broke at step|lands off stored step"):
        run.rebuild(k, m, opt, dataset=DATA, loss_fn=_loss, before_step=clip, check_next=True)


def test_a_step_that_trained_on_other_samples_than_recorded_breaks_the_chain() -> None:
    for delay in (0.02, 0.08, 0.3):
        slow, inner = _slow(delay)
        _train(slow, every="auto", max_backlog=2, shift=1)
        run = dstt.open(inner)
        if run.light_steps():
            break
    k = max(run.light_steps())
    j = max(s for s in run.steps if s < k)
    m = _model()
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    with pytest.raises(ReplayError, match=f"chain broke at step {j + 1}"):
        run.rebuild(k, m, opt, dataset=DATA, loss_fn=_loss)


def test_a_loop_that_logs_another_loss_than_it_trains_on_says_so_with_logged() -> None:
    _, run, _ = _auto_run(log_scale=2.0)
    k = min(run.light_steps())
    j = max(s for s in run.steps if s < k)
    m = _model()
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    with pytest.raises(ReplayError, match=f"chain broke at step {j + 1}"):
        run.rebuild(k, m, opt, dataset=DATA, loss_fn=_loss)
    got = run.rebuild(k, m, opt, dataset=DATA, loss_fn=_loss, logged=lambda ls: ls[-1] * 2)
    assert got.checked == list(range(j + 1, k + 1))


def test_a_light_step_stranded_by_gc_says_so_and_the_kept_ones_still_rebuild() -> None:
    _, run, _ = _auto_run(max_gap=4, min_light=5)  # more than max_gap: two gaps at least
    light_before = sorted(run.light_steps())
    first, last = light_before[0], light_before[-1]
    base = max(s for s in run.steps if s < last)  # what the last light step's rebuild needs:
    record = min(s for s in run.steps if s > last)  # its base, and the commit recording it
    run.gc(keep_last=1, keep_steps=[base, record])
    run.refresh()
    assert first < base  # so the first light step lost its base or its record
    m = _model()
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    with pytest.raises((StepNotFoundError, ReplayError), match="gc pruned stored steps"):
        run.rebuild(first, m, opt, dataset=DATA, loss_fn=_loss)
    got = run.rebuild(last, m, opt, dataset=DATA, loss_fn=_loss)
    assert got.faithful
    assert got.base == base


def test_at_a_light_step_names_the_stored_steps_and_how_to_rebuild() -> None:
    _, run, _ = _auto_run()
    k = min(run.light_steps())
    before = max(s for s in run.steps if s < k)
    with pytest.raises(StepNotFoundError, match=rf"light step.*{before}.*run\.rebuild\({k}"):
        run.at(k)


def test_dstt_log_lists_light_steps_between_the_stored_ones(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from dstt.cli import main

    _, run, inner = _auto_run(path=tmp_path)
    light = run.light_steps()
    capsys.readouterr()
    assert main(["log", str(inner.storage.location), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [d["step"] for d in doc] == list(range(STEPS, 0, -1))
    assert {d["step"] for d in doc if d["light"]} == set(light)
    assert all("loss" in d["metrics"] for d in doc)
    assert main(["log", str(inner.storage.location), "--batches"]) == 0
    out = capsys.readouterr().out
    k = min(light)
    (line,) = [x for x in out.splitlines() if x.startswith(f"step {k:>8}  light")]
    assert f"run.rebuild({k}, ...)" in line
    assert f"[samples {list(range(4 * (k - 1), 4 * k))}]" in line  # what step k trained on


def test_the_auto_block_in_the_performance_doc_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import re

    text = (Path(__file__).resolve().parents[2] / "docs" / "performance.md").read_text()
    blocks = re.findall(r"^```python\n(.*?)^```", text, re.M | re.S)
    (block,) = [b for b in blocks if 'every="auto"' in b]
    monkeypatch.chdir(tmp_path)
    exec(compile(block, "docs/performance.md", "exec"), {})  # the doc's own code, as written
    stored_n, light_n = re.findall(r"(\d+) steps stored, (\d+) light", capsys.readouterr().out)[0]
    assert int(stored_n) + int(light_n) == 16
    assert int(stored_n) >= 1


@pytest.mark.parametrize(
    ("options", "match"),
    [({"every": "always"}, "every must be"), ({"every": "auto", "max_gap": 0}, "max_gap")],
)
def test_bad_auto_options_are_refused(options: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        SessionOptions(run="runs/x", **options)
