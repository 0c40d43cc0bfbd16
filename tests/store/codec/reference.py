"""The general path of the delta codec: one chunk at a time, in plain Python.

dstt has one encoder, ``codec/flatdelta.py``: a whole flat step decided and encoded as columns
(vectorised decisions, one XOR over the buffer, gathered predictions). This module is the
readable statement of the same rule, chunk by chunk, with the per-chunk primitives the reader
mirrors (``xor_encode`` below, ``predict.predict``); ``test_codec_equivalence.py`` proves the
fast path equal to it, byte for byte (zarr's rule: a fast path only skips work whose result
is known). The rule, per chunk of a step encoded against the previous step of its layout:

* dedup: same crc32c of the raw (padded) bytes and the same bytes;
* an array whose measured ratio is under ``min_ratio`` is skipped (written raw) but for every
  ``retry_every``-th step; ratios and chains are kept per chunk, as of the step's start;
* a predicted chunk (its inputs and group at hand, float32, same sizes) is a prediction when
  its group's chain has room and no same-step predicted input restarted its chain; a
  prediction that does not pay is a keyframe (never an XOR delta);
* anything else open is an XOR delta while its chain has room; a delta that does not shrink
  the chunk ``min_ratio`` times is a keyframe.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numcodecs import Blosc

from dstt.store.codec.predict import CUR, PRED, Prediction, predict
from dstt.store.codec.xor import XOR, DeltaPolicy, xor_decode
from dstt.store.format.envelope import checksum

KEY, DELTA, DEDUP = 0, 1, 2
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def chain_limit(policy: DeltaPolicy, ratio: float | None) -> int:
    """K: slots per keyframe (1 = every slot a keyframe); ``flatdelta._limits`` is this rule
    vectorised."""
    if policy.keyframe_every is not None:
        return policy.keyframe_every
    if ratio is None or not math.isfinite(ratio) or ratio <= 1.0:
        return 2  # no evidence yet: try one delta, measure
    k = int(1 + (policy.read_amplification - 1) * ratio)
    return max(2, min(policy.max_chain, k))


def xor_encode(
    data: np.ndarray,
    base: np.ndarray,
    itemsize: int,
    policy: DeltaPolicy,
    cname: str | None = None,
    out: np.ndarray | None = None,
) -> bytes:
    """Encode uint8 ``data`` against uint8 ``base`` of the same length (``out``: a uint8
    work array of that length for the XOR, possibly ``base`` itself)."""
    if out is None:
        x = np.bitwise_xor(_words(data), _words(base)).view(np.uint8)
    else:
        x = np.bitwise_xor(_words(data), _words(base), out=_words(out)).view(np.uint8)
    if x.nbytes % itemsize == 0:  # blosc takes the shuffle's element size from the buffer
        x = x.view(_UINT.get(itemsize, np.uint8))
    name = cname or policy.codec_for(itemsize)
    codec = Blosc(cname=name, clevel=policy.clevel, shuffle=Blosc.SHUFFLE)
    return bytes(codec.encode(x))


def _words(a: np.ndarray) -> np.ndarray:
    return a.view(np.uint64) if a.nbytes % 8 == 0 else a


@dataclass
class Chunk:
    """One chunk of a step: where it is and its bytes (without edge padding)."""

    path: str
    index: int
    itemsize: int
    pad: int  # zero bytes a stored (edge) chunk adds
    data: np.ndarray  # uint8


@dataclass
class Kept:
    """What the encoder keeps of a chunk between steps."""

    data: np.ndarray
    raw_crc: int
    depth: int
    codec: tuple[Any, ...] | None


@dataclass
class Out:
    """The decision about one chunk, and its delta's payload."""

    kind: int
    raw_crc: int
    depth: int
    codec: tuple[Any, ...] | None
    payload: bytes | None = None


