"""The tables ``delta_bench.py`` prints from its results (kept apart: the bench measures,
this only formats)."""

from __future__ import annotations

from typing import Any

__all__ = ["ADAM3", "CLASSES", "print_tables"]

CLASSES = (
    "fp32 params",
    "fp32 exp_avg",
    "fp32 exp_avg_sq",
    "fp32 Adam state (all 3)",
    "bf16 params",
    "fp16 params",
)
ADAM3 = "fp32 Adam state (all 3)"


def print_tables(res: dict[str, Any]) -> None:
    pts = list(res["points"])
    last = res["points"][pts[-1]]
    sc = res["session_classes"]
    print(
        "\n== XOR only: bytes per step / raw (xor_encode vs the previous step: Blosc "
        "byte-shuffle + the policy's codec: lz4 for fp32, zstd for 16-bit; whatever the "
        "ratio)"
    )
    print(
        f"{'class':>26} "
        + " ".join(f"{'step ' + p:>14}" for p in pts)
        + f" {'plain':>10} {'XOR bound':>10}"
    )
    for c in CLASSES:
        cells = " ".join(
            f"{res['points'][p][c]['written_over_raw']:6.3f} ({res['points'][p][c]['ratio']:4.2f}x)"
            for p in pts
        )
        print(
            f"{c:>26} {cells} {1 / last[c]['plain_zstd_ratio']:10.3f} "
            f"{1 / last[c]['xor_bound_ratio']:10.3f}"
        )
    print(
        "  (written/raw; ratio raw/written in brackets; plain = shuffle + codec of the new "
        "state, no delta; XOR bound = leading-zero-bit limit)"
    )
    print(
        "\n== library, DeltaPolicy() with predictions: bytes per step / raw (exp_avg XOR/lz4, "
        "exp_avg_sq and params predicted, residual zstd 1; raw when under min_ratio)"
    )
    print(
        f"{'class':>26} "
        + " ".join(f"{'step ' + p:>14}" for p in pts)
        + f" {'+keyframes est':>16} {'K':>8} {'session run':>15}"
    )
    for c in CLASSES:
        cells = " ".join(
            f"{res['points'][p][c]['lib_written_over_raw']:6.3f} "
            f"({res['points'][p][c]['lib_ratio']:4.1f}x)"
            for p in pts
        )
        kf = last[c]["lib_keyframe_every"]
        s = sc.get(c)
        sess = f"{s['written_over_raw']:.3f} ({s['ratio']:4.2f}x)" if s else "-"
        print(
            f"{c:>26} {cells} {1 / last[c]['lib_est_ratio']:8.3f} "
            f"({last[c]['lib_est_ratio']:4.2f}x) {kf['min']:>3}-{kf['max']:<4} {sess:>15}"
        )
    print(
        "  (steps: between keyframes; +keyframes est = (raw + (K-1)·between)/K per tensor at "
        "the last point, K the encoder's choice (range shown), an estimate; session run = what "
        "the session wrote over the whole run, keyframes included)"
    )
    for c, r in sc.items():
        print(
            f"  session {c}: chunks {r['chunks_by_encoding']}, dedup refs {r['dedup_refs']}, "
            f"base older than the previous commit {r['stale_base_chunks']} "
            f"({r['stale_base_bytes'] / max(1, r['written_bytes']):.1%} of its bytes)"
        )
    print("\n== worst fp32 tensors (>= 16 KiB) for the library at the last point")
    for r in last["worst_tensors_lib"][:6]:
        print(
            f"  {r['tensor']:>40} {r['class']:>16} {r['lib_encoding']:>5} ratio "
            f"{r['lib_ratio']:5.2f} (XOR only {r['ratio']:.2f})  K {r['lib_keyframe_every']}  "
            f"changed {r['changed_frac']:.1%}"
        )
    print(
        "\n== variants (vs the previous step, no prediction) at the last point: ratio "
        "raw/written (compress GB/s)"
    )
    rows = res["variants"]
    classes = sorted({r["class"] for r in rows}, key=CLASSES.index)
    combos = sorted({(r["transform"], r["shuffle"], r["codec"]) for r in rows})
    print(f"{'transform/shuffle/codec':>28} " + " ".join(f"{c[:15]:>16}" for c in classes))
    for t, s_, co in combos:
        vcells = []
        for c in classes:
            r = next(
                x
                for x in rows
                if x["class"] == c and (x["transform"], x["shuffle"], x["codec"]) == (t, s_, co)
            )
            vcells.append(f"{r['ratio']:5.2f}x ({r['compress_gb_s']:5.2f})")
        print(f"{t + '/' + s_ + '/' + co:>28} " + " ".join(f"{x:>16}" for x in vcells))
    print("\n== codec speed, 16 MiB pieces (GB/s of raw bytes; ratios measured in this run)")
    for c, r in res["speed"].items():
        print(
            f"  {c} ({r['ratio']:.2f}x): encode {r['encode_gb_s']:.2f} "
            f"(x{r['encode_vs_disk']:.2f} disk, x{r['encode_vs_memcpy']:.3f} memcpy), decode "
            f"{r['decode_gb_s']:.2f} (x{r['decode_vs_disk']:.2f} disk, "
            f"x{r['decode_vs_memcpy']:.3f} memcpy), memcpy {r['memcpy_gb_s']:.2f}, "
            f"disk {r['disk_gb_s']:.2f}"
        )
    rl = res["read_latency"]
    print(
        f"\n== read latency, all {rl['tensors']} fp32 tensors ({rl['raw_bytes'] / 1e6:.1f} MB), "
        f"chain of {rl['chain']} committed with predictions"
    )
    for k, v in rl.items():
        if isinstance(v, dict):
            print(
                f"  {k:>16}: {v['seconds'] * 1e3:8.1f} ms  x{v['vs_keyframe']:.2f} "
                f"vs keyframe  ({'/'.join(v['encodings'])}, {v['bytes_on_disk'] / 1e6:.1f} MB "
                "on disk)"
            )
    t = res["training"]
    print(
        f"\nsession ({t['session_policy']}): {t['session_steps']} steps, written/raw per step "
        f"median {t['session_written_over_raw_median']:.3f}, "
        f"total {t['session_written_over_raw_total']:.3f}, "
        f"raw-fallback steps {t['session_raw_fallback_steps']}, chunks key/delta/dedup "
        f"{t['session_keyframes']}/{t['session_deltas']}/{t['session_dedups']}"
    )
    g = res["targets"]
    print(
        f"target >= {g['target_ratio']}x fewer bytes for fp32 Adam state: session whole run "
        f"{g['fp32_adam_state_ratio_session']:.2f}x (met: {g['met']}); library between "
        f"keyframes {g['fp32_adam_state_ratio_predictive_between_keyframes']:.2f}x, with "
        f"keyframes (est.) {g['fp32_adam_state_ratio_predictive_with_keyframes_est']:.2f}x; "
        f"XOR only {g['fp32_adam_state_ratio_library']:.2f}x (bound "
        f"{g['fp32_adam_state_xor_bound']:.2f}x)"
    )
