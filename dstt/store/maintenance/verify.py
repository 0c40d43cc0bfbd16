"""Offline verification of a run: ``verify`` every byte, every zip entry, the index.

verify re-derives everything from the refs down and collects *all* problems (it never stops at
the first), each naming the file, so ``dstt verify`` is a complete damage report. It reads
every header from its own file (not the index, which it then checks against the headers) and
walks each timeline rather than taking its lineage, so a damaged header keeps the commits above
it checked. Rejected alternative: stopping at the first problem.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol

from dstt.errors import CorruptRunError, DsttError, FormatVersionError
from dstt.store.format.envelope import checksum
from dstt.store.format.layout import (
    HEAD_KEY,
    LOCK_KEY,
    REFS_PREFIX,
    array_meta_key,
    commit_key,
    key_slot,
    ref_key,
    step_file_key,
    zarr_chunk_key,
)
from dstt.store.format.manifest import dump_head, dump_ref, parse_header
from dstt.store.format.zarr_meta import array_document, dump, group_document, root_attributes
from dstt.store.format.zipfmt import Entry, crc32, local_data_offset, parse_directory
from dstt.store.index.repair import check
from dstt.store.index.view import Index
from dstt.store.read.reader import Reader

if TYPE_CHECKING:
    from dstt.store.format.records import ArrayRecord, CommitHeader
    from dstt.store.storage.base import Storage

__all__ = [
    "Problem",
    "VerifiedRun",
    "VerifyReport",
    "named_timeline",
    "repair",
    "step_zip_attributes",
    "unreached",
    "verify",
]

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
    #: what ``repair`` rebuilt before the check (``verify --repair``), one line each
    repaired: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def verify(repo: VerifiedRun, *, progress: Progress = None) -> VerifyReport:
    """Check refs, every reachable header, arrays table, chunk, object and step entry, and
    that no commit is out of every ref's reach (a lost ref hides its timeline)."""
    st = repo.storage
    rep = VerifyReport()

    def problem(key: str, e: BaseException | str) -> None:
        rep.problems.append(Problem(key, str(e)))

    try:
        repo.root_attributes()
        wrong = _root_wrong(st)
        if wrong:
            problem(
                "zarr.json",
                f"the run's root Zarr metadata is damaged ({wrong} wrong): Zarr readers cannot "
                "open the run; `dstt verify --repair` rewrites it",
            )
    except FormatVersionError:
        raise
    except DsttError as e:  # the metadata below may still be intact: check it too
        problem("zarr.json", f"{e}; `dstt verify --repair` rewrites it")
    try:
        r = Reader(st, use_index=False)  # every header from its own file
    except DsttError as e:
        problem("_dstt/HEAD.json / refs", e)
        return rep
    for name in st.list(REFS_PREFIX):  # refresh() already parsed them all; re-list names
        if not name.endswith(".json"):
            problem(f"{REFS_PREFIX}/{name}", "unexpected file among refs")
    if r.head_problem:
        problem(
            HEAD_KEY,
            f"{r.head_problem}; reads take {r.current_timeline!r} as current; "
            "`dstt verify --repair` rewrites it",
        )
    for key, why in sorted(r.damaged_refs.items()):
        problem(key, f"{why}; `dstt verify --repair` rebuilds it from the commit headers")
    r.recover_refs()  # every header out of every ref's reach, read: a lost ref shows here
    for name, ref in sorted(r.recovered.items()):
        problem(
            ref_key(name),
            f"timeline {name!r} has commits (its newest: slot {ref.head}) but no readable "
            "ref: they are hidden from every read; `dstt verify --repair` rebuilds the ref",
        )
    slots: dict[int, CommitHeader] = {}
    for tl in r.timelines:
        try:  # walk, not lineage: a damaged header keeps the commits above it checked
            for h in r.walk(tl):
                slots[h.slot] = h
        except DsttError as e:
            problem(f"timeline {tl}", e)
    for slot, why in sorted(r.bridged.items()):
        problem(
            commit_key(slot),
            f"{why}; that step cannot be read (the commits below it still can); "
            "`dstt verify --repair` restores it from the index where it holds a copy",
        )
    _verify_unreachable(r, slots, problem)
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