@dataclass
class ReferenceEncoder:
    policy: DeltaPolicy
    kept: dict[tuple[str, int], Kept] = field(default_factory=dict)
    ratio: dict[tuple[str, int], float] = field(default_factory=dict)
    skips: dict[tuple[str, int], int] = field(default_factory=dict)
    base_slot: int | None = None

    def step(
        self,
        chunks: list[Chunk],
        slot: int,
        predictions: dict[str, Prediction],
        *,
        raw: bool = False,
    ) -> list[Out]:
        """Decide and encode ``chunks`` (one step, in layout order); ``raw``: the step is
        written raw (a keyframe, or the writer could not keep up)."""
        raws = [_raw_crc(c) for c in chunks]
        if raw or self.base_slot is None:
            outs = [Out(KEY, r, 0, None) for r in raws]
        else:
            outs = self._encode(chunks, raws, slot, predictions)
        self.kept = {
            (c.path, c.index): Kept(c.data.copy(), o.raw_crc, o.depth, o.codec)
            for c, o in zip(chunks, outs, strict=True)
        }
        self.base_slot = slot
        return outs

    def _encode(
        self,
        chunks: list[Chunk],
        raws: list[int],
        slot: int,
        predictions: dict[str, Prediction],
    ) -> list[Out]:
        p = self.policy
        at = {(c.path, c.index): j for j, c in enumerate(chunks)}
        ratio = dict(self.ratio)  # every decision reads the ratios as of the step's start
        tried: dict[int, float] = {}
        kinds: list[int] = [KEY] * len(chunks)
        opened: list[bool] = []
        for j, c in enumerate(chunks):
            key = (c.path, c.index)
            base = self.kept[key]
            if p.dedup and raws[j] == base.raw_crc and np.array_equal(c.data, base.data):
                kinds[j] = DEDUP
            r = ratio.get(key, math.nan)
            bad = math.isfinite(r) and r < p.min_ratio
            if bad:
                self.skips[key] = self.skips.get(key, 0) + 1
            worth = not bad or self.skips.get(key, 0) % p.retry_every == 0
            opened.append(p.delta and kinds[j] != DEDUP and worth)
        payloads: dict[int, bytes] = {}
        codecs: dict[int, tuple[Any, ...]] = {}
        predicted: set[int] = set()
        base_slot = self.base_slot
        assert base_slot is not None

        def settle(j: int, payload: bytes, codec: tuple[Any, ...]) -> None:
            size = len(chunks[j].data)
            tried[j] = size / max(len(payload), 1)
            if size >= p.min_ratio * max(len(payload), 1):
                kinds[j], payloads[j], codecs[j] = DELTA, payload, codec

        for path in _prediction_order(predictions, {c.path for c in chunks}):
            pr = predictions[path]
            for j, c in enumerate(chunks):
                if c.path != path:
                    continue
                ins = [at.get((src, c.index)) for _, src in pr.inputs]
                members = [at.get((m, c.index)) for m in pr.group]
                if None in ins or None in members:
                    continue  # not a prediction: an XOR delta if anything
                fits = (
                    opened[j]
                    and c.itemsize == 4
                    and all(len(chunks[i].data) == len(c.data) for i in ins if i is not None)
                )
                if not fits:
                    continue
                predicted.add(j)  # a prediction or a keyframe, never an XOR delta
                depth = self.kept[(c.path, c.index)].depth
                limit = _group_limit(
                    p, [ratio.get(_key(chunks[m])) for m in members if m is not None]
                )
                if depth + 1 >= limit:
                    continue
                restarted = any(
                    role == CUR and i in predicted and kinds[i] == KEY
                    for (role, _), i in zip(pr.inputs, ins, strict=True)
                )
                if restarted:
                    continue
                values = [
                    chunks[i].data if role == CUR else self.kept[_key(chunks[i])].data
                    for (role, _), i in zip(pr.inputs, ins, strict=True)
                ]
                guess = predict(pr.fn, self.kept[_key(c)].data, values, pr.coeffs)
                payload = xor_encode(c.data, guess, 4, p, cname=p.residual_cname)
                srcs = [[src, slot if role == CUR else base_slot] for role, src in pr.inputs]
                settle(j, payload, (PRED, base_slot, raws[j], pr.fn, srcs, list(pr.coeffs)))
        for j, c in enumerate(chunks):
            depth = self.kept[_key(c)].depth
            r = ratio.get(_key(c))
            if not opened[j] or j in predicted or depth + 1 >= chain_limit(p, r):
                continue
            payload = xor_encode(c.data, self.kept[_key(c)].data, c.itemsize, p)
            settle(j, payload, (XOR, base_slot, raws[j]))
        for j, r in tried.items():  # what was measured this step, for the next ones
            old = self.ratio.get(_key(chunks[j]))
            self.ratio[_key(chunks[j])] = r if old is None else 0.7 * old + 0.3 * r
        outs = []
        for j, c in enumerate(chunks):
            base = self.kept[_key(c)]
            if kinds[j] == DEDUP:
                outs.append(Out(DEDUP, raws[j], base.depth, base.codec))
            elif kinds[j] == DELTA:
                outs.append(Out(DELTA, raws[j], base.depth + 1, codecs[j], payloads[j]))
            else:
                outs.append(Out(KEY, raws[j], 0, None))
        return outs


