"""Fewer bytes per step: XOR deltas against the previous committed chunk, and dedup.

Consecutive steps are close, so ``cur XOR prev`` is mostly zero bits in the high bytes; Blosc
shuffles by element size and compresses (lz4 or zstd) in one C pass. An unchanged chunk is not
written: its record points at the older file (dedup); Adam(W) state is XORed against a
prediction instead (``predict.py``). Chains are bounded: every ``keyframe_every`` (K) slots, else
``K = 1 + (A-1)·r`` per array from its measured ratio ``r`` and the read-amplification bound
``A``, clamped (predicted groups: ``flatdelta._group_limits``).

Rejected alternatives: deltas against a fixed base (drift grows, ratios decay), and lossy
quantised deltas (restores must be bit-exact).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["DeltaPolicy", "xor_decode"]

XOR = "xor1"  # encoding name in the arrays table: a Blosc frame (shuffle) of cur XOR base


@dataclass(frozen=True)
class DeltaPolicy:
    """How a writer encodes chunks. ``DeltaPolicy(delta=False)`` keeps dedup only."""

    #: keyframe every K slots along a chain; None = choose per array from the measured ratio
    keyframe_every: int | None = None
    #: bound on bytes read to reconstruct the worst slot, as a multiple of its raw size (for
    #: a predicted group: of the group's raw size). 8, not 4: keyframes dominate otherwise
    read_amplification: float = 8.0
    max_chain: int = 32
    delta: bool = True
    dedup: bool = True
    #: encode Adam(W) ``exp_avg_sq`` and parameters as predictions from the optimizer's
    #: update rule (``predict.py``) when the session knows the optimizer
    predict: bool = True
    #: a delta that does not shrink the chunk by this factor is written as a keyframe instead
    min_ratio: float = 1.15
    clevel: int = 1
    #: Blosc codec of XOR deltas. "auto": lz4 for 4- and 8-byte elements (~3x the speed of
    #: zstd for ~6-10 % more bytes on fp32), zstd for 1- and 2-byte ones (bf16 1.9x -> 3.4x)
    cname: str = "auto"
    #: prediction residuals (``predict.py``) are mostly zero bits: zstd halves them vs lz4
    residual_cname: str = "zstd"
    #: an array whose deltas stay under ``min_ratio`` is written raw, re-measured every N steps
    retry_every: int = 8
    #: write a step raw when encoding would need more writer CPU than the time between steps
    #: leaves (``dstt/engine/capture/governor.py``); False: always encode (disk space comes first)
    raw_when_busy: bool = True
    #: host memory for the last committed copy of each chunk (the delta bases)
    shadow_bytes: int = 4 << 30

    def __post_init__(self) -> None:
        if self.keyframe_every is not None and self.keyframe_every < 1:
            raise ValueError(f"keyframe_every must be >= 1, got {self.keyframe_every}")
        if self.read_amplification < 1 or self.max_chain < 1 or self.min_ratio < 1:
            raise ValueError("read_amplification, max_chain and min_ratio must be >= 1")
        for field in ("cname", "residual_cname"):
            name = getattr(self, field)
            if name not in _CNAMES and not (field == "cname" and name == "auto"):
                raise ValueError(
                    f"{field}={name!r}: use one of {sorted(_CNAMES)}"
                    + (" or 'auto'" if field == "cname" else "")
                )

    def codec_for(self, itemsize: int) -> str:
        """The Blosc codec XOR deltas of elements of ``itemsize`` bytes use."""
        if self.cname != "auto":
            return self.cname
        return "zstd" if itemsize <= 2 else "lz4"


_CNAMES = {"blosclz", "lz4", "lz4hc", "zlib", "zstd"}


def _words(a: np.ndarray) -> np.ndarray:
    return a.view(np.uint64) if a.nbytes % 8 == 0 else a


def xor_decode(payload: bytes | memoryview, base: np.ndarray) -> np.ndarray:
    """``payload`` (a Blosc frame of ``cur XOR base``) against ``base``: ``cur``, a new uint8
    array (the encoder: ``codec/flatdelta.py``)."""
    from numcodecs import Blosc

    x = np.frombuffer(Blosc().decode(payload), dtype=np.uint8)
    if x.nbytes != base.nbytes:
        raise ValueError(f"delta decodes to {x.nbytes} bytes, base has {base.nbytes}")
    out: np.ndarray = np.bitwise_xor(_words(x), _words(base)).view(np.uint8)
    return out
