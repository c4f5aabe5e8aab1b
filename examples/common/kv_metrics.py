"""The KV tables' counters during training: this rank's, summed over ranks, as text.

Every KV table shard reports ``metrics()`` (stored rows, capacity, hits,
misses, evictions, admission rejects, ids that found no memory row in their
batch (``insert_failures``: bucket overflow), SSD rows / reads / writes,
scratch rows); the jobs sum them over tables and ranks and show them in the
progress bar.

Example::

    counters, loss = reduce_metrics(model, loss_sum, loss_count, device)  # a collective
    print(describe_kv(counters))
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from torchrec_kvemb.sharding import ShardedKVEmbeddingBagCollection, ShardedKVEmbeddingCollection

#: KV counters summed over tables and ranks for the progress bar.
KV_COUNTERS = (
    "size",
    "capacity",
    "hits",
    "misses",
    "evictions",
    "admission_rejects",
    "insert_failures",
    "scratch_rows",
    "ssd_size",
    "ssd_reads",
    "ssd_writes",
)


def kv_modules(model: nn.Module) -> list[nn.Module]:
    """The sharded KV collections (bag or sequence) inside ``model``."""
    kinds = (ShardedKVEmbeddingBagCollection, ShardedKVEmbeddingCollection)
    return [m for m in model.modules() if isinstance(m, kinds)]


def kv_counters(model: nn.Module) -> torch.Tensor:
    """This rank's KV counters (``KV_COUNTERS``), summed over its table shards."""
    total = torch.zeros(len(KV_COUNTERS), dtype=torch.float64)
    for module in kv_modules(model):
        for metrics in module.metrics().values():
            total += torch.tensor([float(metrics.get(k, 0)) for k in KV_COUNTERS])
    return total


def reduce_metrics(
    model: nn.Module, loss_sum: float, loss_count: int, device: torch.device
) -> tuple[dict[str, float], float]:
    """KV counters and the mean loss, summed over ranks (a collective)."""
    local = torch.cat([kv_counters(model), torch.tensor([loss_sum, float(loss_count)])])
    local = local.to(device)  # nccl reduces CUDA tensors only
    dist.all_reduce(local)
    local = local.cpu()
    counters = dict(zip(KV_COUNTERS, local[:-2].tolist()))
    loss = float(local[-2] / local[-1]) if local[-1] > 0 else float("nan")
    return counters, loss


def describe_kv(c: dict[str, float], window: dict[str, float] | None = None) -> str:
    """Progress-bar text of summed counters; hit rate over ``window`` (deltas) if given."""
    w = window or c
    lookups = w["hits"] + w["misses"]
    text = (
        f"rows={_short(c['size'])} load={c['size'] / max(c['capacity'], 1):.2f} "
        f"hit={100 * w['hits'] / lookups if lookups else 0:.1f}% "
        f"evict={_short(c['evictions'])} rejects={_short(c['admission_rejects'])} "
        # ids that found no memory row in their batch (a bucket full of the batch's ids)
        f"overflow={_short(c['insert_failures'])}"
    )
    if c["ssd_size"] or c["ssd_writes"]:
        text += (
            f" ssd_rows={_short(c['ssd_size'])} ssd_r/w="
            f"{_short(c['ssd_reads'])}/{_short(c['ssd_writes'])}"
            f" scratch={_short(c['scratch_rows'])}"
        )
    return text


def _short(x: float) -> str:
    for unit, size in (("M", 1e6), ("k", 1e3)):
        if abs(x) >= size:
            return f"{x / size:.1f}{unit}"
    return f"{x:.0f}"
