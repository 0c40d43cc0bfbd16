"""Write-time summaries (engine side, torch) and their read side, metrics and spikes."""

from __future__ import annotations

import math
import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
from inspect_helpers import new_repo, write_steps

from dstt.analysis.summary_kernel import probe_indices
from dstt.engine.capture.summaries import SummaryAccumulator, tensor_summary
from dstt.errors import CaptureError
from dstt.inspect.diagnose import rank_by_baseline
from dstt.inspect.summaries import find_spikes
from dstt.run import open_run


def test_exact_statistics_match_numpy() -> None:
    t = torch.randn(300, 70, generator=torch.Generator().manual_seed(1))
    s = tensor_summary(t, "params/w")
    x = t.numpy().astype(np.float64)
    assert s["l2"] == pytest.approx(np.linalg.norm(x), rel=1e-6)
    assert s["rms"] == pytest.approx(np.sqrt(np.mean(x * x)), rel=1e-6)
    assert s["maxabs"] == float(np.abs(x).max())
    assert (s["nan"], s["inf"]) == (0, 0)
    assert s["update_l2"] is None
    assert s["update_ratio"] is None


def test_non_finite_values_are_counted_and_excluded() -> None:
    t = torch.tensor([3.0, float("nan"), 4.0, float("inf"), -float("inf"), float("nan")])
    s = tensor_summary(t, "params/w")
    assert (s["nan"], s["inf"]) == (2, 2)
    assert s["l2"] == 5.0
    assert s["maxabs"] == 4.0
    assert s["rms"] == pytest.approx(5.0 / math.sqrt(2))


def test_probe_is_fixed_per_path_and_reads_those_elements() -> None:
    t = torch.arange(10_000, dtype=torch.float32)
    idx = probe_indices("params/layers/0/w", 10_000)
    assert len(idx) == 16
    assert len(set(idx.tolist())) == 16
    assert idx.max() < 10_000
    np.testing.assert_array_equal(idx, probe_indices("params/layers/0/w", 10_000))
    assert not np.array_equal(idx, probe_indices("params/layers/1/w", 10_000))
    s = tensor_summary(t, "params/layers/0/w")
    assert s["probe"] == [float(i) for i in idx]
    assert len(tensor_summary(torch.ones(3), "params/b")["probe"]) == 3


def test_chunked_accumulation_in_any_order_equals_one_shot() -> None:
    g = torch.Generator().manual_seed(2)
    t, prev = torch.randn(1000, 33, generator=g), torch.randn(1000, 33, generator=g)
    one = tensor_summary(t, "params/w", prev=prev)
    flat, pflat = t.reshape(-1), prev.reshape(-1)
    acc = SummaryAccumulator("params/w", t.numel())
    bounds = list(range(0, t.numel(), 4096))
    random.Random(0).shuffle(bounds)
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda s: acc.add(s, flat[s : s + 4096], pflat[s : s + 4096]), bounds))
    many = acc.result()
    for k in ("l2", "rms", "maxabs", "update_l2", "update_ratio"):
        assert many[k] == pytest.approx(one[k], rel=1e-6), k
    assert many["probe"] == one["probe"]
    assert many["update_exact"]
    assert one["update_exact"]


def test_incomplete_accumulation_is_refused() -> None:
    acc = SummaryAccumulator("params/w", 10)
    acc.add(0, torch.ones(4))
    with pytest.raises(CaptureError, match="4 of 10"):
        acc.result()


def test_update_exact_with_previous_copy_and_estimated_from_probe() -> None:
    g = torch.Generator().manual_seed(3)
    prev = torch.randn(200, 50, generator=g)
    t = prev + 0.01
    exact = tensor_summary(t, "params/w", prev=prev)
    assert exact["update_l2"] == pytest.approx(0.01 * math.sqrt(t.numel()), rel=1e-5)
    assert exact["update_ratio"] == pytest.approx(exact["update_l2"] / exact["l2"])
    before = tensor_summary(prev, "params/w")
    est = tensor_summary(t, "params/w", prev_probe=before["probe"])
    assert est["update_exact"] is False
    # a uniform update makes the probe estimate exact up to float32 rounding
    assert est["update_l2"] == pytest.approx(exact["update_l2"], rel=1e-3)


