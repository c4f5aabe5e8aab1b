"""The torch path of a host tier's row exchange (``HostTier.exchange``): a table's
demoted rows go into the tier's records, its promoted rows come back.

The tier's arrays (``host_tier.py``): ``rows [records, dim + state_dim]`` float32
(weights, then optimizer state), each record's id (-1: free) and memory score, a
free list (``free_list[:free_count]``, popped from the end) and an index in two
parts, a main part and a stash, each with a record number per slot (a global
slot below ``main_record.numel()`` is the main part's). In this order:

0. the down ids whose ``down_host_slots`` are -1 are placed: in order, each
   takes the lowest empty way of its main bucket, else of its stash bucket, and
   its slot is written there; if one finds neither, ``NoRoomError`` is raised
   and nothing is written (the caller grows the index and places them);
1. down: the table's rows at ``down_slots`` go to records popped from the free
   list (the last entry first), set at the index slots ``down_host_slots``
   (their keys written), with their ids and memory scores
   (in the records, and as those index slots' scores: the index of a host
   tier that never ranks keeps each id's memory score);
2. up: the rows of the records at the index slots ``up_host_slots`` go to the
   table's rows at ``up_slots`` (-1: not copied);
3. the up ids leave the index (key -1, score 0, record -1), their records go
   back on the free list (id -1).

The native kernel (``csrc/host_exchange.cpp``) writes the same values.

Example::

    host_exchange_torch(weights, state, rows, record_ids, record_scores, free_list,
                        free_count, main_keys, main_scores, main_record, stash_keys,
                        stash_scores, stash_record, down_slots, down_ids, down_scores,
                        down_host_slots, up_host_slots, up_slots)
"""

from __future__ import annotations

import torch

from torchrec_kvemb.native_lib import NoRoomError
from torchrec_kvemb.ops.hashing import index_bucket
from torchrec_kvemb.options import WAYS

Tensor = torch.Tensor


def _empty_ways(keys: Tensor, buckets: Tensor) -> Tensor:
    """Local slots ids of ``buckets`` would take, in order: a bucket's r-th id its
    r-th empty way, -1 past its empty ways (those ids do not take one)."""
    if buckets.numel() == 0:
        return buckets.clone()
    sorted_buckets, order = torch.sort(buckets, stable=True)
    rank = torch.arange(buckets.numel()) - torch.searchsorted(sorted_buckets, sorted_buckets)
    empty = keys[sorted_buckets] < 0
    take = empty & (empty.cumsum(1) == (rank + 1).unsqueeze(1))
    way = take.to(torch.int8).argmax(1)
    local = torch.where(take.any(1), sorted_buckets * WAYS + way, -1)
    out = torch.empty_like(local)
    out[order] = local
    return out


def _place(main_keys: Tensor, stash_keys: Tensor, ids: Tensor) -> Tensor:
    """Step 0: global slots of ``ids`` placed (keys written), or ``NoRoomError``
    with nothing written."""
    main = _empty_ways(main_keys, index_bucket(ids, main_keys.shape[0]))
    over = (main < 0).nonzero().squeeze(1)
    stash = torch.full_like(over, -1)
    if stash_keys.shape[0] and over.numel():
        stash = _empty_ways(stash_keys, index_bucket(ids[over], stash_keys.shape[0]))
    if bool((stash < 0).any()):
        raise NoRoomError("host exchange: an id found no empty way in its buckets")
    in_main = main >= 0
    main_keys.view(-1)[main[in_main]] = ids[in_main]
    stash_keys.view(-1)[stash] = ids[over]
    main[over] = stash + main_keys.numel()
    return main


def _columns(main: Tensor, stash: Tensor, slots: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(main positions, main slots, stash positions, stash slots)`` of global ``slots``."""
    in_main = slots < main.numel()
    at_main, at_stash = in_main.nonzero().squeeze(1), (~in_main).nonzero().squeeze(1)
    return at_main, slots[at_main], at_stash, slots[at_stash] - main.numel()


def _read(main: Tensor, stash: Tensor, slots: Tensor) -> Tensor:
    at_main, main_slots, at_stash, stash_slots = _columns(main, stash, slots)
    out = torch.empty_like(slots)
    out[at_main] = main.view(-1)[main_slots]
    out[at_stash] = stash.view(-1)[stash_slots]
    return out


def _write(main: Tensor, stash: Tensor, slots: Tensor, values: Tensor | int) -> None:
    at_main, main_slots, at_stash, stash_slots = _columns(main, stash, slots)
    if isinstance(values, Tensor):
        main.view(-1)[main_slots] = values[at_main]
        stash.view(-1)[stash_slots] = values[at_stash]
    else:
        main.view(-1)[main_slots] = values
        stash.view(-1)[stash_slots] = values


def host_exchange_torch(
    weights: Tensor,
    state: Tensor,
    rows: Tensor,
    record_ids: Tensor,
    record_scores: Tensor,
    free_list: Tensor,
    free_count: Tensor,
    main_keys: Tensor,
    main_scores: Tensor,
    main_record: Tensor,
    stash_keys: Tensor,
    stash_scores: Tensor,
    stash_record: Tensor,
    down_slots: Tensor,
    down_ids: Tensor,
    down_scores: Tensor,
    down_host_slots: Tensor,
    up_host_slots: Tensor,
    up_slots: Tensor,
) -> None:
    """The exchange (see the module docstring); writes the table's and the tier's
    arrays in place (``free_count [1]`` too). The table's arrays may be on another
    device than the tier's (host memory)."""
    dim = weights.shape[1]
    top, n = int(free_count[0]), down_slots.numel()
    if n > top:
        raise ValueError(f"host exchange: {n} rows down, {top} free records")
    todo = (down_host_slots == -1).nonzero().squeeze(1)
    if todo.numel():  # 0. placement
        down_host_slots[todo] = _place(main_keys, stash_keys, down_ids[todo])
    # 1. down
    records = free_list[top - n : top].flip(0)
    _write(main_record, stash_record, down_host_slots, records)
    _write(main_scores, stash_scores, down_host_slots, down_scores)
    record_ids[records] = down_ids
    record_scores[records] = down_scores
    down = torch.cat([weights[down_slots].float(), state[down_slots]], dim=1)
    rows[records] = down.to(rows.device)
    # 2. up
    up_records = _read(main_record, stash_record, up_host_slots)
    moved = (up_slots >= 0).nonzero().squeeze(1)
    to, came = up_slots[moved], rows[up_records[moved]].to(weights.device)
    weights[to] = came[:, :dim].to(weights.dtype)
    state[to] = came[:, dim:]
    # 3. the promoted ids leave
    record_ids[up_records] = -1
    free_list[top - n : top - n + up_records.numel()] = up_records
    free_count[0] = top - n + up_records.numel()
    _write(main_keys, stash_keys, up_host_slots, -1)
    _write(main_scores, stash_scores, up_host_slots, 0)
    _write(main_record, stash_record, up_host_slots, -1)