def _root_wrong(st: Storage) -> list[str]:
    """The fields of the run's root zarr.json that keep it from being the Zarr v3 group
    zarr and xarray open."""
    doc = json.loads(st.read("zarr.json"))
    return [k for k, v in group_document().items() if doc.get(k) != v]


def _verify_unreachable(
    r: Reader, reached: dict[int, CommitHeader], problem: Callable[[str, str], None]
) -> None:
    """Commit headers and step files no ref reaches. A complete commit whose timeline's
    ref never moved past it (a crash before the commit point) is debris gc may remove; a
    commit of a timeline with no ref, or one whose header cannot be read, is not: nothing
    proves it abandoned, so it is a problem until repaired."""
    released = r.released()  # a deleted timeline awaits gc: no problem
    names = set(r.timelines) | set(released)
    freed = {s for slots in released.values() for s in slots}
    for _, key, what in unreached(r, {*reached, *r.bridged}, freed):
        if isinstance(what, DsttError):
            problem(key, f"{what}; no ref reaches it, so nothing says whether it was committed")
        elif isinstance(what, dict):  # None: debris of a commit that died before its header
            if what.get("timeline") not in names:
                problem(
                    key,
                    f"step {what.get('step')} of timeline {what.get('timeline')!r}: a step "
                    "file with no commit header, of a timeline with no ref",
                )
        elif what is not None and not what.pruned and what.timeline not in names:
            problem(
                key,
                f"step {what.step} of timeline {what.timeline!r}: no ref reaches it and its "
                "timeline has no ref",
            )


def unreached(
    r: Reader, reached: Collection[int], released: Collection[int] = ()
) -> Iterator[tuple[int, str, CommitHeader | DsttError | dict[str, Any] | None]]:
    """What names each commit no ref reaches, for verify, gc and a timeline's delete:
    ``(slot, key, its header)`` for every commit header outside ``reached`` and ``released``
    (the ``DsttError`` in its place where it cannot be read), then ``(slot, key, the step
    zip's dstt attributes)`` for every step file of a slot with no header, outside
    ``released`` (None: a side file, or a zip that cannot tell)."""
    with_header = set(r.all_slots())
    for slot in sorted(with_header.difference(reached, released)):
        try:
            what: CommitHeader | DsttError = r.header(slot)
        except DsttError as e:
            what = e
        yield slot, commit_key(slot), what
    for key, n in r.step_files().items():
        if n not in with_header and n not in released:
            yield n, key, step_zip_attributes(r.storage, key) if key.endswith(".zip") else None


def named_timeline(what: CommitHeader | dict[str, Any]) -> Any:  # noqa: ANN401 - as the zip says
    """The timeline an unreached commit's header, or its step zip's attributes, name."""
    return what.get("timeline") if isinstance(what, dict) else what.timeline


def step_zip_attributes(st: Storage, key: str) -> dict[str, Any] | None:
    """The ``dstt`` attributes (step, timeline, slot) of a step zip's root zarr.json: what
    names a step whose commit header is lost. None where the zip cannot tell."""
    try:
        entries = read_directory(st, key)
        e = entries.get("zarr.json")
        if e is None:
            return None
        at = local_data_offset(st.read_range(key, e.offset, 30 + len(e.name.encode())), e)
        if at is None:
            return None
        data = st.read_range(key, at, e.size)
        if crc32(data) != e.crc32:
            return None
        attrs = json.loads(data).get("attributes", {}).get("dstt")
    except (OSError, DsttError, ValueError, AttributeError):
        return None
    return attrs if isinstance(attrs, dict) else None


