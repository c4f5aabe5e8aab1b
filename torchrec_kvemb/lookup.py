"""Pooled lookup with the optimizer fused into backward, for one KV table.

Forward pools rows by slot; backward reduces the gradient per row and
updates the rows in place (no ``.grad`` for the table). The backend of each
op is chosen in ``ops/dispatch.py``.
"""

from __future__ import annotations

import torch

from torchrec_kvemb.ops import dispatch
from torchrec_kvemb.table import KVTable


def pooled_forward(
    table: KVTable,
    slots: torch.Tensor,
    ids: torch.Tensor,
    offsets: torch.Tensor,
    per_sample_weights: torch.Tensor | None,
    mean: bool,
    missing_as_zero: bool,
) -> torch.Tensor:
    """Pooled rows ``[B, dim]``; ids without a row pool their initial value, or zeros."""
    return dispatch.pooled_forward(
        table.weights,
        slots,
        ids,
        offsets,
        per_sample_weights,
        mean,
        table.init_spec,
        missing_as_zero,
    )


def apply_gradients(
    table: KVTable,
    grad_out: torch.Tensor,
    slots: torch.Tensor,
    offsets: torch.Tensor,
    per_sample_weights: torch.Tensor | None,
    mean: bool,
) -> None:
    """Reduce ``grad_out`` per stored row and apply one optimizer step, in place."""
    table.optim_step += 1
    dispatch.fused_backward(
        table.weights,
        table.state,
        grad_out,
        slots,
        offsets,
        per_sample_weights,
        mean,
        table.optim,
        table.optim_step,
    )


class KVPooledLookup(torch.autograd.Function):
    """``anchor`` (an empty tensor that requires grad) ties the output into autograd."""

    @staticmethod
    def forward(ctx, anchor, table, slots, ids, offsets, per_sample_weights, mean, training):
        ctx.table = table
        ctx.mean = mean
        ctx.save_for_backward(slots, offsets, per_sample_weights)
        return pooled_forward(
            table, slots, ids, offsets, per_sample_weights, mean, missing_as_zero=not training
        )

    @staticmethod
    def backward(ctx, grad_out):
        slots, offsets, per_sample_weights = ctx.saved_tensors
        apply_gradients(ctx.table, grad_out, slots, offsets, per_sample_weights, ctx.mean)
        return (None,) * 8
