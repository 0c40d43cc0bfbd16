"""Every local backend keeps the ``Storage`` contract: the shipped conformance suite
(``dstt.testing.storage.StorageTests``) against local files (both durability modes), the
in-memory fake and a fault-injecting wrapper that injects nothing. S3 runs the same suite in
``tests/s3/test_s3_storage.py``."""

from __future__ import annotations

from pathlib import Path

import pytest

from dstt.store import LocalStorage, Storage
from dstt.store.storage.memory import FaultyStorage, MemoryStorage
from dstt.testing.storage import StorageTests


class TestLocalStorage(StorageTests):
    @pytest.fixture(params=["fsync", "syncfs"])
    def storage(self, request: pytest.FixtureRequest, tmp_path: Path) -> Storage:
        return LocalStorage(tmp_path / "run", durability=request.param, create=True)

    @pytest.fixture
    def second(self, storage: Storage) -> Storage:
        return LocalStorage(Path(storage.location))  # another handle: another lock holder


class TestMemoryStorage(StorageTests):
    @pytest.fixture
    def storage(self) -> Storage:
        return MemoryStorage()


class TestFaultyStorageWithoutFaults(StorageTests):
    @pytest.fixture
    def storage(self) -> Storage:
        return FaultyStorage(MemoryStorage())