def test_bfloat16_tensors_are_summarised() -> None:
    t = torch.tensor([1.5, -2.0, 0.25], dtype=torch.bfloat16)
    s = tensor_summary(t, "params/w")
    assert s["l2"] == pytest.approx(math.sqrt(1.5**2 + 4 + 0.0625))
    assert s["maxabs"] == 2.0


def _training_like_run(
    path: Path, n: int = 40, spike_at: int = 30, reaction: bool = False
) -> dict[int, np.ndarray]:
    """Two tensors; 'layers.1.w' takes a large update into step ``spike_at - 1`` and the loss
    filed under ``spike_at`` jumps (dstt's step rule: the loss of step k was computed on the
    weights of step k - 1). With ``reaction``, 'layers.0.w' takes an even larger update into
    ``spike_at`` (the optimizer answering the bad loss's gradient): after the cause."""
    written: dict[int, dict[str, np.ndarray]] = {}
    probes: dict[str, list[float]] = {}
    g = torch.Generator().manual_seed(4)
    state = {
        "params/layers/0/w": torch.randn(20, 10, generator=g),
        "params/layers/1/w": torch.randn(30, generator=g),
    }
    prev: dict[str, torch.Tensor] = {}

    def arrays(step: int) -> dict[str, np.ndarray]:
        for k, v in state.items():
            scale = 0.001
            if k.endswith("1/w") and step == spike_at - 1:
                scale = 1.0
            if reaction and k.endswith("0/w") and step == spike_at:
                scale = 3.0
            state[k] = v + scale * torch.randn(v.shape, generator=g)
        written[step] = {k: v.numpy().copy() for k, v in state.items()}
        return written[step]

    def objects(step: int) -> dict[str, object]:
        out = {}
        for k, v in state.items():
            out[k] = tensor_summary(v, k, prev=prev.get(k), prev_probe=probes.get(k))
            probes[k] = out[k]["probe"]
            prev[k] = v.clone()
        return {"summaries": out}

    rng = np.random.default_rng(5)
    losses = {s: 2.0 - 0.01 * s + 0.01 * rng.standard_normal() for s in range(n)}
    losses[spike_at] += 1.0
    write_steps(
        new_repo(path),
        list(range(n)),
        arrays,
        objects_at=objects,
        metrics_at=lambda s: {"loss": losses[s], "lr": 1e-3, "phase": "warm"},
    )
    return written


def test_summaries_dataset_matches_written_tensors(tmp_path: Path) -> None:
    written = _training_like_run(tmp_path / "run")
    ds = open_run(tmp_path / "run").summaries()
    assert ds["l2"].dims == ("step", "tensor")
    assert list(ds["tensor"].values) == ["layers.0.w", "layers.1.w"]
    l2 = ds["l2"].sel(tensor="layers.0.w").values
    np.testing.assert_allclose(
        l2,
        [np.linalg.norm(written[s]["params/layers/0/w"].astype(np.float64)) for s in range(40)],
        rtol=1e-6,
    )
    upd = ds["update_l2"].sel(tensor="layers.1.w")
    assert np.isnan(upd.values[0])
    np.testing.assert_allclose(
        upd.values[1:],
        [
            np.linalg.norm(
                written[s]["params/layers/1/w"].astype(np.float64)
                - written[s - 1]["params/layers/1/w"]
            )
            for s in range(1, 40)
        ],
        rtol=1e-6,
    )
    assert ds["probe"].sizes["probe_index"] == 16
    assert "probe" in ds.data_vars
    assert bool(ds["update_exact"].isel(step=5).all())


