"""The single-writer lease of an ``S3Storage``: the run's lock as a JSON object under the lock key.

It is created with ``If-None-Match: *`` and renewed by a heartbeat thread with ``If-Match: <its
ETag>`` every ``lease_ttl / 3``; an expired lease (a writer that was SIGKILLed) is taken over
with ``If-Match`` on the ETag the taker read, so of two takers exactly one wins. A writer whose
heartbeat is refused, or that has not renewed within ``lease_ttl`` (measured on its own
monotonic clock, a tenth of the TTL kept as margin for clock skew), refuses every further write.
Release writes an expired record rather than deleting the object: a delete is unconditional and
could remove a lease another writer took over after ours lapsed. Rejected alternative: a lock
without expiry — a SIGKILLed writer would lock the run forever.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import socket
import threading
import time
from typing import Any, Protocol

import obstore
from obstore.exceptions import AlreadyExistsError, PreconditionError

from dstt.errors import RunLockedError

from .s3_config import _is_missing


class LeaseOwner(Protocol):
    """What the lease needs of its ``S3Storage`` (``s3.py``, which imports this module: a
    protocol, not the class)."""

    store: Any
    location: str
    lease_ttl: float


class _S3Lease:
    """The single-writer lease: a JSON object under the lock key (see the module docstring)."""

    def __init__(self, storage: LeaseOwner, key: str) -> None:
        self.storage, self.key = storage, key
        self.ttl = storage.lease_ttl
        self.owner = secrets.token_hex(8)
        self.etag: str | None = None
        self.valid_until = 0.0
        self.lost = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._mu = threading.Lock()

    def _put(self, mode: Any, expires: float | None = None) -> None:  # noqa: ANN401 - obstore's put mode
        t0 = time.monotonic()
        record = {
            "owner": self.owner,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "expires": time.time() + self.ttl if expires is None else expires,
            "ttl": self.ttl,
        }
        res = obstore.put(self.storage.store, self.key, json.dumps(record).encode(), mode=mode)
        with self._mu:
            self.etag = str(res["e_tag"])
            self.valid_until = t0 + 0.9 * self.ttl

    def acquire(self) -> None:
        st = self.storage
        for _ in range(3):
            try:
                self._put("create")
                break
            except AlreadyExistsError:
                pass
            try:
                got = obstore.get(st.store, self.key)
                etag, body = str(got.meta["e_tag"]), bytes(got.bytes())
            except Exception as e:
                if _is_missing(e):
                    continue  # deleted meanwhile: try creating it again
                raise
            try:
                held = json.loads(body)
                expires = float(held.get("expires", 0))
            except (ValueError, TypeError, AttributeError):
                held, expires = {}, 0.0
            if expires > time.time():
                raise RunLockedError(
                    f"run {st.location} is locked by another writer (pid={held.get('pid')} "
                    f"host={held.get('host')}; its lease expires in "
                    f"{expires - time.time():.0f} s unless renewed); stop that process or open "
                    "the run read-only with dstt.open()"
                )
            try:  # expired: take it over; of two takers only one matches the ETag
                self._put({"e_tag": etag})
                break
            except PreconditionError:
                continue
        else:
            raise RunLockedError(
                f"run {st.location}: another writer took the lease at the same time; retry"
            )
        self._thread = threading.Thread(target=self._beat, name="dstt-lease", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(self.ttl / 3):
            with self._mu:
                etag = self.etag
            try:
                self._put({"e_tag": etag})
            except PreconditionError:
                self.lost = True  # another process took it over: we must not write again
                return
            except Exception:  # a network error: retry; the lease lapses if it persists
                continue

    def check(self) -> None:
        if self.lost or time.monotonic() > self.valid_until:
            raise RunLockedError(
                f"this writer lost its lease on {self.storage.location} (not renewed within "
                f"{self.ttl:.0f} s, or taken over by another writer); it writes nothing more — "
                "reopen the run to continue"
            )

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self.lost:
            return
        with self._mu:
            etag = self.etag
        # an expired record (not a delete): a delete is unconditional and could remove a lease
        # another writer took over after ours lapsed
        with contextlib.suppress(Exception):
            self._put({"e_tag": etag}, expires=0.0)
