"""Lightning ``.ckpt`` files (``ModelCheckpoint(every_n_train_steps=2)``) imported into a run.

Proves: each file becomes the step of its ``global_step``; the LightningModule's tensors, the
optimizer state (named by the module's parameter order, as ``self.parameters()`` numbered
them), the LR scheduler, the fit loop's progress and the callbacks' states are all there,
bit-exact; the step says it holds no RNG state (a Lightning checkpoint has none).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("lightning")

import dstt
from dstt.integrations.imports import import_checkpoints


def test_ckpt_files_import_bit_exact(lightning_checkpoints: Path, tmp_path: Path) -> None:
    report = import_checkpoints(lightning_checkpoints, tmp_path / "run")
    assert [i.step for i in report.imported] == [2, 4, 6]
    assert report.ok
    assert all(i.lacks == ("RNG state",) and i.format == "lightning" for i in report.imported)
    run = dstt.open(tmp_path / "run")
    for k in (2, 4, 6):
        ck = torch.load(lightning_checkpoints / f"epoch=0-step={k}.ckpt", weights_only=True)
        snap = run.at(k)
        sd = snap.state_dict()
        tied = snap.object("names/tied")  # TinyGPT ties its head to the embedding: stored once
        assert tied == {"net.head.weight": "net.tok.weight"}
        for name, t in ck["state_dict"].items():
            assert torch.equal(sd["model"][tied.get(name, name)], t), name
        src = ck["optimizer_states"][0]
        assert sd["optimizer"]["param_groups"] == src["param_groups"]
        for i, st in src["state"].items():
            for key, v in st.items():
                assert torch.equal(sd["optimizer"]["state"][i][key], v), (i, key)
        # the index -> name mapping is the module's parameter order
        names = snap.object("optim/param_groups")[0]["params"]
        assert names[0] == "net.tok.weight"
        assert len(names) == len(src["state"])
        assert sd["scheduler"] == ck["lr_schedulers"][0]
        loops = snap.object("extra/lightning")
        fit = ck["loops"]["fit_loop"]
        assert loops["fit_loop"]["epoch_loop.batch_progress"] == fit["epoch_loop.batch_progress"]
        assert loops["global_step"] == k
        assert set(loops["callbacks"]) == set(ck["callbacks"])
        assert loops["epoch_end"] == (k == 6)  # 6 batches per epoch: step 6 ends it
