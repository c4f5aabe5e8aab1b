"""A checkpoint load that fails changes nothing: a truncated file, a checkpoint of
another configuration, a disk error while reading. The model (KV tables in memory
and on an SSD tier, a stock dense layer) and its optimizer stay as they were, and
the same load then succeeds once the fault is gone (where it can)."""

import errno
import os

import pytest
import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torch import nn
from torch.distributed.checkpoint import filesystem
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_kvemb import KVEmbeddingBagCollection, KVTableOptions, SSDOptions, checkpoint
from torchrec_kvemb.checkpoint import CheckpointError

ADAGRAD = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.1}


class Model(nn.Module):
    """Two KV tables, one over an SSD tier (memory for about a fifth of its ids),
    and a dense layer."""

    def __init__(self, ssd_path, dim: int = 5) -> None:
        super().__init__()
        configs = [
            EmbeddingBagConfig(name=n, embedding_dim=d, num_embeddings=2**62, feature_names=[f])
            for n, d, f in (("user", dim, "u"), ("item", 3, "i"))
        ]
        options = {
            "user": KVTableOptions(capacity=48, ssd=SSDOptions(str(ssd_path))),
            "item": KVTableOptions(capacity=160),
        }
        self.ebc = KVEmbeddingBagCollection(configs, options, fused_params=ADAGRAD)
        self.dense = nn.Linear(dim + 3, 1)

    def step(self, optimizer: torch.optim.Optimizer, step: int) -> None:
        g = torch.Generator().manual_seed(step)
        values = torch.randint(0, 400, (60,), generator=g) * 9_973 + 11
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=["u", "i"], values=values, lengths=torch.full((12,), 5)
        )
        self.dense(self.ebc(kjt).values()).sum().backward()
        optimizer.step()
        optimizer.zero_grad()


def _trained(path, steps: range, dim: int = 5) -> tuple[Model, torch.optim.Optimizer]:
    model = Model(path, dim)
    optimizer = torch.optim.Adam(model.dense.parameters(), lr=0.1)
    for step in steps:
        model.step(optimizer, step)
    return model, optimizer


def _state(model: Model, optimizer: torch.optim.Optimizer) -> dict:
    out = {
        f"{n}.{k}": v.clone()
        for n, t in model.ebc.kv_tables().items()
        for k, v in t.export().items()
    }
    out.update({f"dense.{k}": v.detach().clone() for k, v in model.dense.state_dict().items()})
    for i, state in optimizer.state_dict()["state"].items():
        out.update({f"adam.{i}.{k}": torch.as_tensor(v).clone() for k, v in state.items()})
    for name, table in model.ebc.kv_tables().items():
        out[f"{name}.steps"] = torch.tensor([table.step, table.optim_step])
    return out


def _assert_unchanged(model: Model, optimizer, before: dict) -> None:
    after = _state(model, optimizer)
    assert after.keys() == before.keys()
    for key in before:
        assert torch.equal(after[key], before[key]), f"{key} changed by a failed load"


@pytest.fixture
def saved(tmp_path):
    model, optimizer = _trained(tmp_path / "ssd_saved", range(8))
    checkpoint.save(model, tmp_path / "ckpt", optimizer=optimizer)
    return tmp_path / "ckpt", _state(model, optimizer)


@pytest.fixture
def target(tmp_path):
    model, optimizer = _trained(tmp_path / "ssd_target", range(20, 26))
    assert model.ebc.table("user").metrics()["ssd_size"] > 0
    return model, optimizer, _state(model, optimizer)


def _largest_data_file(path):
    files = [p for p in path.iterdir() if p.suffix == ".distcp"]
    return max(files, key=lambda p: p.stat().st_size)


def test_truncated_file_changes_nothing(saved, target):
    path, _ = saved
    model, optimizer, before = target
    data = _largest_data_file(path)
    size = data.stat().st_size
    with open(data, "r+b") as f:
        f.truncate(size // 2)
    with pytest.raises(CheckpointError, match="reading failed.*nothing was loaded"):
        checkpoint.load(model, path, optimizer=optimizer)
    _assert_unchanged(model, optimizer, before)


def test_another_configuration_changes_nothing(saved, tmp_path):
    path, _ = saved
    model, optimizer = _trained(tmp_path / "ssd_other", range(3), dim=4)
    before = _state(model, optimizer)
    with pytest.raises(CheckpointError, match="'user'"):
        checkpoint.load(model, path, optimizer=optimizer)
    _assert_unchanged(model, optimizer, before)


def test_disk_error_while_reading_changes_nothing(saved, target, monkeypatch):
    path, want = saved
    model, optimizer, before = target
    real = filesystem.FileSystem.create_stream
    calls = {"n": 0}

    def failing(self, file_path, mode):
        if "r" in mode and str(file_path).endswith(".distcp"):
            calls["n"] += 1
            raise OSError(errno.EIO, os.strerror(errno.EIO), str(file_path))
        return real(self, file_path, mode)

    monkeypatch.setattr(filesystem.FileSystem, "create_stream", failing)
    with pytest.raises(CheckpointError, match="reading failed.*Input/output error"):
        checkpoint.load(model, path, optimizer=optimizer)
    assert calls["n"] > 0, "the injected fault was never reached"
    _assert_unchanged(model, optimizer, before)
    monkeypatch.undo()
    checkpoint.load(model, path, optimizer=optimizer)  # the fault is gone: it loads
    got = _state(model, optimizer)
    for key in want:
        assert torch.equal(got[key], want[key]), key
