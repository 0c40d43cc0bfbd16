"""Fewer bytes per step (issue 8): XOR deltas on real consecutive training states.

A GPT-like model (``dstt.testing.models.TinyGPT``) trains for real with AdamW (GPT-style
hyperparameters: lr 6e-4 after a 20-step warmup, betas (0.9, 0.95), weight decay 0.1) while a
``dstt.session(..., encoding=DeltaPolicy())`` captures every step. At a few capture points the
states of steps k and k+1 are cloned; at the end a chain of consecutive states is kept. Then:

1. **bytes per step** as written/raw, per tensor class: fp32 params, fp32 Adam moments
   (``exp_avg``, ``exp_avg_sq``), the whole fp32 Adam state (the three together), and the same
   params cast to bf16 and fp16 (as a mixed-precision run would hold them) — encoded with the
   library's own ``dstt.store.codec.xor_encode`` and its default policy, per tensor. Beside it:
   plain shuffle+zstd of the new state (no delta), and the *XOR bound*: bits / (bits - leading
   zero bits of cur^prev) per element, what a coder that stores only the bits after the first
   differing one would reach (the low bits are close to random, so this is near the ceiling
   of any XOR-based lossless scheme).
2. **end to end**: what the session actually wrote per class over the run (unique chunk files
   in the arrays tables: keyframes + deltas, dedups counted once) and its per-step metrics.
3. **variants** (to choose from): transform XOR / integer difference / zigzag of the integer
   difference, Blosc byte-shuffle / bit-shuffle, zstd clevel 1, 3, 6 / lz4 clevel 1, each with
   ratio and encode speed, on the last capture point.
4. **speed**: ``xor_encode`` / ``xor_decode`` GB/s (of raw bytes) on the fp32 state, as ratios
   to a memcpy into a reused buffer and to the disk's write bandwidth (64 MiB writes + fsync),
   all measured in this run.
5. **read latency**: ``Reader.read_array`` of every tensor of a keyframe slot vs a delta slot of
   depth 1 and the deepest slot of a ``keyframe_every=chain`` chain, with a fresh ``Reader``
   each time (its decoded-chunk cache empty; the page cache is warm — the run was just written).

GB are 10^9 bytes; timings are medians over ``--repeats``.

    python bench/delta_bench.py [--quick] [--steps 300] [--repeats 5] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import torch
from _common import disk_bandwidth, source_state
from numcodecs import Blosc

import dstt
from dstt.store import DeltaPolicy, Repository
from dstt.store.codec import xor_decode, xor_encode
from dstt.testing.models import TinyGPT, make_batch

MiB = 1024 * 1024
CLASSES = ("fp32 params", "fp32 exp_avg", "fp32 exp_avg_sq", "fp32 Adam state (all 3)",
           "bf16 params", "fp16 params")
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
def snapshot(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, np.ndarray]:
    """Cloned state as numpy: params (fp32 + bf16/fp16 casts as uint16 bits) and moments."""
    out: dict[str, np.ndarray] = {}
    names = {id(p): n for n, p in model.named_parameters()}
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
    return out


def klass(key: str) -> str:
    kind = key.split("/", 1)[0]
    return {"params": "fp32 params", "exp_avg": "fp32 exp_avg", "exp_avg_sq": "fp32 exp_avg_sq",
            "bf16": "bf16 params", "fp16": "fp16 params"}[kind]


def session_class(path: str) -> str | None:
    if path.startswith("params/"):
        return "fp32 params"
    if path.startswith("optim/exp_avg_sq/"):
        return "fp32 exp_avg_sq"
    if path.startswith("optim/exp_avg/"):
        return "fp32 exp_avg"
    return None


def train(cfg: dict[str, Any], steps: int, capture: list[int], chain: int, run: Path,
          log: Any) -> tuple[dict[int, tuple[dict, dict]], list[dict], dict[str, Any]]:
    torch.manual_seed(0)
    model = TinyGPT(vocab=cfg["vocab"], d=cfg["d"], layers=cfg["layers"], heads=cfg["heads"],
                    seq=cfg["seq"], dropout=0.1)
    opt = torch.optim.AdamW(model.parameters(), lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20))
    pairs: dict[int, tuple[dict, dict]] = {}
    prev: dict[str, np.ndarray] | None = None
    tail: list[dict[str, np.ndarray]] = []
    want = set(capture) | {c + 1 for c in capture}
    losses = []
    t0 = time.perf_counter()
    with dstt.session(model, opt, run=run, every=1, scheduler=sched,
                      encoding=DeltaPolicy()) as s:
        for i in range(1, steps + 1):
            x, y = make_batch(i, batch_size=cfg["batch"], seq=cfg["seq"], vocab=cfg["vocab"])
            _, loss = model(x, y)
            assert loss is not None
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            sched.step()
            losses.append(float(loss.detach()))
            if i in want or i > steps - chain:
                snap = snapshot(model, opt)
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
        "loss_first": losses[0], "loss_last": losses[-1],
        "session_steps": len(ms),
        "session_written_over_raw_median": med([m.written_bytes / m.bytes for m in ms[1:]]),
        "session_written_over_raw_total": (sum(m.written_bytes for m in ms)
                                           / max(1, sum(m.bytes for m in ms))),
        "session_raw_fallback_steps": sum(1 for m in ms if m.raw_fallback),
        "session_keyframes": sum(m.keyframes for m in ms),
        "session_deltas": sum(m.deltas for m in ms),
        "session_dedups": sum(m.dedups for m in ms),
        "train_s": time.perf_counter() - t0,
        "params": sum(p.numel() for p in model.parameters()),
    }
    return pairs, tail, info


def session_classes(run: Path) -> dict[str, dict[str, float]]:
    """Per class, over the whole run: unique bytes on disk vs raw bytes committed."""
    r = Repository.open(run).reader()
    raw: dict[str, int] = defaultdict(int)
    written: dict[str, int] = defaultdict(int)
    nd: dict[str, int] = defaultdict(int)
    nk: dict[str, int] = defaultdict(int)
    seen: set[str] = set()
    for h in r.lineage():
        for path, rec in r.arrays(h).items():
            c = session_class(path)
            if c is None:
                continue
            raw[c] += rec.plan.nbytes
            for ch in rec.chunks:
                if ch.key in seen:
                    continue  # a dedup reference to an older file
                seen.add(ch.key)
                written[c] += ch.nbytes
                if ch.encoding == "raw":
                    nk[c] += 1
                else:
                    nd[c] += 1
    out = {}
    for c in raw:
        out[c] = {"written_over_raw": written[c] / raw[c], "ratio": raw[c] / written[c],
                  "keyframe_chunks": nk[c], "delta_chunks": nd[c]}
    tot_raw = sum(raw.values())
    tot_w = sum(written.values())
    out["fp32 Adam state (all 3)"] = {"written_over_raw": tot_w / tot_raw,
                                      "ratio": tot_raw / tot_w,
                                      "keyframe_chunks": sum(nk.values()),
                                      "delta_chunks": sum(nd.values())}
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
    if c == "fp32 Adam state (all 3)":
        return [k for k in state if klass(k) in ("fp32 params", "fp32 exp_avg",
                                                  "fp32 exp_avg_sq")]
    return [k for k in state if klass(k) == c]


def ratios_at(prev: dict[str, np.ndarray], cur: dict[str, np.ndarray]) -> dict[str, Any]:
    pol = DeltaPolicy()
    out: dict[str, Any] = {}
    per_tensor: list[dict[str, Any]] = []
    for c in CLASSES:
        keys = class_arrays(cur, c)
        raw = enc = plain = 0
        lz_sum = 0.0
        n_el = 0
        bits = 32
        for k in keys:
            a, b = cur[k], prev[k]
            size = a.dtype.itemsize
            ua, ub = a.reshape(-1).view(np.uint8), b.reshape(-1).view(np.uint8)
            e = len(xor_encode(ua, ub, size, pol))
            p = blosc_size(a.reshape(-1).view(_UINT[size]), pol.cname, pol.clevel, Blosc.SHUFFLE)
            lz, bits = xor_bound_bits(a, b)
            raw += a.nbytes
            enc += e
            plain += p
            lz_sum += lz * a.size
            n_el += a.size
            if c != "fp32 Adam state (all 3)":
                per_tensor.append({"tensor": k, "class": c, "bytes": a.nbytes,
                                   "ratio": a.nbytes / e,
                                   "changed_frac": float(np.mean(a.view(_UINT[size])
                                                                 != b.view(_UINT[size]))),
                                   "lz_bits": lz})
        lz_mean = lz_sum / max(1, n_el)
        out[c] = {"raw_bytes": raw, "xor_bytes": enc, "ratio": raw / enc,
                  "written_over_raw": enc / raw, "plain_zstd_ratio": raw / plain,
                  "lz_bits": lz_mean, "xor_bound_ratio": bits / max(1e-9, bits - lz_mean)}
    # tiny tensors (biases, norms) are dominated by Blosc's header: rank those >= 16 KiB
    per_tensor = [r for r in per_tensor if r["bytes"] >= 16384] or per_tensor
    per_tensor.sort(key=lambda r: r["ratio"])
    out["worst_tensors"] = per_tensor[:8]
    out["best_tensors"] = per_tensor[-4:]
    return out


VARIANTS_T = ("xor", "sub", "zigzag")
VARIANTS_S = (("shuffle", Blosc.SHUFFLE), ("bitshuffle", Blosc.BITSHUFFLE))
VARIANTS_C = (("zstd", 1), ("zstd", 3), ("zstd", 6), ("lz4", 1))


def variants(prev: dict[str, np.ndarray], cur: dict[str, np.ndarray],
             quick: bool) -> list[dict[str, Any]]:
    rows = []
    classes = [c for c in CLASSES if c != "fp32 Adam state (all 3)"]
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
                    rows.append({"class": c, "transform": how, "shuffle": sname,
                                 "codec": f"{cname}{clevel}", "ratio": raw / n,
                                 "compress_gb_s": raw / dt / 1e9})
    return rows


# -- speed and read latency -------------------------------------------------------------------
def speed(prev: dict[str, np.ndarray], cur: dict[str, np.ndarray], repeats: int,
          disk_bps: float) -> dict[str, Any]:
    pol = DeltaPolicy()
    out: dict[str, Any] = {}
    for c in ("fp32 Adam state (all 3)", "bf16 params"):
        keys = class_arrays(cur, c)
        size = cur[keys[0]].dtype.itemsize
        a = np.concatenate([cur[k].reshape(-1).view(np.uint8) for k in keys])
        b = np.concatenate([prev[k].reshape(-1).view(np.uint8) for k in keys])
        # 16 MiB pieces, as the engine's chunks are
        pieces = [(a[i:i + 16 * MiB], b[i:i + 16 * MiB]) for i in range(0, a.nbytes, 16 * MiB)]
        payloads = [xor_encode(x, y, size, pol) for x, y in pieces]
        sink = np.empty_like(a)
        t_enc = timed(lambda s=size, ps=pieces: [xor_encode(x, y, s, pol) for x, y in ps],
                      repeats)
        t_dec = timed(lambda ps=pieces, pl=payloads: [xor_decode(p, y) for p, (_, y) in
                                                      zip(pl, ps, strict=True)], repeats)
        t_cpy = timed(lambda src=a, dst=sink: np.copyto(dst, src), repeats)
        for p, (x, y) in zip(payloads, pieces, strict=True):
            assert np.array_equal(xor_decode(p, y), x)
        enc, dec, cpy = a.nbytes / t_enc, a.nbytes / t_dec, a.nbytes / t_cpy
        out[c] = {"bytes": a.nbytes, "encode_gb_s": enc / 1e9, "decode_gb_s": dec / 1e9,
                  "memcpy_gb_s": cpy / 1e9, "disk_gb_s": disk_bps / 1e9,
                  "encode_vs_memcpy": enc / cpy, "decode_vs_memcpy": dec / cpy,
                  "encode_vs_disk": enc / disk_bps, "decode_vs_disk": dec / disk_bps}
    return out


def read_latency(chain: list[dict[str, np.ndarray]], root: Path,
                 repeats: int) -> dict[str, Any]:
    """Commit ``chain`` (fp32 state) as consecutive steps of one keyframe chain; time reads."""
    run = root / "read-run"
    shutil.rmtree(run, ignore_errors=True)
    repo = Repository.create(run)
    keys = [k for k in chain[0] if klass(k).startswith("fp32")]
    pol = DeltaPolicy(keyframe_every=len(chain), min_ratio=1.0)
    with repo.writer(encoding=pol) as w:
        for step, st in enumerate(chain, start=1):
            txn = w.begin(step)
            for k in keys:
                a = st[k]
                plan = txn.declare(k, "float32", a.shape)
                flat = a.reshape(-1).view(np.uint8)
                for i in range(plan.n_chunks):
                    lo, hi = plan.byte_range(i)
                    txn.put_chunk(k, i, flat[lo:hi])
            txn.commit()
    headers = repo.reader().lineage()
    out: dict[str, Any] = {"chain": len(chain), "tensors": len(keys),
                           "raw_bytes": sum(chain[0][k].nbytes for k in keys)}
    for label, h in (("keyframe", headers[0]), ("delta depth 1", headers[1]),
                     (f"delta depth {len(chain) - 1}", headers[-1])):
        def read_all(h: Any = h) -> None:
            r = repo.reader()  # fresh: no decoded-chunk cache
            for k in keys:
                r.read_array(h, k)
        r0 = repo.reader()
        recs = r0.arrays(h)
        enc = {c.encoding for k in keys for c in recs[k].chunks}
        st = chain[h.step - 1]
        for k in keys[:3]:  # bit-exact
            assert np.array_equal(r0.read_array(h, k).view(np.uint32), st[k].view(np.uint32))
        out[label] = {"seconds": timed(read_all, repeats), "encodings": sorted(enc),
                      "bytes_on_disk": sum(c.nbytes for k in keys for c in recs[k].chunks)}
    base = out["keyframe"]["seconds"]
    for label in list(out):
        if isinstance(out[label], dict) and "seconds" in out[label]:
            out[label]["vs_keyframe"] = out[label]["seconds"] / base
    shutil.rmtree(run, ignore_errors=True)
    return out


# -- driver -----------------------------------------------------------------------------------
def print_tables(res: dict[str, Any]) -> None:
    print("\n== bytes written per step / raw (library codec: XOR + Blosc shuffle + zstd 1)")
    pts = list(res["points"])
    print(f"{'class':>26} " + " ".join(f"{'step ' + p:>14}" for p in pts)
          + f" {'plain zstd':>11} {'XOR bound':>10} {'session':>9}")
    last = res["points"][pts[-1]]
    for c in CLASSES:
        cells = " ".join(f"{res['points'][p][c]['written_over_raw']:6.3f} "
                         f"({res['points'][p][c]['ratio']:4.2f}x)" for p in pts)
        sess = res["session_classes"].get(c)
        sess_s = f"{sess['written_over_raw']:.3f}" if sess else "-"
        print(f"{c:>26} {cells} {1 / last[c]['plain_zstd_ratio']:11.3f} "
              f"{1 / last[c]['xor_bound_ratio']:10.3f} {sess_s:>9}")
    print("  (written/raw; ratio raw/written in brackets; plain zstd = no delta; XOR bound = "
          "leading-zero-bit limit; session = what the dstt session wrote over the whole run, "
          "keyframes included)")
    print("\n== worst tensors (>= 16 KiB) at the last point")
    for r in last["worst_tensors"][:6]:
        print(f"  {r['tensor']:>40} {r['class']:>16} ratio {r['ratio']:.2f}  changed "
              f"{r['changed_frac']:.1%}  lz bits {r['lz_bits']:.1f}")
    print("\n== variants at the last point: ratio raw/written (compress GB/s)")
    rows = res["variants"]
    classes = sorted({r["class"] for r in rows}, key=CLASSES.index)
    combos = sorted({(r["transform"], r["shuffle"], r["codec"]) for r in rows})
    print(f"{'transform/shuffle/codec':>28} " + " ".join(f"{c[:15]:>16}" for c in classes))
    for t, s, co in combos:
        cells = []
        for c in classes:
            r = next(x for x in rows if x["class"] == c and (x["transform"], x["shuffle"],
                                                             x["codec"]) == (t, s, co))
            cells.append(f"{r['ratio']:5.2f}x ({r['compress_gb_s']:5.2f})")
        print(f"{t + '/' + s + '/' + co:>28} " + " ".join(f"{x:>16}" for x in cells))
    print("\n== codec speed (GB/s of raw bytes; ratios measured in this run)")
    for c, r in res["speed"].items():
        print(f"  {c}: encode {r['encode_gb_s']:.2f} (x{r['encode_vs_disk']:.2f} disk, "
              f"x{r['encode_vs_memcpy']:.3f} memcpy), decode {r['decode_gb_s']:.2f} "
              f"(x{r['decode_vs_disk']:.2f} disk), memcpy {r['memcpy_gb_s']:.2f}, "
              f"disk {r['disk_gb_s']:.2f}")
    rl = res["read_latency"]
    print(f"\n== read latency, all {rl['tensors']} fp32 tensors ({rl['raw_bytes'] / 1e6:.1f} MB), "
          f"chain of {rl['chain']}")
    for k, v in rl.items():
        if isinstance(v, dict):
            print(f"  {k:>16}: {v['seconds'] * 1e3:8.1f} ms  x{v['vs_keyframe']:.2f} "
                  f"vs keyframe  ({'/'.join(v['encodings'])}, {v['bytes_on_disk'] / 1e6:.1f} MB "
                  "on disk)")
    s = res["training"]
    print(f"\nsession: {s['session_steps']} steps, written/raw per step median "
          f"{s['session_written_over_raw_median']:.3f}, "
          f"total {s['session_written_over_raw_total']:.3f}, "
          f"raw-fallback steps {s['session_raw_fallback_steps']}, chunks key/delta/dedup "
          f"{s['session_keyframes']}/{s['session_deltas']}/{s['session_dedups']}")
    print("target >= 2.5x fewer bytes for fp32 Adam state:",
          {k: v for k, v in res["targets"].items()})


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
    out_json = Path(args.json) if args.json else (
        Path(__file__).parent / "results" / ("delta_quick.json" if args.quick else "delta.json"))

    def log(msg: str) -> None:
        print(msg, flush=True)

    root = Path(tempfile.mkdtemp(prefix="dstt-delta-", dir=args.dir))
    t_start = time.perf_counter()
    res: dict[str, Any] = {
        "benchmark": "delta", "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "quick": args.quick,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "torch": torch.__version__, "train_threads": args.threads,
                    "source": source_state(),
                    "loadavg_before": os.getloadavg()},
        "model": cfg, "steps": steps, "capture": capture, "repeats": repeats,
        "policy": {"cname": DeltaPolicy().cname, "clevel": DeltaPolicy().clevel,
                   "shuffle": "byte", "min_ratio": DeltaPolicy().min_ratio},
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
    best = max((r for r in res["variants"] if r["class"].startswith("fp32")),
               key=lambda r: r["ratio"])
    res["targets"] = {
        "target_ratio": 2.5,
        "fp32_adam_state_ratio_library": lp["fp32 Adam state (all 3)"]["ratio"],
        "fp32_moments_ratio_library": (
            (lp["fp32 exp_avg"]["raw_bytes"] + lp["fp32 exp_avg_sq"]["raw_bytes"])
            / (lp["fp32 exp_avg"]["xor_bytes"] + lp["fp32 exp_avg_sq"]["xor_bytes"])),
        "fp32_adam_state_ratio_session": res["session_classes"]["fp32 Adam state (all 3)"]["ratio"],
        "fp32_adam_state_xor_bound": lp["fp32 Adam state (all 3)"]["xor_bound_ratio"],
        "best_fp32_variant": best,
        "met": lp["fp32 Adam state (all 3)"]["ratio"] >= 2.5,
    }
    res["machine"]["loadavg_after"] = os.getloadavg()
    res["wall_s"] = time.perf_counter() - t_start
    print_tables(res)
    out_json.parent.mkdir(parents=True, exist_ok=True)
    out_json.write_text(json.dumps(res, indent=2) + "\n")
    print(f"\nwrote {out_json} ({res['wall_s']:.0f} s)")
    return res


if __name__ == "__main__":
    main()
