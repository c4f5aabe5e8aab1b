"""Asynchronous saves: the jobs of ``tests/checkpoint/test_async_save.py``.

Sharded job (2 ranks, the models of ``ckpt_worker.py``, KV tables row-wise)::

    torchrun --nproc_per_node 2 -m tests.checkpoint.async_worker sharded DIR   # repo root

trains ``SAVE_AT`` steps, saves ``DIR/blocking`` (blocking) and starts an
asynchronous save of ``DIR/async``, whose writing waits until this rank has
trained one more step and then goes on while it trains ``MORE`` more (sharded
lookups on the default group beside the save's collectives on its own), loads
both checkpoints into fresh models and compares every id's row, state, score,
counters, the stock table, the KV learning rates and the dense optimizer with
the state at the call. Rank 0 writes ``DIR/sharded.json``.

Crash child (one process, no process group)::

    python -m tests.checkpoint.async_worker crash DIR

trains, saves ``DIR/ckpt`` (blocking), writes what it holds to
``DIR/expected.pt``, trains on, then starts an asynchronous save replacing
``DIR/ckpt`` whose writer stops in the middle of its first file (after writing
``DIR/writing``) while the child keeps training; the test SIGKILLs it there.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback

import torch
import torch.distributed as dist

import torchrec_kvemb.checkpoint as ckpt
from tests.checkpoint.ckpt_worker import (
    CHANGED_LR,
    SAVE_AT,
    TOL,
    check_lr,
    compare_optimizer,
    compare_snapshots,
    dense_optimizer,
    optimizer_state,
    sharded_model,
    snapshot,
    stock_snapshot,
    train_step,
    unsharded_model,
)
from tests.torchrun_jobs import Tally, gloo_job, write_result
from torchrec_kvemb.checkpoint import writer

#: Training steps while the asynchronous save is in flight.
MORE = 3


def gate_writes() -> threading.Event:
    """Make every checkpoint writer wait for the returned event before writing."""
    release = threading.Event()
    write_data = writer.RowStreamWriter.write_data

    def gated(self, plan, planner):
        if not release.wait(120):
            raise TimeoutError("the test never released the checkpoint writer")
        return write_data(self, plan, planner)

    writer.RowStreamWriter.write_data = gated
    return release


def sharded_job(directory: str) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    tally = Tally(TOL)
    dmp = sharded_model("row_wise")
    optimizer = dense_optimizer(dmp)
    for step in range(SAVE_AT):
        train_step(dmp, optimizer, step, rank, world, 1)
    want = snapshot(dmp)
    stock = stock_snapshot(dmp)
    dense = optimizer_state(optimizer)
    ckpt.save(dmp, os.path.join(directory, "blocking"), optimizer=optimizer)

    release = gate_writes()
    pending = ckpt.save(dmp, os.path.join(directory, "async"), optimizer=optimizer, blocking=False)
    tally.check("async: running after the call", not pending.done())
    for step in range(SAVE_AT, SAVE_AT + MORE):
        train_step(dmp, optimizer, step, rank, world, 1)
        release.set()  # the files are written while the next steps train
    pending.result()
    tally.check("async: done after result()", pending.done())
    moved = snapshot(dmp)
    tally.check(
        "training changed the rows after the call",
        not torch.equal(
            moved["ebc.embedding_bags.user"]["export"]["weights"],
            want["ebc.embedding_bags.user"]["export"]["weights"],
        ),
    )

    for name in ("async", "blocking"):
        fresh = sharded_model("row_wise")
        fresh_optimizer = dense_optimizer(fresh)
        ckpt.load(fresh, os.path.join(directory, name), optimizer=fresh_optimizer)
        compare_snapshots(tally, snapshot(fresh), want, exact=True, label=name)
        for key, value in stock_snapshot(fresh).items():
            tally.exact(f"{name}: stock {key}", value, stock[key])
        compare_optimizer(tally, optimizer_state(fresh_optimizer), dense, name)
        check_lr(tally, fresh, name)
    return {"world_size": world, "lr": CHANGED_LR, **tally.result()}


def crash_child(directory: str) -> None:
    model = unsharded_model()
    optimizer = dense_optimizer(model)
    for step in range(SAVE_AT):
        train_step(model, optimizer, step, 0, 1, 1)
    path = os.path.join(directory, "ckpt")
    ckpt.save(model, path, optimizer=optimizer)
    torch.save(
        {"tables": snapshot(model), "optimizer": optimizer_state(optimizer)},
        os.path.join(directory, "expected.pt"),
    )
    train_step(model, optimizer, SAVE_AT, 0, 1, 1)

    def stuck(self, name, items, planner):
        with open(os.path.join(self.path, name), "wb") as f:
            f.write(b"\0" * 4096)  # part of a data file, then the process dies here
        open(os.path.join(directory, "writing"), "w").close()
        while True:
            time.sleep(1)

    writer.RowStreamWriter._write_file = stuck
    ckpt.save(model, path, optimizer=optimizer, blocking=False)
    step = SAVE_AT + 1
    while True:  # training goes on until the test kills the process
        train_step(model, optimizer, step, 0, 1, 1)
        step += 1
        time.sleep(0.05)


def main() -> None:
    job, directory = sys.argv[1], sys.argv[2]
    if job == "crash":
        crash_child(directory)
        return
    with gloo_job():
        out = os.path.join(directory, "sharded.json")
        try:
            result = sharded_job(directory)
            if dist.get_rank() == 0:
                write_result(out, result)
        except Exception:
            if dist.get_rank() == 0:
                write_result(out, {"passed": False, "error": traceback.format_exc()})
            raise


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
