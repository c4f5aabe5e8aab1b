"""Pooled lookup by slot: forward and per-row gradient reduction (torch path).

Inputs describe one table's bags: ``slots [n]`` (-1 for ids without a row,
which pool their initial value and get no gradient), ``ids [n]``, ``offsets
[B + 1]``, optional per-sample weights ``[n]`` and ``mean`` pooling (divide by
the bag's length, empty bags give zeros). The Triton twins are in
``kernels/pooled_lookup.py``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from torchrec_kvemb.ops.contracts import InitSpec, bag_scale
from torchrec_kvemb.ops.hashing import init_rows


def pooled_forward_torch(
    weights: torch.Tensor,
    slots: torch.Tensor,
    ids: torch.Tensor,
    offsets: torch.Tensor,
    per_sample_weights: torch.Tensor | None,
    mean: bool,
    init: InitSpec | None,
) -> torch.Tensor:
    """Pooled rows ``[B, dim]``: sum (or mean) over each bag of row * sample weight.

    ``init=None``: ids without a row pool as zeros (read-only lookups).
    """
    stored = slots >= 0
    if (per_sample_weights is None or not mean) and bool(stored.all()):
        # why: the common case (every id has a row) pools in one embedding_bag call.
        return F.embedding_bag(
            slots,
            weights,
            offsets,
            mode="mean" if mean else "sum",
            per_sample_weights=None if per_sample_weights is None else per_sample_weights.float(),
            include_last_offset=True,
        )
    n = slots.numel()
    bags, scale = bag_scale(offsets, per_sample_weights, mean, n)
    # why embedding_bag: it pools straight from the table by index (fbgemm's
    # kernel on CPU) instead of materializing n gathered rows.
    out = F.embedding_bag(
        slots.clamp(min=0),
        weights,
        offsets[:-1],
        mode="sum",
        per_sample_weights=scale * stored,
        include_last_offset=False,
    )
    if out.shape[0] != offsets.numel() - 1:  # embedding_bag drops nothing, but be exact
        out = out[: offsets.numel() - 1]
    missing = (~stored).nonzero().squeeze(1)
    if missing.numel() and init is not None:
        rows = init_rows(ids[missing], weights.shape[1], init.seed, init.normal, init.a, init.b)
        out.index_add_(0, bags[missing], rows * scale[missing].unsqueeze(1))
    return out


def pooled_backward_torch(
    grad_out: torch.Tensor,
    slots: torch.Tensor,
    offsets: torch.Tensor,
    per_sample_weights: torch.Tensor | None,
    mean: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradient per stored row: ``(unique slots [u] ascending, grads [u, dim])``."""
    bags, scale = bag_scale(offsets, per_sample_weights, mean, slots.numel())
    stored = slots >= 0
    uniq, inverse = torch.unique(slots[stored], return_inverse=True)
    contrib = grad_out.index_select(0, bags[stored]) * scale[stored].unsqueeze(1)
    grads = torch.zeros(
        uniq.numel(), grad_out.shape[1], dtype=grad_out.dtype, device=grad_out.device
    )
    grads.index_add_(0, inverse, contrib)
    return uniq, grads