def test_metrics_dataset(tmp_path: Path) -> None:
    _training_like_run(tmp_path / "run")
    m = open_run(tmp_path / "run").metrics()
    assert m["loss"].dims == ("step",)
    assert m.sizes["step"] == 40
    assert float(m["lr"].sel(step=7)) == 1e-3
    assert m["phase"].values[0] == "warm"
    assert m["slot"].dims == ("step",)


def test_spikes_find_the_spike_and_the_tensor_that_moved(tmp_path: Path) -> None:
    _training_like_run(tmp_path / "run")
    spikes = open_run(tmp_path / "run").spikes("loss", window=20, z=5.0)
    assert [s.step for s in spikes] == [30]
    assert spikes[0].tensors[0][0] == "layers.1.w"
    assert spikes[0].zscore > 5
    assert "step 30" in str(spikes[0])
    with pytest.raises(KeyError, match="never logged"):
        open_run(tmp_path / "run").spikes("accuracy")


def test_spike_names_the_update_that_caused_it(tmp_path: Path) -> None:
    # the big update is the one into step 29 (28 -> 29); the loss filed under step 30 was
    # computed on the weights of step 29; the larger update into 30 is the reaction to it
    _training_like_run(tmp_path / "run", reaction=True)
    run = open_run(tmp_path / "run")
    (sp,) = run.spikes("loss", window=20, z=5.0)
    assert (sp.step, sp.start) == (30, 30)
    assert (sp.parent, sp.cause, sp.timeline) == (28, 29, "main")
    assert sp.update == (28, 29)
    # ranked by the causing update's summaries, not by the reaction that followed it
    ratio = run.summaries(29)["update_ratio"].sel(step=29)
    assert sp.tensors[0][0] == "layers.1.w"
    assert sp.tensors[0][1] > 100  # z vs its baseline
    assert sp.ratios["layers.1.w"] == pytest.approx(float(ratio.sel(tensor="layers.1.w")))
    # layers.0.w took an ordinary update: listed only if not below its baseline
    z0 = {n: z for n, z, _ in rank_by_baseline(run.summaries(), 29)}["layers.0.w"]
    assert [n for n, _ in sp.tensors] == ["layers.1.w"] + (["layers.0.w"] if z0 >= 0 else [])
    assert "caused by the update 28 -> 29" in str(sp)
    # around widens the ranking to neighbouring commits: then the reaction shows up first
    (wide,) = run.spikes("loss", window=20, z=5.0, around=1)
    assert wide.tensors[0][0] == "layers.0.w"
    assert wide.cause == 29


def test_spike_cause_rule_with_sparse_and_first_commits() -> None:
    from dstt.inspect.summaries import spike_cause

    assert spike_cause([1, 2, 3, 4], 4) == (2, 3)
    # every 10th step committed: the update into k - 1 lies inside one committed interval
    assert spike_cause([10, 20, 30], 21) == (10, 20)  # weights of 20: exactly a commit
    assert spike_cause([10, 20, 30], 25) == (20, 30)  # weights of 24: made inside 20 -> 30
    assert spike_cause([10, 20, 30], 30) == (20, 30)
    assert spike_cause([5, 6, 7], 6) == (None, 5)  # the update into 5 was not captured
    assert spike_cause([5, 6, 7], 5) == (None, None)  # computed on weights before any commit


def test_spike_rule_merges_consecutive_steps_and_ignores_the_trend() -> None:
    steps = np.arange(200)
    loss = 5.0 * np.exp(-steps / 50.0) + 0.001 * np.sin(steps)  # smooth decreasing trend
    assert find_spikes(steps, loss, window=20, z=6.0) == []
    loss2 = loss.copy()
    loss2[100:103] += [1.0, 2.0, 1.5]
    got = find_spikes(steps, loss2, window=20, z=6.0)
    assert [g[0] for g in got] == [101]  # three flagged steps, one spike at its peak z
    assert [g[5] for g in got] == [100]  # ... which started one step earlier
    with pytest.raises(ValueError, match="window must be an int >= 2"):
        find_spikes(steps, loss, window=1)


