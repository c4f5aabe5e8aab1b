"""Starting an example job: torchrun from a plain ``python`` command, the process group.

Each job is one script that runs under ``torchrun`` (one process per rank).
Started with plain ``python``, it starts ``torchrun`` on itself
(:func:`relaunched_under_torchrun`); under ``torchrun`` it joins the process
group (:func:`setup_process_group`: gloo on CPU, nccl on CUDA).

Example::

    if relaunched_under_torchrun(__file__, args.world_size or 2):
        return  # the ranks have run
    rank, world, device = setup_process_group()
    say(rank, "only rank 0 prints this")
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from typing import Any

import torch
import torch.distributed as dist


def relaunched_under_torchrun(script: str, world: int) -> bool:
    """Outside torchrun (no ``RANK``): run ``script`` with this command line on
    ``world`` local processes through torchrun and return True once they end;
    under torchrun, return False (this process is one of the ranks)."""
    if "RANK" in os.environ:
        return False
    from torch.distributed.run import main as torchrun

    torchrun(["--standalone", f"--nproc_per_node={world}", os.path.abspath(script)] + sys.argv[1:])
    return True


def setup_process_group() -> tuple[int, int, torch.device]:
    """Join the job's process group; returns (rank, world size, device). Torch
    threads: this machine's cores shared by its local ranks."""
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local_rank)
        device, backend = torch.device(f"cuda:{local_rank}"), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    dist.init_process_group(backend)
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    return dist.get_rank(), dist.get_world_size(), device


def quiet_logs() -> None:
    """No warnings and no log lines below errors: TorchRec and fbgemm print many per rank."""
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)


def say(rank: int, *parts: Any) -> None:
    """Print on rank 0 only."""
    if rank == 0:
        print(*parts, flush=True)
