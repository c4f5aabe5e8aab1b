"""The Triton pass of a group's training lookup over lower tiers (``tiered_lookup``).

On CUDA (and on CPU tensors in Triton's interpreter) a group of tables over
tiers is looked up by the group kernels of ``kernels/group_lookup.py`` in their
``TIER`` variant: the batch's ids the tiers hold go in as promotions (they
outrank every unprotected entry and keep their own scores), no row is written,
and each winner's lane records the entry it evicted. This module hands the
kernel its promotions and gives back what the native pass gives
(``native.TrainLookup`` with ``unique_flags``, ``unique_scores`` and
``evicted_scores``), so that ``tiered_lookup`` moves the rows of both the same
way: one gather down, one copy up and one scatter for the whole group.

What crosses to the device before the kernel: the promoted ids, their scores
and each table's offsets in one small int64 copy (``upload``: the side stream on
CUDA); the promoted rows in one copy of one host buffer (pinned under CUDA;
``rows_up``).

Example::

    rows = rows_up([f.rows for f in fetched], ids.device)      # one copy up
    out = lookup_train_triton(layout, storage, ids, table_idx, steps, None, None,
                              [f.ids for f in fetched], [f.scores for f in fetched])
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from torchrec_kvemb.contracts import KERNEL_METRICS, GroupLayout, TableStorage
from torchrec_kvemb.ops import native
from torchrec_kvemb.transfers import host_buffer, upload


def rows_up(rows: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The tables' promoted rows (host ``[k_t, width]`` float32, table by table) as one
    tensor on ``device``: one host buffer (pinned under CUDA) and one copy up; a lone
    table's rows on the CPU as they are."""
    if len(rows) == 1 and device.type != "cuda":
        return rows[0].to(device)
    total = sum(r.shape[0] for r in rows)
    buffer = host_buffer(total, rows[0].shape[1], device)
    torch.cat([r.to(buffer.dtype) for r in rows], out=buffer)
    return upload(buffer, device)


def _promotions(
    ids: Sequence[torch.Tensor], scores: Sequence[torch.Tensor], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(ids, scores, offsets [T + 1])`` of the promotions on ``device``: the tiers'
    host ``ids`` and ``scores``, table by table, and where each table's start, in one
    int64 host buffer (pinned under CUDA) and one copy up."""
    counts = [i.numel() for i in ids]
    total = sum(counts)
    meta = torch.empty(
        2 * total + len(counts) + 1, dtype=torch.int64, pin_memory=device.type == "cuda"
    )
    if total:
        torch.cat([*ids, *(s.to(torch.int64) for s in scores)], out=meta[: 2 * total])
    meta[2 * total] = 0
    meta[2 * total + 1 :] = torch.tensor(counts, dtype=torch.int64).cumsum(0)
    meta = upload(meta, device)
    return meta[:total], meta[total : 2 * total], meta[2 * total :]


def lookup_train_triton(
    layout: GroupLayout,
    storage: TableStorage,
    ids: torch.Tensor,
    table_idx: torch.Tensor,
    steps: torch.Tensor,
    custom_scores: torch.Tensor | None,
    custom_tables: Sequence[bool] | None,
    promoted_ids: Sequence[torch.Tensor],
    promoted_scores: Sequence[torch.Tensor],
) -> native.TrainLookup:
    """The training lookup of a group over tiers by the Triton kernels, as
    ``native.lookup_train_group`` with a ``TierPromotion`` does it: the ids the tiers
    hold, ``promoted_ids[t]`` (host, ascending) with their scores
    ``promoted_scores[t]``, compete as promoted ids; ``steps [T]``: the tables'
    clocks, already advanced. Uniques are the kernel's lanes (idle lanes: no flag,
    slot -1); evictions in slot order; ``metrics`` the counters' deltas ``[T, 6]``
    on the device."""
    from torchrec_kvemb.kernels.group_lookup import (
        KIND_ADMIT_HIT,
        KIND_ADMIT_NEW,
        KIND_NEW,
        KIND_PROMOTED,
        TierPromotions,
        group_lookup_train_tiers_triton,
    )

    device = ids.device
    T = layout.num_tables
    tier = TierPromotions(*_promotions(promoted_ids, promoted_scores, device))
    use_custom = None
    if custom_scores is not None:
        flags = [True] * T if custom_tables is None else list(custom_tables)
        use_custom = torch.tensor(flags, dtype=torch.int64, device=device)
    metrics = torch.zeros(T, KERNEL_METRICS, dtype=torch.int64, device=device)
    lanes = group_lookup_train_tiers_triton(
        layout, tuple(storage), ids, table_idx, steps, metrics, custom_scores, use_custom, tier
    )
    look = lanes.lookup
    kind, slots = lanes.kind, look.unique_slots
    promoted = kind == KIND_PROMOTED
    candidate = (kind == KIND_NEW) | (kind == KIND_ADMIT_HIT) | (kind == KIND_ADMIT_NEW)
    has_row = slots >= 0
    flags = (
        promoted.to(torch.uint8) * native.UNIQUE_PROMOTED
        + (candidate & has_row).to(torch.uint8) * native.UNIQUE_INSERTED
        + ((candidate | promoted) & ~has_row).to(torch.uint8) * native.UNIQUE_NO_ROOM
    )
    winners = (lanes.evicted_ids >= 0).nonzero().squeeze(1)
    evicted_slots, by_slot = torch.sort(slots.index_select(0, winners))
    winners = winners.index_select(0, by_slot)
    return native.TrainLookup(
        slots=look.slots,
        unique_index=look.unique_index,
        unique_ids=lanes.ids,
        unique_slots=slots,
        unique_table=look.unique_table,
        unique_inserted=candidate & has_row,
        evicted_ids=lanes.evicted_ids.index_select(0, winners),
        evicted_slots=evicted_slots,
        metrics=metrics,
        unique_flags=flags,
        unique_scores=lanes.score,
        evicted_scores=lanes.evicted_scores.index_select(0, winners),
    )