def test_without_summaries_spikes_have_no_tensors(tmp_path: Path) -> None:
    loss = {s: 1.0 + (3.0 if s == 15 else 0.0) + 0.01 * (s % 3) for s in range(20)}
    write_steps(
        new_repo(tmp_path / "run"),
        list(range(20)),
        lambda s: {"params/w": np.zeros(2, np.float32)},
        metrics_at=lambda s: {"loss": loss[s]},
    )
    run = open_run(tmp_path / "run")
    ds = run.summaries()
    assert ds.sizes["step"] == 0
    assert {"l2", "probe"} <= set(ds.data_vars)
    spikes = run.spikes("loss", window=10, z=5.0)
    assert [(s.step, s.cause, s.tensors) for s in spikes] == [(15, 14, [])]


def test_summary_book_carries_probes_between_steps() -> None:
    from dstt.engine.capture.summaries import SummaryBook

    book = SummaryBook()
    w0 = torch.zeros(50, 40)
    first = book.summarize("params/w", w0)
    assert first["update_l2"] is None
    acc = book.accumulator("params/w", 2000)
    w1 = w0 + 0.5
    for s in range(0, 2000, 300):
        acc.add(s, w1.reshape(-1)[s : s + 300])
    second = book.finish("params/w", acc)
    assert second["update_l2"] == pytest.approx(0.5 * math.sqrt(2000))  # estimated, exact here
    assert second["update_exact"] is False
    assert second["update_ratio"] == pytest.approx(1.0)
    book.forget()
    assert book.summarize("params/w", w1)["update_l2"] is None


def test_spikes_read_only_the_summaries_around_them(tmp_path: Path) -> None:
    from inspect_helpers import CountingStorage

    from dstt.store import LocalStorage, Repository

    _training_like_run(tmp_path / "run")
    Repository.open(tmp_path / "run").reindex()  # a session's close leaves a tail unindexed
    storage = CountingStorage(LocalStorage(tmp_path / "run"))
    spikes = open_run(Repository(storage)).spikes("loss", window=20, z=5.0, around=2)
    assert [(s.step, s.cause) for s in spikes] == [(30, 29)]
    read = sorted(step for step, name in storage.object_reads() if name == "summaries")
    # commits within 2 of the cause, not all 40 (none: the run's index holds them, #14)
    assert set(read) <= {27, 28, 29, 30, 31}
    assert storage.data_reads() == set()  # and never a tensor


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_the_torch_glue_hands_the_kernel_the_same_numbers(dtype: torch.dtype) -> None:
    """``tensor_summary`` (the chunk lane's and the importer's path: torch tensors, bf16 and
    fp16 cast by torch) stores the bits the kernel gives on the raw numpy elements (the
    flat lane's path: cast by numpy / ml_dtypes)."""
    import ml_dtypes

    from dstt.analysis import summary_kernel as sk

    t = (torch.randn(70, 33, generator=torch.Generator().manual_seed(4)) * 3).to(dtype)
    t.view(-1)[[5, 77]] = torch.tensor([float("nan"), float("inf")], dtype=dtype)
    got = tensor_summary(t, "params/w")
    raw = t.reshape(-1).view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    x = raw if dtype == torch.bfloat16 else t.reshape(-1).numpy()
    idx = probe_indices("params/w", x.size)
    st = sk.segment_stats(x, sk.Segments.build([0], [x.size], [idx]), len(idx))
    want = sk.finish_columns(np.array([x.size]), st, None)
    for f in ("l2", "rms", "maxabs", "nan", "inf"):
        assert got[f] == want[f][0], f
    assert got["probe"] == want["probe"][0].tolist()
    assert (got["nan"], got["inf"]) == (1, 1)
