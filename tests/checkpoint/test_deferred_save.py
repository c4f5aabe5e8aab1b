"""``checkpoint.save`` gathers the rows of in-memory KV tables while DCP writes
(``state_dict/deferred.py``, ``checkpoint/save_planner.py``): the files hold exactly
``model.state_dict()``; a failure while gathering fails the save, and nothing is
published at the path."""

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from tests.checkpoint.test_state_dict import ADAGRAD, ADAM, SGD, build, train
from torchrec_kvemb import checkpoint
from torchrec_kvemb.state_dict import deferred
from torchrec_kvemb.table import KVTable

FUSED = {"sgd": SGD, "adagrad": ADAGRAD, "adam": ADAM}


@pytest.mark.parametrize("fused", FUSED.values(), ids=FUSED.keys())
def test_saved_entries_equal_state_dict(tmp_path, monkeypatch, fused):
    model = build(fused)
    train(model, range(5))
    filled = []
    real_fill = deferred.DeferredRows.fill

    def fill(self):
        filled.append(len(self.pending))
        real_fill(self)

    monkeypatch.setattr(deferred.DeferredRows, "fill", fill)
    checkpoint.save(model, tmp_path / "ckpt", thread_count=3)
    assert filled and filled[0] > 0, "no entry was deferred"
    reader = dcp.FileSystemReader(str(tmp_path / "ckpt"))
    saved = reader.read_metadata().state_dict_metadata
    want = model.state_dict()
    got = {
        k: torch.empty(saved[f"model.{k}"].size, dtype=saved[f"model.{k}"].properties.dtype)
        for k in want
        if isinstance(saved.get(f"model.{k}"), TensorStorageMetadata)
    }
    dcp.load({"model": got}, storage_reader=reader, no_dist=True)
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert torch.equal(got[key], value), key


def test_gather_error_fails_the_save(tmp_path, monkeypatch):
    model = build()
    train(model, range(3))
    real = KVTable.rows_of_slots

    def failing(self, slots, out=None):
        if out is not None:
            raise MemoryError("no memory to gather rows")
        return real(self, slots, out)

    monkeypatch.setattr(KVTable, "rows_of_slots", failing)
    with pytest.raises(CheckpointException) as failed:  # DCP's, with each rank's error
        checkpoint.save(model, tmp_path / "ckpt")
    first, _ = next(iter(failed.value.failures.values()))
    assert "gathering the rows of a KV table failed" in str(first)
    assert isinstance(first.__cause__, MemoryError)
    assert not (tmp_path / "ckpt").exists()
    monkeypatch.undo()
    checkpoint.save(model, tmp_path / "ckpt")
    fresh = build()
    checkpoint.load(fresh, tmp_path / "ckpt")
    for name, table in model.kv_tables().items():
        for key, value in table.export().items():
            assert torch.equal(fresh.table(name).export()[key], value), (name, key)
