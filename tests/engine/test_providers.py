"""Provider round trips through a real store: capture → commit → restore is bit-exact."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from dstt.engine.capture.pipeline import Pipeline
from dstt.engine.state.model_names import param_names
from dstt.engine.state.optimizers import OptimizerStateProvider
from dstt.engine.state.providers import (
    CompositeProvider,
    ObjectProvider,
    StateProvider,
    StoreSource,
    TensorProvider,
)
from dstt.engine.state.torch_state import ModelTensors, discover, model_tensors, rng_provider
from dstt.engine.tensors._convert import from_plain, store_dtype, to_plain
from dstt.errors import SchemaError
from dstt.store._internal import Encoded, Repository
from dstt.store.format.objects import decode_object
from dstt.store.storage.memory import MemoryStorage
from dstt.testing.models import TinyGPT, make_batch

from ._helpers import same_bits, train_step


def capture(
    repo: Repository, step: int, provider: StateProvider, boundary: StateProvider | None = None
) -> None:
    """Commit one step of ``provider`` through the real pipeline."""
    with repo.writer(chunk_bytes=1024) as w:
        pipe = Pipeline(w, budget_bytes=1 << 20, writers=2)
        try:
            f = pipe.stage(step, provider.tensors(), provider.objects())
            pipe.wait_copied(f)
            assert pipe.check(f) == []
            pipe.seal(f, boundary.objects() if boundary else {})
            pipe.drain()
            assert pipe.take_errors() == []
        finally:
            pipe.close()


def source(repo: Repository) -> StoreSource:
    r = repo.reader()
    return StoreSource(r, r.head())


def odd_values(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.rand(shape) > 0.5
    if dtype.is_floating_point:
        t = torch.randn(shape, dtype=torch.float32).to(dtype)
        flat = t.view(-1)
        if flat.numel() >= 4:  # the values a float conversion would get wrong
            flat[0], flat[1], flat[2], flat[3] = float("nan"), -0.0, float("inf"), 1e-40
        return t
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, shape, dtype=dtype)


DTYPES = [
    torch.float64,
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
]


def test_tensor_provider_round_trip_every_dtype_and_shape() -> None:
    repo = Repository.create(MemoryStorage())
    tensors = {
        f"t/{store_dtype(dt)}/{i}": odd_values(dt, shape)
        for dt in DTYPES
        for i, shape in enumerate([(37, 5), (3,), (), (0, 4), (700,)])
    }
    capture(repo, 1, TensorProvider(tensors))
    live = {k: torch.zeros_like(v) for k, v in tensors.items()}
    TensorProvider(live).restore(source(repo))
    for k in tensors:
        assert same_bits(live[k], tensors[k]), k


def test_tensor_provider_refuses_a_dtype_or_shape_change() -> None:
    repo = Repository.create(MemoryStorage())
    capture(repo, 1, TensorProvider({"w": torch.ones(4, 2)}))
    with pytest.raises(SchemaError, match="stored as"):
        TensorProvider({"w": torch.ones(4, 2, dtype=torch.float64)}).restore(source(repo))
    with pytest.raises(SchemaError, match="no array"):
        TensorProvider({"other": torch.ones(1)}).restore(source(repo))
    TensorProvider({"other": torch.ones(1)}, strict=False).restore(source(repo))


def test_object_provider_round_trip_keeps_types_and_tensors() -> None:
    value = {
        "a": (1, 2.5, None),
        "b": [b"\x00\xff", "s"],
        3: float("nan"),
        "t": torch.tensor([1.5, -0.0], dtype=torch.bfloat16),
        "n": np.arange(3),
    }
    got: list[object] = []
    repo = Repository.create(MemoryStorage())
    capture(repo, 1, ObjectProvider("thing", lambda: value, got.append))
    ObjectProvider("thing", lambda: None, got.append).restore(source(repo))
    (back,) = got
    assert isinstance(back, dict)
    assert back["a"] == (1, 2.5, None)
    assert back["b"] == [b"\x00\xff", "s"]
    assert np.isnan(back[3])
    assert np.array_equal(back["n"], np.arange(3))
    assert same_bits(back["t"], value["t"])


def test_to_plain_is_a_snapshot() -> None:
    live = {"lr": [0.1], "t": torch.zeros(2)}
    plain = to_plain(live)
    live["lr"][0] = 9.0
    live["t"].add_(1)
    back = from_plain(plain)
    assert back["lr"] == [0.1]
    assert torch.equal(back["t"], torch.zeros(2))


def test_rng_provider_restores_every_generator() -> None:
    repo = Repository.create(MemoryStorage())
    torch.manual_seed(1)
    np.random.seed(2)
    random.seed(3)
    capture(repo, 1, rng_provider())
    expected = (torch.rand(5), np.random.rand(5), [random.random() for _ in range(5)])
    torch.rand(100), np.random.rand(7), random.random()  # move every generator on
    rng_provider().restore(source(repo))
    got = (torch.rand(5), np.random.rand(5), [random.random() for _ in range(5)])
    assert torch.equal(got[0], expected[0])
    assert np.array_equal(got[1], expected[1])
    assert got[2] == expected[2]


def test_composite_rejects_duplicate_names() -> None:
    a = TensorProvider({"x": torch.ones(1)})
    with pytest.raises(ValueError, match="two providers"):
        CompositeProvider([a, TensorProvider({"x": torch.ones(1)})]).tensors()
    with pytest.raises(ValueError, match="two providers"):
        CompositeProvider([ObjectProvider("o", dict), ObjectProvider("o", dict)]).objects()


def test_model_paths_follow_modules_and_skip_non_persistent_buffers() -> None:
    m = TinyGPT(layers=1)
    m.register_buffer("counter", torch.zeros(1, dtype=torch.int64))
    paths = set(model_tensors(m))
    assert "params/layers/0/qkv/weight" in paths
    assert "params/tok/weight" in paths
    assert "params/head/weight" not in paths  # tied, once
    assert "buffers/counter" in paths
    assert not any(p.endswith("positions") for p in paths)  # non-persistent


@pytest.mark.parametrize(
    "make_opt",
    [
        lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
        lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True),
        lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, nesterov=True),
    ],
    ids=["adamw", "adam-amsgrad", "sgd-nesterov"],
)
def test_model_optimizer_scheduler_round_trip(make_opt) -> None:
    def build(seed: int):
        torch.manual_seed(seed)
        m = TinyGPT(layers=1)
        opt = make_opt(m.parameters())
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=50)
        return m, opt, sched

    m, opt, sched = build(0)
    for i in range(3):
        train_step(m, opt, *make_batch(i))
        sched.step()
    state = discover(m, opt, scheduler=sched, rng=False)
    repo = Repository.create(MemoryStorage())
    capture(repo, 3, state.step_state, state.boundary_state)

    m2, opt2, sched2 = build(1)  # different init, no optimizer state yet
    state2 = discover(m2, opt2, scheduler=sched2, rng=False)
    state2.step_state.restore(source(repo))
    state2.boundary_state.restore(source(repo))
    for (k, a), b in zip(m.state_dict().items(), m2.state_dict().values(), strict=True):
        assert same_bits(a, b), k
    sd, sd2 = opt.state_dict(), opt2.state_dict()
    assert sd["param_groups"] == sd2["param_groups"]
    for idx, st in sd["state"].items():
        for key, v in st.items():
            w = sd2["state"][idx][key]
            assert same_bits(v, w) if isinstance(v, torch.Tensor) else v == w, key
    assert sched.state_dict() == sched2.state_dict()
    # and the next step is identical
    torch.manual_seed(5)
    a = train_step(m, opt, *make_batch(3))
    torch.manual_seed(5)
    b = train_step(m2, opt2, *make_batch(3))
    assert a == b
    for p, q in zip(m.parameters(), m2.parameters(), strict=True):
        assert same_bits(p, q)


def test_optimizer_provider_names_state_by_module_path() -> None:
    m = TinyGPT(layers=1)
    opt = torch.optim.AdamW(m.parameters())
    prov = OptimizerStateProvider(opt, param_names(m))
    assert dict(prov.tensors()) == {}  # no state before the first step
    train_step(m, opt, *make_batch(0))
    paths = set(prov.tensors())
    assert "optim/exp_avg/layers/0/qkv/weight" in paths
    assert "optim/exp_avg_sq/tok/weight" in paths
    # 0-d step counters are arrays too: copied with the rest in one batched copy, not
    # snapshot one by one on the training thread
    assert float(prov.tensors()["optim/step/tok/weight"]) == 1.0  # one optimizer step taken
    (obj,) = prov.objects().values()
    assert isinstance(obj, Encoded)  # pure-tensor state: encoded once, stored as these bytes
    doc = decode_object(obj.data, obj.encoding)
    assert doc["format"] == 2
    assert "tok.weight" in doc["params"]
    assert doc["params"]["tok.weight"] == {
        "arrays": ["step", "exp_avg", "exp_avg_sq"],
        "values": {},
    }
    again = prov.objects()[OptimizerStateProvider.OBJECT]
    assert again is obj  # unchanged structure: the same object, encoded once
    train_step(m, opt, *make_batch(1))
    assert prov.objects()[OptimizerStateProvider.OBJECT] is obj  # Adam updates in place
    assert float(prov.tensors()["optim/step/tok/weight"]) == 2.0
    opt.state[m.tok.weight]["exp_avg"] = torch.zeros_like(m.tok.weight)  # replaced, not in place
    assert prov.tensors()["optim/exp_avg/tok/weight"] is opt.state[m.tok.weight]["exp_avg"]
    assert prov.objects()[OptimizerStateProvider.OBJECT] is not obj  # noticed: rebuilt


def test_optimizer_provider_sees_every_way_the_state_changes_without_hashing_each_step() -> None:
    """The state is found by parameter only when its keys or dicts changed (a parameter's
    hash is a Python call): a dict replaced, a whole state loaded, a parameter gaining state,
    and state entries that are mappings but not dicts are all seen."""
    from collections import UserDict

    m = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 3))
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    prov = OptimizerStateProvider(opt, param_names(m))
    w0, w1 = m[0].weight, m[1].weight
    for p in m.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    first = prov.tensors()
    assert prov.tensors() is first  # nothing changed: the same mapping
    buf = "optim/momentum_buffer/0/weight"
    opt.state[w0] = {"momentum_buffer": torch.full_like(w0, 7.0)}  # a dict replaced
    assert float(prov.tensors()[buf][0, 0]) == 7.0
    opt.load_state_dict(opt.state_dict())  # a whole new state object
    assert prov.tensors()[buf] is opt.state[w0]["momentum_buffer"]
    opt.state[w1] = UserDict({"momentum_buffer": torch.full_like(w1, 5.0)})  # not a dict
    assert float(prov.tensors()["optim/momentum_buffer/1/weight"][0, 0]) == 5.0
    del opt.state[w1]  # a parameter losing its state
    assert "optim/momentum_buffer/1/weight" not in prov.tensors()


class _RefillsInPlace:
    """A user provider that keeps one dict and refills it (no ``stable`` promise)."""

    def __init__(self) -> None:
        self.d = {"extra/t": torch.zeros(3)}

    def tensors(self) -> dict[str, torch.Tensor]:
        return self.d

    def objects(self) -> dict[str, object]:
        return {}

    def restore(self, source: object) -> None:
        pass


def test_composite_reuses_its_mapping_only_while_nothing_changed() -> None:
    """The step's mapping is last step's object while every built-in provider returned
    the same one (the engine's checks then go by identity) — never when a tensor object
    changed, and never past a provider that may refill its dict in place."""
    m = torch.nn.Sequential(torch.nn.Linear(3, 2))
    opt = torch.optim.AdamW(m.parameters(), lr=0.1)
    m(torch.ones(1, 3)).sum().backward()
    opt.step()
    state = discover(m, opt)
    a, objs = state.step_state.capture()
    assert set(objs) >= {"optim/state", "rng"}
    assert state.step_state.capture()[0] is a
    assert state.step_state.tensors() is a
    opt.step()  # Adam updates in place: still the same tensors
    assert state.step_state.tensors() is a
    m[0].weight = torch.nn.Parameter(torch.zeros(2, 3))  # a new tensor object
    b = state.step_state.tensors()
    assert b is not a
    assert b["params/0/weight"] is m[0].weight
    user = _RefillsInPlace()
    comp = CompositeProvider([TensorProvider(ModelTensors(m)), user])  # type: ignore[list-item]
    first = comp.tensors()
    user.d["extra/t"] = torch.ones(3)  # the same dict, a new tensor in it
    second = comp.tensors()
    assert second["extra/t"] is user.d["extra/t"]
    assert second is not first
