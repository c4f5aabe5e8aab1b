"""``use_index_dedup``: the de-duplication itself, the sharders' keyword, and sharded
training with it against the same sharding without it and the unsharded module
(one torchrun job, ``dedup_worker``): sequences row-wise and table-wise, bags row-wise
unweighted and weighted (SUM and MEAN tables)."""

import pytest
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from tests.sharding import dedup_worker as worker
from tests.torchrun_jobs import assert_scenarios_passed, read_result, run_job, torchrun_command
from torchrec_kvemb import (
    KVEmbeddingBagCollectionSharder,
    KVEmbeddingCollectionSharder,
    KVTableOptions,
)
from torchrec_kvemb.sharding.index_dedup import dedup_features

OPTIONS = {"t": KVTableOptions(capacity=64)}


def kjt(keys, values, lengths, weights=None) -> KeyedJaggedTensor:
    return KeyedJaggedTensor.from_lengths_sync(
        keys=keys,
        values=torch.tensor(values),
        lengths=torch.tensor(lengths),
        weights=None if weights is None else torch.tensor(weights),
    )


def naive_dedup(features: KeyedJaggedTensor, labels: list[int]):
    """One table at a time in plain Python: its distinct ids sorted, all in the first
    bag of its first key; each input id's position among them."""
    ids = features.values().tolist()
    per_key = features.length_per_key()
    stride = features.stride()
    kept, reverse = [], []
    lengths = [0] * features.lengths().numel()
    k = pos = 0
    while k < len(labels):
        end = k
        while end < len(labels) and labels[end] == labels[k]:
            end += 1
        segment = ids[pos : pos + sum(per_key[k:end])]
        distinct = sorted(set(segment))
        reverse += [len(kept) + distinct.index(i) for i in segment]
        lengths[k * stride] = len(distinct)
        kept += distinct
        pos += len(segment)
        k = end
    return kept, lengths, reverse


CASES = {
    "one_feature": (["f"], [7, 5, 7, 7], [2, 2], [0]),
    "two_features_one_table": (["f", "g"], [7, 5, 5, 9, 7, 5], [3, 0, 1, 2], [0, 0]),
    "two_tables": (["f", "g", "h"], [7, 5, 7, 7, 5, 9, 7, 3], [2, 2, 1, 1, 0, 2], [0, 0, 1]),
    "empty_bags": (["f", "g"], [2**62 + 1, 2**62 + 1, 2**62 + 1], [0, 2, 1, 0], [0, 1]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_dedup_matches_one_id_at_a_time(case):
    keys, values, lengths, labels = CASES[case]
    features = kjt(keys, values, lengths)
    dedup, reverse = dedup_features(features, labels)
    kept, want_lengths, want_reverse = naive_dedup(features, labels)
    assert dedup.keys() == keys and dedup.stride() == features.stride()
    assert dedup.values().tolist() == kept
    assert dedup.lengths().tolist() == want_lengths
    assert reverse.tolist() == want_reverse
    assert torch.equal(dedup.values()[reverse], features.values())


def test_dedup_sums_weights_of_each_unique_id():
    features = kjt(["f"], [9, 4, 4, 4], [3, 1], weights=[0.5, 1.0, 0.25, 2.0])
    dedup, _ = dedup_features(features, [0])
    assert dedup.values().tolist() == [4, 9]
    assert dedup.weights().tolist() == [3.25, 0.5]


def test_dedup_refuses_variable_batch_and_bad_labels():
    vbe = KeyedJaggedTensor(
        keys=["f", "g"],
        values=torch.tensor([1, 2, 3]),
        lengths=torch.tensor([1, 1, 1]),
        stride_per_key_per_rank=[[1], [2]],
    )
    with pytest.raises(ValueError, match="VBE"):
        dedup_features(vbe, [0, 1])
    with pytest.raises(ValueError, match="2 table labels for 1 features"):
        dedup_features(kjt(["f"], [1], [1]), [0, 0])
    with pytest.raises(ValueError, match="features of a table must be consecutive"):
        dedup_features(kjt(["f", "g", "h"], [1, 2, 3], [1, 1, 1]), [0, 1, 0])


@pytest.mark.parametrize(
    "sharder", [KVEmbeddingCollectionSharder, KVEmbeddingBagCollectionSharder], ids=["ec", "ebc"]
)
def test_sharders_take_use_index_dedup(sharder):
    assert sharder(OPTIONS).use_index_dedup is False
    assert sharder(OPTIONS, use_index_dedup=True).use_index_dedup is True
    with pytest.raises(TypeError, match="use_index_dedup must be a bool"):
        sharder(OPTIONS, use_index_dedup="yes")


def test_sharded_training_with_dedup_matches_without_and_unsharded(tmp_path):
    result_path = tmp_path / "result.json"
    job = run_job(
        torchrun_command(2, "-m", "tests.sharding.dedup_worker", str(result_path), str(tmp_path))
    )
    result = read_result(result_path, job)
    assert_scenarios_passed(result, job, set(worker.SCENARIOS))
