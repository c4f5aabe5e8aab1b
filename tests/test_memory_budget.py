"""``memory_budget_bytes`` holds, and the planner's figure is what a table allocates.

What a table allocates is measured on the table itself: the bytes of the
distinct storages behind every tensor it holds (index keys and scores, rows,
optimizer state, admission counter, an SSD tier's scratch rows). For each
option that adds memory, that is at most the budget and equal to
``kv_table_bytes`` (the planner's storage stand-in) and ``storage_estimate``'s
in-memory part.
"""

from __future__ import annotations

import pytest
import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType

from torchrec_kvemb import KVTableOptions, SSDOptions
from torchrec_kvemb.memory import COUNTER_BYTES_PER_ID, SCRATCH_RESERVE_ROWS
from torchrec_kvemb.optimizer import FusedOptimConfig
from torchrec_kvemb.sharding.planner import kv_table_bytes, storage_proxy
from torchrec_kvemb.ssd.estimate import storage_estimate
from torchrec_kvemb.ssd.scratch import MIN_PAD_ROWS
from torchrec_kvemb.table import KVTable

DIM = 13
BUDGET = 300_007


def allocated(table: KVTable) -> int:
    """Bytes of the distinct storages behind the tensors ``table`` holds."""
    tensors = [table.keys, table.scores, table.weights, table.state, *table.batch_rows()]
    if table.counter is not None:
        tensors += [table.counter.keys, table.counter.scores, table.counts]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def optim(kind: EmbOptimType) -> FusedOptimConfig:
    return FusedOptimConfig.from_fused_params({"optimizer": kind})


OPTIMIZERS = [EmbOptimType.EXACT_SGD, EmbOptimType.EXACT_ROWWISE_ADAGRAD, EmbOptimType.ADAM]


@pytest.mark.parametrize(
    "options",
    [
        KVTableOptions(memory_budget_bytes=BUDGET),
        KVTableOptions(memory_budget_bytes=BUDGET, admission_threshold=3),
        KVTableOptions(
            memory_budget_bytes=BUDGET, admission_threshold=2, admission_counter_capacity=1001
        ),
        KVTableOptions(memory_budget_bytes=BUDGET, weights_dtype=torch.float16),
        KVTableOptions(memory_budget_bytes=BUDGET, weights_dtype=torch.bfloat16),
        KVTableOptions(memory_budget_bytes=BUDGET, initial_capacity=100),
    ],
    ids=["plain", "admission", "admission_counter_capacity", "float16", "bfloat16", "growing"],
)
@pytest.mark.parametrize("kind", OPTIMIZERS, ids=lambda k: k.name)
def test_budget_holds_and_planner_equals_allocation(options, kind):
    config = optim(kind)
    table = KVTable("t", DIM, options, config)
    table.grow(table.max_capacity)
    planned = kv_table_bytes(options, DIM, config)
    assert allocated(table) == table.memory_bytes() == planned <= BUDGET
    estimate = storage_estimate(options, DIM, config)
    assert estimate["memory_bytes"] == planned and estimate["memory_rows"] == table.capacity
    assert storage_proxy(options, DIM, config).nbytes >= planned
    # the budget is used: one more bucket of rows (and their counter entries) would not
    # fit; a growing table's maximum is a multiple of its initial buckets
    per_row = table._memory.row_bytes
    if options.admission_threshold > 1 and options.admission_counter_capacity is None:
        per_row += COUNTER_BYTES_PER_ID
    step = table.max_capacity // table._memory.initial_rows
    assert planned + step * 16 * per_row > BUDGET


def test_budget_with_admission_counts_the_counter():
    """1,000,000 bytes with admission: rows, index and counter within the budget."""
    options = KVTableOptions(memory_budget_bytes=1_000_000, admission_threshold=2)
    table = KVTable("t", 16, options)
    assert table.counts.numel() == table.capacity
    assert allocated(table) == kv_table_bytes(options, 16, FusedOptimConfig()) <= 1_000_000


@pytest.mark.parametrize("kind", OPTIMIZERS, ids=lambda k: k.name)
def test_budget_with_an_ssd_tier_counts_the_scratch_rows(kind, tmp_path):
    assert SCRATCH_RESERVE_ROWS == MIN_PAD_ROWS
    config = optim(kind)
    budget = 60_013
    options = KVTableOptions(memory_budget_bytes=budget, ssd=SSDOptions(str(tmp_path)))
    table = KVTable("t", DIM, options, config)
    try:
        # more distinct ids than the memory holds: the overflow takes scratch rows
        ids = torch.arange(table.capacity + 101) * 1_000_003
        table.lookup_train(ids)
        assert 0 < table.metrics()["scratch_rows"] <= SCRATCH_RESERVE_ROWS
        planned = kv_table_bytes(options, DIM, config)
        assert allocated(table) == table.memory_bytes() == planned <= budget
        estimate = storage_estimate(options, DIM, config, ssd_rows=1000)
        assert estimate["memory_bytes"] >= planned + table.ssd.memory_bytes()
    finally:
        table.close()


def test_growing_table_allocates_less_until_grown():
    options = KVTableOptions(capacity=3000, initial_capacity=50, admission_threshold=2)
    config = optim(EmbOptimType.ADAM)
    table = KVTable("t", DIM, options, config)
    planned = kv_table_bytes(options, DIM, config)
    assert allocated(table) == table.memory_bytes() < planned
    table.lookup_train(torch.arange(2000) * 7)
    table.lookup_train(torch.arange(2000) * 7)
    assert table.capacity == table.max_capacity
    assert allocated(table) == table.memory_bytes() == planned


def test_budget_too_small_for_its_fixed_parts():
    options = KVTableOptions(
        memory_budget_bytes=20_000, admission_threshold=2, admission_counter_capacity=1000
    )
    with pytest.raises(ValueError, match="admission counter"):
        KVTable("t", DIM, options)
