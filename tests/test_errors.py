"""User mistakes in the Python API raise ``DsttError`` subclasses that are also the builtin a
caller would catch, with a message that prints cleanly (no ``KeyError`` quotes) and says what
to do: the closest names, the states a tensor has, how to list every name."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import dstt
from dstt.errors import (
    DsttError,
    MetricNotFoundError,
    NotARunError,
    SchemaError,
    TensorNotFoundError,
)
from dstt.store import save


@pytest.fixture
def run(tmp_path: Path) -> dstt.Run:
    path = tmp_path / "run"
    for s in (1, 2):
        save(
            path,
            s,
            {
                "params/layers/0/attn/weight": np.ones((3, 2), np.float32),
                "params/layers/0/attn/bias": np.ones(3, np.float32),
                "optim/exp_avg/layers/0/attn/weight": np.zeros((3, 2), np.float32),
            },
            metrics={"loss": 1.0 / s},
        )
    return dstt.open(path)


def _raised(fn: object, cls: type[BaseException], builtin: type[BaseException]) -> str:
    with pytest.raises(cls) as info:
        fn()  # type: ignore[operator]
    assert isinstance(info.value, DsttError)
    assert isinstance(info.value, builtin)
    msg = str(info.value)
    assert not (msg[:1] in "'\"" and msg[:1] == msg[-1:]), msg  # no KeyError quoting
    return msg


def test_unknown_tensor_names_the_closest_and_how_to_list(run: dstt.Run) -> None:
    snap = run.at(1)
    msg = _raised(lambda: snap.tensor("layers.0.attn.weigth"), TensorNotFoundError, KeyError)
    assert "at step 1" in msg
    assert "did you mean 'layers.0.attn.weight'" in msg
    assert "run.at(1).names(optim=True)" in msg
    msg = _raised(lambda: snap.to_numpy("nope"), TensorNotFoundError, KeyError)
    assert "no tensor named 'nope' at step 1" in msg
    msg = _raised(lambda: run.trajectory("layers.0.attn.bais"), TensorNotFoundError, KeyError)
    assert "at step 2, the newest selected step" in msg
    assert "'layers.0.attn.bias'" in msg


def test_unknown_optimizer_state_lists_the_states_the_tensor_has(run: dstt.Run) -> None:
    msg = _raised(
        lambda: run.at(2).to_numpy("layers.0.attn.weight", state="exp_avgsq"),
        TensorNotFoundError,
        KeyError,
    )
    assert "has no optimizer state 'exp_avgsq' at step 2; its states: exp_avg" in msg
    msg = _raised(
        lambda: run.trajectory("layers.0.attn.bias", state="exp_avg"), TensorNotFoundError, KeyError
    )
    assert "'layers.0.attn.bias' has no optimizer states" in msg
    assert "leave state unset" in msg


def test_selector_that_matches_nothing(run: dstt.Run) -> None:
    msg = _raised(lambda: run.at(1).layer("layers.0.atn"), TensorNotFoundError, KeyError)
    assert "did you mean 'layers.0.attn'" in msg
    assert "run.at(1).names()" in msg
    msg = _raised(lambda: run.at(1).layer("decoder"), TensorNotFoundError, KeyError)
    assert "top-level modules: layers" in msg
    msg = _raised(lambda: run.diff(1, 2, selector="mlp"), TensorNotFoundError, KeyError)
    assert "at steps 1 or 2" in msg


def test_unknown_metric(run: dstt.Run) -> None:
    msg = _raised(lambda: run.spikes("acc"), MetricNotFoundError, KeyError)
    assert "'acc' was never logged on timeline 'main'" in msg
    assert "loss" in msg


def test_a_file_is_not_a_run(tmp_path: Path, run: dstt.Run) -> None:
    f = tmp_path / "notes.txt"
    f.write_text("x")
    msg = _raised(lambda: dstt.open(f), NotARunError, FileNotFoundError)
    assert "is a file, not a run directory" in msg
    assert "[Errno" not in msg
    msg = _raised(lambda: dstt.open(tmp_path / "missing"), NotARunError, FileNotFoundError)
    assert msg == f"no run at {tmp_path / 'missing'}: no such file or directory"
    msg = _raised(lambda: dstt.open(Path(run.path) / "_dstt"), NotARunError, FileNotFoundError)
    assert f"is a folder inside the run {run.path}" in msg
    model = torch.nn.Linear(2, 2)

    def train() -> None:
        with dstt.session(model, run=f) as s:
            s.step()

    msg = _raised(train, NotARunError, OSError)
    assert "is a file; a run is a directory" in msg
    assert f.read_text() == "x"


def test_trajectory_over_a_missing_integer_tensor_is_a_schema_error(tmp_path: Path) -> None:
    path = tmp_path / "late"
    save(path, 1, {"params/w": np.ones(3, np.float32)})
    save(path, 2, {"params/w": np.ones(3, np.float32), "buffers/count": np.arange(3)})
    tr = dstt.open(path).trajectory("count")
    msg = _raised(lambda: tr.values, SchemaError, ValueError)
    assert "missing at step 1" in msg
    assert "narrow the steps" in msg
