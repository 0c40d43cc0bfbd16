"""A session's steps carry dimension names from the module types: in inspection, in each
array's zarr.json (what a plain ``xr.open_datatree`` of a step file shows, without a
warning) and through ``verify``; both lanes (flat, and the chunk lane of DeltaPolicy runs)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import dstt
from dstt.run import open_run
from dstt.store import Repository
from dstt.store.format.layout import step_file_key


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(10, 4)
        self.fc = torch.nn.Linear(4, 3)
        self.ln = torch.nn.LayerNorm(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ln(self.fc(self.emb(x))).float().pow(2).mean()


def _session_run(path: Path, dtype: torch.dtype, **kw: object) -> None:
    torch.manual_seed(0)
    model = Net().to(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with dstt.session(model, opt, run=path, **kw) as s:  # type: ignore[arg-type]
        for _ in range(3):
            loss = model(torch.arange(5))
            loss.backward()
            opt.step()
            opt.zero_grad()
            s.log(loss=loss.item())


WANT = {
    "emb": {"weight": ["num_embeddings", "embedding_dim"]},
    "fc": {"weight": ["out_features", "in_features"], "bias": ["out_features"]},
    "ln": {"weight": ["normalized_shape"], "bias": ["normalized_shape"]},
}

PLAIN = """
    import json, sys, warnings
    import xarray as xr, zarr
    from zarr.storage import ZipStore
    dstt_before = any(m == "dstt" or m.startswith("dstt.") for m in sys.modules)
    from zarr.core.dtype import data_type_registry
    data_type_registry._lazy_load()  # zarr 3.1: bfloat16 from dstt's entry point
    out = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for path in sys.argv[1:]:
            dt = xr.open_datatree(ZipStore(path, mode="r"), engine="zarr")
            out[path] = {node.path: {k: list(v.dims) for k, v in node.data_vars.items()}
                         for node in dt.subtree if node.data_vars}
    print(json.dumps({"dims": out, "dstt_before": dstt_before,
                      "warnings": [f"{w.category.__name__}: {w.message}" for w in caught]}))
"""


@pytest.mark.parametrize(
    ("dtype", "kw"),
    [(torch.bfloat16, {}), (torch.float32, {"encoding": dstt.DeltaPolicy()})],
    ids=["bf16-flat", "fp32-delta-chunk-lane"],
)
def test_module_dims_reach_inspection_zarr_json_and_plain_xarray(
    tmp_path: Path, dtype: torch.dtype, kw: dict[str, object]
) -> None:
    path = tmp_path / "run"
    _session_run(path, dtype, **kw)
    run = open_run(path)
    tree = run.at(1).layer("fc")
    assert tree["fc"]["weight"].dims == ("out_features", "in_features")
    assert tree["fc"]["bias"].dims == ("out_features",)
    full = run.at(1).tree(optim=True)
    for node, vars_ in WANT.items():
        for var, dims in vars_.items():
            assert list(full[node][var].dims) == dims, (node, var)
            assert list(full[f"optim/exp_avg/{node}"][var].dims) == dims, (node, var)
    assert full["optim/step/fc"]["weight"].dims == ()
    assert run.trajectory("emb.weight").dims == ("step", "num_embeddings", "embedding_dim")
    assert run.verify().ok

    slot = run.at(1).slot  # step 1: a keyframe (the first step of a DeltaPolicy run too)
    zips = [str(path / step_file_key(slot))]
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(PLAIN), *zips],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    info = json.loads(proc.stdout.strip().splitlines()[-1])
    assert info["dstt_before"] is False
    assert info["warnings"] == []
    assert "Warning" not in proc.stderr
    got = info["dims"][zips[0]]
    for node, vars_ in WANT.items():
        assert got[f"/params/{node}"] == vars_
        assert got[f"/optim/exp_avg_sq/{node}"] == vars_


def test_verify_reports_a_consolidated_document_that_disagrees(tmp_path: Path) -> None:
    path = tmp_path / "run"
    _session_run(path, torch.float32)
    repo = Repository.open(path)
    h = repo.reader().head()
    assert h is not None
    key = path / step_file_key(h.slot)
    data = bytearray(key.read_bytes())
    old = b'"out_features"'
    at = data.find(b'"consolidated_metadata"')
    pos = data.find(old, at)  # inside the root document: the consolidated copy
    assert at > 0
    assert pos > 0
    new = b'"out_featurez"'  # same length: the zip stays well formed
    data[pos : pos + len(old)] = new
    key.write_bytes(bytes(data))
    report = repo.verify()
    assert not report.ok
    assert any("consolidated metadata" in p for p in map(str, report.problems))
