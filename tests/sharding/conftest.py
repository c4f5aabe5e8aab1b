"""Fixtures of the sharding tests."""

import pytest
from torchrec.distributed.types import ShardingEnv


@pytest.fixture
def fake_world():
    """A process group of world size 3 in this process (no communication)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=3)
    try:
        yield ShardingEnv.from_process_group(dist.GroupMember.WORLD)
    finally:
        dist.destroy_process_group()
