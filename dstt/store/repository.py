"""A run: its root metadata, writer, reader, timelines (rollback) and retention (gc).

``Repository`` is the store's front door. Creating a run durably writes the root group, the
``step`` coordinate, the ``main`` ref and ``HEAD``, so an empty run is already a valid Zarr
hierarchy and dstt run. A *timeline* is a branch (icechunk's vocabulary); rollback creates one
whose head is an old commit (default ``<timeline>-from-<step>``) and deletes nothing. Renaming
and deleting: ``maintenance/timelines.py``. The writer, gc, verify and the index rebuild are
imported where used, so opening a run to read it loads only the reader.

Rejected alternative: a silent ``.2`` suffix for a second rollback to the same step — it told
two attempts apart by nothing; that is a ``TimelineError`` asking for a name.
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any

from dstt.errors import DsttError, FormatVersionError, NotARunError, TimelineError

from .format.layout import (
    FORMAT_VERSION,
    HEAD_KEY,
    LOCK_KEY,
    WRITTEN_PREFIXES,
    check_timeline_name,
    group_meta_key,
    ref_key,
)
from .format.manifest import dump_head, dump_ref
from .format.records import RefInfo
from .format.zarr_meta import dump, group_document, root_attributes
from .read.reader import Reader
from .storage.base import Storage
from .storage.urls import storage_for

if TYPE_CHECKING:
    import os
    from collections.abc import Callable, Iterable

    from .commit.writer import Writer
    from .maintenance.gc import GcReport
    from .maintenance.retention import Retention
    from .maintenance.timelines import DeleteReport
    from .maintenance.verify import VerifyReport

__all__ = ["Repository"]

MAIN = "main"


class Repository:
    """One run directory (or any ``Storage``)."""

    def __init__(self, storage: Storage) -> None:
        self.storage = storage

    # -- construction ---------------------------------------------------------------------
    @classmethod
    def open(cls, path: str | os.PathLike[str] | Storage, **storage_options: Any) -> Repository:
        """Open an existing run (a folder or ``s3://bucket/prefix``); ``NotARunError`` if
        ``path`` is not one."""
        storage = path if isinstance(path, Storage) else storage_for(path, **storage_options)
        repo = cls(storage)
        repo.root_attributes()  # validates
        return repo

    @classmethod
    def create(cls, path: str | os.PathLike[str] | Storage, **storage_options: Any) -> Repository:
        """Open a run for writing, creating it if needed."""
        storage = (
            path if isinstance(path, Storage) else storage_for(path, create=True, **storage_options)
        )
        repo = cls(storage)
        if storage.exists("zarr.json"):
            repo.root_attributes()
            return repo
        storage.check_writable(WRITTEN_PREFIXES)
        _check_empty(storage)  # before the lock file is made
        with storage.lock(LOCK_KEY):
            if storage.exists("zarr.json"):
                return repo
            _check_empty(storage)
            # an empty group document keeps zarr from warning about the _dstt folder
            storage.write(group_meta_key("_dstt"), dump(group_document()))
            storage.write_durable(ref_key(MAIN), dump_ref(RefInfo(MAIN, None, created=time.time())))
            storage.write_durable(HEAD_KEY, dump_head(MAIN))
            storage.barrier()
            # the root zarr.json goes last: its presence marks a complete, openable run
            storage.write_durable("zarr.json", dump(group_document(root_attributes())))
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
        fmt = attrs.get("format")
        if fmt == 1:
            raise FormatVersionError(
                f"{st.location} is a dstt format 1 run (a file per tensor per step); this dstt "
                f"reads format {FORMAT_VERSION} only. Read it with dstt 0.1 (pip install "
                "'dstt<0.2'), e.g. export its steps, or start a new run"
            )
        if fmt != FORMAT_VERSION:
            raise FormatVersionError(
                f"{st.location}/zarr.json: dstt format {fmt!r}; this dstt reads format "
                f"{FORMAT_VERSION}. Upgrade dstt to read it."
            )
        return attrs

    def reader(self) -> Reader:
        return Reader(self.storage)

    def writer(self, **options: Any) -> Writer:
        """The run's exclusive writer (``RunLockedError`` if another process holds it)."""
        from .commit.writer import Writer  # not imported to read a run (``dstt ls``)

        return Writer(self, **options)

    # -- timelines ------------------------------------------------------------------------
    def rollback(
        self,
        to_step: int,
        *,
        skip_data: int = 0,
        timeline: str | None = None,
        name: str | None = None,
        force: bool = False,
    ) -> RefInfo:
        """Start a new timeline at ``to_step`` of ``timeline`` (default current); make it current.

        Nothing is deleted: the old timeline keeps its head and stays inspectable. A live
        writer: ``RunLockedError`` unless ``force`` (``maintenance/timelines.changing``).
        """
        if skip_data < 0:
            raise ValueError(f"skip_data must be >= 0, got {skip_data}")
        from .maintenance.timelines import changing  # (with gc: not for reading a run)

        with changing(self.storage, "roll back", force=force, cli="dstt rollback"):
            r = self.reader()
            base_name = timeline or r.current_timeline
            base = r.find(to_step, base_name)
            new = name if name is not None else f"{base_name}-from-{to_step}"
            try:
                check_timeline_name(new)
            except TimelineError:
                if name is not None:
                    raise
                raise TimelineError(
                    f"the default name {new!r} is too long (64 characters at most); name the "
                    f"new timeline: run.rollback({to_step}, name=...), dstt rollback --to "
                    f"{to_step} --name NAME"
                ) from None
            if new in r.timelines:
                if name is not None:
                    raise TimelineError(f"timeline {new!r} already exists; pick another name")
                raise TimelineError(
                    f"step {to_step} of {base_name!r} was rolled back to before: timeline "
                    f"{new!r} exists. Name the new one (run.rollback({to_step}, name=...), "
                    f"dstt rollback --to {to_step} --name NAME), or make {new!r} current "
                    f"(run.switch({new!r}), dstt timeline switch {new})"
                )
            ref = RefInfo(
                new,
                base.slot,
                base_slot=base.slot,
                base_step=base.step,
                base_timeline=base_name,
                skip_data=skip_data,
                created=time.time(),
            )
            self.storage.write_durable(ref_key(new), dump_ref(ref))
            self.storage.write_durable(HEAD_KEY, dump_head(new))
            return ref

    def switch(self, timeline: str, *, force: bool = False) -> None:
        """Make an existing timeline current (the next resume continues it); a live writer:
        ``RunLockedError`` unless ``force``."""
        from .maintenance.timelines import changing

        with changing(self.storage, "switch timelines", force=force, cli="dstt timeline switch"):
            self.reader().ref(timeline)
            self.storage.write_durable(HEAD_KEY, dump_head(timeline))

    def rename_timeline(self, old: str, new: str, *, force: bool = False) -> RefInfo:
        """Rename a timeline (HEAD and the timelines forked from it follow); crash-safe, and
        running it again finishes an interrupted rename (``maintenance/timelines.py``)."""
        from .maintenance.timelines import rename_timeline

        return rename_timeline(self, old, new, force=force)

    def delete_timeline(
        self, name: str, *, gc: bool = True, dry_run: bool = False, force: bool = False
    ) -> DeleteReport:
        """Delete a timeline that is not the current one; with ``gc``, free the commits and
        files no other timeline reaches (``maintenance/timelines.py``)."""
        from .maintenance.timelines import delete_timeline

        return delete_timeline(self, name, sweep=gc, dry_run=dry_run, force=force)

    # -- maintenance (maintenance/gc.py, maintenance/verify.py) -------------------------------
    def gc(
        self,
        *,
        keep_last: int | None = None,
        keep_every: int | None = None,
        keep_steps: Iterable[int] = (),
        retention: Retention | None = None,
        dry_run: bool = False,
        progress: Callable[[int, int], None] | None = None,
    ) -> GcReport:
        """Prune what ``retention`` (or the keywords) does not keep (``maintenance.gc``)."""
        from .maintenance.gc import gc

        return gc(
            self,
            keep_last=keep_last,
            keep_every=keep_every,
            keep_steps=keep_steps,
            retention=retention,
            dry_run=dry_run,
            progress=progress,
        )

    def verify(
        self, *, progress: Callable[[int, int], None] | None = None, repair: bool = False
    ) -> VerifyReport:
        """Check every reachable byte and the index; ``repair``: first rebuild lost or
        damaged metadata from what survives (``maintenance.verify.repair``: root zarr.json,
        headers from the index, refs and HEAD from the headers), then the index from the
        commit headers (what ``dstt verify --repair`` does); the report lists the rebuilt."""
        from .maintenance.verify import repair as repair_metadata
        from .maintenance.verify import verify

        done = []
        if repair:
            done = repair_metadata(self)
            try:
                self.reindex()
            except DsttError as e:  # a damaged step: verify names it below
                done.append(f"index not rebuilt: {e}")
        rep = verify(self, progress=progress)
        rep.repaired = done
        return rep

    def reindex(self) -> int:
        """Rebuild the index from the commit headers (``dstt index``); returns its rows."""
        from .index.repair import rebuild

        with self.storage.lock(LOCK_KEY):
            return rebuild(Reader(self.storage))


def _check_empty(storage: Storage) -> None:
    """``NotARunError`` unless the location holds nothing but what an interrupted ``create``
    leaves behind (``_dstt/`` is written before the root ``zarr.json``; a crash in between
    must not make the directory unusable forever)."""
    if any(not n.startswith(".") and n != "_dstt" for n in storage.list("")):
        raise NotARunError(
            f"{storage.location} exists and is not empty but is not a dstt run; "
            "choose an empty or new directory"
        )
