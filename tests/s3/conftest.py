"""A real S3-API server on loopback for the object-store tests: moto's server mode, started once
per test session as a subprocess on a free port and stopped at the end.

moto (5.1+) implements the conditional writes the commit protocol needs (``If-None-Match: *``
and ``If-Match`` on PutObject) and multipart uploads, so the tests run the real protocol over
real HTTP. Each test gets a fresh ``s3://dstt-test/<random>`` prefix; the bucket is shared.
"""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

BUCKET = "dstt-test"


@dataclass(frozen=True)
class S3Server:
    endpoint: str
    env: dict[str, str]

    @property
    def options(self) -> dict[str, Any]:
        """Explicit ``storage_options`` naming this server (no environment needed)."""
        return {
            "endpoint": self.endpoint,
            "access_key_id": "testing",
            "secret_access_key": "testing",
            "region": "us-east-1",
            "allow_http": True,
        }

    def boto(self) -> Any:
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
            region_name="us-east-1",
        )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    port = _free_port()
    endpoint = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=1).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the moto S3 server did not start") from None
                time.sleep(0.1)
        env = {
            "AWS_ENDPOINT_URL": endpoint,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_REGION": "us-east-1",
            "AWS_ALLOW_HTTP": "true",
        }
        server = S3Server(endpoint, env)
        server.boto().create_bucket(Bucket=BUCKET)
        yield server
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture
def s3_env(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> S3Server:
    """The standard AWS variables point at the loopback server for this test."""
    for k, v in s3_server.env.items():
        monkeypatch.setenv(k, v)
    return s3_server


@pytest.fixture
def s3_url(s3_env: S3Server) -> str:
    """A fresh, empty run URL in the test bucket."""
    return f"s3://{BUCKET}/{secrets.token_hex(6)}/run"


def child_env(server: S3Server) -> dict[str, str]:
    return {**os.environ, **server.env}
