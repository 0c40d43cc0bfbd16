"""Plain readers straight from the bucket, no dstt: zarr-python and xarray through fsspec's
``zip::s3://`` chain (s3fs), tensorstore through its own ``s3`` and ``zip`` kvstores. This is
the recipe docs/object-store.md shows."""

from __future__ import annotations

import numpy as np
import torch

import dstt
from dstt import session

from ._helpers import MLP, mlp_batch, train_step
from .conftest import BUCKET, S3Server


def _one_step_run(url: str) -> np.ndarray:
    m = MLP()
    opt = torch.optim.SGD(m.parameters(), lr=1e-2)
    with session(m, opt, run=url) as s:
        for i in s.data(range(1)):
            train_step(m, opt, *mlp_batch(i))
    return m.l1.weight.detach().numpy().copy()


def test_zarr_xarray_and_tensorstore_read_a_step_from_the_bucket(
    s3_url: str, s3_server: S3Server
) -> None:
    import tensorstore as ts
    import xarray as xr
    import zarr
    from zarr.core.dtype import data_type_registry

    data_type_registry._lazy_load()
    want = _one_step_run(s3_url)
    run = dstt.open(s3_url)
    slot = run.commits()[-1].slot
    key = f"{s3_url.removeprefix(f's3://{BUCKET}/')}/steps/{slot:012d}.zip"
    url = f"s3://{BUCKET}/{key}"
    opts = {
        "key": "testing",
        "secret": "testing",
        "client_kwargs": {"endpoint_url": s3_server.endpoint, "region_name": "us-east-1"},
    }

    store = zarr.storage.FsspecStore.from_url(
        f"zip::{url}", storage_options={"s3": opts}, read_only=True
    )
    root = zarr.open_group(store, mode="r", zarr_format=3)
    assert np.array_equal(root["params/l1/weight"][...], want)
    # xarray's open_datatree finds arrays by listing folders, which fsspec's zip layer does not
    # give zarr for a dstt step (no folder entries): open the array by its path with zarr
    # (above) and wrap it, or read the zip locally (docs/object-store.md)
    da = xr.DataArray(root["params/l1/weight"][...])
    assert np.array_equal(da.values, want)

    spec = {
        "driver": "zarr3",
        "kvstore": {
            "driver": "zip",
            "path": "params/l1/weight/",
            "base": {
                "driver": "s3",
                "bucket": BUCKET,
                "path": key,
                "endpoint": s3_server.endpoint,
                "aws_region": "us-east-1",
            },
        },
    }
    arr = ts.open(spec, read=True).result()
    assert np.array_equal(arr.read().result(), want)
