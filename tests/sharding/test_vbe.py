"""Variable batch per feature (VBE) on KV tables sharded row-wise and table-wise, on 2
gloo ranks, against stock fbgemm tables sharded the same way (``vbe_worker``)."""

import json

import pytest

from tests.torchrun_jobs import read_result, run_job, torchrun_command


@pytest.mark.parametrize("sharding", ["row_wise", "table_wise"])
def test_vbe_matches_stock_sharded_tables(sharding, tmp_path):
    out = tmp_path / "result.json"
    job = run_job(torchrun_command(2, "-m", "tests.sharding.vbe_worker", str(out), sharding))
    result = read_result(out, job)
    assert result["passed"], json.dumps(result, indent=1)
    assert result["checks"]["the batch is VBE"]
    figures = result["max_abs_diff"]
    for key in ("u", "i", "j", "v"):  # trained steps, then a forward of uneven rank sizes
        assert f"outputs {key}" in figures and f"outputs {key} (uneven, forward)" in figures
    assert {f"rows {t}" for t in ("tu", "ti", "tv")} <= set(figures)
    assert job.returncode == 0, job.stderr[-6000:]


def test_the_unsharded_collection_refuses_vbe_clearly():
    import torch
    from torchrec import EmbeddingBagConfig
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from torchrec_kvemb import KVEmbeddingBagCollection, KVTableOptions
    from torchrec_kvemb.validation import KVInputError

    ebc = KVEmbeddingBagCollection(
        [
            EmbeddingBagConfig(
                name="t", embedding_dim=4, num_embeddings=10, feature_names=["a", "b"]
            )
        ],
        KVTableOptions(capacity=16),
    )
    kjt = KeyedJaggedTensor(
        keys=["a", "b"],
        values=torch.tensor([1, 2, 3]),
        lengths=torch.tensor([1, 1, 1]),
        stride_per_key_per_rank=[[1], [2]],
    )
    with pytest.raises(KVInputError, match="only supported sharded"):
        ebc(kjt)
