"""One name per tensor (wrappers dropped, tied tensors once), and several optimizers.

A session over ``torch.compile(model)`` stores the model's own names and resumes into the
plain model; tied parameters are stored once with their other names in ``names/tied``; a
Hugging Face model's config rides along as ``model/config``. Several optimizers (a list or a
dict) are each captured and resumed bit-exactly, an iteration stepping each of them being one
step; what is not supported is a ``ConfigError``, never an internal ``AttributeError``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import dstt
from dstt.errors import ConfigError
from dstt.schema import canonical_name
from dstt.store import Repository
from dstt.training import session

from ._helpers import MLP, committed_steps, mlp_batch, same_bits, stored


def _objects(run: Path, step: int) -> dict[str, object]:
    r = Repository.open(run).reader()
    h = r.find(step)
    return {n: r.read_object(h, n) for n in h.objects}


def test_canonical_name_drops_wrappers_only() -> None:
    assert canonical_name("_orig_mod.layers.0.w") == "layers.0.w"
    assert canonical_name("a._checkpoint_wrapped_module.b._fsdp_wrapped_module.c") == "a.b.c"
    assert canonical_name("module.layers.0.w") == "module.layers.0.w"  # a real submodule
    assert canonical_name("module.layers.0.w", {""}) == "layers.0.w"  # DDP at the root
    assert canonical_name("_orig_mod.module.x", {"_orig_mod"}) == "x"  # compile(DDP(m))
    assert canonical_name("enc.module.x", {"enc"}) == "enc.x"  # a DDP inside the model


def test_a_compiled_model_is_stored_under_its_own_names(tmp_path: Path) -> None:
    torch.manual_seed(0)
    m = MLP()
    compiled = torch.compile(m, backend="eager")
    assert any(n.startswith("_orig_mod.") for n, _ in compiled.named_parameters())
    opt = torch.optim.AdamW(compiled.parameters(), lr=1e-2)
    with session(compiled, opt, run=tmp_path / "run") as s:
        for i in range(3):
            _, loss = compiled(*mlp_batch(i))
            loss.backward()
            opt.step()
            opt.zero_grad()
        assert s.step == 3
    r = Repository.open(tmp_path / "run").reader()
    paths = set(r.arrays(r.head()))
    assert "params/l1/weight" in paths
    assert "optim/exp_avg/l2/bias" in paths
    assert not any("_orig_mod" in p for p in paths)
    assert dstt.open(tmp_path / "run").at(3).names() == [
        "l1.bias",
        "l1.weight",
        "l2.bias",
        "l2.weight",
    ]
    # the plain model resumes from it, and so does a compiled one
    plain = MLP()
    popt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    with session(plain, popt, run=tmp_path / "run", resume=True) as s2:
        assert s2.step == 3
    assert same_bits(plain.l1.weight, m.l1.weight)
    again = torch.compile(MLP(), backend="eager")
    aopt = torch.optim.AdamW(again.parameters(), lr=1e-2)
    with session(again, aopt, run=tmp_path / "run", resume=True):
        pass
    assert same_bits(again._orig_mod.l2.weight, m.l2.weight)
    key = next(iter(aopt.state))
    assert torch.equal(aopt.state[key]["exp_avg"], opt.state[next(iter(opt.state))]["exp_avg"])


class Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte = torch.nn.Embedding(11, 6)
        self.mid = torch.nn.Linear(6, 6)
        self.lm_head = torch.nn.Linear(6, 11, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(torch.relu(self.mid(self.wte(ids))))


def test_tied_parameters_are_stored_once_and_named_in_names_tied(tmp_path: Path) -> None:
    m = Tied()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with session(m, opt, run=tmp_path / "run"):
        m(torch.tensor([[1, 2, 3]])).sum().backward()
        opt.step()
    r = Repository.open(tmp_path / "run").reader()
    paths = set(r.arrays(r.head()))
    assert "params/wte/weight" in paths
    assert "params/lm_head/weight" not in paths
    assert _objects(tmp_path / "run", 1)["names/tied"] == {"lm_head.weight": "wte.weight"}
    untied = MLP()
    uopt = torch.optim.SGD(untied.parameters(), lr=0.1)
    with session(untied, uopt, run=tmp_path / "run2") as s:
        s.mark_step()
    assert "names/tied" not in _objects(tmp_path / "run2", 1)


def test_a_hugging_face_config_rides_with_every_commit(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=8)
    model = transformers.GPT2LMHeadModel(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with session(torch.compile(model, backend="eager"), opt, run=tmp_path / "run") as s:
        s.mark_step()
    objects = _objects(tmp_path / "run", 1)
    assert objects["model/config"]["n_embd"] == 16
    assert objects["model/config"]["model_type"] == "gpt2"
    assert objects["names/tied"] == {"lm_head.weight": "transformer.wte.weight"}


def _two_opt_model(seed: int = 0) -> tuple[MLP, dict[str, torch.optim.Optimizer]]:
    torch.manual_seed(seed)
    m = MLP()
    return m, {
        "body": torch.optim.SGD(m.l1.parameters(), lr=0.05, momentum=0.9),
        "head": torch.optim.AdamW(m.l2.parameters(), lr=1e-2),
    }


def _step(m: MLP, opts: dict[str, torch.optim.Optimizer], i: int) -> float:
    _, loss = m(*mlp_batch(i))
    loss.backward()
    for o in opts.values():
        o.step()
        o.zero_grad()
    return float(loss.detach())


@pytest.mark.parametrize("form", ["dict", "list"])
@pytest.mark.parametrize("copy", ["async", "sync"])
def test_several_optimizers_are_each_captured_and_resumed(
    tmp_path: Path, form: str, copy: str
) -> None:
    ref, ropts = _two_opt_model()
    ref_losses = [_step(ref, ropts, i) for i in range(6)]
    m, opts = _two_opt_model()
    arg = opts if form == "dict" else list(opts.values())
    with session(m, arg, run=tmp_path / "run", copy=copy) as s:  # type: ignore[arg-type]
        losses = [_step(m, opts, i) for i in range(3)]
        assert s.step == 3  # one step per iteration, not one per optimizer
    repo = Repository.open(tmp_path / "run")
    assert committed_steps(repo) == [1, 2, 3]
    keys = ("body", "head") if form == "dict" else ("0", "1")
    objects = _objects(tmp_path / "run", 3)
    assert {f"optim/state/{k}" for k in keys} <= set(objects)
    assert {f"optim/param_groups/{k}" for k in keys} <= set(objects)
    assert same_bits(
        stored(repo, 3, "optim/momentum_buffer/l1/weight"),
        opts["body"].state[m.l1.weight]["momentum_buffer"],
    )
    assert same_bits(
        stored(repo, 3, "optim/exp_avg/l2/weight"), opts["head"].state[m.l2.weight]["exp_avg"]
    )
    m2, opts2 = _two_opt_model(seed=1)
    arg2 = opts2 if form == "dict" else list(opts2.values())
    with session(m2, arg2, run=tmp_path / "run", resume=True) as s2:  # type: ignore[arg-type]
        assert s2.step == 3
        losses += [_step(m2, opts2, i) for i in range(3, 6)]
    assert losses == ref_losses  # bit-exact: both optimizers' states came back
    assert same_bits(m2.l1.weight, ref.l1.weight)
    assert same_bits(m2.l2.weight, ref.l2.weight)


def test_optimizers_that_cannot_be_captured_are_refused_clearly(tmp_path: Path) -> None:
    m = MLP()
    with pytest.raises(ConfigError, match=r"torch\.optim\.Optimizer, a list of them or a dict"):
        session(m, object(), run=tmp_path / "a")  # type: ignore[arg-type]
    both = [torch.optim.SGD(m.parameters(), lr=0.1), torch.optim.SGD(m.l1.parameters(), lr=1)]
    with pytest.raises(ConfigError, match="hold the same parameter"):
        session(m, both, run=tmp_path / "b")
    with pytest.raises(ConfigError, match="without '/'"):
        session(m, {"a/b": torch.optim.SGD(m.parameters(), lr=0.1)}, run=tmp_path / "c")
    with pytest.raises(ConfigError, match="is empty"):
        session(m, [], run=tmp_path / "d")
