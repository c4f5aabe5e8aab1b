"""TorchRec's own sharding test harness with the KV sequence sharder:
``torchrec.distributed.test_utils.test_sharding.sharding_single_rank_test`` on
TorchRec's sequence test model (``TestMixedEmbeddingSparseArch``: an
``EmbeddingCollection`` whose every output is padded to 20 ids and read by the over
arch), one SGD step of the sharded model against TorchRec's unsharded model, the
predictions compared by the harness itself.

Run by ``tests/sharding/test_ec_torchrec_harness.py``::

    torchrun --nproc_per_node=2 -m tests.sharding.ec_harness_worker OUT.json SHARDING

Adaptations, as for the bags (:mod:`tests.sharding.harness_worker`): the
installed wheel lacks ``torchrec.distributed.tests`` (a stub stands in); the
harness copies the unsharded weights into the sharded model by shard offsets, a
KV table's rows go by id (inserted on the rank that owns them). And one for
shared features: the wheel's sequence model reads the collection's outputs by
feature name, which a feature read by two tables does not have (the stock
``EmbeddingCollection`` names them ``feature@table``, as TorchRec's own
``TestSequenceSparseNN`` reads them); :class:`SequenceSparseNN` reads them by
those names.
"""

from __future__ import annotations

import os
import sys
import traceback
from typing import Any

import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torchrec.distributed.planner import ParameterConstraints
from torchrec.distributed.test_utils.test_model import TestMixedEmbeddingSparseArch
from torchrec.modules.embedding_configs import EmbeddingConfig
from torchrec.modules.embedding_modules import get_embedding_names_by_table

from tests.sharding.harness_stub import install_missing_test_module
from tests.torchrun_jobs import write_result
from torchrec_kvemb import KVEmbeddingCollectionSharder, KVTableOptions
from torchrec_kvemb.sharding import owner_rank

install_missing_test_module()
import torchrec.distributed.test_utils.test_sharding as harness  # noqa: E402

from tests.sharding.harness_worker import _MODELS, RecordedDMP  # noqa: E402

SGD = {"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": 0.1}
BUCKETS = 24
DIM = 4
ORIGINAL_COPY = harness.copy_state_dict


class SequenceSparseNN(TestMixedEmbeddingSparseArch):
    """TorchRec's sequence test model reading its collection's outputs by their names
    (``feature``, or ``feature@table`` for a feature read by several tables)."""

    def __init__(self, tables: list[EmbeddingConfig], **kwargs: Any) -> None:
        super().__init__(tables=tables, **kwargs)
        sequences = [t for t in tables if isinstance(t, EmbeddingConfig)]
        self._ec_features = [n for ns in get_embedding_names_by_table(sequences) for n in ns]


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
            full = glob[f"{path}.embeddings.{name}.weight"]
            ids = torch.arange(full.shape[0])
            if plan[name].sharding_type == "row_wise":
                ids = ids[owner_rank(ids, BUCKETS, world) == rank]
            table.insert(ids, full[ids].detach().clone())
    stock = {k: v for k, v in loc.items() if not any(f".embeddings.{n}." in k for n in kv_names)}
    ORIGINAL_COPY(stock, glob, exclude_predfix=exclude_predfix)


def tables() -> list[EmbeddingConfig]:
    """Sequence tables of odd sizes, one dim (an EmbeddingCollection's rule), and a
    table reading the features of two others."""
    configs = [
        EmbeddingConfig(
            num_embeddings=(i + 1) * 11 + 2,
            embedding_dim=DIM,
            name=f"table_{i}",
            feature_names=[f"feature_{i}"],
        )
        for i in range(3)
    ]
    # The harness draws a shared feature's ids for its last table: 13 rows.
    configs.append(
        EmbeddingConfig(
            num_embeddings=13, embedding_dim=DIM, name="table_shared",
            feature_names=["feature_0", "feature_2"],
        )
    )  # fmt: skip
    return configs


def run(sharding: str) -> None:
    """KV tables sharded ``sharding``; ``table_2`` stays stock (table-wise)."""
    configs = tables()
    stock_tables = {"table_2"}
    options = {
        c.name: KVTableOptions(capacity=4 * c.num_embeddings, total_num_buckets=BUCKETS)
        for c in configs
        if c.name not in stock_tables
    }
    constraints = {
        c.name: ParameterConstraints(
            sharding_types=["table_wise" if c.name in stock_tables else sharding]
        )
        for c in configs
    }
    harness.sharding_single_rank_test(
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        model_class=SequenceSparseNN,
        embedding_groups={
            "group_0": [n for ns in get_embedding_names_by_table(configs) for n in ns]
        },
        tables=configs,
        weighted_tables=None,
        sharders=[KVEmbeddingCollectionSharder(options, SGD)],
        backend="gloo",
        optim=EmbOptimType.EXACT_SGD,
        constraints=constraints,
        random_seed=7,
    )


def main() -> None:
    harness.DistributedModelParallel = RecordedDMP
    harness.copy_state_dict = kv_copy_state_dict
    torch.set_num_threads(1)
    out_path, sharding = sys.argv[1], sys.argv[2]
    try:
        run(sharding)
        results = {sharding: "passed"}
    except Exception:
        results = {sharding: traceback.format_exc()[-3000:]}
    if int(os.environ["RANK"]) == 0:
        write_result(out_path, results)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
