"""The CUDA path: side-stream copies into a pinned ring, events, resume on the device.

Skipped without a CUDA device; run on a GPU machine with ``pytest -m gpu tests/engine``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import dstt
from dstt.engine.capture.flatlane import StepBuffers
from dstt.engine.capture.staging import Copier
from dstt.engine.tensors._convert import flat_bytes
from dstt.errors import RaceError
from dstt.store import Repository
from dstt.testing.models import SyntheticBatches, TinyGPT
from dstt.training import session

from ._helpers import committed_steps, same_bits, stored

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_side_stream_copy_into_a_pinned_ring_in_segments_is_exact() -> None:
    src = torch.randn(1000, 37, device="cuda").to(torch.bfloat16)
    flat = flat_bytes(src)
    ring = StepBuffers(1 << 14, 2, pin=True)
    assert ring.pinned
    copier = Copier()
    copier.begin(Copier.mark([src]))
    out = torch.empty(flat.numel(), dtype=torch.uint8)
    step = 1 << 14
    for start in range(0, flat.numel(), step):
        stop = min(start + step, flat.numel())
        index, _ = ring.acquire()
        view = ring.buffers[index][: stop - start]
        copier.copy_all([view], [flat[start:stop]]).wait()
        out[start:stop] = view
        ring.release(index)
    assert torch.equal(out, flat.cpu())
    ring.close()


def _gpt(seed: int):
    torch.manual_seed(seed)
    m = TinyGPT(layers=2).cuda()
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    return m, opt


def test_cuda_session_commits_exact_values_and_resumes(tmp_path: Path) -> None:
    m, opt = _gpt(0)
    after = {}
    with session(m, opt, run=tmp_path / "run", budget_bytes=1 << 20) as s:
        for x, y in s.data(SyntheticBatches(6)):
            _, loss = m(x.cuda(), y.cuda())
            loss.backward()
            opt.step()
            opt.zero_grad()
            after[s.step] = m.layers[0].qkv.weight.detach().clone()
            s.log(loss=loss)
    repo = Repository.open(tmp_path / "run")
    assert committed_steps(repo) == list(range(1, 7))
    for step, w in after.items():
        assert same_bits(stored(repo, step, "params/layers/0/qkv/weight"), w)
    m2, opt2 = _gpt(1)
    with session(m2, opt2, run=tmp_path / "run", resume=True) as s2:
        assert s2.step == 6
    for p, q in zip(m.parameters(), m2.parameters(), strict=True):
        assert same_bits(p, q)


def test_cuda_in_place_race_is_detected(tmp_path: Path) -> None:
    m, opt = _gpt(0)
    armed = [False]

    def hook(mod, args):
        if armed[0]:
            with torch.no_grad():
                mod.weight.mul_(1.0)

    m.layers[0].qkv.register_forward_pre_hook(hook)
    x, y = SyntheticBatches(2)[0]
    with pytest.raises(RaceError), session(m, opt, run=tmp_path / "run"):
        for _ in range(2):
            _, loss = m(x.cuda(), y.cuda())
            loss.backward()
            opt.step()
            armed[0] = True


def test_back_to_back_flat_sessions_leave_cuda_usable(tmp_path: Path) -> None:
    """The flat lane page-locks its shared step ring (``cudaHostRegister``). Closing a
    session must unregister it before the memory goes: a range left registered made the next
    session's registration, and pinned memory anyone mapped over it, fail with
    ``cudaErrorAlreadyMapped`` at a later kernel launch (found by bench/gpu_check.py on an
    H200: every mode after dstt's first session failed)."""
    m, opt = _gpt(0)
    for i in range(3):  # the default budget: the whole step takes the flat lane
        with session(m, opt, run=tmp_path / f"run{i}") as s:
            for x, y in s.data(SyntheticBatches(3)):
                _, loss = m(x.cuda(), y.cuda())
                loss.backward()
                opt.step()
                opt.zero_grad()
            ring = s._pipeline.steps if s._pipeline else None  # the ring this test is about
            assert ring is not None
            assert ring.pinned
        assert committed_steps(Repository.open(tmp_path / f"run{i}")) == [1, 2, 3]
    pinned = torch.empty(64 << 20, dtype=torch.uint8, pin_memory=True)  # what DCP stages into
    pinned.copy_(torch.ones(64 << 20, dtype=torch.uint8, device="cuda"), non_blocking=True)
    torch.cuda.synchronize()
    assert int(pinned[-1]) == 1
    _, loss = m(*(t.cuda() for t in next(iter(SyntheticBatches(1)))))
    assert torch.isfinite(loss)


def test_auto_capture_on_cuda_rebuilds_a_light_step_bit_for_bit() -> None:
    """``every="auto"`` on the device: a storage slowed so the engine stays busy makes light
    steps, and replay rebuilds one to the bits an every=1 run stored at that step."""
    import time

    from dstt.engine.state.torch_state import discover
    from dstt.store.storage.memory import FaultyStorage, MemoryStorage

    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(96, 8), torch.randn(96, 4))

    def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        m = torch.nn.Sequential(
            torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)
        ).cuda()
        return m, torch.optim.Adam(m.parameters(), lr=1e-2)

    def loss_fn(model: torch.nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        x, y = (t.cuda() for t in batch)
        return torch.nn.functional.mse_loss(model(x), y)

    def train(repo: Repository, every: int | str, **options: object) -> None:
        m, opt = build()
        loader = torch.utils.data.DataLoader(data, batch_size=4)
        with session(m, opt, run=repo, every=every, **options) as s:  # type: ignore[arg-type]
            for batch in s.data(loader):
                loss = loss_fn(m, batch)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                s.log(loss=loss)

    ref = MemoryStorage()
    Repository.create(ref)
    train(Repository(ref), every=1)
    inner = MemoryStorage()
    Repository.create(inner)
    slow = FaultyStorage(inner, on_write=lambda key: time.sleep(0.05))
    train(Repository(slow), every="auto", max_backlog=2, max_gap=4)
    run = dstt.open(Repository(inner))
    light = sorted(run.light_steps())
    assert light, "the slowed storage should have made light steps"
    ref_repo = Repository(ref)
    for k in light[:2]:
        m, opt = build()
        got = run.rebuild(k, m, opt, dataset=data, loss_fn=loss_fn)
        assert got.faithful
        assert got.step == k
        tensors = discover(m, opt).step_state.tensors()
        for path in ref_repo.reader().arrays(ref_repo.reader().find(k)):
            assert same_bits(tensors[path], stored(ref_repo, k, path)), (k, path)
