"""Child processes of the object-store tests (run as ``python -m tests.s3.children <what>``).

``kill URL``: commits steps 1-2 straight to the bucket, then SIGKILLs itself in the middle of
step 3's multipart upload (after the first part was read), leaving an unfinished upload and a
live lease. ``rank RANK WORLD PORT URL``: one gloo rank of a two-rank run, each rank writing
only its own arrays through ``open_ranks``, rank 0 committing.
"""

from __future__ import annotations

import os
import signal
import sys
from types import SimpleNamespace
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
    import obstore

    from dstt.store import Repository
    from dstt.store.storage import s3_blob

    repo = Repository.create(url, lease_ttl=5.0, chunk_size=5 * MiB)  # test_s3_run.LEASE_S
    real_put = obstore.put
    with repo.writer(chunk_bytes=1 * MiB) as w:
        for step in (1, 2, 3):
            if step == 3:  # from here, the upload dies after reading its first part

                class Dying:
                    def __init__(self, f: Any) -> None:
                        self.f, self.n = f, 0

                    def read(self, n: int = -1) -> bytes:
                        if self.n > 0:
                            os.kill(os.getpid(), signal.SIGKILL)
                        data = self.f.read(n)
                        self.n += len(data)
                        return bytes(data)

                    def __getattr__(self, name: str) -> Any:
                        return getattr(self.f, name)

                def put(store: Any, key: str, f: Any, **kw: Any) -> Any:
                    if kw.get("use_multipart"):
                        print("uploading", flush=True)
                        f = Dying(f)
                    return real_put(store, key, f, **kw)

                s3_blob.obstore = SimpleNamespace(  # type: ignore[assignment]
                    **{
                        n: getattr(obstore, n)
                        for n in (
                            "get",
                            "get_range",
                            "head",
                            "list",
                            "list_with_delimiter",
                            "delete",
                        )
                    },
                    put=put,
                )
            t = w.begin(step)
            _put_array(t, "params/w", np.full(3 * MiB, step, np.float32))  # 12 MiB
            t.commit({"loss": float(step)})
            print("committed", step, flush=True)
    raise SystemExit("not killed")


def rank(rank: int, world: int, port: int, url: str) -> None:
    import torch.distributed as dist

    from dstt.engine.ranks import dist_info, open_ranks

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
