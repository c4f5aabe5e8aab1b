"""The examples' DLRM: its tables, KV options, optimizers, and the model sharded or not.

``torchrec.models.dlrm.DLRM`` over one collection of 26 tables, one per
Criteo feature. The ``--num-kv-tables`` features with the largest
vocabularies get KV tables (raw ids, ``--id-space`` as ``num_embeddings``);
the others get stock tables of at most ``--stock-rows`` rows (ids modulo the
size). Sharded, the collection is a stock ``EmbeddingBagCollection`` on the
meta device that ``KVEmbeddingBagCollectionSharder`` turns into KV tables;
unsharded (world size 1), a :class:`~common.mixed_ebc.MixedEmbeddingBagCollection`
that loads the sharded model's checkpoints. Every function reads the run's
flags (an ``argparse.Namespace``).

Example::

    model = dlrm_on_meta(args, device)
    sharder = KVEmbeddingBagCollectionSharder(kv_options(args, ssd_dir), fused_params(args))
    model = DistributedModelParallel(model, device=device, sharders=[sharder])
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.datasets.criteo import CAT_FEATURE_COUNT, DEFAULT_CAT_NAMES, INT_FEATURE_COUNT
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.models.dlrm import DLRM, DLRMTrain
from torchrec.optim.optimizers import in_backward_optimizer_filter

from common.criteo import CARDINALITIES
from common.mixed_ebc import MixedEmbeddingBagCollection
from common.workdir import shown
from torchrec_kvemb import EvictionPolicy, KVTableOptions, SSDOptions

DENSE_ARCH = [64]  # then the embedding dim
OVER_ARCH = [64, 32, 1]
#: KV capacity of a model that loads a checkpoint at another world size, in
#: multiples of the trained one. Why: after training, a shard's 16-way index
#: buckets are often all full; the same ids rehashed into one table of the same
#: total size overflow some buckets (default run: 2317 of 32768 rows of t_cat_9
#: found no room at 1x, 2 at 2x, none at 4x).
RELOAD_HEADROOM = 4


def kv_features(num_kv_tables: int) -> list[int]:
    """The features with the largest vocabularies, largest first."""
    order = sorted(range(CAT_FEATURE_COUNT), key=lambda f: -CARDINALITIES[f])
    return order[:num_kv_tables]


def table_name(feature: int) -> str:
    return f"t_{DEFAULT_CAT_NAMES[feature]}"


def kv_table_names(args: argparse.Namespace) -> list[str]:
    """The KV tables' names, sorted."""
    return sorted(table_name(f) for f in kv_features(args.num_kv_tables))


def table_configs(args: argparse.Namespace) -> list[EmbeddingBagConfig]:
    """One table per feature: KV tables span the id space, stock ones ``--stock-rows``."""
    kv = set(kv_features(args.num_kv_tables))
    return [
        EmbeddingBagConfig(
            name=table_name(f),
            embedding_dim=args.embedding_dim,
            num_embeddings=args.id_space if f in kv else min(n, args.stock_rows),
            feature_names=[DEFAULT_CAT_NAMES[f]],
        )
        for f, n in enumerate(CARDINALITIES)
    ]


def table_sizes(args: argparse.Namespace) -> list[int | None]:
    """Per feature: the stock table's size (ids are taken modulo it), None for KV."""
    kv = set(kv_features(args.num_kv_tables))
    return [None if f in kv else min(n, args.stock_rows) for f, n in enumerate(CARDINALITIES)]


def kv_options(
    args: argparse.Namespace, ssd_dir: str | None, headroom: int = 1
) -> dict[str, KVTableOptions]:
    """Per KV table. The two largest go on SSD tiers (``ssd_dir``; one group, looked
    up in one pass) and keep half their rows in memory; the second admits an id
    after 2 sightings and evicts LFU; the others evict LRU. ``headroom``
    multiplies the capacities (see ``RELOAD_HEADROOM``)."""
    out = {}
    for i, f in enumerate(kv_features(args.num_kv_tables)):
        ssd = SSDOptions(path=ssd_dir, resume=False) if (i < 2 and ssd_dir) else None
        capacity = args.kv_capacity // 2 if ssd else args.kv_capacity
        out[table_name(f)] = KVTableOptions(
            capacity=capacity * headroom,
            eviction=EvictionPolicy.LFU if i == 1 else EvictionPolicy.LRU,
            admission_threshold=2 if i == 1 else 1,
            seed=args.seed + f,
            # Explicit: TorchRec's default range, sqrt(1 / num_embeddings), is ~0
            # over the whole id space.
            init_low=-0.01,
            init_high=0.01,
            ssd=ssd,
        )
    return out


def fused_params(args: argparse.Namespace) -> dict[str, Any]:
    """Every embedding table's fused optimizer: row-wise Adagrad at ``--lr``."""
    return {
        "optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
        "learning_rate": args.lr,
        "eps": 1e-8,
    }


def build_dlrm(ebc: nn.Module, args: argparse.Namespace, device: torch.device) -> DLRMTrain:
    """TorchRec's DLRM (with its BCE loss) over ``ebc``; dense weights from ``--seed``."""
    torch.manual_seed(args.seed)
    return DLRMTrain(
        DLRM(
            embedding_bag_collection=ebc,
            dense_in_features=INT_FEATURE_COUNT,
            dense_arch_layer_sizes=[*DENSE_ARCH, args.embedding_dim],
            over_arch_layer_sizes=OVER_ARCH,
            dense_device=device,
        )
    )


def dlrm_on_meta(args: argparse.Namespace, device: torch.device) -> DLRMTrain:
    """The DLRM to shard: every table of a stock collection on the meta device."""
    ebc = EmbeddingBagCollection(table_configs(args), device=torch.device("meta"))
    return build_dlrm(ebc, args, device)


def unsharded_dlrm(
    args: argparse.Namespace, ssd_dir: str | None, headroom: int = RELOAD_HEADROOM
) -> DLRMTrain:
    """The DLRM at world size 1, on CPU, that loads the sharded model's checkpoints:
    KV tables in a ``KVEmbeddingBagCollection``, the others in a stock one."""
    device = torch.device("cpu")
    options = kv_options(args, ssd_dir, headroom=headroom)
    ebc = MixedEmbeddingBagCollection(table_configs(args), options, fused_params(args), device)
    return build_dlrm(ebc, args, device)


def dense_optimizer(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    """Adagrad for the parameters that no fused optimizer updates (the dense part,
    and stock tables the planner makes data-parallel)."""
    params = [p for _, p in in_backward_optimizer_filter(model.named_parameters())]
    return torch.optim.Adagrad(params, lr=lr, eps=1e-8)


def plan_summary(model: DistributedModelParallel, options: dict, seconds: float) -> str:
    """One line: how many tables of each kind got each sharding type, the KV ones by
    name, and where the SSD tier lies."""
    by_kind: dict[str, list[str]] = {}
    for module_plan in model.plan.plan.values():
        for table, ps in module_plan.items():
            kind = "KV" if table in options else "stock"
            by_kind.setdefault(f"{kind} {ps.sharding_type}", []).append(table)
    parts = [
        f"{len(t)} {k}" + (f" ({', '.join(sorted(t))})" if k.startswith("KV") else "")
        for k, t in sorted(by_kind.items())
    ]
    ssd = [n for n, o in options.items() if o.ssd is not None]
    text = f"plan ({seconds:.1f} s): " + "; ".join(parts)
    if ssd:
        text += f"; SSD tier: {', '.join(ssd)} under {shown(options[ssd[0]].ssd.path)}"
    return text
