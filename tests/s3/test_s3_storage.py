"""``S3Storage`` against the loopback S3 server: the storage contract, the lease and the
compare-and-swap refs that replace ``flock`` and ``rename`` on an object store."""

from __future__ import annotations

import os
import pickle
import time

import pytest

from dstt.errors import MissingFileError, NotARunError, RunLockedError
from dstt.store import LocalStorage, Repository, Storage, storage_for
from dstt.store.format.layout import HEAD_KEY, LOCK_KEY, STEPS_PREFIX, ref_key, step_file_key
from dstt.store.format.manifest import dump_head
from dstt.store.storage.s3 import DEFAULT_GUARDED, S3Storage
from dstt.testing.storage import StorageTests

from .conftest import S3Server


def test_storage_for_parses_urls_and_paths(s3_url: str, tmp_path: os.PathLike[str]) -> None:
    st = storage_for(s3_url)
    assert isinstance(st, S3Storage)
    assert st.location == s3_url
    assert isinstance(storage_for(tmp_path), LocalStorage)


def test_guarded_keys_are_the_formats_refs_and_head() -> None:
    st = S3Storage("s3://b/p", endpoint="http://127.0.0.1:1", allow_http=True)
    assert st._is_guarded(ref_key("main"))
    assert st._is_guarded(HEAD_KEY)
    assert st._is_guarded(ref_key("main-from-3"))
    assert not st._is_guarded("steps/000000000001.zip")
    assert not st._is_guarded(LOCK_KEY)
    assert (ref_key("x")[: -len("x.json")], HEAD_KEY) == DEFAULT_GUARDED


def test_contract_read_write_list_delete(s3_url: str) -> None:
    st = storage_for(s3_url)
    st.write("a/b/c.json", [b"he", memoryview(b"llo")])
    st.write_durable("a/d", b"x")
    st.barrier()
    assert st.read("a/b/c.json") == b"hello"
    assert st.read_range("a/b/c.json", 1, 3) == b"ell"
    assert st.read_ranges([("a/b/c.json", 0, 2), ("a/d", 0, 1), ("a/b/c.json", 3, 2)]) == [
        b"he",
        b"x",
        b"lo",
    ]
    assert st.size("a/b/c.json") == 5
    assert st.exists("a/d")
    assert not st.exists("a/zz")
    assert list(st.list("a")) == ["b", "d"]
    assert list(st.list("")) == ["a"]
    assert list(st.list("nothing")) == []
    with pytest.raises(MissingFileError):
        st.read("a/zz")
    st.delete("a/b")  # a folder: everything under it
    assert not st.exists("a/b/c.json")
    assert st.exists("a/d")
    st.delete("a/missing")  # no error


def test_blob_is_invisible_until_published_and_goes_up_multipart(s3_url: str) -> None:
    st = storage_for(s3_url, chunk_size=5 * 1024 * 1024)
    size = 11 * 1024 * 1024 + 7
    data = os.urandom(size)
    blob = st.open_blob("steps/big.zip")
    half = size // 2
    blob.write_at(half, [memoryview(data)[half:]], raw=True)  # out of order, like the threads
    blob.write_at(0, data[:half])
    assert not st.exists("steps/big.zip")
    blob.publish(durable=True)
    assert st.read("steps/big.zip") == data
    assert st.read_range("steps/big.zip", size - 10, 10) == data[-10:]
    small = st.open_blob("steps/small.zip")
    small.write_at(0, b"abc")
    small.discard()
    assert not st.exists("steps/small.zip")


def test_a_second_lease_is_refused_and_released_ones_are_taken(s3_url: str) -> None:
    a, b = storage_for(s3_url), storage_for(s3_url)
    with (
        a.lock(LOCK_KEY),
        pytest.raises(RunLockedError, match="locked by another writer"),
        b.lock(LOCK_KEY),
    ):
        pass
    with b.lock(LOCK_KEY):  # released: taken at once
        pass


def test_an_expired_lease_is_taken_over_and_its_holder_writes_nothing(s3_url: str) -> None:
    a = storage_for(s3_url, lease_ttl=1.0)
    b = storage_for(s3_url, lease_ttl=1.0)
    a.write(ref_key("main"), b"v0")
    cm = a.lock(LOCK_KEY)
    cm.__enter__()
    lease = a._lease
    assert lease is not None
    lease._stop.set()  # a frozen writer: its heartbeat stops
    lease._thread.join()  # type: ignore[union-attr]
    time.sleep(1.2)
    with b.lock(LOCK_KEY):  # expired: b takes it over
        assert b.read(ref_key("main")) == b"v0"
        with pytest.raises(RunLockedError, match="lost its lease"):
            a.write(ref_key("main"), b"zombie")
        b.write(ref_key("main"), b"v1")
    cm.__exit__(None, None, None)
    assert b.read(ref_key("main")) == b"v1"


