"""The memory fake's crash model: what a barrier covers in each durability mode, per handle.

``MemoryStorage`` is what every power-cut test stands on, so its model is tested on its own:
``"syncfs"`` (the default, unchanged) makes every pending write durable at any barrier;
``"fsync"`` only the writes of the handle that calls it — a rank's own files.
"""

from __future__ import annotations

import pytest

from dstt.store.storage.memory import MemoryStorage


def test_syncfs_mode_a_barrier_covers_every_handles_writes() -> None:
    mem = MemoryStorage()
    assert mem.durability == "syncfs"
    other = mem.handle()
    mem.write("a", b"1")
    other.write("b", b"2")
    assert mem.pending() == ["a", "b"]
    assert mem.crash().data == {}  # nothing durable yet
    other.barrier()  # one syncfs: the whole filesystem
    assert mem.pending() == []
    assert mem.crash().data == {"a": b"1", "b": b"2"}


def test_fsync_mode_a_barrier_covers_only_its_own_handles_writes() -> None:
    mem = MemoryStorage("fsync")
    rank1, rank2 = mem.handle(), mem.handle()
    mem.write("r0", b"0")
    rank1.write("r1", b"1")
    rank2.write("r2", b"2")
    assert rank1.read("r2") == b"2"
    assert rank2.exists("r0")  # one namespace, visible to all
    rank1.barrier()
    assert mem.crash().data == {"r1": b"1"}
    assert mem.pending() == ["r0", "r2"]
    mem.barrier()
    assert mem.crash().data == {"r0": b"0", "r1": b"1"}
    rank2.write_durable("v", b"vote")  # durable at once, whoever writes it
    assert mem.crash().data == {"r0": b"0", "r1": b"1", "v": b"vote"}
    assert mem.crash().durability == "fsync"  # the crashed copy keeps the mode


def test_deletes_are_durable_at_once_and_handles_share_locks() -> None:
    from dstt.errors import RunLockedError

    mem = MemoryStorage("fsync")
    h = mem.handle()
    mem.write_durable("d/x", b"x")
    h.delete("d")
    assert mem.crash().data == {}
    assert not mem.exists("d/x")
    with mem.lock("lock"), pytest.raises(RunLockedError), h.lock("lock"):
        pass


def test_crash_keeps_the_pending_writes_the_page_cache_wrote_back() -> None:
    mem = MemoryStorage("fsync")
    h = mem.handle()
    mem.write("a", b"1")
    h.write("b", b"2")
    h.write("c", b"3")
    asked: list[str] = []

    def written_back(key: str) -> bool:
        asked.append(key)
        return key != "b"

    assert mem.crash(written_back).data == {"a": b"1", "c": b"3"}
    assert asked == ["a", "b", "c"]  # each pending key once, in key order


def test_unknown_durability_is_refused() -> None:
    with pytest.raises(ValueError, match="'syncfs' or 'fsync'"):
        MemoryStorage("none")  # type: ignore[arg-type]
