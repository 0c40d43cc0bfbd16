"""Offline verification of a run: ``verify`` every byte, every zip entry, the index.

verify re-derives everything from the refs down and collects *all* problems (it never stops at
the first), each naming the file, so ``dstt verify`` is a complete damage report. It reads
every header from its own file (not the index, which it then checks against the headers) and
walks each timeline rather than taking its lineage, so a damaged header keeps the commits above
it checked. Rejected alternative: stopping at the first problem.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from dstt.errors import CorruptRunError, DsttError
from dstt.store.format.envelope import checksum
from dstt.store.format.layout import (
    REFS_PREFIX,
    STEPS_PREFIX,
    array_meta_key,
    commit_key,
    key_slot,
    zarr_chunk_key,
)
from dstt.store.format.zarr_meta import array_document
from dstt.store.format.zipfmt import Entry, crc32, local_data_offset, parse_directory
from dstt.store.index.repair import check
from dstt.store.read.reader import Reader

if TYPE_CHECKING:
    from dstt.store.format.records import ArrayRecord, CommitHeader
    from dstt.store.storage.base import Storage

__all__ = ["Problem", "VerifiedRun", "VerifyReport", "verify"]

Progress = Callable[[int, int], None] | None


class VerifiedRun(Protocol):
    """The run verify checks: its storage and validated root attributes (the store's
    ``Repository``; a protocol, so this room imports nothing above it)."""

    @property
    def storage(self) -> Storage: ...

    def root_attributes(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class Problem:
    key: str
    message: str


@dataclass
class VerifyReport:
    problems: list[Problem] = field(default_factory=list)
    commits: int = 0
    chunks: int = 0
    objects: int = 0
    bytes: int = 0

    @property
    def ok(self) -> bool:
        return not self.problems


def verify(repo: VerifiedRun, *, progress: Progress = None) -> VerifyReport:
    """Check refs, every reachable header, arrays table, chunk, object and step entry."""
    st = repo.storage
    rep = VerifyReport()

    def problem(key: str, e: BaseException | str) -> None:
        rep.problems.append(Problem(key, str(e)))

    try:
        repo.root_attributes()
        r = Reader(st, use_index=False)  # every header from its own file
    except DsttError as e:
        problem("zarr.json / refs", e)
        return rep
    for name in st.list(REFS_PREFIX):  # refresh() already parsed them all; re-list names
        if not name.endswith(".json"):
            problem(f"{REFS_PREFIX}/{name}", "unexpected file among refs")
    slots: dict[int, CommitHeader] = {}
    for tl in r.timelines:
        try:  # walk, not lineage: a damaged header keeps the commits above it checked
            for h in r.walk(tl):
                slots[h.slot] = h
        except DsttError as e:
            problem(f"timeline {tl}", e)
    todo = sorted(slots)
    for n, slot in enumerate(todo):
        h = slots[slot]
        rep.commits += 1
        if progress:
            progress(n, len(todo))
        if h.pruned:
            continue
        try:
            table = r.arrays(h)
        except DsttError as e:  # its chunks cannot be located; its objects can
            problem(h.arrays.key if h.arrays else commit_key(slot), e)
            table = {}
        for path, rec in table.items():
            for i, c in enumerate(rec.chunks):
                rep.chunks += 1
                try:
                    rep.bytes += len(r.read_chunk(h, path, i))
                except (DsttError, OSError) as e:
                    problem(c.key, e)
        for oname, o in h.objects.items():
            rep.objects += 1
            try:
                data = st.read_range(o.key, o.offset, o.nbytes)
                if len(data) != o.nbytes or checksum(data) != o.crc32c:
                    problem(o.key, f"object {oname!r} of step {h.step}: crc32c/size mismatch")
            except OSError as e:
                problem(o.key, e)
        _verify_step_files(st, h, table, problem)
    for key, message in check(r):  # the index against the headers (index/writer.py)
        problem(key, message)
    if progress:
        progress(len(todo), len(todo))
    return rep


def read_directory(st: Storage, key: str) -> dict[str, Entry]:
    """The entries of a step file, from its central directory (``CorruptRunError``)."""
    size = st.size(key)
    tail = st.read_range(key, max(0, size - (1 << 16)), 1 << 16)
    try:
        return parse_directory(tail, size, f"{st.location}/{key}")
    except CorruptRunError as e:
        if "outside the read tail" not in str(e):
            raise
    return parse_directory(st.read(key), size, f"{st.location}/{key}")


def _verify_step_files(
    st: Storage, h: CommitHeader, table: dict[str, ArrayRecord], problem: Callable[[str, str], None]
) -> None:
    """Each zip this commit wrote must be a plain Zarr hierarchy that holds its chunks: the
    central directory lists every chunk where the manifest says, with a correct CRC-32
    (zarr-python checks it), and every array's zarr.json matches the committed array."""
    own: dict[str, list[tuple[str, ArrayRecord, int]]] = {}
    for path, rec in table.items():
        for i, c in enumerate(rec.chunks):
            if c.encoding == "raw" and key_slot(c.key) == h.slot and c.key.endswith(".zip"):
                own.setdefault(c.key, []).append((path, rec, i))
    files = set(own) | {f"{STEPS_PREFIX}/{h.slot:012d}.zip"}
    for key in sorted(files):
        try:
            entries = read_directory(st, key)
        except (OSError, DsttError) as e:
            problem(key, f"step {h.step}: the zip cannot be listed ({e})")
            continue
        if "zarr.json" not in entries:
            problem(key, f"step {h.step}: the zip has no root zarr.json")
        data_at: dict[str, int] = {}
        for ent in entries.values():  # every entry, metadata included: zipfile checks CRC-32
            try:
                at = local_data_offset(
                    st.read_range(key, ent.offset, 30 + len(ent.name.encode())), ent
                )
                if at is None:
                    problem(
                        key, f"step {h.step}: local header of zip entry {ent.name!r} is damaged"
                    )
                    continue
                data_at[ent.name] = at
                if crc32(st.read_range(key, at, ent.size)) != ent.crc32:
                    problem(key, f"step {h.step}: zip entry {ent.name!r} fails its CRC-32")
            except OSError as err:
                problem(key, str(err))
        for path, rec, i in own.get(key, []):
            c = rec.chunks[i]
            name = zarr_chunk_key(path, rec.plan.index(i))
            got = entries.get(name)
            if got is None or got.size != c.nbytes or data_at.get(name, c.offset) != c.offset:
                problem(
                    key,
                    f"step {h.step}: zip entry {name!r} is missing or not where the "
                    "commit manifest says",
                )
        for rec in {x[1].path: x[1] for x in own.get(key, [])}.values():
            _verify_array_document(st, key, entries, data_at, rec, problem)
        _verify_consolidated(st, key, entries, data_at, problem)


