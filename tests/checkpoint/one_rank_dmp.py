"""A model sharded by the stock planner onto one CPU rank (the ``one_rank`` fixture's
process group), every table with one sharding type: what the single-process
checkpoint tests shard."""

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology


def shard_on_one_rank(
    model: nn.Module, sharders: list, table_names: Sequence[str], sharding: str
) -> DistributedModelParallel:
    """``model`` under ``DistributedModelParallel`` with ``sharders``; the tables
    ``table_names`` constrained to ``sharding`` (e.g. ``"row_wise"``)."""
    constraints = {name: ParameterConstraints(sharding_types=[sharding]) for name in table_names}
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=1, compute_device="cpu"), constraints=constraints
    )
    plan = planner.collective_plan(model, sharders, dist.GroupMember.WORLD)
    return DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=sharders)
