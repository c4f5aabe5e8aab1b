"""A KV collection marked by ``apply_optimizer_in_backward`` before sharding, against
the stock sharded twin, one torchrun job.

Run by ``tests/test_apply_optimizer_in_backward.py``::

    torchrun --nproc_per_node 2 -m tests.sharding.marked_optimizer_worker RESULT.json

Per scenario every rank builds a ``KVEmbeddingBagCollection`` (two tables, two
features each) and a stock ``EmbeddingBagCollection`` of the same configs, marks
both with the same torch optimizer, and shards them under
``DistributedModelParallel``: the KV one row-wise by ``KVEmbeddingBagCollectionSharder``,
the stock one table-wise by TorchRec's own sharder (FBGEMM's fused CPU tables; its
only CPU sharding). The stock tables start from the KV tables' initial rows; both
models see the same batches. Outputs at every step and, at the end, every id's row
must agree.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.optim import _apply_optimizer_in_backward
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import ParameterConstraints
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.optim import RowWiseAdagrad
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from tests.sharding.dist_worker import CPU, META, EBCModel, planned
from tests.torchrun_jobs import Tally, gather, scenarios_main
from torchrec_kvemb import (
    KVEmbeddingBagCollection,
    KVEmbeddingBagCollectionSharder,
    KVTableOptions,
)

ROWS, BAGS, STEPS = 37, 3, 4
TOL = 1e-6
#: table -> (dim, features); two features per table: FBGEMM's generic CPU kernel
TABLES = {"t": (4, ["f1", "f2"]), "s": (8, ["g1", "g2"])}
KEYS = [f for _, features in TABLES.values() for f in features]


def configs() -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(
            name=name,
            embedding_dim=dim,
            num_embeddings=ROWS,
            feature_names=features,
            weight_init_min=-0.5,
            weight_init_max=0.5,
        )
        for name, (dim, features) in TABLES.items()
    ]


def batch(step: int, rank: int) -> tuple[KeyedJaggedTensor, dict[str, torch.Tensor]]:
    """This rank's bags at ``step`` and the loss coefficients of each feature's output."""
    g = torch.Generator().manual_seed(100 * step + rank)
    lengths = torch.randint(0, 4, (len(KEYS) * BAGS,), generator=g)
    ids = torch.randint(0, ROWS, (int(lengths.sum()),), generator=g)
    coeff = {
        f: torch.randn(BAGS, dim, generator=g)
        for dim, features in TABLES.values()
        for f in features
    }
    return KeyedJaggedTensor.from_lengths_sync(keys=KEYS, values=ids, lengths=lengths), coeff


def kv_rows(dmp: DistributedModelParallel, name: str, start: torch.Tensor) -> torch.Tensor:
    """Every id's row of KV table ``name``, gathered from its row-wise shards (an id no
    batch read has no row: its initial one, ``start``)."""
    rows, found = dmp.module.ebc.kv_tables()[name].find(torch.arange(ROWS))
    parts = gather((rows * found[:, None], found))
    found = sum(f.long() for _, f in parts)
    assert int(found.max()) <= 1, "an id stored on two ranks"
    return torch.where(found[:, None] > 0, sum(r for r, _ in parts), start)


def stock_rows(dmp: DistributedModelParallel, name: str) -> torch.Tensor | None:
    """This rank's whole stock table ``name`` (table-wise: None off its owner)."""
    shards = dmp.state_dict()[f"ebc.embedding_bags.{name}.weight"].local_shards()
    return shards[0].tensor if shards else None


def scenario(
    optimizer_class: type, kwargs: dict, sharder_fused: dict | None = None
) -> Callable[[], dict]:
    """Both collections marked with ``optimizer_class(**kwargs)``; both sharders given
    ``sharder_fused`` (the marked kwargs win over them, as TorchRec merges them)."""

    def run() -> dict:
        rank = dist.get_rank()
        tally = Tally(TOL)
        kv = KVEmbeddingBagCollection(configs(), KVTableOptions(capacity=64), device=CPU)
        _apply_optimizer_in_backward(optimizer_class, kv.parameters(), dict(kwargs))
        start = {n: kv.table(n).initial_rows(torch.arange(ROWS)) for n in TABLES}
        kv_sharder = KVEmbeddingBagCollectionSharder(
            fused_params=sharder_fused, module_type=KVEmbeddingBagCollection
        )
        kv_model = EBCModel(kv)
        rw = {n: ParameterConstraints(sharding_types=["row_wise"]) for n in TABLES}
        kv_dmp = DistributedModelParallel(
            kv_model,
            device=CPU,
            plan=planned(kv_model, [kv_sharder], rw),
            sharders=[kv_sharder],
        )

        stock = EmbeddingBagCollection(configs(), device=META)
        _apply_optimizer_in_backward(optimizer_class, stock.parameters(), dict(kwargs))
        stock_sharder = EmbeddingBagCollectionSharder(fused_params=sharder_fused)
        stock_model = EBCModel(stock)
        tw = {n: ParameterConstraints(sharding_types=["table_wise"]) for n in TABLES}
        stock_dmp = DistributedModelParallel(
            stock_model,
            device=CPU,
            plan=planned(stock_model, [stock_sharder], tw),
            sharders=[stock_sharder],
        )
        for name in TABLES:
            rows = stock_rows(stock_dmp, name)
            if rows is not None:
                rows.copy_(start[name])

        for step in range(STEPS):
            kjt, coeff = batch(step, rank)
            # by key: the stock sharded output orders its keys by sharding group
            got, want = kv_dmp(kjt).to_dict(), stock_dmp(kjt).to_dict()
            for key in KEYS:
                tally.diff("outputs", got[key], want[key])
            sum((got[k] * coeff[k]).sum() for k in KEYS).backward()
            sum((want[k] * coeff[k]).sum() for k in KEYS).backward()
        for name in TABLES:
            got = kv_rows(kv_dmp, name, start[name])
            owned = [r for r in gather(stock_rows(stock_dmp, name)) if r is not None]
            tally.check(f"{name}: one stock owner", len(owned) == 1)
            tally.diff("rows", got, owned[0])
            tally.check(f"{name}: trained", not torch.equal(got, start[name]))
        optims = {
            n: [t.optim.kind.value, t.optim.learning_rate]
            for n, t in kv_dmp.module.ebc.kv_tables().items()
        }
        result = tally.result()
        result["kv optimizers"] = optims
        return result

    return run


SCENARIOS = {
    # the sharders' own learning rate gives way to the marked one (TorchRec's merge)
    "rowwise_adagrad": scenario(
        RowWiseAdagrad, {"lr": 0.2, "eps": 1e-3}, sharder_fused={"learning_rate": 0.5}
    ),
    "torch_sgd": scenario(torch.optim.SGD, {"lr": 0.3}),
}


if __name__ == "__main__":
    scenarios_main(SCENARIOS)