#: the fields of an array's zarr.json a plain Zarr reader needs to find and decode the chunks
_READ_FIELDS = (
    "zarr_format",
    "node_type",
    "shape",
    "data_type",
    "chunk_grid",
    "chunk_key_encoding",
    "fill_value",
    "codecs",
    "dimension_names",
)


def _verify_array_document(
    st: Storage,
    key: str,
    entries: dict[str, Entry],
    data_at: dict[str, int],
    rec: ArrayRecord,
    problem: Callable[[str, str], None],
) -> None:
    name = array_meta_key(rec.path)
    e = entries.get(name)
    if e is None:
        problem(key, f"zip entry {name!r} missing")
        return
    if name not in data_at:  # its local header is damaged: reported above
        return
    try:
        doc = json.loads(st.read_range(key, data_at[name], e.size))
        want = array_document(rec.path, rec.dtype, rec.plan, dims=rec.dims)
        wrong = [f for f in _READ_FIELDS if doc.get(f) != want[f]]
    except (OSError, ValueError, TypeError, AttributeError) as err:
        problem(key, f"{name}: Zarr metadata unreadable ({type(err).__name__}: {err})")
        return
    if wrong:
        problem(key, f"{name}: Zarr metadata does not match the committed array: {wrong}")


def _verify_consolidated(
    st: Storage,
    key: str,
    entries: dict[str, Entry],
    data_at: dict[str, int],
    problem: Callable[[str, str], None],
) -> None:
    """The root's consolidated metadata (what xarray and zarr-python read instead of the
    nodes' own documents) must say what every node's zarr.json says."""
    root = entries.get("zarr.json")
    if root is None or "zarr.json" not in data_at:  # missing or damaged: reported above
        return
    try:
        cm = json.loads(st.read_range(key, data_at["zarr.json"], root.size)).get(
            "consolidated_metadata"
        )
        if cm is None:  # steps written before consolidation
            return
        for path, doc in cm["metadata"].items():
            name = array_meta_key(path)
            e, at = entries.get(name), data_at.get(name)
            own = None if e is None or at is None else json.loads(st.read_range(key, at, e.size))
            if own is None or {k: v for k, v in doc.items() if k != "consolidated_metadata"} != {
                k: v for k, v in own.items() if k != "consolidated_metadata"
            }:
                problem(
                    key,
                    f"zarr.json: the consolidated metadata of {path!r} does not "
                    "match its own zarr.json",
                )
    except (OSError, ValueError, TypeError, AttributeError, KeyError) as err:
        problem(key, f"zarr.json: consolidated metadata unreadable ({type(err).__name__}: {err})")
