"""``torch.export`` of a trained KV collection for inference.

A collection in eval mode is read-only (ids without a row pool zeros), and its
lookup is registered ops, so ``torch.export.export`` captures it: the graph
holds ``kvemb.pooled_eval_group`` (probe and pool in one op) with the tables'
arrays as constants. The program is saved with ``torch.export.save``, loaded in
a fresh Python process that imports the package (which registers the ops), and
run there on the same batches: its outputs equal the eager collection's bit for
bit.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torch.export import Dim
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.modules.embedding_configs import PoolingType

from torchrec_kvemb import EvictionPolicy, KVEmbeddingBagCollection, KVTableOptions

KEYS = ["f0", "f1", "f2"]


def _trained() -> KVEmbeddingBagCollection:
    configs = [
        EmbeddingBagConfig(
            name=f"t{i}",
            embedding_dim=4 + 2 * i,
            num_embeddings=2**40,
            feature_names=[KEYS[i]],
            pooling=PoolingType.MEAN if i == 2 else PoolingType.SUM,
        )
        for i in range(3)
    ]
    ebc = KVEmbeddingBagCollection(
        configs,
        {
            "t0": KVTableOptions(capacity=64, init_low=-0.1, init_high=0.1),
            "t1": KVTableOptions(capacity=32, eviction=EvictionPolicy.LFU, admission_threshold=2),
            "t2": KVTableOptions(capacity=48, init_low=-0.1, init_high=0.1),
        },
        fused_params={"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.1},
    )
    for step in range(4):
        ebc(_batch(step, 200)).values().sum().backward()
    return ebc.eval()


def _batch(seed: int, id_space: int, batch: int = 5) -> KeyedJaggedTensor:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 4, (len(KEYS) * batch,), generator=gen)
    values = torch.randint(0, id_space, (int(lengths.sum()),), generator=gen)
    return KeyedJaggedTensor(keys=KEYS, values=values, lengths=lengths)


class _Served(torch.nn.Module):
    """A served model's entry: the features' ids and lengths (any count of ids)."""

    def __init__(self, ebc: KVEmbeddingBagCollection) -> None:
        super().__init__()
        self.ebc = ebc

    def forward(self, values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        return self.ebc(KeyedJaggedTensor(keys=KEYS, values=values, lengths=lengths)).values()


RUN_SAVED = textwrap.dedent(
    """
    import sys, torch
    import torchrec  # noqa: F401  (KeyedJaggedTensor's pytree)
    import torchrec_kvemb  # noqa: F401  (registers torch.ops.kvemb)
    program = torch.export.load(sys.argv[1])
    inputs = torch.load(sys.argv[2], weights_only=False)
    torch.save([program.module()(*args) for args in inputs], sys.argv[3])
    """
)


def _run_in_fresh_process(program: Path, inputs: list, tmp_path: Path) -> list:
    torch.save(inputs, tmp_path / "inputs.pt")
    subprocess.run(
        [sys.executable, "-c", RUN_SAVED, str(program), str(tmp_path / "inputs.pt"),
         str(tmp_path / "outputs.pt")],
        check=True,
        cwd=tmp_path,
    )  # fmt: skip
    return torch.load(tmp_path / "outputs.pt", weights_only=False)


def test_exported_collection_runs_in_a_fresh_process(tmp_path):
    ebc = _trained()
    example = _batch(10, 400)
    program = torch.export.export(ebc, (example,))
    targets = {str(n.target) for n in program.graph.nodes if "kvemb" in str(n.target)}
    assert targets == {"kvemb.pooled_eval_group.default"}
    torch.export.save(program, tmp_path / "ebc.pt2")

    (got,) = _run_in_fresh_process(tmp_path / "ebc.pt2", [(example,)], tmp_path)
    want = ebc(example)
    assert got.keys() == want.keys()
    assert torch.equal(got.values(), want.values())
    stored = torch.cat([ebc.table(f"t{i}").export()["ids"] for i in range(3)])
    assert not bool(torch.isin(example.values(), stored).all()), "no id without a row"


def test_exported_served_model_takes_any_number_of_ids(tmp_path):
    ebc = _trained()
    example = _batch(20, 300)
    ids = Dim("ids", min=2, max=4096)
    program = torch.export.export(
        _Served(ebc),
        (example.values(), example.lengths()),
        dynamic_shapes={"values": {0: ids}, "lengths": None},
    )
    torch.export.save(program, tmp_path / "served.pt2")
    batches = [_batch(seed, 300) for seed in (21, 22, 23)]
    batches = [b for b in batches if b.values().numel() >= 2]
    inputs = [(b.values(), b.lengths()) for b in batches]
    assert len({v.numel() for v, _ in inputs}) > 1, "the batches should differ in size"
    got = _run_in_fresh_process(tmp_path / "served.pt2", inputs, tmp_path)
    for (values, lengths), out in zip(inputs, got, strict=True):
        assert torch.equal(out, _Served(ebc)(values, lengths))
