"""Pooled lookup with the optimizer fused into backward, for one KV table.

Forward pools rows by slot; backward reduces the gradient per row and
updates the rows in place (no ``.grad`` for the table). The backend is chosen
per call: Triton kernels on CUDA (``TORCHREC_KVEMB_BACKEND`` overrides), else
the torch path, which hands the reduction and update to fbgemm's CPU TBE
backward where that computes the same update.
"""

from __future__ import annotations

import torch

from torchrec_kvemb.backend import use_triton
from torchrec_kvemb.ops.optimizer_update import (
    fbgemm_supports,
    fused_backward_fbgemm,
    optimizer_update_torch,
)
from torchrec_kvemb.ops.pooled_lookup import (
    bag_scale,
    pooled_backward_torch,
    pooled_forward_torch,
)
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
    if use_triton(slots.device):
        from torchrec_kvemb.kernels.pooled_lookup import pooled_forward_triton

        if missing_as_zero:
            stored = (slots >= 0).to(torch.float32)
            per_sample_weights = (
                stored if per_sample_weights is None else per_sample_weights * stored
            )
        return pooled_forward_triton(
            table.weights, slots, ids, offsets, per_sample_weights, mean, table.init_spec
        )
    init = None if missing_as_zero else table.init_spec
    return pooled_forward_torch(table.weights, slots, ids, offsets, per_sample_weights, mean, init)


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
    grad_out = grad_out.to(torch.float32).contiguous()
    if use_triton(slots.device):
        from torchrec_kvemb.kernels.optimizer_update import optimizer_update_triton
        from torchrec_kvemb.kernels.pooled_lookup import pooled_backward_triton

        uniq, grads = pooled_backward_triton(grad_out, slots, offsets, per_sample_weights, mean)
        optimizer_update_triton(
            table.weights, table.state, uniq, grads, table.optim, table.optim_step
        )
        return
    if fbgemm_supports(table.optim, table.weights):
        stored = slots >= 0
        if per_sample_weights is None and bool(stored.all()):
            fused_backward_fbgemm(
                grad_out, table.weights, table.state, slots, offsets, None, table.optim, mean
            )
            return
        bags, scale = bag_scale(offsets, per_sample_weights, mean, slots.numel())
        kept = torch.bincount(bags[stored], minlength=offsets.numel() - 1)
        compact_offsets = torch.zeros(offsets.numel(), dtype=torch.int64, device=offsets.device)
        torch.cumsum(kept, 0, out=compact_offsets[1:])
        fused_backward_fbgemm(
            grad_out,
            table.weights,
            table.state,
            slots[stored],
            compact_offsets,
            scale[stored],
            table.optim,
        )
        return
    uniq, grads = pooled_backward_torch(grad_out, slots, offsets, per_sample_weights, mean)
    optimizer_update_torch(table.weights, table.state, uniq, grads, table.optim, table.optim_step)


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
