"""Child processes of the object-store tests (run as ``python -m tests.s3.children <what>``).

``kill URL``: commits steps 1-2 straight to the bucket, then SIGKILLs itself in the middle of
step 3's multipart upload (before its second part), leaving an unfinished upload and a
live lease. ``rank RANK WORLD PORT URL``: one gloo rank of a two-rank run, each rank writing
only its own arrays through ``open_ranks``, rank 0 committing.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

import numpy as np

MiB = 1024 * 1024


def _put_array(txn: Any, path: str, a: np.ndarray) -> None:
    plan = txn.declare(path, a.dtype.name, a.shape)
    flat = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
    for i in range(plan.n_chunks):
        start, stop = plan.byte_range(i)
        txn.put_chunk(path, i, flat[start:stop])


def kill(url: str) -> None:
    from dstt.store import Repository
    from dstt.store.storage.s3 import S3Storage

    repo = Repository.create(url, lease_ttl=5.0, chunk_size=5 * MiB)  # test_s3_run.LEASE_S
    real_part = S3Storage._upload_part
    with repo.writer(chunk_bytes=1 * MiB) as w:
        for step in (1, 2, 3):
            if step == 3:  # from here, the upload dies before its second part

                def dying(self: Any, client: Any, full: str, up: str, f: Any, i: int) -> Any:
                    if i > 0:
                        os.kill(os.getpid(), signal.SIGKILL)
                    print("uploading", flush=True)
                    return real_part(self, client, full, up, f, i)

                S3Storage._upload_part = dying  # type: ignore[method-assign]
            t = w.begin(step)
            _put_array(t, "params/w", np.full(3 * MiB, step, np.float32))  # 12 MiB
            t.commit({"loss": float(step)})
            print("committed", step, flush=True)
    raise SystemExit("not killed")


def rank(rank: int, world: int, port: int, url: str) -> None:
    import torch.distributed as dist

    from dstt.engine.distributed.ranks import dist_info, open_ranks

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        rw, _ = open_ranks(url, dist_info(), resume=False, chunk_bytes=4096, timeout=60)
        try:
            for step in (1, 2, 3):
                t = rw.begin(step)
                _put_array(
                    t,
                    f"zero/r{rank}/flat",
                    np.arange(1000 + rank, dtype=np.float32) * (rank + 1) + step,
                )
                t.put_object(f"rng/r{rank}", {"seed": rank, "step": step})
                t.commit({"loss": float(step)})
        finally:
            rw.close()
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    what, *args = sys.argv[1:]
    if what == "kill":
        kill(args[0])
    else:
        rank(int(args[0]), int(args[1]), int(args[2]), args[3])
