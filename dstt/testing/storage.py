"""A shipped conformance suite for ``dstt.store.Storage`` backends.

Every backend the commit protocol runs on (local files, the in-memory fake, S3) keeps the
contract of ``dstt/store/storage/base.py``: atomic visibility, whole and ranged reads,
folder-like listing and deletion, ``MissingFileError`` for a missing key, blobs invisible
until published, an exclusive writer lock. Subclass :class:`StorageTests` and give it a
``storage`` fixture returning a fresh, empty backend; every test then runs against it.

Modelled on zarr-python's ``zarr.testing.store.StoreTests``. Rejected alternative: each
backend's own contract test — they drift (the S3 and local tests checked different things).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

import pytest

from dstt.errors import MissingFileError, RunLockedError

if TYPE_CHECKING:
    from dstt.store._internal import Storage

__all__ = ["StorageTests"]


class StorageTests:
    """The contract every ``Storage`` keeps (see the module docstring)."""

    @pytest.fixture
    def storage(self) -> Storage:  # pragma: no cover - overridden
        raise NotImplementedError("give StorageTests a `storage` fixture")

    @pytest.fixture
    def second(self, storage: Storage) -> Storage:
        """Another handle on the same backend, for the lock test (default: the same object;
        a backend whose ``supports_locking`` is False is not required to exclude)."""
        return storage

    def test_write_and_read_whole_values_and_parts(self, storage: Storage) -> None:
        storage.write("a/b/c.json", [b"he", memoryview(b"llo")])
        storage.write_durable("a/d", bytearray(b"x"))
        storage.barrier()
        assert storage.read("a/b/c.json") == b"hello"
        assert storage.read("a/d") == b"x"
        assert storage.size("a/b/c.json") == 5

    def test_read_range_and_ranges(self, storage: Storage) -> None:
        storage.write_durable("f", bytes(range(100)))
        storage.write_durable("g", b"0123456789")
        assert storage.read_range("f", 10, 5) == bytes(range(10, 15))
        assert storage.read_ranges([("f", 0, 2), ("g", 3, 4), ("f", 98, 2)]) == [
            bytes([0, 1]),
            b"3456",
            bytes([98, 99]),
        ]

    def test_overwrite_replaces_the_whole_value(self, storage: Storage) -> None:
        storage.write_durable("k", b"a long first value")
        storage.write_durable("k", b"short")
        assert storage.read("k") == b"short"
        assert storage.size("k") == 5

    def test_create_writes_a_new_key_and_never_over_one(self, storage: Storage) -> None:
        storage.create("_dstt/commits/000000000001.json", b"first")
        assert storage.read("_dstt/commits/000000000001.json") == b"first"
        with pytest.raises(RunLockedError, match="another writer"):
            storage.create("_dstt/commits/000000000001.json", b"second")
        assert storage.read("_dstt/commits/000000000001.json") == b"first"

    def test_a_missing_key_is_a_missing_file_error(self, storage: Storage) -> None:
        assert not storage.exists("nope")
        with pytest.raises(MissingFileError):
            storage.read("nope")
        with pytest.raises(FileNotFoundError):
            storage.read("dir/nope")

    def test_list_names_directly_under_a_prefix(self, storage: Storage) -> None:
        for key in ("r/a/1", "r/a/2", "r/b", "r/c/d/e", "other"):
            storage.write_durable(key, b"v")
        assert sorted(storage.list("r")) == ["a", "b", "c"]
        assert sorted(storage.list("r/a")) == ["1", "2"]
        assert sorted(storage.list("")) == ["other", "r"]
        assert list(storage.list("absent")) == []

    def test_delete_a_key_or_a_folder_and_missing_ones_quietly(self, storage: Storage) -> None:
        for key in ("x/1", "x/y/2", "x2", "z"):
            storage.write_durable(key, b"v")
        storage.delete("z")
        assert not storage.exists("z")
        storage.delete("x")  # a folder: everything under it, not its namesake prefix
        assert not storage.exists("x/1")
        assert not storage.exists("x/y/2")
        assert storage.exists("x2")
        storage.delete("never/was")  # no error

    def test_a_blob_is_invisible_until_published(self, storage: Storage) -> None:
        data = bytes(range(256)) * 64
        blob = storage.open_blob("steps/one.zip")
        half = len(data) // 2
        blob.write_at(half, [memoryview(data)[half:]], raw=True)  # out of order, as threads do
        blob.write_at(0, data[:half])
        assert not storage.exists("steps/one.zip")
        blob.publish(durable=True)
        assert storage.read("steps/one.zip") == data
        assert storage.read_range("steps/one.zip", len(data) - 7, 7) == data[-7:]

    def test_a_blob_written_from_threads(self, storage: Storage) -> None:
        parts = [bytes([i]) * 4096 for i in range(16)]
        blob = storage.open_blob("steps/threads.zip")
        threads = [
            threading.Thread(target=blob.write_at, args=(i * 4096, p)) for i, p in enumerate(parts)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        blob.publish()
        storage.barrier()
        assert storage.read("steps/threads.zip") == b"".join(parts)

    def test_a_discarded_blob_leaves_nothing(self, storage: Storage) -> None:
        blob = storage.open_blob("steps/gone.zip")
        blob.write_at(0, b"abc")
        blob.discard()
        blob.discard()  # twice: no error
        assert not storage.exists("steps/gone.zip")

    def test_the_writer_lock_is_exclusive_and_released(
        self, storage: Storage, second: Storage
    ) -> None:
        if not storage.supports_locking:
            pytest.skip(f"{type(storage).__name__} does not claim mutual exclusion")
        with storage.lock("_dstt/lock"), pytest.raises(RunLockedError), second.lock("_dstt/lock"):
            pass
        with second.lock("_dstt/lock"):  # released: the next writer takes it
            pass

    def test_location_names_the_backend(self, storage: Storage) -> None:
        assert isinstance(storage.location, str)
        assert storage.location

    def test_remove_temporaries_leaves_values(self, storage: Storage) -> None:
        storage.write_durable("keep/me", b"v")
        n: Any = storage.remove_temporaries()
        assert isinstance(n, int)
        assert n >= 0
        assert storage.read("keep/me") == b"v"
