"""The host tier's row exchange as an op: ``torch.ops.kvemb.host_exchange``.

A table's demoted rows go into its host tier's records and its promoted rows
come back, with the tier's records, free list and index kept (what it writes,
in which order: ``ops/host_exchange.py``, the torch path it equals). Kernels:
native on the CPU (one pass, each row copied once between its table slot and
its record); on CUDA the torch path (the table's rows on the GPU, the tier's in
host memory; a CUDA table's tier rows move in ``transfers.py``'s batched copies
instead).

Example::

    torch.ops.kvemb.host_exchange(*ExchangeArgs(weights, state, rows, ...))
"""

from typing import NamedTuple

import torch

from torchrec_kvemb.library.registry import define, schema
from torchrec_kvemb.ops import native
from torchrec_kvemb.ops.host_exchange import host_exchange_torch

Tensor = torch.Tensor


class ExchangeArgs(NamedTuple):
    """``host_exchange``'s arguments (``ops/host_exchange.py`` says what each holds)."""

    weights: Tensor
    state: Tensor
    rows: Tensor
    record_ids: Tensor
    record_scores: Tensor
    free_list: Tensor
    free_count: Tensor
    main_keys: Tensor
    main_scores: Tensor
    main_record: Tensor
    stash_keys: Tensor
    stash_scores: Tensor
    stash_record: Tensor
    down_slots: Tensor
    down_ids: Tensor
    down_scores: Tensor
    down_host_slots: Tensor
    up_host_slots: Tensor
    up_slots: Tensor


EXCHANGE_MUTATES = ("weights", "state", "rows", "record_ids", "record_scores", "free_list",
                    "free_count", "main_keys", "main_scores", "main_record", "stash_keys",
                    "stash_scores", "stash_record", "down_host_slots")  # fmt: skip


def _host_exchange_cpu(*args: Tensor) -> None:
    a = ExchangeArgs(*args)
    if a.weights.dtype == torch.float32:
        native.host_exchange(*a)
    else:  # half-precision table rows: the torch path converts them
        host_exchange_torch(*a)


def _host_exchange_cuda(*args: Tensor) -> None:
    host_exchange_torch(*args)


def _host_exchange_fake(*args: Tensor) -> None:
    return None


host_exchange = define(
    "host_exchange",
    _host_exchange_cpu,
    _host_exchange_cuda,
    _host_exchange_fake,
    mutates=EXCHANGE_MUTATES,
    cpu_name="native (float32 rows) / torch path",
    cuda_name="torch",
    op_schema=schema(ExchangeArgs, "()", EXCHANGE_MUTATES),
)
