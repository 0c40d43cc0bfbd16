"""``dstt rebuild``: light steps of an ``every="auto"`` run on disk rebuilt by replay and
written, so a fresh ``dstt.open(run).at(k)`` reads them without a factory, bit for bit the
``every=1`` reference; ``dstt log`` marks them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

import dstt
from dstt.cli import main
from dstt.errors import StepNotFoundError
from dstt.run.derived import written_bases

from ._helpers import same_bits, stored
from .test_auto_open import FACTORY, _auto_run, _reference

#: the factory's dataset with every sample from ``START`` on changed: the recorded samples no
#: longer give the recorded losses
TAMPERED = (
    FACTORY
    + """
class Tampered(torch.utils.data.Dataset):
    def __init__(self, inner):
        self.inner = inner

    def __len__(self):
        return len(self.inner)

    def __getitem__(self, i):
        x, y = self.inner[i]
        return (x + 1 if i >= START else x), y


def tampered():
    made = make()
    made["dataset"] = Tampered(made["dataset"])
    return made
"""
)


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An ``every="auto"`` run on disk whose session recorded its replay factory."""
    where = tmp_path_factory.mktemp("rebuildcli")
    script = where / "train.py"
    script.write_text(FACTORY)
    _, _, inner = _auto_run(path=where, max_gap=4, min_light=3, replay=f"{script}:make")
    return Path(str(inner.storage.location))


def _copy(src: Path, tmp_path: Path) -> str:
    dst = tmp_path / "run"
    shutil.copytree(src, dst)
    return str(dst)


def _stored_before(run: dstt.Run, k: int) -> int:
    return max(s for s in run.steps if s < k)