def test_ref_writes_are_compare_and_swap(s3_url: str) -> None:
    a, b = storage_for(s3_url), storage_for(s3_url)
    a.write(HEAD_KEY, b"1")  # unseen: created
    assert b.read(HEAD_KEY) == b"1"
    a.write(HEAD_KEY, b"2")  # a saw its own write
    with pytest.raises(RunLockedError, match="changed by another writer"):
        b.write(HEAD_KEY, b"stale")  # b's view is stale: refused, nothing overwritten
    assert a.read(HEAD_KEY) == b"2"
    c = storage_for(s3_url)
    with pytest.raises(RunLockedError):
        c.write(HEAD_KEY, b"blind")  # never read it: create-only, and it exists
    b.read(HEAD_KEY)
    b.write(HEAD_KEY, b"3")
    assert a.read(HEAD_KEY) == b"3"


def test_pickles_as_its_description(s3_url: str, s3_server: S3Server) -> None:
    st = storage_for(s3_url, **s3_server.options)
    st.write("k", b"v")
    again = pickle.loads(pickle.dumps(st))
    assert isinstance(again, S3Storage)
    assert again.read("k") == b"v"
    assert again._lease is None
    assert again.options == st.options


def test_gc_aborts_leftover_multipart_uploads(s3_url: str, s3_server: S3Server) -> None:
    st = storage_for(s3_url)
    assert isinstance(st, S3Storage)
    key = f"{st.prefix}/steps/000000000009.zip"
    s3_server.boto().create_multipart_upload(Bucket=st.bucket, Key=key)
    assert st.multipart_uploads() == ("steps/000000000009.zip",)
    with st.lock(LOCK_KEY):
        assert st.remove_temporaries() == 1
    assert st.multipart_uploads() == ()


def test_a_missing_bucket_is_a_clear_error_at_create(s3_env: S3Server) -> None:
    with pytest.raises(NotARunError, match=r"bucket 'no-such-bucket' .* does not exist"):
        Repository.create("s3://no-such-bucket/run")
    with pytest.raises(NotARunError, match=r"no zarr\.json"):
        Repository.open("s3://no-such-bucket/run")


def test_the_lease_holder_finishes_an_interrupted_create(s3_url: str) -> None:
    storage_for(s3_url).write(HEAD_KEY, dump_head("main"))  # cut after HEAD, before zarr.json
    repo = Repository.create(s3_url)  # a fresh process: it never read HEAD, but holds the lease
    assert repo.reader().current_timeline == "main"
    assert repo.verify().ok


class TestS3StorageConformance(StorageTests):
    """The shipped ``Storage`` conformance suite against S3 (moto on loopback)."""

    @pytest.fixture
    def storage(self, s3_url: str) -> Storage:
        return storage_for(s3_url)

    @pytest.fixture
    def second(self, storage: Storage, s3_url: str) -> Storage:
        return storage_for(s3_url)  # another client: another lease holder


def test_step_files_are_create_only(s3_url: str) -> None:
    a, b = storage_for(s3_url), storage_for(s3_url)
    key = step_file_key(3)
    blob = a.open_blob(key)
    blob.write_at(0, b"a's step")
    blob.publish()
    blob = b.open_blob(key)
    blob.write_at(0, b"b's step")
    with pytest.raises(RunLockedError, match="already written by another writer"):
        blob.publish()
    assert b.read(key) == b"a's step"
    again = a.open_blob(key)  # the same bytes again: a PUT retried after a lost reply
    again.write_at(0, b"a's step")
    again.publish()
    other = "_dstt/other.json"
    a.write(other, b"1")
    b.write(other, b"2")  # not a write-once key: overwritten as before
    assert a.read(other) == b"2"


def test_a_multipart_step_file_is_create_only(s3_url: str) -> None:
    """A step file of several parts is completed with ``If-None-Match: *``: over another
    writer's object the upload is aborted (no unfinished upload left) and nothing is
    overwritten; the step file goes up whole where the key is free."""
    st = storage_for(s3_url, chunk_size=5 * 1024 * 1024)
    key = f"{STEPS_PREFIX}/000000000001.zip"
    theirs = os.urandom(64)
    st.write(key, theirs)  # the new lease holder's committed step file
    blob = st.open_blob(key)
    blob.write_at(0, os.urandom(11 * 1024 * 1024))
    with pytest.raises(RunLockedError, match="already written by another writer"):
        blob.publish(durable=True)
    assert st.read(key) == theirs
    assert st.multipart_uploads() == ()
    free = f"{STEPS_PREFIX}/000000000002.zip"
    data = os.urandom(11 * 1024 * 1024 + 3)
    blob = st.open_blob(free)
    blob.write_at(0, data)
    blob.publish(durable=True)
    assert st.read(free) == data
