"""Per-step commit cost on a local S3-API server (moto, loopback) against the local disk, at the
same workload; and obstore against s3fs for the two operations a commit does (small PUTs and one
multipart upload per step file), which is why the backend uses obstore.

    .venv/bin/python bench/s3_bench.py [--mib-per-step 32] [--steps 8] [--out bench/results/s3.json]

moto is a Python server: its numbers bound dstt's own per-step overhead on an object store from
above (a real S3 or MinIO endpoint is faster per request and slower per round trip).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import MiB, source_state

from dstt.store import Repository


def _server() -> tuple[subprocess.Popen[bytes], str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            urllib.request.urlopen(f"{url}/moto-api/", timeout=1).close()
            return proc, url
        except OSError:
            time.sleep(0.1)
    raise RuntimeError("moto did not start")


def _commit_steps(run: Any, steps: int, mib: int, **opts: Any) -> list[float]:
    repo = Repository.create(run, **opts)
    rng = np.random.default_rng(0)
    arrays = {
        f"params/l{i}/w": rng.standard_normal(mib * MiB // 8 // 4, dtype=np.float32)
        for i in range(8)
    }
    times = []
    with repo.writer(chunk_bytes=4 * MiB) as w:
        for step in range(1, steps + 1):
            t0 = time.perf_counter()
            txn = w.begin(step)
            for path, a in arrays.items():
                plan = txn.declare(path, "float32", a.shape)
                flat = a.view(np.uint8)
                for i in range(plan.n_chunks):
                    s, e = plan.byte_range(i)
                    txn.put_chunk(path, i, flat[s:e])
            txn.commit({"loss": 1.0})
            times.append(time.perf_counter() - t0)
    return times


def _clients(endpoint: str, mib: int) -> dict[str, float]:
    import io

    import obstore
    import s3fs
    from obstore.store import S3Store

    store = S3Store(
        "bench",
        endpoint=endpoint,
        access_key_id="x",
        secret_access_key="x",
        region="us-east-1",
        client_options={"allow_http": True},
    )
    fs = s3fs.S3FileSystem(
        key="x", secret="x", client_kwargs={"endpoint_url": endpoint, "region_name": "us-east-1"}
    )
    big = os.urandom(mib * MiB)
    out: dict[str, float] = {}
    t0 = time.perf_counter()
    for i in range(50):
        obstore.put(store, f"o/small{i}", b"x" * 300)
    out["obstore_small_put_ms"] = (time.perf_counter() - t0) / 50 * 1e3
    t0 = time.perf_counter()
    for i in range(50):
        fs.pipe_file(f"bench/f/small{i}", b"x" * 300)
    out["s3fs_small_put_ms"] = (time.perf_counter() - t0) / 50 * 1e3
    t0 = time.perf_counter()
    obstore.put(store, "o/big", io.BytesIO(big), use_multipart=True, chunk_size=16 * MiB)
    out["obstore_multipart_MBps"] = len(big) / MiB / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    with fs.open("bench/f/big", "wb", block_size=16 * MiB) as f:
        f.write(big)
    out["s3fs_multipart_MBps"] = len(big) / MiB / (time.perf_counter() - t0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib-per-step", type=int, default=32)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    proc, endpoint = _server()
    try:
        import boto3

        boto3.client(
            "s3",
            endpoint_url=endpoint,
            aws_access_key_id="x",
            aws_secret_access_key="x",
            region_name="us-east-1",
        ).create_bucket(Bucket="bench")
        s3 = _commit_steps(
            f"s3://bench/{secrets.token_hex(4)}",
            a.steps,
            a.mib_per_step,
            endpoint=endpoint,
            access_key_id="x",
            secret_access_key="x",
            allow_http=True,
        )
        with tempfile.TemporaryDirectory() as d:
            local = _commit_steps(Path(d) / "run", a.steps, a.mib_per_step)
        clients = _clients(endpoint, a.mib_per_step)
    finally:
        proc.terminate()
        proc.wait()
    res = {
        "mib_per_step": a.mib_per_step,
        "steps": a.steps,
        "s3_step_ms_median": float(np.median(s3[1:]) * 1e3),
        "local_step_ms_median": float(np.median(local[1:]) * 1e3),
        **clients,
        **source_state(),
    }
    print(json.dumps(res, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
