"""The fused optimizer read from TorchRec's ``fused_params`` resolves every default as
FBGEMM's fused tables do (the stock sharder hands ``fused_params`` to them), so
swapping the stock sharder for the KV one never changes the update silently.
(FBGEMM's CPU tables have no Adam; its defaults are those of the other optimizers.)"""

import pytest
import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
    ComputeDevice,
    SplitTableBatchedEmbeddingBagsCodegen,
)
from fbgemm_gpu.tbe.config.optimizer_config import WeightDecayMode
from torchrec.modules.embedding_configs import EmbeddingBagConfig

from torchrec_kvemb import KVEmbeddingBagCollection, KVTableOptions
from torchrec_kvemb.optimizer import FusedOptimConfig, OptimKind, WeightDecay

FUSED_PARAMS = {
    "nothing": {},
    "learning-rate-only": {"learning_rate": 0.1},
    "decay-without-mode": {"learning_rate": 0.1, "weight_decay": 0.01},
    "adagrad": {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "eps": 1e-3},
    "adagrad-l2-betas": {
        "optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
        "beta1": 0.8,
        "weight_decay": 0.02,
        "weight_decay_mode": WeightDecayMode.L2,
    },
    "sgd-clipped": {"optimizer": EmbOptimType.EXACT_SGD, "gradient_clipping": True},
}
_KINDS = {
    "exact_sgd": OptimKind.SGD,
    "exact_row_wise_adagrad": OptimKind.ROWWISE_ADAGRAD,
}


@pytest.mark.parametrize("name", list(FUSED_PARAMS))
def test_defaults_are_fbgemm_fused_tables_defaults(name: str) -> None:
    params = FUSED_PARAMS[name]
    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        [(10, 4, EmbeddingLocation.HOST, ComputeDevice.CPU)], **params
    )
    got = FusedOptimConfig.from_fused_params(params)
    args = tbe.optimizer_args
    assert got.kind == _KINDS[tbe.optimizer.value], name
    assert got.learning_rate == pytest.approx(tbe.get_learning_rate())
    assert got.eps == pytest.approx(args.eps)
    assert (got.beta1, got.beta2) == pytest.approx((args.beta1, args.beta2))
    assert got.weight_decay == pytest.approx(args.weight_decay)
    assert int(got.weight_decay_mode) == int(args.weight_decay_mode)
    assert got.gradient_clipping == args.gradient_clipping
    assert got.max_gradient == pytest.approx(args.max_gradient)


def test_a_collection_without_an_optimizer_trains_by_sgd_as_the_stock_one() -> None:
    ebc = KVEmbeddingBagCollection(
        [EmbeddingBagConfig(name="t", embedding_dim=3, num_embeddings=10, feature_names=["f"])],
        KVTableOptions(capacity=16),
        fused_params={"learning_rate": 0.5, "weight_decay": 0.1},
    )
    table = ebc.table("t")
    assert table.optim.kind == OptimKind.SGD and table.state_dim == 0
    assert table.optim.weight_decay_mode == WeightDecay.NONE
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=["f"], values=torch.tensor([4]), lengths=torch.tensor([1])
    )
    before = table.initial_rows(torch.tensor([4]))
    ebc(kjt).values().sum().backward()
    after, _ = table.find(torch.tensor([4]))
    # SGD without decay (weight_decay_mode NONE): row - lr * grad, grad = 1
    torch.testing.assert_close(after, before - 0.5)
