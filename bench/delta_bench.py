"""Fewer bytes per step (issue 8): XOR deltas and predictive coding on real training states.

A GPT-like model (``dstt.testing.models.TinyGPT``) trains for real with AdamW (GPT-style
hyperparameters: lr 6e-4 after a 20-step warmup, betas (0.9, 0.95), weight decay 0.1) while a
``dstt.session(..., encoding=DeltaPolicy(raw_when_busy=False))`` captures every step (the
CPU-based raw fallback is off so that it cannot perturb the byte counts; what it costs and
saves is measured by ``capture_bench.py``). At a few capture points the states of steps k and
k+1 are cloned, with the Adam(W) coefficients each step used (the lr read right after
``opt.step()``, before ``sched.step()``, betas, eps, weight decay, the state's step count); at
the end a chain of consecutive states is kept.

The library's scheme (``dstt/store/codec/predict.py``): ``exp_avg`` (m) carries the step's new
information and is written as an XOR delta against the previous step (Blosc byte-shuffle +
lz4 for fp32: ``DeltaPolicy.cname="auto"``), or raw when that does not pay ``min_ratio``;
``exp_avg_sq`` (v) and the parameter (p) are predicted from the Adam update rule (``adam_v``
from v_prev, m, m_prev; ``adam_p`` from p_prev, m, v) and written as ``actual XOR predicted``
("pred1", Blosc byte-shuffle + zstd, ``DeltaPolicy.residual_cname``). Then:

1. **bytes per step** as written/raw, per tensor class: fp32 params, fp32 Adam moments
   (``exp_avg``, ``exp_avg_sq``), the whole fp32 Adam state (the three together), and the same
   params cast to bf16 and fp16 (as a mixed-precision run would hold them):
   a. *XOR only*: ``xor_encode`` (tests/store/codec/reference.py) against the previous step with the
      default policy, per tensor (whatever its ratio). Beside it: plain shuffle + the policy's codec
      of the new state (no delta; JSON key ``plain_zstd_ratio``, kept for history), and
      the *XOR bound*: bits / (bits - leading zero bits of cur^prev) per element, near the
      ceiling of any XOR-against-the-previous-step scheme.
   b. *library* (``DeltaPolicy()`` with the session's predictions), emulated per tensor as the
      encoder decides: v and p predicted, m (and bf16/fp16) XOR, each written raw instead when
      its ratio is under ``min_ratio``. Between keyframes (a step inside a chain), and an
      *estimate* with keyframes: per step (raw + (K-1)·between)/K per tensor, with the K the
      encoder would choose from these ratios (``DeltaEncoder.group_limit`` for a predicted
      group m/v/p, ``chain_limit`` for an XOR chain).
   Payload bytes; the 4-byte crc trailer of each chunk file is not counted here.
2. **end to end**: what the session actually wrote per class over the whole run (unique chunk
   files in the arrays tables: keyframes + xor1 + pred1 deltas, dedups counted once, crc
   trailers included) and its per-step metrics. Its fp32 Adam state ratio is the headline for
   the >= 2.5x target.
3. **variants** (to choose from): transform XOR / integer difference / zigzag of the integer
   difference, Blosc byte-shuffle / bit-shuffle, zstd clevel 1, 3, 6 / lz4 clevel 1, each with
   ratio and encode speed, on the last capture point (against the previous step, no prediction).
4. **speed**: GB/s (of raw bytes) on 16 MiB pieces, as the engine's chunks: ``xor_encode`` /
   ``xor_decode`` on the fp32 state and bf16 params, and the predictive path on the fp32 Adam
   state (encode: m XOR + predict and residual ``xor_encode`` of v and p; decode:
   ``xor_decode`` of m, then predict + ``xor_decode`` of v and p), as ratios to a memcpy into a
   reused buffer and to the disk's write bandwidth (64 MiB writes + fsync), all measured in this
   run.
5. **read latency**: ``Reader.read_array`` of every fp32 tensor of a keyframe slot vs a delta
   slot of depth 1 and the deepest slot of a ``keyframe_every=chain`` chain committed with
   predictions, with a fresh ``Reader`` each time (its decoded-chunk cache empty; the page cache
   is warm — the run was just written); reads are checked bit-exact.

GB are 10^9 bytes; timings are medians over ``--repeats``.

    python bench/delta_bench.py [--quick] [--steps 300] [--repeats 5] [--json PATH]
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import torch
from _common import disk_bandwidth, finish, source_state
from _delta_report import ADAM3, CLASSES, print_tables
from numcodecs import Blosc

import dstt
from dstt.store import DeltaPolicy, Repository
from dstt.store.codec.predict import CUR, Prediction, adam_predictions, predict
from dstt.store.codec.xor import xor_decode
from dstt.testing.models import TinyGPT, make_batch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the chunk-wise reference codec
from tests.store.codec.reference import chain_limit, xor_encode

MiB = 1024 * 1024
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_INT = {2: np.int16, 4: np.int32, 8: np.int64}


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def timed(fn: Any, repeats: int) -> float:
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return med(ts)


# -- training and capture ---------------------------------------------------------------------
@dataclass
class Snap:
    """One step's cloned state: ``arrays`` by bench key (``params/<name>``, ``exp_avg/<name>``,
    ``exp_avg_sq/<name>``, ``bf16/<name>``, ``fp16/<name>``), and per parameter name the Adam(W)
    hyperparameters that step used (``adam``: lr, beta1, beta2, eps, weight_decay, decoupled,
    step)."""

    arrays: dict[str, np.ndarray]
    adam: dict[str, dict[str, float]]


def snapshot(model: torch.nn.Module, opt: torch.optim.Optimizer) -> Snap:
    """Cloned state as numpy: params (fp32 + bf16/fp16 casts as uint16 bits) and moments.

    Call right after ``opt.step()`` and before ``sched.step()``: the lr in ``param_groups`` is
    then the one the step used (what the session's predictions use too)."""
    out: dict[str, np.ndarray] = {}
    adam: dict[str, dict[str, float]] = {}
    names = {id(p): n for n, p in model.named_parameters()}
    groups = {id(p): g for g in opt.param_groups for p in g["params"]}
    decoupled = isinstance(opt, torch.optim.AdamW)
    for p in model.parameters():
        n = names[id(p)]
        d = p.detach()
        out[f"params/{n}"] = d.clone().numpy()
        out[f"bf16/{n}"] = d.to(torch.bfloat16).view(torch.uint16).clone().numpy()
        out[f"fp16/{n}"] = d.to(torch.float16).view(torch.uint16).clone().numpy()
        st = opt.state.get(p, {})
        for key in ("exp_avg", "exp_avg_sq"):
            if key in st:
                out[f"{key}/{n}"] = st[key].detach().clone().numpy()
        g = groups.get(id(p))
        if g is not None and "step" in st and "exp_avg_sq" in st:
            b1, b2 = g["betas"]
            adam[n] = {
                "lr": float(g["lr"]),
                "beta1": float(b1),
                "beta2": float(b2),
                "eps": float(g["eps"]),
                "weight_decay": float(g["weight_decay"]),
                "decoupled": float(decoupled),
                "step": float(st["step"]),
            }
    return Snap(out, adam)


def predictions(snap: Snap) -> dict[str, Prediction]:
    """The session's predictions for this step, keyed by bench key (v and p of each param)."""
    out: dict[str, Prediction] = {}
    for n, h in snap.adam.items():
        out.update(
            adam_predictions(
                param=f"params/{n}",
                exp_avg=f"exp_avg/{n}",
                exp_avg_sq=f"exp_avg_sq/{n}",
                lr=h["lr"],
                betas=(h["beta1"], h["beta2"]),
                eps=h["eps"],
                weight_decay=h["weight_decay"],
                decoupled=bool(h["decoupled"]),
                step=h["step"],
            )
        )
    return out


def u8(a: np.ndarray) -> np.ndarray:
    return a.reshape(-1).view(np.uint8)


def predicted(pr: Prediction, key: str, prev: Snap, cur: Snap) -> np.ndarray:
    """What the library predicts for ``cur.arrays[key]`` (uint8)."""
    ins = [u8((cur if role == CUR else prev).arrays[src]) for role, src in pr.inputs]
    return predict(pr.fn, u8(prev.arrays[key]), ins, pr.coeffs)


def klass(key: str) -> str:
    kind = key.split("/", 1)[0]
    return {
        "params": "fp32 params",
        "exp_avg": "fp32 exp_avg",
        "exp_avg_sq": "fp32 exp_avg_sq",
        "bf16": "bf16 params",
        "fp16": "fp16 params",
    }[kind]


def session_class(path: str) -> str | None:
    if path.startswith("params/"):
        return "fp32 params"
    if path.startswith("optim/exp_avg_sq/"):
        return "fp32 exp_avg_sq"
    if path.startswith("optim/exp_avg/"):
        return "fp32 exp_avg"
    return None


def train(
    cfg: dict[str, Any], steps: int, capture: list[int], chain: int, run: Path, log: Any
) -> tuple[dict[int, tuple[Snap, Snap]], list[Snap], dict[str, Any]]:
    torch.manual_seed(0)
    model = TinyGPT(
        vocab=cfg["vocab"],
        d=cfg["d"],
        layers=cfg["layers"],
        heads=cfg["heads"],
        seq=cfg["seq"],
        dropout=0.1,
    )
    opt = torch.optim.AdamW(model.parameters(), lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20))
    pairs: dict[int, tuple[Snap, Snap]] = {}
    prev: Snap | None = None
    tail: list[Snap] = []
    want = set(capture) | {c + 1 for c in capture}
    losses = []
    # no CPU-based raw fallback: the bytes measured are what the encoder writes (capture_bench
    # measures the fallback)
    policy = DeltaPolicy(raw_when_busy=False)
    t0 = time.perf_counter()
    with dstt.session(model, opt, run=run, every=1, scheduler=sched, encoding=policy) as s:
        for i in range(1, steps + 1):
            x, y = make_batch(i, batch_size=cfg["batch"], seq=cfg["seq"], vocab=cfg["vocab"])
            _, loss = model(x, y)
            assert loss is not None
            loss.backward()
            opt.step()
            # before sched.step(): the snapshot records the lr this step used
            snap = snapshot(model, opt) if i in want or i > steps - chain else None
            opt.zero_grad(set_to_none=True)
            sched.step()
            losses.append(float(loss.detach()))
            if snap is not None:
                if i in capture:
                    prev = snap
                if i - 1 in capture and prev is not None:
                    pairs[i - 1] = (prev, snap)
                if i > steps - chain:
                    tail.append(snap)
            if i % max(1, steps // 5) == 0:
                log(f"  step {i}/{steps} loss {losses[-1]:.3f} ({time.perf_counter() - t0:.0f} s)")
    ms = s.metrics
    info = {
        "loss_first": losses[0],
        "loss_last": losses[-1],
        "session_policy": {"raw_when_busy": policy.raw_when_busy, "predict": policy.predict},
        "session_steps": len(ms),
        "session_written_over_raw_median": med([m.written_bytes / m.bytes for m in ms[1:]]),
        "session_written_over_raw_total": (
            sum(m.written_bytes for m in ms) / max(1, sum(m.bytes for m in ms))
        ),
        "session_raw_fallback_steps": sum(1 for m in ms if m.raw_fallback),
        "session_keyframes": sum(m.keyframes for m in ms),
        "session_deltas": sum(m.deltas for m in ms),
        "session_dedups": sum(m.dedups for m in ms),
        "train_s": time.perf_counter() - t0,
        "params": sum(p.numel() for p in model.parameters()),
    }
    return pairs, tail, info


def session_classes(run: Path) -> dict[str, dict[str, Any]]:
    """Per class, over the whole run: unique bytes on disk vs raw bytes committed.

    Every chunk whose encoding is not ``raw`` (``xor1``, ``pred1``) is a delta; a dedup
    reference to an older file is counted once, with the file. ``stale_base_*``: deltas whose
    base is older than the previous commit."""
    r = Repository.open(run).reader()
    raw: dict[str, int] = defaultdict(int)
    written: dict[str, int] = defaultdict(int)
    by_enc: dict[str, Counter[str]] = defaultdict(Counter)
    bytes_enc: dict[str, Counter[str]] = defaultdict(Counter)
    dedup: dict[str, int] = defaultdict(int)
    # deltas whose base is not the previous commit (encoded while it was still in flight):
    # a prediction from such a base is a two-step guess and costs bytes
    stale: dict[str, Counter[str]] = defaultdict(Counter)
    stale_bytes: dict[str, int] = defaultdict(int)
    seen: set[tuple[str, int]] = set()
    prev_slot: int | None = None
    for h in r.lineage():
        for path, rec in r.arrays(h).items():
            c = session_class(path)
            if c is None:
                continue
            raw[c] += rec.plan.nbytes
            for ch in rec.chunks:
                where = (ch.key, ch.offset)  # format 2: a byte range of a step's file
                if where in seen:
                    dedup[c] += 1
                    continue  # a dedup reference to an older step's bytes
                seen.add(where)
                written[c] += ch.nbytes
                by_enc[c][ch.encoding] += 1
                bytes_enc[c][ch.encoding] += ch.nbytes
                if ch.base is not None and ch.base != prev_slot:
                    stale[c][ch.encoding] += 1
                    stale_bytes[c] += ch.nbytes
        prev_slot = h.slot

    def row(cs: list[str]) -> dict[str, Any]:
        rw, wr = sum(raw[c] for c in cs), sum(written[c] for c in cs)
        enc: Counter[str] = Counter()
        benc: Counter[str] = Counter()
        old: Counter[str] = Counter()
        for c in cs:
            enc.update(by_enc[c])
            benc.update(bytes_enc[c])
            old.update(stale[c])
        return {
            "raw_bytes": rw,
            "written_bytes": wr,
            "written_over_raw": wr / rw,
            "ratio": rw / wr,
            "keyframe_chunks": enc["raw"],
            "delta_chunks": sum(n for e, n in enc.items() if e != "raw"),
            "chunks_by_encoding": dict(enc),
            "bytes_by_encoding": dict(benc),
            "dedup_refs": sum(dedup[c] for c in cs),
            "stale_base_chunks": dict(old),
            "stale_base_bytes": sum(stale_bytes[c] for c in cs),
        }

    out = {c: row([c]) for c in raw}
    out[ADAM3] = row(list(raw))
    return out


# -- encoders ---------------------------------------------------------------------------------
def transform(cur: np.ndarray, prev: np.ndarray, how: str) -> np.ndarray:
    """A same-size integer array that is mostly small/zero when cur ≈ prev."""
    size = cur.dtype.itemsize
    u = _UINT[size]
    a, b = cur.view(u).ravel(), prev.view(u).ravel()
    if how == "xor":
        return np.bitwise_xor(a, b)
    if how == "none":
        return a
    d = (a - b).view(_INT[size])  # wrap-around difference of the integer views
    if how == "sub":
        return d.view(u)
    if how == "zigzag":  # small negative differences become small positive numbers
        bits = 8 * size
        return ((d << 1) ^ (d >> (bits - 1))).view(u)
    raise ValueError(how)


def blosc_size(x: np.ndarray, cname: str, clevel: int, shuffle: int) -> int:
    return len(Blosc(cname=cname, clevel=clevel, shuffle=shuffle).encode(x))


def xor_bound_bits(cur: np.ndarray, prev: np.ndarray) -> tuple[float, int]:
    """Mean leading zero bits of cur^prev per element, and the element width."""
    size = cur.dtype.itemsize
    x = transform(cur, prev, "xor").astype(np.uint64)
    bits = 8 * size
    # leading zeros within the element width: bits - bit_length(x)
    with np.errstate(divide="ignore"):
        bl = np.where(x == 0, 0, np.floor(np.log2(np.maximum(x, 1))).astype(np.int64) + 1)
    return float(np.mean(bits - bl)), bits


def class_arrays(state: dict[str, np.ndarray], c: str) -> list[str]:
    if c == ADAM3:
        return [k for k in state if klass(k) in ("fp32 params", "fp32 exp_avg", "fp32 exp_avg_sq")]
    return [k for k in state if klass(k) == c]


def lib_keyframe_every(
    pol: DeltaPolicy, key: str, preds: dict[str, Prediction], ratio: dict[str, float]
) -> int:
    """K the encoder would choose for ``key`` given these ratios: a predicted array follows its
    group's chain (``DeltaEncoder.group_limit``), any other its own (``chain_limit``); an array
    whose delta does not pay ``min_ratio`` is written raw (K = 1)."""
    if ratio[key] < pol.min_ratio:
        return 1
    pr = preds.get(key)
    if pr is None:
        return chain_limit(pol, ratio[key])
    if pol.keyframe_every is not None:
        return pol.keyframe_every
    u = sum(1.0 / ratio[g] if ratio.get(g, 0.0) >= pol.min_ratio else 1.0 for g in pr.group)
    k = int(1 + (pol.read_amplification - 1) * len(pr.group) / max(u, 1e-9))
    return max(2, min(pol.max_chain, k))


def ratios_at(prev: Snap, cur: Snap) -> dict[str, Any]:
    pol = DeltaPolicy()
    preds = predictions(cur)
    # per tensor: XOR-only payload, plain zstd, XOR bound, and the library's choice
    xor_n: dict[str, int] = {}
    plain_n: dict[str, int] = {}
    lz: dict[str, float] = {}
    bits: dict[str, int] = {}
    lib_n: dict[str, int] = {}  # payload of what the library writes between keyframes
    lib_r: dict[str, float] = {}  # its delta ratio (what the encoder measures)
    lib_enc: dict[str, str] = {}
    for k, a in cur.arrays.items():
        b = prev.arrays[k]
        size = a.dtype.itemsize
        xor_n[k] = len(xor_encode(u8(a), u8(b), size, pol))
        plain_n[k] = blosc_size(
            a.reshape(-1).view(_UINT[size]), pol.codec_for(size), pol.clevel, Blosc.SHUFFLE
        )
        lz[k], bits[k] = xor_bound_bits(a, b)
        pr = preds.get(k)
        if pr is not None and size == 4:
            e, n = (
                "pred1",
                len(
                    xor_encode(u8(a), predicted(pr, k, prev, cur), 4, pol, cname=pol.residual_cname)
                ),
            )
        else:
            e, n = "xor1", xor_n[k]
        lib_r[k] = a.nbytes / n
        lib_enc[k], lib_n[k] = (e, n) if lib_r[k] >= pol.min_ratio else ("raw", a.nbytes)
    kf = {k: lib_keyframe_every(pol, k, preds, lib_r) for k in cur.arrays}
    out: dict[str, Any] = {}
    per_tensor: list[dict[str, Any]] = []
    for c in CLASSES:
        keys = class_arrays(cur.arrays, c)
        raw = sum(cur.arrays[k].nbytes for k in keys)
        enc = sum(xor_n[k] for k in keys)
        plain = sum(plain_n[k] for k in keys)
        n_el = sum(cur.arrays[k].size for k in keys)
        lz_mean = sum(lz[k] * cur.arrays[k].size for k in keys) / max(1, n_el)
        nbits = bits[keys[0]]
        lib = sum(lib_n[k] for k in keys)
        # keyframes included: per step (raw + (K-1)·between)/K, per tensor
        est = sum((cur.arrays[k].nbytes + (kf[k] - 1) * lib_n[k]) / kf[k] for k in keys)
        ks = [kf[k] for k in keys]
        out[c] = {
            "raw_bytes": raw,
            "xor_bytes": enc,
            "ratio": raw / enc,
            "written_over_raw": enc / raw,
            "plain_zstd_ratio": raw / plain,
            "lz_bits": lz_mean,
            "xor_bound_ratio": nbits / max(1e-9, nbits - lz_mean),
            "lib_bytes": lib,
            "lib_ratio": raw / lib,
            "lib_written_over_raw": lib / raw,
            "lib_encodings": dict(Counter(lib_enc[k] for k in keys)),
            "lib_est_bytes": est,
            "lib_est_ratio": raw / est,
            "lib_keyframe_every": {
                "min": min(ks),
                "median": med([float(x) for x in ks]),
                "max": max(ks),
            },
        }
        if c != ADAM3:
            for k in keys:
                a, b = cur.arrays[k], prev.arrays[k]
                u = _UINT[a.dtype.itemsize]
                per_tensor.append(
                    {
                        "tensor": k,
                        "class": c,
                        "bytes": a.nbytes,
                        "ratio": a.nbytes / xor_n[k],
                        "lib_ratio": a.nbytes / lib_n[k],
                        "lib_encoding": lib_enc[k],
                        "lib_keyframe_every": kf[k],
                        "changed_frac": float(np.mean(a.view(u) != b.view(u))),
                        "lz_bits": lz[k],
                    }
                )
    # tiny tensors (biases, norms) are dominated by Blosc's header: rank those >= 16 KiB
    per_tensor = [r for r in per_tensor if r["bytes"] >= 16384] or per_tensor
    per_tensor.sort(key=lambda r: r["ratio"])
    out["worst_tensors"] = per_tensor[:8]
    out["best_tensors"] = per_tensor[-4:]
    fp32 = sorted(
        (r for r in per_tensor if r["class"].startswith("fp32")), key=lambda r: r["lib_ratio"]
    )
    out["worst_tensors_lib"] = fp32[:8]
    return out


VARIANTS_T = ("xor", "sub", "zigzag")
VARIANTS_S = (("shuffle", Blosc.SHUFFLE), ("bitshuffle", Blosc.BITSHUFFLE))
VARIANTS_C = (("zstd", 1), ("zstd", 3), ("zstd", 6), ("lz4", 1))


def variants(prev_s: Snap, cur_s: Snap, quick: bool) -> list[dict[str, Any]]:
    prev, cur = prev_s.arrays, cur_s.arrays
    rows = []
    classes = [c for c in CLASSES if c != ADAM3]
    codecs = VARIANTS_C[:2] + VARIANTS_C[3:] if quick else VARIANTS_C
    for c in classes:
        keys = class_arrays(cur, c)
        raw = sum(cur[k].nbytes for k in keys)
        for how in VARIANTS_T:
            xs = [transform(cur[k], prev[k], how) for k in keys]
            for sname, shuf in VARIANTS_S:
                for cname, clevel in codecs:
                    t = time.perf_counter()
                    n = sum(blosc_size(x, cname, clevel, shuf) for x in xs)
                    dt = time.perf_counter() - t
                    rows.append(
                        {
                            "class": c,
                            "transform": how,
                            "shuffle": sname,
                            "codec": f"{cname}{clevel}",
                            "ratio": raw / n,
                            "compress_gb_s": raw / dt / 1e9,
                        }
                    )
    return rows


# -- speed and read latency -------------------------------------------------------------------
def speed(prev_s: Snap, cur_s: Snap, repeats: int, disk_bps: float) -> dict[str, Any]:
    pol = DeltaPolicy()
    prev, cur = prev_s.arrays, cur_s.arrays
    out: dict[str, Any] = {}
    for c in (ADAM3, "bf16 params"):
        keys = class_arrays(cur, c)
        size = cur[keys[0]].dtype.itemsize
        a = np.concatenate([u8(cur[k]) for k in keys])
        b = np.concatenate([u8(prev[k]) for k in keys])
        # 16 MiB pieces, as the engine's chunks are
        pieces = [(a[i : i + 16 * MiB], b[i : i + 16 * MiB]) for i in range(0, a.nbytes, 16 * MiB)]
        payloads = [xor_encode(x, y, size, pol) for x, y in pieces]
        sink = np.empty_like(a)
        np.copyto(sink, a)  # fault its pages in: the memcpy is into a reused buffer
        t_enc = timed(lambda s=size, ps=pieces: [xor_encode(x, y, s, pol) for x, y in ps], repeats)
        t_dec = timed(
            lambda ps=pieces, pl=payloads: [
                xor_decode(p, y) for p, (_, y) in zip(pl, ps, strict=True)
            ],
            repeats,
        )
        t_cpy = timed(lambda src=a, dst=sink: np.copyto(dst, src), repeats)
        for p, (x, y) in zip(payloads, pieces, strict=True):
            assert np.array_equal(xor_decode(p, y), x)
        enc, dec, cpy = a.nbytes / t_enc, a.nbytes / t_dec, a.nbytes / t_cpy
        out[c] = {
            "bytes": a.nbytes,
            "ratio": a.nbytes / sum(len(p) for p in payloads),
            "encode_gb_s": enc / 1e9,
            "decode_gb_s": dec / 1e9,
            "memcpy_gb_s": cpy / 1e9,
            "disk_gb_s": disk_bps / 1e9,
            "encode_vs_memcpy": enc / cpy,
            "decode_vs_memcpy": dec / cpy,
            "encode_vs_disk": enc / disk_bps,
            "decode_vs_disk": dec / disk_bps,
        }
    out[ADAM3 + " predictive"] = speed_predictive(prev_s, cur_s, repeats, disk_bps)
    return out


def speed_predictive(prev: Snap, cur: Snap, repeats: int, disk_bps: float) -> dict[str, Any]:
    """The library's path on the fp32 Adam state, on 16 MiB pieces aligned across m, v, p:
    encode = m XOR (lz4) + predict and residual XOR (zstd) of v and p, with reused work
    buffers as the encoder has; decode = ``xor_decode`` of m, then predict + ``xor_decode``
    of v and p, allocating as the reader does. Conservative for encode: the encoder skips m's
    XOR (writes it raw) while that does not pay ``min_ratio``."""
    pol = DeltaPolicy()
    preds = predictions(cur)
    sets: dict[tuple[tuple[float, ...], tuple[float, ...]], list[str]] = defaultdict(list)
    for n in cur.adam:  # params with the same coefficients can share a piece
        pv, pp = preds.get(f"exp_avg_sq/{n}"), preds.get(f"params/{n}")
        if pv is not None and pp is not None:
            sets[(pv.coeffs, pp.coeffs)].append(n)
    Piece = tuple[list[np.ndarray], tuple[float, ...], tuple[float, ...]]
    pieces: list[Piece] = []
    for (cv, cp), names in sets.items():
        cols = [
            np.concatenate([u8(st.arrays[f"{pre}/{n}"]) for n in names])
            for pre in ("exp_avg", "exp_avg_sq", "params")
            for st in (cur, prev)
        ]
        for i in range(0, cols[0].nbytes, 16 * MiB):
            pieces.append(([x[i : i + 16 * MiB] for x in cols], cv, cp))
    total = sum(x.nbytes for cols, _, _ in pieces for x in cols[0::2])
    work = np.empty(16 * MiB, np.uint8), np.empty(16 * MiB, np.uint8)

    def encode() -> list[tuple[bytes, bytes, bytes]]:
        res = []
        for (mc, mp, vc, vp, pc, pp), cv, cp in pieces:
            n = mc.nbytes
            o, t = work[0][:n], work[1][:n]
            em = xor_encode(mc, mp, 4, pol, out=o)
            g = predict("adam_v", vp, [mc, mp], cv, out=o, tmp=t)
            ev = xor_encode(vc, g, 4, pol, cname=pol.residual_cname, out=g)
            g = predict("adam_p", pp, [mc, vc], cp, out=o, tmp=t)
            ep = xor_encode(pc, g, 4, pol, cname=pol.residual_cname, out=g)
            res.append((em, ev, ep))
        return res

    payloads = encode()

    def decode() -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        res = []
        for ((_, mp, _, vp, _, pp), cv, cp), (em, ev, ep) in zip(pieces, payloads, strict=True):
            m = xor_decode(em, mp)
            v = xor_decode(ev, predict("adam_v", vp, [m, mp], cv))
            p = xor_decode(ep, predict("adam_p", pp, [m, v], cp))
            res.append((m, v, p))
        return res

    for ((mc, _, vc, _, pc, _), _, _), got in zip(pieces, decode(), strict=True):
        for want, x in zip((mc, vc, pc), got, strict=True):  # bit-exact
            assert np.array_equal(x, want)
    a = np.concatenate([x for cols, _, _ in pieces for x in cols[0::2]])
    sink = np.empty_like(a)
    np.copyto(sink, a)  # fault its pages in: the memcpy is into a reused buffer
    t_enc, t_dec = timed(encode, repeats), timed(decode, repeats)
    t_cpy = timed(lambda: np.copyto(sink, a), repeats)
    enc, dec, cpy = total / t_enc, total / t_dec, total / t_cpy
    nbytes = [sum(len(e[i]) for e in payloads) for i in range(3)]
    raw3 = [sum(cols[2 * i].nbytes for cols, _, _ in pieces) for i in range(3)]
    return {
        "bytes": total,
        "ratio": total / sum(nbytes),
        "ratio_by_array": {
            k: r / n
            for k, r, n in zip(
                ("exp_avg (xor)", "exp_avg_sq (pred)", "params (pred)"), raw3, nbytes, strict=True
            )
        },
        "coefficient_sets": len(sets),
        "pieces": len(pieces),
        "encode_gb_s": enc / 1e9,
        "decode_gb_s": dec / 1e9,
        "memcpy_gb_s": cpy / 1e9,
        "disk_gb_s": disk_bps / 1e9,
        "encode_vs_memcpy": enc / cpy,
        "decode_vs_memcpy": dec / cpy,
        "encode_vs_disk": enc / disk_bps,
        "decode_vs_disk": dec / disk_bps,
    }


def read_latency(chain: list[Snap], root: Path, repeats: int) -> dict[str, Any]:
    """Commit ``chain`` (fp32 state, with the session's predictions) as consecutive steps of
    one keyframe chain; time reads."""
    run = root / "read-run"
    shutil.rmtree(run, ignore_errors=True)
    repo = Repository.create(run)
    arrays = chain[0].arrays
    names = [k.split("/", 1)[1] for k in arrays if k.startswith("params/")]
    # m, v, p of each param: a prediction's "cur" inputs are written before it
    keys = [
        f"{pre}/{n}"
        for n in names
        for pre in ("exp_avg", "exp_avg_sq", "params")
        if f"{pre}/{n}" in arrays
    ]
    pol = DeltaPolicy(keyframe_every=len(chain), min_ratio=1.0)
    with repo.writer(encoding=pol) as w:
        for step, st in enumerate(chain, start=1):
            txn = w.begin(step)
            txn.predict(predictions(st))
            for k in keys:
                a = st.arrays[k]
                plan = txn.declare(k, "float32", a.shape)
                flat = u8(a)
                for i in range(plan.n_chunks):
                    lo, hi = plan.byte_range(i)
                    txn.put_chunk(k, i, flat[lo:hi])
            txn.commit()
    headers = repo.reader().lineage()
    out: dict[str, Any] = {
        "chain": len(chain),
        "tensors": len(keys),
        "raw_bytes": sum(arrays[k].nbytes for k in keys),
    }
    for label, h in (
        ("keyframe", headers[0]),
        ("delta depth 1", headers[1]),
        (f"delta depth {len(chain) - 1}", headers[-1]),
    ):

        def read_all(h: Any = h) -> None:
            r = repo.reader()  # fresh: no decoded-chunk cache
            for k in keys:
                r.read_array(h, k)

        r0 = repo.reader()
        recs = r0.arrays(h)
        enc = {c.encoding for k in keys for c in recs[k].chunks}
        st = chain[h.step - 1]
        for k in keys:  # bit-exact
            assert np.array_equal(
                r0.read_array(h, k).view(np.uint32), st.arrays[k].view(np.uint32)
            ), (label, k)
        out[label] = {
            "seconds": timed(read_all, repeats),
            "encodings": sorted(enc),
            "bytes_on_disk": sum(c.nbytes for k in keys for c in recs[k].chunks),
        }
    base = out["keyframe"]["seconds"]
    for label in list(out):
        if isinstance(out[label], dict) and "seconds" in out[label]:
            out[label]["vs_keyframe"] = out[label]["seconds"] / base
    shutil.rmtree(run, ignore_errors=True)
    return out


# -- driver -----------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny model, few steps (smoke run)")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--capture", default=None, help="steps k to compare with k+1, e.g. 10,100")
    ap.add_argument("--chain", type=int, default=None, help="states in the read-latency chain")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.quick:
        cfg = dict(vocab=128, d=64, layers=2, heads=4, seq=32, batch=8)
        steps, capture, chain, repeats = 24, [5, 20], 3, 2
    else:
        cfg = dict(vocab=512, d=256, layers=4, heads=8, seq=64, batch=8)
        steps, capture, chain, repeats = 300, [10, 100, 290], 8, 5
    steps = args.steps or steps
    capture = [int(c) for c in args.capture.split(",")] if args.capture else capture
    chain = args.chain or chain
    repeats = args.repeats or repeats
    capture = [c for c in capture if c + 1 <= steps]
    out_json = (
        Path(args.json)
        if args.json
        else (
            Path(__file__).parent / "results" / ("delta_quick.json" if args.quick else "delta.json")
        )
    )

    def log(msg: str) -> None:
        print(msg, flush=True)

    root = Path(tempfile.mkdtemp(prefix="dstt-delta-", dir=args.dir))
    t_start = time.perf_counter()
    res: dict[str, Any] = {
        "benchmark": "delta",
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "quick": args.quick,
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "train_threads": args.threads,
            "source": source_state(),
            "loadavg_before": os.getloadavg(),
        },
        "model": cfg,
        "steps": steps,
        "capture": capture,
        "repeats": repeats,
        "policy": {
            "cname": DeltaPolicy().cname,
            "clevel": DeltaPolicy().clevel,
            "residual_cname": DeltaPolicy().residual_cname,
            "shuffle": "byte",
            "min_ratio": DeltaPolicy().min_ratio,
            "read_amplification": DeltaPolicy().read_amplification,
            "max_chain": DeltaPolicy().max_chain,
            "predict": DeltaPolicy().predict,
            "session_raw_when_busy": False,
        },
    }
    try:
        log(f"training {steps} steps of TinyGPT{cfg} with a DeltaPolicy session ...")
        pairs, tail, info = train(cfg, steps, capture, chain, root / "session-run", log)
        res["training"] = info
        res["session_classes"] = session_classes(root / "session-run")
        shutil.rmtree(root / "session-run", ignore_errors=True)
        log("ratios per capture point ...")
        res["points"] = {str(k): ratios_at(a, b) for k, (a, b) in sorted(pairs.items())}
        last = max(pairs)
        log("variants ...")
        res["variants"] = variants(*pairs[last], quick=args.quick)
        log("codec speed ...")
        bw = med([disk_bandwidth(root, (16 if args.quick else 256) * MiB) for _ in range(3)])
        res["disk_write_gb_s"] = bw / 1e9
        res["speed"] = speed(*pairs[last], repeats, bw)
        log("read latency ...")
        res["read_latency"] = read_latency(tail, root, repeats)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    lp = res["points"][str(last)]
    best = max(
        (r for r in res["variants"] if r["class"].startswith("fp32")), key=lambda r: r["ratio"]
    )
    lib3 = lp[ADAM3]
    sess3 = res["session_classes"][ADAM3]["ratio"]
    res["targets"] = {
        "target_ratio": 2.5,
        # the headline (``met``): what the session wrote over the whole run, keyframes included
        "fp32_adam_state_ratio_session": sess3,
        # the library's encoding (predictions) at the last point: between keyframes, and an
        # estimate with the keyframes of the K the encoder would choose
        "fp32_adam_state_ratio_predictive_between_keyframes": lib3["lib_ratio"],
        "fp32_adam_state_ratio_predictive_with_keyframes_est": lib3["lib_est_ratio"],
        "fp32_adam_state_predictive_keyframe_every": lib3["lib_keyframe_every"],
        # XOR only against the previous step (no prediction), for comparison
        "fp32_adam_state_ratio_library": lib3["ratio"],
        "fp32_adam_state_ratio_xor_only": lib3["ratio"],
        "fp32_moments_ratio_library": (
            (lp["fp32 exp_avg"]["raw_bytes"] + lp["fp32 exp_avg_sq"]["raw_bytes"])
            / (lp["fp32 exp_avg"]["xor_bytes"] + lp["fp32 exp_avg_sq"]["xor_bytes"])
        ),
        "fp32_adam_state_xor_bound": lib3["xor_bound_ratio"],
        "best_fp32_variant": best,
        "met": sess3 >= 2.5,
        "met_on": "fp32_adam_state_ratio_session",
    }
    return finish(res, out_json, t_start, print_tables)


if __name__ == "__main__":
    main()
