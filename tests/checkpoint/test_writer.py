"""``checkpoint.save``'s writer (``checkpoint/writer.py``) and the deferred entries it
fills (``state_dict/deferred.py``): DCP's own reader reads what it writes, entry for
entry equal to the model's ``state_dict()`` and to what DCP's ``FileSystemWriter``
writes of it; placeholders stand for exactly the in-memory CPU tables' row entries
and fill to their values in blocks of any size; a table changed under a save, a
placeholder given in another shape, and a failed write are refused loudly and
leave the older checkpoint as it was."""

import errno
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from tests.checkpoint.test_state_dict import (
    ADAGRAD,
    ADAM,
    OPTIONS,
    SGD,
    Model,
    assert_same,
    build,
    configs,
    kjt,
    snapshot,
    train,
)
from torchrec_kvemb import KVEmbeddingBagCollection, KVTableOptions, SSDOptions, checkpoint
from torchrec_kvemb.checkpoint import CheckpointError
from torchrec_kvemb.checkpoint import writer as writer_module
from torchrec_kvemb.checkpoint.writer import RowStreamWriter
from torchrec_kvemb.state_dict.deferred import active, deferring

ROW_KEYS = ("weight", "weight_id", "weight_score", "bucket")


def trained(fused, steps: int = 4) -> Model:
    model = Model(fused)
    optimizer = torch.optim.SGD(model.dense.parameters(), lr=0.1)
    for step in range(steps):
        model.step(optimizer, step)
    return model


def read_with_dcp(path) -> dict[str, torch.Tensor]:
    """Every ``model.`` entry of the checkpoint at ``path``, read by DCP's own reader."""
    reader = dcp.FileSystemReader(path)
    saved = reader.read_metadata().state_dict_metadata
    targets = {
        key: torch.empty(md.size, dtype=md.properties.dtype)
        for key, md in saved.items()
        if key.startswith("model.") and hasattr(md, "size")
    }
    dcp.load(targets, storage_reader=reader, no_dist=True)
    return targets


@pytest.mark.parametrize("fused", [SGD, ADAGRAD, ADAM], ids=["sgd", "adagrad", "adam"])
@pytest.mark.parametrize("threads", [1, 3], ids=["1-file", "3-files"])
def test_dcps_reader_reads_the_state_dict(fused, threads, tmp_path):
    model = trained(fused)
    checkpoint.save(model, tmp_path / "ckpt", thread_count=threads)
    got = read_with_dcp(tmp_path / "ckpt")
    want = {f"model.{k}": v for k, v in model.state_dict().items()}
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert got[key].dtype == value.dtype and torch.equal(got[key], value), key
    # What DCP's own writer writes of the same state_dict reads back the same.
    plain = tmp_path / "plain"
    dcp.save(
        {"model": model.state_dict()}, storage_writer=dcp.FileSystemWriter(plain), no_dist=True
    )
    for key, value in read_with_dcp(plain).items():
        assert torch.equal(got[key], value), key


def test_save_of_tiered_and_in_memory_tables_loads_back(tmp_path):
    options = dict(OPTIONS, item=KVTableOptions(capacity=64, ssd=SSDOptions(str(tmp_path / "s"))))
    model = KVEmbeddingBagCollection(configs(), options, fused_params=ADAGRAD)
    train(model, range(6))
    assert model.table("item").metrics()["ssd_size"] > 0  # rows on both tiers
    checkpoint.save(model, tmp_path / "ckpt")
    got = read_with_dcp(tmp_path / "ckpt")
    for key, value in model.state_dict().items():
        assert torch.equal(got[f"model.{key}"], value), key
    fresh_options = dict(
        options, item=KVTableOptions(capacity=64, ssd=SSDOptions(str(tmp_path / "t")))
    )
    fresh = KVEmbeddingBagCollection(configs(), fresh_options, fused_params=ADAGRAD)
    checkpoint.load(fresh, tmp_path / "ckpt")
    assert_same(snapshot(fresh), snapshot(model))
    model.table("item").close()
    fresh.table("item").close()


