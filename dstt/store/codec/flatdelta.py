"""The delta codec: a whole flat step decided and encoded at once, as columns.

Every encoded step is a flat step (one fed chunk by chunk is staged by its transaction and
handed over at commit). It is encoded against a *flat shadow*, a copy of the last step of the
same layout with its records as columns: one XOR over the whole buffer, C calls mapped over
cached chunk views, vectorised decisions (dedup, chain limits, ``min_ratio``), one append of
every delta, one gathered prediction per predicted group. ``tests/store/codec/reference.py``
states the same rule chunk by chunk; a property test proves the two equal, byte for byte.

Rejected alternatives: a second, chunk-by-chunk encoder for ``put_chunk`` (~75 µs of Python per
chunk, and it drifted: one step had other bytes per lane), and one Blosc frame per step (a chunk
would no longer decode on its own).
"""

from __future__ import annotations

import itertools
import struct
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from .flatpredict import groups, predict_residuals
from .predict import CUR, PRED, Prediction
from .xor import XOR, DeltaPolicy

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from dstt.store.format.flat import FlatLayout

    from .buffers import Scratch
    from .layout_state import LayoutState

__all__ = ["FlatEncoded", "FlatShadow", "encode_flat", "seed_shadow", "xor_into"]

KEY, DELTA, DEDUP = 0, 1, 2
_PACK = struct.Struct("<I").pack


@dataclass(frozen=True, eq=False)
class FlatShadow:
    """The last written copy of a flat layout's step: its bytes and its records, as columns."""

    layout: FlatLayout
    timeline: str
    slot: int  # every chunk of ``data`` is this slot's copy of it
    data: np.ndarray  # uint8, the step buffer's bytes [0, layout.nbytes)
    files: np.ndarray  # object: per chunk, the key of the file its record points at
    offsets: np.ndarray  # int64 per chunk
    nbytes: np.ndarray  # int64 per chunk
    crcs: np.ndarray  # int64 per chunk: the record's crc32c
    raw_crcs: np.ndarray  # int64 per chunk: crc32c of the raw (padded) chunk
    depth: np.ndarray  # int32 per chunk: deltas since its keyframe
    codecs: Mapping[int, tuple[Any, ...]]  # chunk -> codec entry of a non-raw record
    #: per-chunk views of ``data`` (``LayoutState.make_views``), made on first use
    views: dict[str, list[Any]] = field(default_factory=dict)

    def chunk_views(self, st: LayoutState, kind: str) -> list[Any]:
        v = self.views.get(kind)
        if v is None:
            v = self.views[kind] = st.make_views(self.data, kind)
        return v


@dataclass
class FlatEncoded:
    """What ``encode_flat`` decided for one step; the transaction writes and records it."""

    kinds: np.ndarray  # int8 per chunk: KEY, DELTA or DEDUP
    raw_crcs: np.ndarray  # int64 per chunk
    payloads: list[bytes]  # the deltas' Blosc frames, in chunk order of ``delta_idx``
    delta_idx: np.ndarray
    codecs: dict[int, tuple[Any, ...]]  # chunk -> codec entry (deltas and dedups)
    depth: np.ndarray
    deps: set[int] = field(default_factory=set)


