"""PyTorch-native parallelism: what one rank of a DDP, FSDP2 or tensor-parallel trainer holds.

``ParallelState`` builds the same two provider sets as the plain-PyTorch path (``TorchState``:
*step state* right after optimizer step k, *boundary state* at the end of iteration k), for
one rank of a model trained with PyTorch's own parallelism — ``DistributedDataParallel``,
``fully_shard`` (FSDP2: DTensor parameters), ``parallelize_module`` (tensor parallel), or a
DTensor model on one process — under the model's canonical names (``dstt.schema``):

* parameters and optimizer state: each rank writes only its share (``RankShare``: a DTensor's
  local shard, a replicated tensor once across the ranks), planned once and again only when
  the set of tensors changes;
* buffers: rank 0's (DDP broadcasts rank 0's buffers; FSDP2 and tensor parallel keep buffers
  whole on every rank), cloned at capture as on one process;
* state every rank holds alike — the optimizer's per-parameter structure (``optim/state``),
  hyperparameters and the LR scheduler — from rank 0; under pipeline parallelism, where each
  rank holds its own stage, every rank's own (``StageLayout``, decided at open);
* per rank: RNG, data position and ``extra_state`` (``<name>/r<rank>``).

Restore reads every live tensor's own box from the stored boxes (``dtensors.restore_tensor``):
the same placements restore bit-exactly, other world sizes and meshes reshard, and a plain
one-process model takes the whole logical tensors. Optimizer state of a DTensor parameter is
rebuilt as a DTensor of the parameter's placements before ``optimizer.load_state_dict``.
Rejected alternative: ``torch.distributed.checkpoint.state_dict.get_state_dict`` per step —
it builds new state dicts on the training thread at every step (and, for a full state dict,
gathers), where the providers here hand the engine the live tensors and cache everything
while nothing changes.
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
            ]
        )
        for p in extra:
            step.add(p)
        step.add(rng_provider(info))  # last: restoring it is the final word on RNG
        boundary = CompositeProvider()
        for key, opt in optimizers.items():
            boundary.add(
                RankZeroObjects(optimizer_groups_provider(opt, names, key), info, self.layout)
            )
        if scheduler is not None:
            boundary.add(RankZeroObjects(scheduler_provider(scheduler), info, self.layout))
        for p in extra_state_objects(extra_state, info, required=True):
            boundary.add(p)
        self.state = TorchState(step, boundary)
