"""PyTorch-native parallelism: what one rank of a DDP, FSDP2 or tensor-parallel trainer holds.

``ParallelState`` builds the plain-PyTorch path's two provider sets for one rank under the
model's canonical names: parameters and optimizer state written once across the ranks
(``RankShare``), buffers from rank 0, optimizer structure, hyperparameters and scheduler from
rank 0 (every rank's own under pipeline parallelism), RNG, data position and ``extra_state``
per rank. Restore reads every live tensor's own box: the same placements restore bit-exactly,
other world sizes and meshes reshard. Rejected alternative: DCP's ``get_state_dict`` per step
(new state dicts on the training thread every step, a gather for a full one). The details:
docs/decisions.md, "Module notes".
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dstt.engine.state.model_names import ModelInfoProvider, param_names
from dstt.engine.state.optimizers import (
    OptimizerStateProvider,
    optimizer_groups_provider,
    optimizers_of,
)
from dstt.engine.state.providers import CompositeProvider, StateProvider, TensorProvider
from dstt.engine.state.torch_state import (
    ModelTensors,
    Stateful,
    TorchState,
    extra_state_objects,
    rng_provider,
    scheduler_provider,
)

from .sharding import OwnedTensors, RankShare, RankZeroObjects, StageLayout

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping

    import torch

    from .ranks import RankChannel, RankInfo

__all__ = ["ParallelState"]


class ParallelState:
    """The providers of one rank of a PyTorch-native parallel trainer (module docstring)."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: Any,
        info: RankInfo,
        channel: RankChannel,
        *,
        scheduler: Any = None,
        extra_state: Mapping[str, Stateful] | None = None,
        extra: Iterable[StateProvider] = (),
    ) -> None:
        self.info = info
        names = param_names(model)
        self.names = sorted(set(names.values()))
        self.layout = StageLayout(info)
        optimizers = optimizers_of(optimizer)
        logical: list[StateProvider] = [TensorProvider(ModelTensors(model))]
        logical += [OptimizerStateProvider(opt, names, key) for key, opt in optimizers.items()]
        self.share = RankShare(CompositeProvider(logical), info, channel, self.layout)
        buffers = TensorProvider(ModelTensors(model, buffers=True), snapshot=True)
        step = CompositeProvider(
            [
                self.share,
                OwnedTensors([buffers], info, rank0=True),
                RankZeroObjects(ModelInfoProvider(model), info),
                *extra,
                rng_provider(info),  # last: restoring it is the final word on RNG
            ]
        )
        boundary: list[StateProvider] = [
            RankZeroObjects(optimizer_groups_provider(opt, names, key), info, self.layout)
            for key, opt in optimizers.items()
        ]
        if scheduler is not None:
            boundary.append(RankZeroObjects(scheduler_provider(scheduler), info, self.layout))
        boundary += extra_state_objects(extra_state, info, required=True)
        self.state = TorchState(step, CompositeProvider(boundary))
