"""TorchRec's own sharding test harness with the KV sharder: ``TestSparseNN``
through ``torchrec.distributed.test_utils.test_sharding.sharding_single_rank_test``
(one SGD step of the sharded model against TorchRec's unsharded model, predictions
compared by the harness itself).

Run by ``tests/sharding/test_torchrec_harness.py``::

    torchrun --nproc_per_node=2 -m tests.sharding.harness_worker OUT.json SCENARIO...

Two adaptations (docs/sharding.md, "TorchRec's test harness"): the installed
wheel lacks ``torchrec.distributed.tests``, which ``test_sharding`` imports for its
2D-parallel path only (a stub stands in, :mod:`tests.sharding.harness_stub`); and
the harness copies the unsharded model's weights into the sharded one with
``copy_state_dict``, by shard offsets, while a KV table's rows go by id: a wrapper
inserts each KV table's rows by id on the rank that owns them and copies every
other entry with the harness's own function.
"""

from __future__ import annotations

import os
import sys
import traceback
from typing import Any

import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import ParameterConstraints
from torchrec.distributed.test_utils.test_model import TestSparseNN
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import get_embedding_names_by_table

from tests.sharding.harness_stub import install_missing_test_module
from tests.torchrun_jobs import write_result
from torchrec_kvemb import KVEmbeddingBagCollectionSharder, KVTableOptions
from torchrec_kvemb.sharding import owner_rank

install_missing_test_module()
import torchrec.distributed.test_utils.test_sharding as harness  # noqa: E402

SGD = {"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": 0.1}
BUCKETS = 24
_MODELS: list[DistributedModelParallel] = []


class RecordedDMP(DistributedModelParallel):
    """DMP that remembers the models the harness builds (to reach their KV tables)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _MODELS.append(self)


def kv_copy_state_dict(loc: dict, glob: dict, exclude_predfix: Any = None) -> None:
    """The harness's ``copy_state_dict`` for stock entries; KV rows inserted by id."""
    dmp = _MODELS[-1]
    rank, world = dist.get_rank(), dist.get_world_size()
    kv_names = set()
    for path, module in dmp.module.named_modules():
        if not hasattr(module, "kv_tables"):
            continue
        plan = dmp.plan.plan[path]
        kv_names |= {n for n, ps in plan.items() if ps.compute_kernel == "customized_kernel"}
        for name, table in module.kv_tables().items():
            full = glob[f"{path}.embedding_bags.{name}.weight"]
            ids = torch.arange(full.shape[0])
            if plan[name].sharding_type == "row_wise":
                ids = ids[owner_rank(ids, BUCKETS, world) == rank]
            table.insert(ids, full[ids].detach().clone())
    stock = {
        k: v for k, v in loc.items() if not any(f".embedding_bags.{n}." in k for n in kv_names)
    }
    ORIGINAL_COPY(stock, glob, exclude_predfix=exclude_predfix)


ORIGINAL_COPY = harness.copy_state_dict


def tables(mean: bool, shared: bool) -> tuple[list, list]:
    """TestSparseNN's usual tables (odd sizes), MEAN pooling on some, a table that
    reads another's feature."""
    pooling = PoolingType.MEAN if mean else PoolingType.SUM
    plain = [
        EmbeddingBagConfig(
            num_embeddings=(i + 1) * 11 + 2,
            embedding_dim=(i + 2) * 4,
            name=f"table_{i}",
            feature_names=[f"feature_{i}"],
            pooling=pooling if i % 2 else PoolingType.SUM,
        )
        for i in range(3)
    ]
    if shared:  # the harness draws a shared feature's ids for its last table: 13 rows
        plain.append(
            EmbeddingBagConfig(
                num_embeddings=13, embedding_dim=8, name="table_shared",
                feature_names=["feature_0", "feature_2"],
            )
        )  # fmt: skip
    weighted = [
        EmbeddingBagConfig(
            num_embeddings=(i + 1) * 7 + 3,
            embedding_dim=(i + 2) * 4,
            name=f"weighted_table_{i}",
            feature_names=[f"weighted_feature_{i}"],
        )
        for i in range(2)
    ]
    return plain, weighted


def run(scenario: str) -> None:
    sharding, *flags = scenario.split("+")
    plain, weighted = tables(mean="mean" in flags, shared="shared" in flags)
    # table_1 pools by MEAN when asked: it stays KV.
    stock_tables = {"table_2", "weighted_table_0"} if "mixed" in flags else set()
    options = {
        c.name: KVTableOptions(capacity=4 * c.num_embeddings, total_num_buckets=BUCKETS)
        for c in plain + weighted
        if c.name not in stock_tables
    }
    constraints = {
        c.name: ParameterConstraints(
            sharding_types=["table_wise" if c.name in stock_tables else sharding]
        )
        for c in plain + weighted
    }
    in_backward = None
    if "in_backward" in flags:
        in_backward = {"embedding_bags": (torch.optim.SGD, {"lr": 0.05})}
    harness.sharding_single_rank_test(
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        model_class=TestSparseNN,
        # The over arch reads the pooled outputs by these names: TorchRec's
        # embedding names, ``feature@table`` for a shared feature.
        embedding_groups={"group_0": [n for ns in get_embedding_names_by_table(plain) for n in ns]},
        tables=plain,
        weighted_tables=weighted,
        sharders=[KVEmbeddingBagCollectionSharder(options, SGD)],
        backend="gloo",
        optim=EmbOptimType.EXACT_SGD,
        constraints=constraints,
        apply_optimizer_in_backward_config=in_backward,
        variable_batch_per_feature="vbe" in flags,
        random_seed=7,
    )


def main() -> None:
    harness.DistributedModelParallel = RecordedDMP
    harness.copy_state_dict = kv_copy_state_dict
    torch.set_num_threads(1)
    out_path, scenarios = sys.argv[1], sys.argv[2:]
    results = {}
    for scenario in scenarios:
        try:
            run(scenario)
            results[scenario] = "passed"
        except Exception:
            results[scenario] = traceback.format_exc()[-3000:]
            break
        finally:
            _MODELS.clear()
    if int(os.environ["RANK"]) == 0:
        write_result(out_path, results)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
