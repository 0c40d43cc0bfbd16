"""Analysis past one process: dask arrays over a run in the bucket, computed on a
``dask.distributed.LocalCluster`` of two worker processes. The graph carries the storage's
description (URL and options), never an open handle, and each task reads its own steps'
chunks (byte ranges) from the bucket."""

from __future__ import annotations

import pickle

import numpy as np
import torch

import dstt
from dstt import session

from ._helpers import MLP, mlp_batch, train_step
from .conftest import S3Server


def test_trajectory_computes_on_a_two_worker_cluster(s3_url: str, s3_server: S3Server) -> None:
    from dask.distributed import Client, LocalCluster

    m = MLP()
    opt = torch.optim.SGD(m.parameters(), lr=1e-2)
    want = []
    with session(m, opt, run=s3_url) as s:
        for i in s.data(range(8)):
            train_step(m, opt, *mlp_batch(i))
            want.append(m.l1.weight.detach().clone().numpy())
    # explicit options (not the environment) so the workers need no AWS variables
    run = dstt.open(s3_url, storage_options=s3_server.options)
    traj = run.trajectory("l1.weight", chunks={"step": 2})
    assert traj.chunks is not None
    assert len(traj.chunks[0]) == 4  # 8 steps, 2 per task
    graph = dict(traj.data.__dask_graph__())
    assert b"http://127.0.0.1" in pickle.dumps(graph)  # the description travels, not handles
    with (
        LocalCluster(
            n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None
        ) as cluster,
        Client(cluster) as client,
    ):
        got = traj.data.compute(scheduler=client)
        workers = set(client.run(lambda: 1))
        assert len(workers) == 2
        mean = float(traj.mean().compute(scheduler=client))
        sums = run.summaries(chunks={"step": 4})
        plain = run.summaries()
        assert sums.sizes["step"] == 8
        assert sums.chunks
        assert plain.chunks == {}
        assert sums.compute(scheduler=client).equals(plain)
    assert np.array_equal(got, np.stack(want))
    assert np.isclose(mean, np.stack(want).mean())
