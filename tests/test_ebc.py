"""KVEmbeddingBagCollection: modes, layout, bad input."""

import pytest
import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_kvemb import KVEmbeddingBagCollection, KVInputError, KVTableOptions


def _ebc(weighted=False, pooling=PoolingType.SUM, **options):
    configs = [
        EmbeddingBagConfig(
            name="user",
            embedding_dim=5,
            num_embeddings=2**63 - 1,
            feature_names=["u1", "u2"],
            pooling=pooling,
        ),
        EmbeddingBagConfig(
            name="item", embedding_dim=3, num_embeddings=2**40, feature_names=["i"], pooling=pooling
        ),
    ]
    opts = {"user": KVTableOptions(capacity=96, **options), "item": KVTableOptions(capacity=48)}
    return KVEmbeddingBagCollection(
        configs, opts, is_weighted=weighted, fused_params={"learning_rate": 0.1}
    )


def _kjt(values, lengths, weights=None, keys=("u1", "u2", "i")):
    return KeyedJaggedTensor.from_lengths_sync(
        keys=list(keys),
        values=values,
        lengths=torch.tensor(lengths),
        weights=weights,
    )


def _state(ebc):
    return {
        name: [t.keys.clone(), t.weights.clone(), t.state.clone(), t.scores.clone()]
        for name, t in ebc.kv_tables().items()
    }


def test_eval_is_read_only_and_missing_ids_pool_zero():
    ebc = _ebc()
    train_kjt = _kjt(torch.tensor([1, 2, 2**62, 9, 4]), [2, 0, 1, 1, 0, 1])
    ebc(train_kjt)
    ebc.eval()
    before = _state(ebc)
    kt = ebc(_kjt(torch.tensor([1, 77, 2**62, 9, 88]), [2, 0, 1, 1, 0, 1]))
    user = ebc.table("user")
    rows, _ = user.find(torch.tensor([1, 2**62, 9]))
    torch.testing.assert_close(kt["u1"][0], rows[0])  # 77 is missing: zeros
    torch.testing.assert_close(kt["u2"][0], rows[1])
    torch.testing.assert_close(kt["u2"][1], rows[2])
    torch.testing.assert_close(kt["i"][1], torch.zeros(3))
    after = _state(ebc)
    for name in before:
        assert all(torch.equal(a, b) for a, b in zip(before[name], after[name])), name
    assert not kt.values().requires_grad


def test_mean_pooling_with_empty_bags():
    ebc = _ebc(pooling=PoolingType.MEAN)
    kt = ebc(_kjt(torch.tensor([1, 2, 3, 4]), [2, 0, 0, 1, 1, 0]))
    rows, _ = ebc.table("user").find(torch.tensor([1, 2, 3]))
    torch.testing.assert_close(kt["u1"][0], rows[:2].mean(0))
    torch.testing.assert_close(kt["u1"][1], torch.zeros(5))
    torch.testing.assert_close(kt["u2"][1], rows[2])


def test_training_step_changes_only_touched_rows():
    ebc = _ebc()
    kjt = _kjt(torch.tensor([1, 2, 3, 4]), [2, 0, 0, 1, 1, 0])
    ebc(kjt)
    ids = torch.tensor([1, 2, 3])
    before, _ = ebc.table("user").find(ids)
    ebc(_kjt(torch.tensor([1, 4]), [1, 0, 0, 0, 1, 0])).values().sum().backward()
    after, _ = ebc.table("user").find(ids)
    assert not torch.equal(before[0], after[0])
    assert torch.equal(before[1:], after[1:])


BAD_BATCHES = [
    pytest.param(
        lambda: _kjt(torch.tensor([1, -5, 3, 4]), [2, 0, 0, 1, 1, 0]),
        r"'user'.*negative",
        id="negative-id",
    ),
    pytest.param(
        lambda: _kjt(torch.tensor([1.0, 2.0, 3.0, 4.0]), [2, 0, 0, 1, 1, 0]),
        r"'user'.*int64 or int32",
        id="float-ids",
    ),
    pytest.param(
        lambda: _kjt(torch.tensor([1, 2, 3]), [2, 0, 0, 1, 1, 0]),
        r"lengths sum to 4 but there are 3 ids",
        id="lengths-mismatch",
    ),
    pytest.param(
        lambda: _kjt(torch.tensor([1, 2, 3, 4]), [2, 0, 0, 1, 1, 0], keys=("u1", "u2", "x")),
        r"'item'.*feature 'i' is missing",
        id="missing-feature",
    ),
]


@pytest.mark.parametrize("make,message", BAD_BATCHES)
def test_bad_batches_raise_and_change_nothing(make, message):
    ebc = _ebc()
    ebc(_kjt(torch.tensor([7, 8, 9]), [1, 1, 0, 1, 0, 0]))
    before = _state(ebc)
    metrics = ebc.metrics()
    with pytest.raises(KVInputError, match=message):
        ebc(make())
    after = _state(ebc)
    for name in before:
        assert all(torch.equal(a, b) for a, b in zip(before[name], after[name])), name
    assert ebc.metrics() == metrics


def test_weights_of_wrong_length_raise():
    ebc = _ebc(weighted=True)
    good = torch.tensor([1, 2, 3, 4])
    with pytest.raises(KVInputError, match="weights"):
        KeyedJaggedTensor.from_lengths_sync(
            keys=["u1", "u2", "i"],
            values=good,
            lengths=torch.tensor([2, 0, 0, 1, 1, 0]),
            weights=torch.ones(3),
        )
        ebc(
            KeyedJaggedTensor(
                keys=["u1", "u2", "i"],
                values=good,
                lengths=torch.tensor([2, 0, 0, 1, 1, 0]),
                weights=torch.ones(3),
            )
        )
    with pytest.raises(KVInputError, match="no weights"):
        ebc(_kjt(good, [2, 0, 0, 1, 1, 0]))


def test_weighted_pooling():
    ebc = _ebc(weighted=True)
    ebc.eval()
    w = torch.tensor([0.5, 2.0, 1.0, 3.0])
    ebc.train()
    ebc(_kjt(torch.tensor([1, 2, 3, 4]), [2, 0, 0, 1, 1, 0], weights=torch.ones(4)))
    ebc.eval()
    kt = ebc(_kjt(torch.tensor([1, 2, 3, 4]), [2, 0, 0, 1, 1, 0], weights=w))
    rows, _ = ebc.table("user").find(torch.tensor([1, 2]))
    torch.testing.assert_close(kt["u1"][0], 0.5 * rows[0] + 2.0 * rows[1])


def test_options_dict_must_cover_tables():
    configs = [
        EmbeddingBagConfig(name="a", embedding_dim=4, num_embeddings=10, feature_names=["f"])
    ]
    with pytest.raises(KeyError, match="'a'"):
        KVEmbeddingBagCollection(configs, {"b": KVTableOptions(capacity=16)})


def test_unknown_fused_param_is_an_error():
    configs = [
        EmbeddingBagConfig(name="a", embedding_dim=4, num_embeddings=10, feature_names=["f"])
    ]
    with pytest.raises(ValueError, match="momentum"):
        KVEmbeddingBagCollection(configs, KVTableOptions(capacity=16), fused_params={"momentum": 1})