def decode(
    c: Chunk, out: Out, before: dict[tuple[str, int], Kept], step: list[Chunk]
) -> np.ndarray:
    """The bytes a reader rebuilds from ``out`` (``before``: the previous step's copies;
    ``step``: this step's chunks, a prediction's ``"cur"`` inputs, named by slot)."""
    base = before[_key(c)].data
    if out.kind == DEDUP:
        return base
    if out.kind == KEY:
        return c.data
    assert out.codec is not None
    assert out.payload is not None
    if out.codec[0] == XOR:
        return xor_decode(out.payload, base)
    _, _, _, fn, srcs, coeffs = out.codec
    now = {(x.path, x.index): x.data for x in step}
    values = [
        before[(src, c.index)].data if sl == out.codec[1] else now[(src, c.index)]
        for src, sl in srcs
    ]
    guess = predict(fn, base, values, tuple(coeffs))
    residual = np.frombuffer(Blosc().decode(out.payload), np.uint8)
    return np.bitwise_xor(residual, guess)


def _key(c: Chunk) -> tuple[str, int]:
    return (c.path, c.index)


def _raw_crc(c: Chunk) -> int:
    crc = checksum(c.data)
    return checksum(bytes(c.pad), crc) if c.pad else crc


def _group_limit(policy: DeltaPolicy, ratios: list[float | None]) -> int:
    """K of a predicted group: restoring its arrays at the worst slot reads at most
    ``read_amplification`` times their raw bytes (``u``: the sum of 1/ratio)."""
    if policy.keyframe_every is not None:
        return policy.keyframe_every
    u = 0.0
    for r in ratios:
        ok = r is not None and math.isfinite(r) and r >= policy.min_ratio
        u += 1.0 / r if ok and r is not None else 1.0
    k = int(1 + (policy.read_amplification - 1) * len(ratios) / max(u, 1e-9))
    return max(2, min(policy.max_chain, k))


def _prediction_order(predictions: dict[str, Prediction], present: set[str]) -> list[str]:
    """Predicted arrays, each after the predicted arrays it takes as ``"cur"`` inputs (a
    cycle predicts none of its members)."""
    pending = {p: pr for p, pr in predictions.items() if p in present}
    order: list[str] = []
    while pending:
        ready = [
            p
            for p, pr in pending.items()
            if all(role != CUR or s not in pending or s == p for role, s in pr.inputs)
        ]
        if not ready:
            break
        order += ready
        pending = {p: pr for p, pr in pending.items() if p not in ready}
    return order
