"""State_dict entries given to a KV module, read into :class:`TableRows`.

An entry may be a plain tensor (the whole table), a ShardedTensor (this rank's
local shards) or a DTensor (its local tensor: this rank's shard, or the whole
table when replicated).

Example::

    rows = rows_from_entries("user", {"weight": w, "weight_id": ids, "momentum1": m})
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.tensor import DTensor, Replicate

from torchrec_kvemb.state_dict.checks import CheckpointError
from torchrec_kvemb.state_dict.rows import ADMISSION_KEYS, LAST_SEEN_KEY, STATE_NAMES, TableRows


def rows_from_entries(name: str, entries: dict[str, Any]) -> TableRows:
    """A table's rows from its state_dict entries (suffix -> plain tensor, or the
    local shards of a ShardedTensor, see :func:`local_rows`)."""
    local = {k: local_rows(name, k, v) for k, v in entries.items()}
    admission = None
    if all(k in local for k in ADMISSION_KEYS):
        admission = tuple(local[k].to(torch.int64) for k in ADMISSION_KEYS)
    step = None
    if "step" in local:
        value = local["step"].reshape(-1).tolist()
        if len(value) != 2:
            raise CheckpointError(f"table {name!r}: step must hold 2 values, got {len(value)}")
        step = (int(value[0]), int(value[1]))
    return TableRows(
        ids=local["weight_id"],
        weights=local["weight"],
        scores=local.get("weight_score"),
        state={k: local[k] for k in STATE_NAMES if k in local},
        step=step,
        admission=admission,
        last_seen=local.get(LAST_SEEN_KEY),
    )


def is_distributed(value: Any) -> bool:
    """Whether an entry is this rank's part of a distributed tensor (a ShardedTensor,
    a DTensor sharded over its mesh), not the whole table."""
    if isinstance(value, ShardedTensor):
        return True
    if isinstance(value, DTensor):
        return not all(isinstance(p, Replicate) for p in value.placements)
    return False


def local_rows(name: str, key: str, value: Any) -> torch.Tensor:
    """The rows a state_dict entry gives this rank: a plain tensor as it is, a
    ShardedTensor's local shards (in offset order), a DTensor's local tensor."""
    if isinstance(value, ShardedTensor):
        shards = sorted(value.local_shards(), key=lambda s: s.metadata.shard_offsets[0])
        size = value.size()
        if not shards:
            return torch.empty((0, *size[1:]), dtype=value.dtype)
        return torch.cat([s.tensor.detach() for s in shards])
    if isinstance(value, DTensor):
        return value.to_local().detach()
    if not isinstance(value, torch.Tensor):
        raise CheckpointError(
            f"table {name!r}: {key} must be a tensor, ShardedTensor or DTensor, "
            f"got {type(value).__name__}"
        )
    return value.detach()


def is_placeholder(value: Any) -> bool:
    """A stand-in weight: TorchRec's meta EBC weight, or an empty one (plain tensor,
    ShardedTensor or DTensor)."""
    if isinstance(value, ShardedTensor):
        return value.metadata().size.numel() == 0 or any(
            s.tensor.is_meta for s in value.local_shards()
        )
    if isinstance(value, DTensor):
        return value.to_local().is_meta or value.size().numel() == 0
    return isinstance(value, torch.Tensor) and (value.is_meta or value.numel() == 0)