@pytest.mark.parametrize("rows_per_fill", [1, 4, 1000], ids=["1-row", "4-rows", "all"])
def test_placeholders_fill_to_the_state_dict(rows_per_fill, tmp_path):
    options = dict(OPTIONS, item=KVTableOptions(capacity=64, ssd=SSDOptions(str(tmp_path))))
    ebc = KVEmbeddingBagCollection(configs(), options, fused_params=ADAM)
    train(ebc, range(5))
    want = ebc.state_dict()
    assert active() is None
    with deferring() as deferred:
        state = ebc.state_dict()
    assert state.keys() == want.keys()
    filled = 0
    for key, value in state.items():
        found = deferred.find(value)
        deferred_row = key.startswith("embedding_bags.user.") and key.rsplit(".", 1)[1] in (
            *ROW_KEYS,
            "exp_avg",
            "exp_avg_sq",
        )
        assert (found is not None) == deferred_row, key  # the tiered table is not deferred
        if found is None:
            assert torch.equal(value, want[key]), key
            continue
        entry, first, n = found
        assert (first, n) == (0, want[key].shape[0])
        out = torch.full_like(want[key], -7)
        for start in range(0, n, rows_per_fill):
            entry.fill(start, out[start : start + rows_per_fill])
        assert torch.equal(out, want[key]), key
        filled += 1
    assert filled == 6 and len(deferred) == 6
    ebc.table("item").close()


def test_a_table_changed_under_its_save_is_refused():
    ebc = build()
    train(ebc, range(3))
    with deferring() as deferred:
        state = ebc.state_dict()
    ebc.table("item").insert(torch.tensor([2**41 + 1]), torch.zeros(1, 3), torch.zeros(1, 1))
    entry, first, n = deferred.find(state["embedding_bags.item.weight"])
    with pytest.raises(RuntimeError, match="'item'.*must not change"):
        entry.fill(first, torch.empty(n, 3))


def test_part_of_a_placeholder_in_another_shape_is_refused():
    ebc = build()
    train(ebc, range(3))
    with deferring() as deferred:
        weight = ebc.state_dict()["embedding_bags.user.weight"]
    entry, first, n = deferred.find(weight[2:5])
    assert (first, n) == (2, 3)
    with pytest.raises(ValueError, match="'user'.*'weights'"):
        deferred.find(weight[:, 1:])


def test_a_failed_write_leaves_the_older_checkpoint(tmp_path, monkeypatch):
    older = trained(ADAGRAD, steps=2)
    path = tmp_path / "ckpt"
    checkpoint.save(older, path)
    newer = trained(ADAGRAD, steps=5)
    calls = []

    def full_disk(f, *args):
        calls.append(1)
        if len(calls) == 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(f, *args)

    real = writer_module.write_tensor
    monkeypatch.setattr(writer_module, "write_tensor", full_disk)
    with pytest.raises(CheckpointError, match="writing failed on rank 0: OSError.*No space left"):
        checkpoint.save(newer, path)
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # the partly written files are gone
    fresh = Model()
    checkpoint.load(fresh, path)
    assert_same(snapshot(fresh.ebc), snapshot(older.ebc))
    assert torch.equal(fresh.dense.weight, older.dense.weight)
    # The next save goes through, over the older checkpoint.
    checkpoint.save(newer, path)
    checkpoint.load(fresh, path)
    assert_same(snapshot(fresh.ebc), snapshot(newer.ebc))


def test_other_tensors_go_through_torch_save(tmp_path):
    """A tensor ``write_tensor`` does not write (complex) is written as DCP writes it."""
    state = {"z": torch.tensor([1 + 2j, 3 - 1j]), "x": torch.arange(5.0)}
    dcp.save(state, storage_writer=RowStreamWriter(tmp_path / "c", thread_count=2), no_dist=True)
    back = {"z": torch.zeros(2, dtype=torch.complex64), "x": torch.zeros(5)}
    dcp.load(back, storage_reader=dcp.FileSystemReader(tmp_path / "c"), no_dist=True)
    assert torch.equal(back["z"], state["z"]) and torch.equal(back["x"], state["x"])
    assert sorted(os.listdir(tmp_path / "c")) == [".metadata", "__0_0.distcp", "__0_1.distcp"]


def test_models_without_kv_tables_save_as_ever(tmp_path):
    model = nn.Sequential(nn.Linear(3, 5), nn.ReLU(), nn.Linear(5, 2))
    checkpoint.save(model, tmp_path / "ckpt")
    fresh = nn.Sequential(nn.Linear(3, 5), nn.ReLU(), nn.Linear(5, 2))
    checkpoint.load(fresh, tmp_path / "ckpt")
    for a, b in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b)
    assert kjt(0) is not None
