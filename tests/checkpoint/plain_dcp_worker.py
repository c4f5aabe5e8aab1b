"""Two ranks: the optimizer state of sharded KV tables by id, and the plain DCP recipe.
The job of ``tests/checkpoint/test_plain_dcp.py``::

    torchrun --nproc_per_node 2 -m tests.checkpoint.plain_dcp_worker DIR SHARDING

For KV tables sharded ``SHARDING`` (``row_wise`` or ``table_wise``) beside a stock
table-wise table (the models of ``ckpt_worker.py``), after ``SAVE_AT`` steps:

* ``m1.fused_optimizer.load_state_dict(m2.fused_optimizer.state_dict())`` into a model
  holding m2's ids without optimizer state gives every id m2's state; a model holding
  other ids refuses it on every rank;
* a model sharded the other way refuses the model's ShardedTensors on every rank;
* ``dcp.save({"model": model.state_dict(), "optim": model.fused_optimizer.state_dict()})``
  then ``dcp.load`` into a fresh model: without a planner DCP refuses (its size
  mismatch); with ``checkpoint.KVLoadPlanner()`` the fresh model trains on exactly
  as the model that never stopped;
* the same through torch's ``get_model_state_dict`` / ``set_model_state_dict`` (on
  ``model.module``, as for stock tables): loaded exactly, trains on exactly.

Rank 0 writes ``DIR/plain_dcp_<SHARDING>.json``; the test asserts.
"""

from __future__ import annotations

import copy
import os
import sys
import traceback

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

from tests.checkpoint.ckpt_worker import (
    CHANGED_LR,
    KV_TABLES,
    SAVE_AT,
    STEPS,
    TOL,
    compare_snapshots,
    dense_optimizer,
    kv_tables,
    set_kv_lr,
    sharded_model,
    snapshot,
    stock_snapshot,
    train_step,
)
from tests.torchrun_jobs import Tally, gloo_job, write_result
from torchrec_kvemb import checkpoint
from torchrec_kvemb.checkpoint import CheckpointError

STATE_SUFFIXES = ("momentum1", "exp_avg", "exp_avg_sq")
OTHER = {"row_wise": "table_wise", "table_wise": "row_wise"}


def kv_only(snap: dict) -> dict:
    return {k: v for k, v in snap.items() if k in KV_TABLES}


def refused(tally: Tally, name: str, call, *words: str) -> None:
    try:
        call()
    except CheckpointError as e:
        tally.check(name, all(w in str(e) for w in words))
        return
    tally.check(name, False)


