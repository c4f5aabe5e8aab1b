"""Fused optimizer row update (Triton).

Twin of ``optimizer_update_torch`` in ``torchrec_kvemb/ops/optimizer_update.py``:
SGD, row-wise Adagrad and Adam, L2 or decoupled weight decay, gradient
clipping, applied in place to the rows ``slots`` of ``weights`` and ``state``.
One program updates a block of rows, walking the columns in blocks; row-wise
Adagrad first walks them once to get the row's mean squared gradient.
"""

# Triton's convention: constexpr kernel arguments are UPPER_CASE.
# ruff: noqa: N803

from __future__ import annotations

import torch
import triton
import triton.language as tl

from torchrec_kvemb.optimizer import FusedOptimConfig, OptimKind, WeightDecay

# why 128: a warp reads 128 fp32 columns (512 B) of a row as whole cache lines.
MAX_BLOCK_D = 128
# why 2048: rows x columns per tile; small tables (dim 8..32) pack 64..256 rows
# into one program instead of leaving most lanes of a one-row program idle.
TILE = 2048

_KIND_CODE = {OptimKind.SGD: 0, OptimKind.ROWWISE_ADAGRAD: 1, OptimKind.ADAM: 2}


@triton.jit
def _grad_tile(
    grads_ptr,
    rows,
    cols,
    mask,
    w,
    g_stride,
    decay,
    max_gradient,
    L2: tl.constexpr,
    CLIP: tl.constexpr,
):
    """The gradient the optimizer sees: clipped, then plus L2 decay."""
    g = tl.load(grads_ptr + rows[:, None] * g_stride + cols[None, :], mask=mask, other=0.0)
    g = g.to(tl.float32)
    if CLIP:
        g = tl.minimum(tl.maximum(g, -max_gradient), max_gradient)
    if L2:
        g = g + decay * w
    return g


@triton.jit
def optimizer_update_fwd_kernel(
    weights_ptr,
    state_ptr,
    slots_ptr,
    grads_ptr,
    num_rows,
    dim,
    w_stride,
    s_stride,
    g_stride,
    lr,
    eps,
    beta1,
    one_minus_beta1,
    beta2,
    one_minus_beta2,
    bias1,
    bias2,
    decay,
    lr_decay,
    max_gradient,
    KIND: tl.constexpr,
    L2: tl.constexpr,
    DECOUPLE: tl.constexpr,
    CLIP: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_mask = rows < num_rows
    slots = tl.load(slots_ptr + rows, mask=row_mask, other=0)
    w_row = slots * w_stride
    s_row = slots * s_stride
    if KIND == 1:
        sq = tl.zeros([BLOCK_R], dtype=tl.float32)
        for d0 in range(0, dim, BLOCK_D):
            cols = d0 + tl.arange(0, BLOCK_D)
            mask = row_mask[:, None] & (cols < dim)[None, :]
            w = tl.load(weights_ptr + w_row[:, None] + cols[None, :], mask=mask, other=0.0)
            w = w.to(tl.float32)
            g = _grad_tile(grads_ptr, rows, cols, mask, w, g_stride, decay, max_gradient, L2, CLIP)
            sq += tl.sum(g * g, axis=1)
        acc = tl.load(state_ptr + s_row, mask=row_mask, other=0.0).to(tl.float32) + sq / dim
        tl.store(state_ptr + s_row, acc.to(state_ptr.dtype.element_ty), mask=row_mask)
        multiplier = lr / (tl.sqrt(acc) + eps)
    for d0 in range(0, dim, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        mask = row_mask[:, None] & (cols < dim)[None, :]
        w_ptrs = weights_ptr + w_row[:, None] + cols[None, :]
        w = tl.load(w_ptrs, mask=mask, other=0.0).to(tl.float32)
        g = _grad_tile(grads_ptr, rows, cols, mask, w, g_stride, decay, max_gradient, L2, CLIP)
        if KIND == 0:
            new_w = w - lr * g
        elif KIND == 1:
            new_w = w - multiplier[:, None] * g
        else:
            m_ptrs = state_ptr + s_row[:, None] + cols[None, :]
            v_ptrs = m_ptrs + dim
            m = beta1 * tl.load(m_ptrs, mask=mask, other=0.0).to(tl.float32) + one_minus_beta1 * g
            v = beta2 * tl.load(v_ptrs, mask=mask, other=0.0).to(tl.float32)
            v = v + one_minus_beta2 * g * g
            tl.store(m_ptrs, m.to(state_ptr.dtype.element_ty), mask=mask)
            tl.store(v_ptrs, v.to(state_ptr.dtype.element_ty), mask=mask)
            new_w = w - lr * (m / bias1) / (tl.sqrt(v / bias2) + eps)
        if DECOUPLE:
            new_w = new_w - lr_decay * w
        tl.store(w_ptrs, new_w.to(weights_ptr.dtype.element_ty), mask=mask)


def _check_rows(name: str, t: torch.Tensor) -> None:
    if t.dim() != 2 or (t.shape[1] > 1 and t.stride(1) != 1):
        raise ValueError(f"{name} must be 2-D with contiguous columns, got strides {t.stride()}")


def optimizer_update_triton(
    weights: torch.Tensor,
    state: torch.Tensor,
    slots: torch.Tensor,
    grads: torch.Tensor,
    config: FusedOptimConfig,
    step: int,
) -> None:
    """Apply one optimizer step to rows ``slots`` (unique) given their ``grads``, in place.

    ``step`` counts this table's optimizer steps from 1 (Adam's bias correction).
    ``weights`` and ``state`` may be column slices of one value-row tensor.
    """
    num_rows = slots.numel()
    dim = weights.shape[1]
    if num_rows == 0 or dim == 0:
        return
    _check_rows("weights", weights)
    _check_rows("state", state)
    _check_rows("grads", grads)
    kind = config.kind
    if state.shape[1] < config.state_dim(dim):
        raise ValueError(
            f"state has {state.shape[1]} columns, {kind.value} needs {config.state_dim(dim)}"
        )
    decay = config.weight_decay
    l2 = bool(decay) and config.weight_decay_mode == WeightDecay.L2
    decouple = bool(decay) and config.weight_decay_mode == WeightDecay.DECOUPLE
    lr = config.learning_rate
    block_d = min(triton.next_power_of_2(dim), MAX_BLOCK_D)
    block_r = max(1, TILE // block_d)
    grid = (triton.cdiv(num_rows, block_r),)
    optimizer_update_fwd_kernel[grid](
        weights,
        state if state.numel() else weights,  # SGD has no state; the pointer is never read
        slots.contiguous(),
        grads,
        num_rows,
        dim,
        weights.stride(0),
        state.stride(0),
        grads.stride(0),
        lr,
        config.eps,
        config.beta1,
        1.0 - config.beta1,
        config.beta2,
        1.0 - config.beta2,
        1.0 - config.beta1**step,
        1.0 - config.beta2**step,
        decay,
        lr * decay,
        config.max_gradient,
        KIND=_KIND_CODE[kind],
        L2=l2,
        DECOUPLE=decouple,
        CLIP=bool(config.gradient_clipping),
        BLOCK_R=block_r,
        BLOCK_D=block_d,
    )
