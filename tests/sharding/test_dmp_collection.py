"""``KVDMPCollection`` on CPU: ``DMPCollection`` (and so this subclass) takes CUDA or
MTIA only, so its 2D job is ``test_replica_2d.py`` (which builds its syncs with the
same ``kv_syncs_for_contexts``); here only what runs without a device: the pipeline
sees a ``DMPCollection``, ``sync()`` runs the stock sync then every KV sync, and a
CPU device gets the stock refusal."""

from __future__ import annotations

import pytest
import torch
from torchrec.distributed.model_parallel import DMPCollection

from torchrec_kvemb.sharding import KVDMPCollection


class _Recorder:
    def __init__(self, calls: list, name: str) -> None:
        self.calls, self.name = calls, name

    def sync(self) -> None:
        self.calls.append(self.name)

    def reset(self) -> None:
        self.calls.append(f"reset {self.name}")


def test_is_a_dmp_collection():
    assert issubclass(KVDMPCollection, DMPCollection)


def test_sync_runs_stock_then_kv(monkeypatch):
    calls: list = []
    monkeypatch.setattr(
        DMPCollection, "sync", lambda self, include_optimizer_state=True: calls.append("stock")
    )
    model = object.__new__(KVDMPCollection)
    model.__dict__["_kv_syncs"] = [_Recorder(calls, "ctx0"), _Recorder(calls, "ctx1")]
    model.sync()
    assert calls == ["stock", "ctx0", "ctx1"]
    model.reset_kv_replicas()
    assert calls[3:] == ["reset ctx0", "reset ctx1"]


def test_cpu_device_refused_as_stock():
    with pytest.raises(AssertionError, match="CUDA or MTIA"):
        KVDMPCollection(
            module=torch.nn.Linear(2, 2),
            device=torch.device("cpu"),
            plan=None,
            world_size=4,
            sharding_group_size=2,
            global_pg=None,
        )