def repair(repo: VerifiedRun) -> list[str]:
    """Rebuild lost or damaged run metadata from what survives; one line per thing rebuilt.

    Under the run's lock, in an order where each step only adds: the root zarr.json
    (rewritten: it holds nothing but the format); commit headers restored byte for byte from
    the copy the index keeps of each; refs rebuilt from the commit headers (``Reader.
    recover_refs``: head = the timeline's newest intact commit); a ref whose head header is
    still unreadable moved down to the newest intact commit below it (the damaged step's
    files stay: gc keeps a slot whose header it cannot read); HEAD rewritten. A damaged ref
    file is moved to ``_dstt/damaged/`` (its bytes kept) when its timeline is rebuilt under
    the name its headers carry. The index is rebuilt afterwards (``Repository.verify``).
    Rejected alternative: guessing a lost header's parent and rewriting it — a wrong guess
    would be written history; a restored copy or a moved ref is not a guess."""
    st = repo.storage
    done: list[str] = []
    with st.lock(LOCK_KEY):
        try:
            repo.root_attributes()
            root_ok = not _root_wrong(st)
        except FormatVersionError:
            raise
        except DsttError:
            root_ok = False
        if not root_ok:
            st.write_durable("zarr.json", dump(group_document(root_attributes())))
            done.append("zarr.json: the run's root Zarr metadata rewritten")
        for slot, (seg, i) in sorted(Index(st).load().rows.items()):
            key = commit_key(slot)
            try:
                parse_header(st.read(key), f"{st.location}/{key}")
                continue
            except FormatVersionError:
                raise
            except (FileNotFoundError, CorruptRunError):
                pass
            try:
                data = seg.header_bytes(st, i)
                h = parse_header(data, f"{st.location}/{seg.key}")
            except (DsttError, OSError):
                continue
            if h.slot == slot:
                st.write_durable(key, data)
                done.append(f"{key}: commit header of step {h.step} restored from the index")
        r = Reader(st, use_index=False)
        r.recover_refs()
        for key in sorted(r.damaged_refs):
            name = key.rsplit("/", 1)[1][: -len(".json")]
            if name not in r.timelines:  # its timeline is rebuilt under its headers' name
                st.write_durable(f"_dstt/damaged/{name}.json", st.read(key))
                st.delete(key)
                done.append(f"{key}: unreadable; moved to _dstt/damaged/{name}.json")
        for name, ref in sorted(r.timelines.items()):
            fixed = ref
            for h in r.walk(name):  # the first intact commit: the head, or below a damaged one
                if h.slot != ref.head:
                    fixed = replace(ref, head=h.slot)
                break
            if name in r.recovered or fixed != ref:
                st.write_durable(ref_key(name), dump_ref(fixed))
                head = r.header(fixed.head) if fixed.head is not None else None
                done.append(
                    f"{ref_key(name)}: ref of timeline {name!r} rebuilt, head step "
                    f"{None if head is None else head.step} (slot {fixed.head})"
                    + (
                        f"; the header of slot {ref.head} is unreadable and stays"
                        if fixed.head != ref.head and ref.head is not None
                        else ""
                    )
                )
        if r.head_problem:
            st.write_durable(HEAD_KEY, dump_head(r.current_timeline))
            done.append(f"{HEAD_KEY}: rewritten, current timeline {r.current_timeline!r}")
    return done


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
    files = set(own) | {step_file_key(h.slot)}
    for key in sorted(files):
        try:
            entries = read_directory(st, key)
        except (OSError, DsttError) as e:
            problem(key, f"step {h.step}: the zip cannot be listed ({e})")
            continue
        if "zarr.json" not in entries:
            problem(key, f"step {h.step}: the zip has no root zarr.json")
        foreign = sorted(n for n in entries if not _zarr_entry(n, entries))
        if foreign:
            problem(
                key,
                f"step {h.step}: foreign zip entries {foreign[:5]}"
                f"{' ...' if len(foreign) > 5 else ''} (not part of the step's Zarr hierarchy; "
                "something appended them to the step file)",
            )
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


def _zarr_entry(name: str, entries: dict[str, Entry]) -> bool:
    """Whether a zip entry belongs to a Zarr v3 hierarchy dstt writes: a node's zarr.json,
    or a chunk key ``<array>/c/<i>...`` of an array whose zarr.json is in the zip."""
    if name == "zarr.json" or name.endswith("/zarr.json"):
        return True
    array, sep, index = name.partition("/c/")
    if not sep:
        array, sep = (name[:-2], "/c") if name.endswith("/c") else (name, "")
    return (
        bool(sep)
        and array_meta_key(array) in entries
        and all(p.isdigit() for p in index.split("/") if index)
    )


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
