"""A run in the bucket as one virtual Zarr store: references to ``s3://`` step files, read
by plain xarray through fsspec's reference file system and s3fs in a process that imports
neither dstt nor torch, bit for bit against ``dstt.open(url).trajectory``."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

import dstt
from dstt import session

from ._helpers import MLP, mlp_batch, train_step
from .conftest import S3Server, child_env

READER = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    import xarray as xr
    refs, names, opts = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
    tree = xr.open_datatree(
        "reference://run", engine="zarr", consolidated=False, zarr_format=3,
        storage_options={"fo": refs, "remote_protocol": "s3", "remote_options": opts},
    )
    out = {"steps": tree["step"].values.tolist(), "loss": tree["loss"].values.tolist()}
    for n in names:
        out[n] = np.ascontiguousarray(tree[n].values).tobytes().hex()
    out["modules"] = sorted(k for k in sys.modules if k.split(".")[0] in ("dstt", "torch"))
    print(json.dumps(out))
    """
)
NAMES = {"l1.weight": "params/l1/weight", "l2.bias": "params/l2/bias"}


def _train(url: str, steps: int) -> None:
    torch.manual_seed(0)
    m = MLP()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    with session(m, opt, run=url, every=1, resume=True) as s:
        for i in range(s.step, steps):
            s.log(loss=train_step(m, opt, *mlp_batch(i)))


def test_a_run_in_the_bucket_reads_as_one_store_bit_for_bit(
    s3_url: str, s3_server: S3Server, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from dstt.cli import EXIT_OK, main

    refs = tmp_path / "run.refs.json"
    _train(s3_url, 3)
    rep = dstt.open(s3_url).virtual(refs)
    assert rep.steps == (1, 2, 3)
    _train(s3_url, 4)
    assert main(["virtual", s3_url, "-o", str(refs)]) == EXIT_OK
    text = capsys.readouterr().out
    assert "1 steps added" in text
    assert "'remote_protocol': 's3'" in text  # how to open it, for a bucket
    stored = json.loads(refs.read_text())["refs"]
    chunk = stored["run/params/l1/weight/c/3/0/0"]
    assert chunk[0].startswith(f"{s3_url}/steps/"), chunk

    opts = {
        "asynchronous": True,  # zarr's store reads through an async reference file system
        "key": "testing",
        "secret": "testing",
        "client_kwargs": {"endpoint_url": s3_server.endpoint, "region_name": "us-east-1"},
    }
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            READER,
            str(refs),
            json.dumps(list(NAMES.values())),
            json.dumps(opts),
        ],
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
        env=child_env(s3_server),
    )
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)
    assert got["modules"] == [], "the reader must not import dstt or torch"
    run = dstt.open(s3_url)
    assert got["steps"] == [1, 2, 3, 4]
    assert got["loss"] == np.asarray(run.metrics()["loss"].values, dtype=np.float64).tolist()
    for name, path in NAMES.items():
        want = np.ascontiguousarray(run.trajectory(name).values).tobytes()
        assert bytes.fromhex(got[path]) == want, name