def test_a_range_is_rebuilt_written_and_read_back_bit_for_bit(
    recorded: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = _copy(recorded, tmp_path)
    run = dstt.open(root)
    light = sorted(run.light_steps())
    lo, hi = _stored_before(run, light[0]), light[1]
    capsys.readouterr()
    assert main(["rebuild", root, "--steps", f"{lo}:{hi}", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["timeline"] == run.timeline
    assert [d["step"] for d in doc["rebuilt"]] == light[:2]
    assert doc["stored"] == [s for s in run.steps if lo <= s <= hi]
    for d in doc["rebuilt"]:
        assert d["base"] == _stored_before(run, d["step"])
        assert d["matched"] is True
        assert d["checked"] == list(range(d["base"] + 1, d["step"] + 1))
        assert d["written_before"] is False
    # a later process, no factory: reads what was written, equal to every=1 bit for bit
    ref = _reference(False)
    later = dstt.open(root)
    for k in light[:2]:
        snap, want = later.at(k), dstt.open(ref).at(k)
        assert snap.rebuilt is not None
        assert sorted(snap.arrays) == sorted(want.arrays)
        for path in want.arrays:
            assert same_bits(
                torch.from_numpy(snap.to_numpy(path, native=True)), stored(ref, k, path)
            ), (k, path)
    assert later.steps == run.steps  # never history
    # dstt log tells the written ones from the others
    assert main(["log", root]) == 0
    out = capsys.readouterr().out
    for k in light:
        (line,) = [x for x in out.splitlines() if x.startswith(f"step {k:>8}  light")]
        if k in light[:2]:
            assert f"light (rebuilt from step {_stored_before(run, k)}; run.at({k})" in line
        else:
            assert "light (not stored" in line
    assert main(["log", root, "--json"]) == 0
    marks = {d["step"]: d["rebuilt"] for d in json.loads(capsys.readouterr().out) if d["light"]}
    assert marks == {k: (_stored_before(run, k) if k in light[:2] else None) for k in light}
    # dstt ls counts them, and how many are written
    assert main(["ls", root]) == 0
    assert f'{len(light)} light steps (every="auto": taken, not stored; 2 rebuilt)' in (
        capsys.readouterr().out
    )
    assert main(["ls", root, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert (doc["n_light"], doc["n_rebuilt"]) == (len(light), 2)
    # the default, 'light': the rest; the written ones are not replayed again
    assert main(["rebuild", root]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [int(x.split()[1]) for x in lines] == light[2:]
    assert all("every replayed loss matched bit for bit" in x for x in lines)
    assert main(["rebuild", root]) == 0
    assert "nothing to rebuild" in capsys.readouterr().out
    assert main(["rebuild", root, "--steps", f"{lo}:{lo}"]) == 2  # one stored step: refused
    assert main(["rebuild", root, "--steps", f"{run.steps[-1]}:{run.steps[-1] + 5}"]) == 0
    assert "stored, nothing to rebuild" in capsys.readouterr().out
    # an explicit step written before is read back, no factory needed
    assert main(["rebuild", root, "--steps", str(light[0]), "--script", "nope.py:make"]) == 0
    assert "(written before)" in capsys.readouterr().out


def test_a_stored_or_unknown_step_is_refused(
    recorded: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = str(recorded)
    run = dstt.open(root)
    k = run.steps[0]
    capsys.readouterr()
    assert main(["rebuild", root, "--steps", str(k)]) == 2
    assert f"step {k} is stored" in capsys.readouterr().err
    assert main(["rebuild", root, "--steps", "999"]) == 2
    assert "no step 999" in capsys.readouterr().err
    assert main(["rebuild", root, "--steps", "9:3"]) == 2
    assert "first <= last" in capsys.readouterr().err
    assert main(["rebuild", root, "--steps", "x"]) == 2
    assert "'light'" in capsys.readouterr().err
    assert written_bases(dstt.open(root), run.timeline) == {}  # nothing written


def test_without_a_factory_it_says_to_pass_script(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, run, inner = _auto_run(path=tmp_path, max_gap=4)
    root = str(inner.storage.location)
    k = min(run.light_steps())
    capsys.readouterr()
    assert main(["rebuild", root, "--steps", str(k)]) == 2
    err = capsys.readouterr().err
    assert "no replay factory" in err
    assert "--script FILE.py:FUNCTION" in err
    assert main(["rebuild", root, "--steps", str(k), "--script", "train.py"]) == 2
    assert "--script" in capsys.readouterr().err
    script = tmp_path / "train.py"
    script.write_text(FACTORY)
    assert main(["rebuild", root, "--steps", str(k), "--script", f"{script}:make"]) == 0
    (line,) = capsys.readouterr().out.splitlines()
    assert line.split()[:2] == ["step", str(k)]
    assert f"rebuilt from stored step {_stored_before(run, k)}" in line
    assert dstt.open(root).at(k).rebuilt is not None


def test_a_broken_chain_exits_3_and_keeps_what_was_rebuilt_before_it(
    recorded: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = _copy(recorded, tmp_path)
    run = dstt.open(root)
    light = sorted(run.light_steps())
    gaps: dict[int, list[int]] = {}
    for k in light:
        gaps.setdefault(_stored_before(run, k), []).append(k)
    # break a gap after its first light step when one has two (the steps of that gap before
    # the break are kept too), else the second gap
    bad = next((g[1] for g in gaps.values() if len(g) > 1), light[1])
    script = tmp_path / "tampered.py"
    script.write_text(f"START = {4 * (bad - 1)}\n{TAMPERED}")
    capsys.readouterr()
    assert main(["rebuild", root, "--script", f"{script}:tampered"]) == 3
    err = capsys.readouterr().err
    assert f"the chain broke at step {bad}" in err
    later = dstt.open(root)
    assert sorted(written_bases(later, later.timeline)) == [k for k in light if k < bad]
    assert later.at(light[0]).rebuilt is not None  # before the break: written, readable
    with pytest.raises(StepNotFoundError):
        later.at(bad)  # not written: still needs a factory


def test_the_scrubber_shows_a_rebuilt_light_step_as_available(
    recorded: Path, tmp_path: Path
) -> None:
    from dstt.widgets.model import ScrubberModel

    root = _copy(recorded, tmp_path)
    run = dstt.open(root)
    light = sorted(run.light_steps())
    m = ScrubberModel(dstt.open(root))
    assert m.steps == run.steps
    assert m.light == light
    assert m.rebuilt == {}
    k = light[0]
    assert main(["rebuild", root, "--steps", str(k)]) == 0
    m.refresh()
    base = _stored_before(run, k)
    assert m.rebuilt == {k: base}
    assert m.light == light[1:]
    assert m.steps == sorted({*run.steps, k})
    m.step = k
    assert f"light, rebuilt from stored step {base}" in m.label()
    want = dstt.open(root).at(k).tensor(m.tensor).values
    assert np.array_equal(m.values(), want)
    assert m.reference_step == base
    m.mode = "change"
    ch = m.change()
    assert ch.attrs["reference"] == base
    assert sorted(ch["tensor"].values.tolist()) == sorted(m.tensors)
    assert np.isfinite(ch["ratio"].values).all()
    assert (ch["ratio"].values > 0).all()
    img, title = m.shown()
    assert img is not None
    assert f"@ {k} - @ {base}" in title