def job(directory: str, sharding: str) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    tally = Tally(TOL)
    model = sharded_model(sharding)
    optimizer = dense_optimizer(model)
    for step in range(SAVE_AT):
        train_step(model, optimizer, step, rank, world, 1)
    saved = snapshot(model)

    # The fused optimizer's state by id, into a model holding the same ids elsewhere.
    state = model.state_dict()
    for key, value in state.items():
        if key.endswith(STATE_SUFFIXES) and key.rpartition(".")[0] in KV_TABLES:
            for shard in value.local_shards():
                shard.tensor.zero_()
    other = sharded_model(sharding)
    other.load_state_dict(state)
    zeroed = snapshot(other)
    tally.check(
        "before: optimizer state zero",
        all(
            not zeroed[p]["export"][k].any()
            for p in KV_TABLES
            for k in ("momentum1", "exp_avg")
            if k in zeroed[p]["export"]
        ),
    )
    other.fused_optimizer.load_state_dict(model.fused_optimizer.state_dict())
    compare_snapshots(tally, snapshot(other), saved, exact=True, label="fused load by id")
    tally.exact(
        "fused load: stock", stock_snapshot(other)["momentum"], stock_snapshot(model)["momentum"]
    )

    # Other ids (none yet): refused on every rank holding a KV table, nothing changes.
    fresh = sharded_model(sharding)
    before = kv_only(snapshot(fresh))
    saved_optim = model.fused_optimizer.state_dict()
    if kv_tables(fresh):
        refused(
            tally,
            "other ids refused",
            lambda: fresh.fused_optimizer.load_state_dict(saved_optim),
            "other ids",
        )
    else:
        fresh.fused_optimizer.load_state_dict(saved_optim)
    compare_snapshots(
        tally,
        {**snapshot(fresh), "dense": saved["dense"]},
        {**before, "dense": saved["dense"]},
        exact=True,
        label="refused: unchanged",
    )

    # ShardedTensors of another sharding: refused on every rank.
    crossed = sharded_model(OTHER[sharding])
    before = snapshot(crossed)
    refused(
        tally,
        "other sharding refused",
        lambda: crossed.load_state_dict(model.state_dict()),
        "another world size or sharding",
        "torchrec_kvemb.checkpoint.load",
    )
    after = snapshot(crossed)
    for prefix in KV_TABLES:
        tally.exact(
            f"other sharding: {prefix} unchanged",
            after[prefix]["export"]["ids"],
            before[prefix]["export"]["ids"],
        )

    # Plain DCP.
    path = os.path.join(directory, f"plain_{sharding}")
    dcp.save(
        {"model": model.state_dict(), "optim": model.fused_optimizer.state_dict()},
        checkpoint_id=path,
    )
    resumed = sharded_model(sharding)
    target = {"model": resumed.state_dict(), "optim": resumed.fused_optimizer.state_dict()}
    try:
        dcp.load(target, checkpoint_id=path)
        tally.check("plain recipe without the planner: DCP's size mismatch", False)
    except CheckpointException as e:  # DCP's, with every rank's error
        tally.check(
            "plain recipe without the planner: DCP's size mismatch", "Size mismatch" in str(e)
        )
    target = {"model": resumed.state_dict(), "optim": resumed.fused_optimizer.state_dict()}
    dcp.load(target, checkpoint_id=path, planner=checkpoint.KVLoadPlanner())
    resumed.load_state_dict(target["model"])
    resumed.fused_optimizer.load_state_dict(target["optim"])
    set_kv_lr(resumed, CHANGED_LR)  # hyper-parameters: the job's, as for stock tables
    resumed_optimizer = dense_optimizer(resumed)
    resumed_optimizer.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    compare_snapshots(tally, snapshot(resumed), saved, exact=True, label="plain DCP: loaded")

    # torch's state-dict helpers, on the module DMP wraps (as for stock tables).
    path = os.path.join(directory, f"helpers_{sharding}")
    dcp.save(
        {"model": get_model_state_dict(model.module), "optim": model.fused_optimizer.state_dict()},
        checkpoint_id=path,
    )
    helped = sharded_model(sharding)
    target = {
        "model": get_model_state_dict(helped.module),
        "optim": helped.fused_optimizer.state_dict(),
    }
    dcp.load(target, checkpoint_id=path, planner=checkpoint.KVLoadPlanner())
    loaded = set_model_state_dict(helped.module, target["model"])
    tally.check("torch helpers: no missing or unexpected keys", not any(loaded))
    helped.fused_optimizer.load_state_dict(target["optim"])
    set_kv_lr(helped, CHANGED_LR)
    helped_optimizer = dense_optimizer(helped)
    helped_optimizer.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    compare_snapshots(tally, snapshot(helped), saved, exact=True, label="torch helpers: loaded")
    for key, value in stock_snapshot(model).items():
        tally.exact(f"torch helpers: loaded stock {key}", stock_snapshot(helped)[key], value)

    for step in range(SAVE_AT, STEPS):
        want = train_step(model, optimizer, step, rank, world, 1)
        got = train_step(resumed, resumed_optimizer, step, rank, world, 1)
        helped_got = train_step(helped, helped_optimizer, step, rank, world, 1)
        for key in want:
            tally.exact(f"plain DCP: continued {key}", got[key], want[key])
            tally.exact(f"torch helpers: continued {key}", helped_got[key], want[key])
    compare_snapshots(
        tally, snapshot(resumed), snapshot(model), exact=True, label="plain DCP: continued"
    )
    compare_snapshots(
        tally, snapshot(helped), snapshot(model), exact=True, label="torch helpers: continued"
    )
    for key, value in stock_snapshot(model).items():
        tally.exact(f"plain DCP: continued stock {key}", stock_snapshot(resumed)[key], value)
        tally.exact(f"torch helpers: continued stock {key}", stock_snapshot(helped)[key], value)
    return {"world_size": world, **tally.result()}


def main() -> None:
    directory, sharding = sys.argv[1], sys.argv[2]
    out = os.path.join(directory, f"plain_dcp_{sharding}.json")
    with gloo_job():
        try:
            result = job(directory, sharding)
        except Exception:
            if dist.get_rank() == 0:
                write_result(out, {"passed": False, "error": traceback.format_exc()})
            raise
        if dist.get_rank() == 0:
            write_result(out, result)


if __name__ == "__main__":
    main()
