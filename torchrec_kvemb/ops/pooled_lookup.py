"""Pooled lookup of a group of tables by slot: forward and per-row gradient
reduction (torch path).

A batch is ``slots [n]`` (global slots of the group's rows; -1 for ids without
a row, which pool their table's initial value and get no gradient), ``ids
[n]``, the table of each id ``table_idx [n]`` (-1: not the group's) and its
``Bags`` (offsets, the bag of each id, each id's multiplier: per-sample weight,
divided by the bag length for MEAN pooling). The Triton twins are in
``kernels/group_pooled.py``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from torchrec_kvemb.contracts import Bags, InitSpec
from torchrec_kvemb.ops.hashing import init_rows
from torchrec_kvemb.ops.optimizer_update import clip_output_gradient, optimizer_update_torch
from torchrec_kvemb.optimizer import FusedOptimConfig


def group_pooled_forward_torch(
    weights: torch.Tensor,
    slots: torch.Tensor,
    ids: torch.Tensor,
    table_idx: torch.Tensor,
    bags: Bags,
    init_specs: tuple[InitSpec, ...],
    missing_as_zero: bool,
) -> torch.Tensor:
    """Pooled rows ``[B, dim]`` of a group's batch: over each bag, the sum of
    ``row * scale``. Ids with slot -1 pool their table's initial value
    (``init_specs[table_idx]``), or zeros when ``missing_as_zero``; ids of no
    table of the group (``table_idx`` -1) pool nothing."""
    if weights.dtype != torch.float32:
        # Half-precision rows pool in float32: gather and widen them first.
        rows = weights.index_select(0, slots.clamp(min=0)).to(torch.float32)
        position = torch.arange(slots.numel(), device=slots.device)
        weights, slots = rows, torch.where(slots >= 0, position, -1)
    stored = slots >= 0
    if bags.scale is None and bool(stored.all()):
        return F.embedding_bag(slots, weights, bags.offsets, mode="sum", include_last_offset=True)
    scale = bags.scale if bags.scale is not None else torch.ones(slots.numel(), device=slots.device)
    # why embedding_bag: it pools straight from the table by index (fbgemm's
    # kernel on CPU) instead of materializing n gathered rows.
    out = F.embedding_bag(
        slots.clamp(min=0),
        weights,
        bags.offsets,
        mode="sum",
        per_sample_weights=scale * stored,
        include_last_offset=True,
    )
    if missing_as_zero:
        return out
    add_initial_rows(out, slots, ids, table_idx, bags, init_specs)
    return out


def add_initial_rows(
    out: torch.Tensor,
    slots: torch.Tensor,
    ids: torch.Tensor,
    table_idx: torch.Tensor,
    bags: Bags,
    init_specs: tuple[InitSpec, ...],
) -> None:
    """Add to the pooled rows ``out [B, dim]`` the initial rows of the ids of a table
    without a row (slot -1), times their scale, in place: the last step of
    ``group_pooled_forward_torch``, which the native kernel's sums take too."""
    stored = slots >= 0
    for t, spec in enumerate(init_specs):
        missing = ((~stored) & (table_idx == t)).nonzero().squeeze(1)
        if missing.numel():
            rows = init_rows(
                ids[missing], out.shape[1], spec.seed, spec.normal, spec.a, spec.b, spec.first_col
            )
            if bags.scale is not None:
                rows = rows * bags.scale[missing].unsqueeze(1)
            out.index_add_(0, bags.bag_of[missing], rows)


def group_rows_forward_torch(
    weights: torch.Tensor,
    slots: torch.Tensor,
    ids: torch.Tensor,
    table_idx: torch.Tensor,
    init_specs: tuple[InitSpec, ...],
    missing_as_zero: bool,
) -> torch.Tensor:
    """One row per id ``[n, dim]`` (float32): what ``group_pooled_forward_torch`` gives
    when every id is a bag of its own with scale 1, gathered without pooling."""
    stored = slots >= 0
    rows = weights.index_select(0, slots.clamp(min=0)).to(torch.float32)
    # why index_fill_ of the missing rows only: masking every row costs as much as the
    # gather itself on a large batch, and most ids are stored.
    missing = (~stored).nonzero().squeeze(1)
    if missing.numel() == 0:
        return rows
    rows.index_fill_(0, missing, 0.0)
    if missing_as_zero:
        return rows
    copy_initial_rows(rows, missing, ids, table_idx, init_specs)
    return rows


def copy_initial_rows(
    rows: torch.Tensor,
    missing: torch.Tensor,
    ids: torch.Tensor,
    table_idx: torch.Tensor,
    init_specs: tuple[InitSpec, ...],
) -> None:
    """Write into ``rows [n, dim]`` the initial rows of the ``missing`` ids (positions
    of ids without a row) of a table, in place: the last step of
    ``group_rows_forward_torch``, which the native kernel's rows take too."""
    missing_table = table_idx[missing]
    for t, spec in enumerate(init_specs):
        mine = missing[missing_table == t]
        if mine.numel():
            dim = rows.shape[1]
            fresh = init_rows(
                ids[mine], dim, spec.seed, spec.normal, spec.a, spec.b, spec.first_col
            )
            rows.index_copy_(0, mine, fresh)


def group_pooled_backward_torch(
    grad_out: torch.Tensor, slots: torch.Tensor, bags: Bags
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradient per stored row of a group: ``(unique slots [u] ascending, grads [u, dim])``,
    the sum over a row's ids of ``grad_out[bag] * scale``."""
    stored = (slots >= 0).nonzero().squeeze(1)
    uniq, inverse = torch.unique(slots[stored], return_inverse=True)
    contrib = grad_out.index_select(0, bags.bag_of[stored])
    if bags.scale is not None:
        contrib = contrib * bags.scale[stored].unsqueeze(1)
    grads = torch.zeros(
        uniq.numel(), grad_out.shape[1], dtype=grad_out.dtype, device=grad_out.device
    )
    grads.index_add_(0, inverse, contrib)
    return uniq, grads


def pooled_backward_update_torch(
    weights: torch.Tensor,
    state: torch.Tensor,
    grad_out: torch.Tensor,
    slots: torch.Tensor,
    bags: Bags,
    config: FusedOptimConfig,
    step: int,
) -> None:
    """The torch reference of a fused backward of one table: the gradient of each
    stored row (``slots``: the table's own), then one step of ``config`` (``step``:
    this step's count, from 1), in place."""
    grad_out = clip_output_gradient(grad_out, config)
    uniq, grads = group_pooled_backward_torch(grad_out.contiguous(), slots, bags)
    optimizer_update_torch(weights, state, uniq, grads, config, step)