def xor_into(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
    """``out = a XOR b`` over uint8 arrays of one length, 8 bytes at a time."""
    n8 = len(a) // 8 * 8
    np.bitwise_xor(a[:n8].view(np.uint64), b[:n8].view(np.uint64), out=out[:n8].view(np.uint64))
    np.bitwise_xor(a[n8:], b[n8:], out=out[n8:])


def seed_shadow(
    layout: FlatLayout,
    timeline: str,
    slot: int,
    data: np.ndarray,
    files: np.ndarray,
    offsets: Sequence[int],
    nbytes: Sequence[int],
    crcs: Sequence[int],
    raw_crcs: np.ndarray | None = None,
    depth: np.ndarray | None = None,
    codecs: Mapping[int, tuple[Any, ...]] | None = None,
) -> FlatShadow:
    """A flat shadow from a step's columns (``data``: a copy of its buffer, made by the
    caller). Raw chunks by default: record crc = raw crc, depth 0."""
    n = len(layout.chunks)
    crc = np.asarray(crcs, dtype=np.int64)
    return FlatShadow(
        layout,
        timeline,
        slot,
        data,
        files,
        np.asarray(offsets, dtype=np.int64),
        np.asarray(nbytes, dtype=np.int64),
        crc,
        crc if raw_crcs is None else raw_crcs,
        np.zeros(n, np.int32) if depth is None else depth,
        {} if codecs is None else codecs,
    )


def _limits(policy: DeltaPolicy, ratio: np.ndarray) -> np.ndarray:
    """K per chunk (``xor.chain_limit``, vectorised)."""
    if policy.keyframe_every is not None:
        return np.full(len(ratio), policy.keyframe_every, np.int64)
    with np.errstate(invalid="ignore"):
        good = np.isfinite(ratio) & (ratio > 1.0)
        k = np.where(good, 1 + (policy.read_amplification - 1) * np.where(good, ratio, 1.0), 2)
    return np.clip(k.astype(np.int64), 2, policy.max_chain)


def _group_limits(policy: DeltaPolicy, ratio: np.ndarray, members: np.ndarray) -> np.ndarray:
    """K per predicted chunk from its group's members (rows of ``members``: chunk
    positions): restoring all its arrays at the worst slot reads at most
    ``read_amplification`` times their raw bytes (``u``: the sum of 1/ratio of its members)."""
    if policy.keyframe_every is not None:
        return np.full(len(members), policy.keyframe_every, np.int64)
    r = ratio[members]
    with np.errstate(invalid="ignore", divide="ignore"):
        u = np.where(np.isfinite(r) & (r >= policy.min_ratio), 1.0 / r, 1.0).sum(axis=1)
    k = 1 + (policy.read_amplification - 1) * members.shape[1] / np.maximum(u, 1e-9)
    every: np.ndarray = np.clip(k.astype(np.int64), 2, policy.max_chain)
    return every


def _names(policy: DeltaPolicy, st: LayoutState) -> np.ndarray:
    """The Blosc codec of each chunk's XOR delta (by element size), cached per layout."""
    key = (policy.cname, "names")
    got = st.cache.get(key)
    if got is None:
        got = st.cache[key] = np.asarray(
            [policy.codec_for(int(k)) for k in st.itemsize.tolist()], dtype=object
        )
    return got


class _Settled:
    """The deltas of a step as they are compressed: which paid (``min_ratio``), their
    payloads and codec entries, and every size tried (the ratios to learn from)."""

    def __init__(self, policy: DeltaPolicy, size: np.ndarray, kinds: np.ndarray) -> None:
        self.policy, self.size, self.kinds = policy, size, kinds
        self.payload: dict[int, bytes] = {}
        self.codecs: dict[int, tuple[Any, ...]] = {}
        self.won: list[np.ndarray] = []
        self.tried: list[np.ndarray] = []
        self.sizes: list[np.ndarray] = []

    def settle(self, chunks: np.ndarray, payloads: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
        """The chunks whose payload pays, and the mask of them in ``chunks``."""
        sizes = np.fromiter(map(len, payloads), np.int64, len(payloads))
        self.tried.append(chunks)
        self.sizes.append(sizes)
        ok = self.size[chunks] >= self.policy.min_ratio * np.maximum(sizes, 1)
        win = chunks[ok]
        self.kinds[win] = DELTA
        self.won.append(win)
        self.payload.update(
            zip(win.tolist(), itertools.compress(payloads, ok.tolist()), strict=False)
        )
        return win, ok


def _compress(views: list[Any], cname: str, clevel: int) -> list[bytes]:
    # imported here: numcodecs registers every codec it has on import (~0.1 s), which a
    # session that never encodes (the default) should not pay at its start
    from numcodecs import blosc

    return list(
        map(
            blosc.compress,
            views,
            itertools.repeat(cname.encode()),
            itertools.repeat(clevel),
            itertools.repeat(blosc.SHUFFLE),
        )
    )


def encode_flat(
    policy: DeltaPolicy,
    st: LayoutState,
    buf: np.ndarray,
    base: FlatShadow,
    slot: int,
    predictions: Mapping[str, Prediction],
    scratch: Scratch,
) -> FlatEncoded:
    """Decide and encode every chunk of the step in ``buf`` (uint8, ``layout.nbytes``)
    against ``base``; writes nothing (``scratch``: a ``buffers.Scratch``)."""
    layout = st.layout
    n = len(layout.chunks)
    size = st.size
    cur_b = st.views(buf, "b")
    raw = st.raw_crcs(cur_b)
    x = scratch.get("flatx", buf.nbytes)
    xor_into(buf, base.data, x)
    kinds = np.zeros(n, np.int8)
    # dedup: same crc32c, then an all-zero XOR (a C call per candidate only)
    if policy.dedup:
        cand = np.flatnonzero(raw == base.raw_crcs)
        if len(cand):
            xb = st.views(x, "t")
            same = (
                np.fromiter(
                    map(np.count_nonzero, map(xb.__getitem__, cand.tolist())), np.int64, len(cand)
                )
                == 0
            )
            kinds[cand[same]] = DEDUP
    with st.mu:
        ratio = st.ratio.copy()
        known = np.isfinite(ratio)
        bad = known & (ratio < policy.min_ratio)
        st.skips[bad] += 1
        skips = st.skips.copy()
    worth = ~bad | (skips % policy.retry_every == 0)
    open_ = (kinds != DEDUP) & worth if policy.delta else np.zeros(n, bool)
    depth = base.depth.astype(np.int64)
    xor_ok = open_ & (depth + 1 < _limits(policy, ratio))
    predicted = np.zeros(n, bool)
    rounds = groups(st, predictions) if predictions else []
    acc = _Settled(policy, size, kinds)
    xt = st.views(x, "t")
    for round_ in rounds:
        for g in round_:
            t = np.asarray(g.targets, np.int64)
            ins = [np.asarray(i, np.int64) for i in g.inputs]
            fits = open_[t] & (st.itemsize[t] == 4)
            for i in ins:
                fits &= size[i] == size[t]
            predicted[t[fits]] = True  # predicted (or a keyframe): never an XOR delta
            go = fits & (depth[t] + 1 < _group_limits(policy, ratio, np.asarray(g.members)))
            for role, i in zip(g.roles, ins, strict=True):
                if role == CUR:  # a predicted input that restarted its chain: so does this
                    go &= ~(predicted[i] & (kinds[i] == KEY))
            sel = np.flatnonzero(go)
            if not len(sel):
                continue
            tsel = t[sel]
            res = predict_residuals(
                g, tsel, [i[sel] for i in ins], base.chunk_views(st, "b"), cur_b, st, scratch
            )
            payloads = _compress(res, policy.residual_cname, policy.clevel)
            win, ok = acc.settle(tsel, payloads)
            srcs = itertools.compress([g.srcs[k] for k in sel.tolist()], ok.tolist())
            slots = tuple(slot if r == CUR else base.slot for r in g.roles)
            acc.codecs.update(
                zip(
                    win.tolist(),
                    (
                        (
                            PRED,
                            base.slot,
                            c,
                            g.fn,
                            [[s, sl] for s, sl in zip(ss, slots, strict=True)],
                            list(g.coeffs),
                        )
                        for c, ss in zip(raw[win].tolist(), srcs, strict=True)
                    ),
                    strict=True,
                )
            )
    xsel = np.flatnonzero(xor_ok & ~predicted)
    names = _names(policy, st)[xsel]
    for name in sorted(set(names.tolist())):
        part = xsel[names == name]
        payloads = _compress(list(map(xt.__getitem__, part.tolist())), name, policy.clevel)
        win, _ = acc.settle(part, payloads)
        acc.codecs.update(
            zip(
                win.tolist(),
                zip(itertools.repeat(XOR), itertools.repeat(base.slot), raw[win].tolist()),
                strict=False,
            )
        )
    # the XOR deltas: every open chunk not predicted (decided after the predictions)
    codecs = acc.codecs
    if acc.tried:
        idx = np.concatenate(acc.tried)
        r = size[idx] / np.maximum(np.concatenate(acc.sizes), 1)
        with st.mu:
            old = st.ratio[idx]
            st.ratio[idx] = np.where(np.isfinite(old), 0.7 * old + 0.3 * r, r)
    delta_idx = np.sort(np.concatenate(acc.won)) if acc.won else np.zeros(0, np.int64)
    dedup = np.flatnonzero(kinds == DEDUP)
    for j in dedup.tolist():
        c = base.codecs.get(j)
        if c is not None:
            codecs[j] = c
    new_depth = np.where(kinds == KEY, 0, np.where(kinds == DELTA, depth + 1, depth))
    out = FlatEncoded(
        kinds,
        raw,
        list(map(acc.payload.__getitem__, delta_idx.tolist())),
        delta_idx,
        codecs,
        new_depth.astype(np.int32),
    )
    if len(delta_idx) or len(dedup):
        out.deps.add(base.slot)
    return out
