"""Fixtures of the checkpoint tests."""

import pytest
import torch.distributed as dist


@pytest.fixture
def one_rank(tmp_path):
    """A gloo process group of one rank in this process."""
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        yield
    finally:
        dist.destroy_process_group()
