"""A run: its root metadata, writer, reader, timelines (rollback) and retention (gc).

``Repository`` is the store's front door. Creating a run writes the root group (with
``attributes.dstt``), the ``step`` coordinate array, the ``main`` ref and ``HEAD`` — all
durably — so an empty run is already a valid Zarr hierarchy and a valid dstt run.
Vocabulary after icechunk: a *timeline* is a branch (a ref with a head slot); rollback creates
a new timeline whose head is an old commit and makes it current; nothing is deleted.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable, Iterator
from typing import Any

from ..errors import FormatVersionError, NotARunError, TimelineError
from .backend import LocalStorage, Storage
from .layout import (
    FORMAT_VERSION,
    HEAD_KEY,
    LOCK_KEY,
    STEP_ARRAY,
    array_meta_key,
    check_timeline_name,
    group_meta_key,
    ref_key,
)
from .manifest import RefInfo, dump_head, dump_ref
from .reader import Reader
from .writer import Writer
from .zarr_meta import dump, group_document, root_attributes

__all__ = ["Repository"]

INITIAL_CAPACITY = 64
MAIN = "main"


class Repository:
    """One run directory (or any ``Storage``)."""

    def __init__(self, storage: Storage) -> None:
        self.storage = storage

    # -- construction ---------------------------------------------------------------------
    @classmethod
    def open(cls, path: str | os.PathLike[str] | Storage) -> Repository:
        """Open an existing run; ``NotARunError`` if ``path`` is not one."""
        storage = path if isinstance(path, Storage) else LocalStorage(path)
        repo = cls(storage)
        repo.root_attributes()  # validates
        return repo

    @classmethod
    def create(cls, path: str | os.PathLike[str] | Storage, **storage_options: Any) -> Repository:
        """Open a run for writing, creating it if needed."""
        storage = (path if isinstance(path, Storage)
                   else LocalStorage(path, create=True, **storage_options))
        repo = cls(storage)
        if storage.exists("zarr.json"):
            repo.root_attributes()
            return repo
        storage.check_writable()
        if not _empty_or_interrupted_create(storage):  # before the lock file is made
            raise NotARunError(
                f"{storage.location} exists and is not empty but is not a dstt run; "
                "choose an empty or new directory"
            )
        with storage.lock(LOCK_KEY):
            if storage.exists("zarr.json"):
                return repo
            if not _empty_or_interrupted_create(storage):
                raise NotARunError(
                    f"{storage.location} exists and is not empty but is not a dstt run; "
                    "choose an empty or new directory"
                )
            storage.write(group_meta_key(STEP_ARRAY), dump(_step_document(INITIAL_CAPACITY)))
            # an empty group document keeps zarr from warning about the _dstt folder
            storage.write(group_meta_key("_dstt"), dump(group_document()))
            storage.write_durable(ref_key(MAIN), dump_ref(RefInfo(MAIN, None, created=time.time())))
            storage.write_durable(HEAD_KEY, dump_head(MAIN))
            storage.barrier()
            # the root zarr.json goes last: its presence marks a complete, openable run
            repo.write_root(INITIAL_CAPACITY, durable=True)
        return repo

    # -- root metadata --------------------------------------------------------------------
    def root_attributes(self) -> dict[str, Any]:
        st = self.storage
        try:
            doc = json.loads(st.read("zarr.json"))
        except FileNotFoundError:
            raise NotARunError(f"{st.location} is not a dstt run (no zarr.json)") from None
        except ValueError:
            raise NotARunError(f"{st.location}/zarr.json is not valid JSON") from None
        attrs = doc.get("attributes", {}).get("dstt") if isinstance(doc, dict) else None
        if not isinstance(attrs, dict):
            raise NotARunError(
                f"{st.location} is a Zarr group but not a dstt run (no attributes.dstt)"
            )
        if attrs.get("format") != FORMAT_VERSION:
            raise FormatVersionError(
                f"{st.location}/zarr.json: dstt format {attrs.get('format')!r}; this dstt "
                f"reads format {FORMAT_VERSION}"
            )
        return attrs

    def slot_capacity(self) -> int:
        return int(self.root_attributes()["slot_capacity"])

    def write_root(self, capacity: int, *, durable: bool) -> None:
        doc = dump(group_document(root_attributes(capacity)))
        step_doc = dump(_step_document(capacity))
        if durable:
            self.storage.write_durable(group_meta_key(STEP_ARRAY), step_doc)
            self.storage.write_durable("zarr.json", doc)
        else:
            self.storage.write(group_meta_key(STEP_ARRAY), step_doc)
            self.storage.write("zarr.json", doc)

    def array_document(self, path: str) -> dict[str, Any] | None:
        try:
            doc = json.loads(self.storage.read(array_meta_key(path)))
        except FileNotFoundError:
            return None
        if doc.get("node_type") != "array":
            raise ValueError(f"{path!r} is a group in this run, not an array")
        return doc  # type: ignore[no-any-return]

    def iter_array_documents(self, prefix: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
        """Every tensor array of the run (the ``step`` coordinate excluded)."""
        for name in self.storage.list(prefix):
            if name in ("zarr.json", "_dstt", STEP_ARRAY) and not prefix:
                continue
            if name == "zarr.json" or name.startswith("c."):
                continue
            path = f"{prefix}/{name}" if prefix else name
            try:
                doc = json.loads(self.storage.read(group_meta_key(path)))
            except FileNotFoundError:
                continue
            if doc.get("node_type") == "array":
                yield path, doc
            else:
                yield from self.iter_array_documents(path)

    # -- access ---------------------------------------------------------------------------
    def reader(self) -> Reader:
        return Reader(self.storage)

    def writer(self, **options: Any) -> Writer:
        """The run's exclusive writer (``RunLockedError`` if another process holds it)."""
        return Writer(self, **options)

    # -- timelines ------------------------------------------------------------------------
    def rollback(self, to_step: int, *, skip_data: int = 0, timeline: str | None = None,
                 name: str | None = None) -> RefInfo:
        """Start a new timeline at ``to_step`` of ``timeline`` (default current); make it current.

        Nothing is deleted: the old timeline keeps its head and stays inspectable.
        """
        if skip_data < 0:
            raise ValueError(f"skip_data must be >= 0, got {skip_data}")
        with self.storage.lock(LOCK_KEY):
            r = self.reader()
            base_name = timeline or r.current_timeline
            base = r.find(to_step, base_name)
            new = name if name is not None else _fresh_name(
                f"{base_name.split('@')[0]}-from-{to_step}", r.timelines)
            check_timeline_name(new)
            if new in r.timelines:
                raise TimelineError(f"timeline {new!r} already exists; pick another name")
            ref = RefInfo(new, base.slot, base_slot=base.slot, base_step=base.step,
                          base_timeline=base_name, skip_data=skip_data, created=time.time())
            self.storage.write_durable(ref_key(new), dump_ref(ref))
            self.storage.write_durable(HEAD_KEY, dump_head(new))
            return ref

    def switch(self, timeline: str) -> None:
        """Make an existing timeline current (the next resume continues it)."""
        with self.storage.lock(LOCK_KEY):
            self.reader().ref(timeline)
            self.storage.write_durable(HEAD_KEY, dump_head(timeline))

    # -- maintenance (implemented in maintenance.py) --------------------------------------
    def gc(self, *, keep_last: int | None = None, keep_every: int | None = None,
           keep_steps: Iterable[int] = (), dry_run: bool = False,
           progress: Any = None) -> Any:
        from .maintenance import gc

        return gc(self, keep_last=keep_last, keep_every=keep_every, keep_steps=keep_steps,
                  dry_run=dry_run, progress=progress)

    def verify(self, *, progress: Any = None) -> Any:
        from .maintenance import verify

        return verify(self, progress=progress)


def _empty_or_interrupted_create(storage: Storage) -> bool:
    """Whether the location holds nothing but what an interrupted ``create`` leaves behind.

    ``create`` writes ``step/zarr.json`` and ``_dstt/`` before the root ``zarr.json``; a crash in
    between must not make the directory unusable forever.
    """
    for n in storage.list(""):
        if n.startswith(".") or n == "_dstt":
            continue
        if n == STEP_ARRAY and set(storage.list(STEP_ARRAY)) <= {"zarr.json"}:
            continue
        return False
    return True


def _fresh_name(base: str, taken: dict[str, RefInfo]) -> str:
    if base not in taken:
        return base
    i = 2
    while f"{base}.{i}" in taken:
        i += 1
    return f"{base}.{i}"


def _step_document(capacity: int) -> dict[str, Any]:
    return {
        "zarr_format": 3,
        "node_type": "array",
        "shape": [capacity],
        "data_type": "int64",
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [1]}},
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": "."}},
        "fill_value": -1,
        "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}],
        "attributes": {"dstt": {"format": FORMAT_VERSION,
                                "description": "training step held by each slot; -1 = none"}},
        "dimension_names": ["slot"],
    }

