"""Pooled lookup of a group of KV tables: forward, and backward fused with the optimizer (Triton).

Twins of ``group_pooled_forward_torch`` / ``group_pooled_backward_torch`` +
``optimizer_update_torch`` (``torchrec_kvemb/ops``); one launch each, no host
sync, deterministic (no atomics: each row's gradient is summed in a fixed
order by one program).

* Forward: one program per (bag, block of columns) walks its bag's ids,
  gathers stored rows (slot >= 0) or computes the initial values of ids
  without a row (their table's seed and initializer), and sums ``row *
  scale`` in fp32.
* Backward: torch sorts the ids by slot (stable); one program per sorted
  position: the first of each run of equal slots (one row) finds the run's
  end, sums ``grad_out[bag] * scale`` over the run (``grad_out[bag]`` clamped
  first with gradient clipping, FBGEMM's rule), then applies the table's
  optimizer to the row: SGD, row-wise Adagrad or Adam, L2 or decoupled weight
  decay; per-table learning rate and Adam bias corrections.
"""

# Triton's convention: constexpr kernel arguments are UPPER_CASE.
# ruff: noqa: N803

from __future__ import annotations

import torch
import triton
import triton.language as tl

from torchrec_kvemb.contracts import Bags, GroupLayout
from torchrec_kvemb.kernels.hashing import init_values_any
from torchrec_kvemb.kernels.rounding import round_to
from torchrec_kvemb.optimizer import OptimKind

# why 128: a warp reads 128 fp32 columns (512 B) of a row as whole cache lines.
MAX_BLOCK_D = 128
# why 16: 16 ids x 128 columns = 2048 loads in flight per step of the bag loop.
BLOCK_N = 16

#: Optimizer codes and state blocks of the fused backward, from ``OptimKind``.
SGD = tl.constexpr(OptimKind.SGD.code)
ROWWISE_ADAGRAD = tl.constexpr(OptimKind.ROWWISE_ADAGRAD.code)
ADAM = tl.constexpr(OptimKind.ADAM.code)
#: Adam's second moment: the state block after the first (``dim`` columns each).
EXP_AVG_SQ = tl.constexpr(OptimKind.ADAM.state_names.index("exp_avg_sq"))


def _block_d(dim: int) -> int:
    return min(triton.next_power_of_2(max(dim, 1)), MAX_BLOCK_D)


@triton.jit
def group_pooled_fwd_kernel(
    weights_ptr,
    slots_ptr,
    ids_ptr,
    table_idx_ptr,
    bag_list_ptr,
    offsets_ptr,
    scale_ptr,
    seed_mix_ptr,
    init_normal_ptr,
    init_a_ptr,
    init_b_ptr,
    init_col_ptr,
    out_ptr,
    dim,
    HAS_SCALE: tl.constexpr,
    MISSING_AS_ZERO: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    bag = tl.load(bag_list_ptr + tl.program_id(0).to(tl.int64))
    cols = tl.program_id(1).to(tl.int64) * BLOCK_D + tl.arange(0, BLOCK_D)
    col_mask = cols < dim
    start = tl.load(offsets_ptr + bag)
    end = tl.load(offsets_ptr + bag + 1)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for i0 in range(start, end, BLOCK_N):
        idx = i0 + tl.arange(0, BLOCK_N)
        mask = idx < end
        slots = tl.load(slots_ptr + idx, mask=mask, other=-1)
        stored = slots >= 0
        rows = tl.load(
            weights_ptr + slots[:, None] * dim + cols[None, :],
            mask=stored[:, None] & col_mask[None, :],
            other=0.0,
        ).to(tl.float32)
        if not MISSING_AS_ZERO:
            table = tl.load(table_idx_ptr + idx, mask=mask, other=-1)
            missing = mask & ~stored & (table >= 0)
            # why the branch: hashing costs ~2 fmix64 per value; most blocks are all stored.
            if tl.sum(missing.to(tl.int32), axis=0) > 0:
                t = tl.where(missing, table, 0)
                ids = tl.load(ids_ptr + idx, mask=missing, other=0)
                seed = tl.load(seed_mix_ptr + t)
                normal = tl.load(init_normal_ptr + t)
                a = tl.load(init_a_ptr + t)
                b = tl.load(init_b_ptr + t)
                first_col = tl.load(init_col_ptr + t)
                init = init_values_any(ids, cols, seed, normal, a, b, first_col)
                rows = tl.where(missing[:, None], init, rows)
        if HAS_SCALE:
            scale = tl.load(scale_ptr + idx, mask=mask, other=0.0).to(tl.float32)
            rows = rows * scale[:, None]
        else:
            rows = tl.where(mask[:, None], rows, 0.0)
        acc += tl.sum(rows, axis=0)
    tl.store(out_ptr + bag * dim + cols, acc.to(out_ptr.dtype.element_ty), mask=col_mask)


@triton.jit
def _row_gradient(
    grad_ptr, order_ptr, bag_of_ptr, scale_ptr, start, end, cols, col_mask, go_stride,
    max_gradient, CLIP: tl.constexpr, HAS_SCALE: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Sum of ``grad[bag] * scale`` over the ids at sorted positions ``[start, end)``;
    ``CLIP``: each ``grad[bag]`` clamped to ``[-max_gradient, max_gradient]`` first
    (FBGEMM clamps its output's gradient, bag by bag)."""
    g = tl.zeros([BLOCK_D], dtype=tl.float32)
    for i0 in range(start, end, BLOCK_N):
        idx = i0 + tl.arange(0, BLOCK_N)
        mask = idx < end
        occ = tl.load(order_ptr + idx, mask=mask, other=0)
        bags = tl.load(bag_of_ptr + occ, mask=mask, other=0)
        rows = tl.load(
            grad_ptr + bags[:, None] * go_stride + cols[None, :],
            mask=mask[:, None] & col_mask[None, :],
            other=0.0,
        ).to(tl.float32)
        if CLIP:
            rows = tl.minimum(tl.maximum(rows, -max_gradient), max_gradient)
        if HAS_SCALE:
            rows = rows * tl.load(scale_ptr + occ, mask=mask, other=0.0)[:, None]
        g += tl.sum(rows, axis=0)
    return g


@triton.jit
def _run_end(sorted_slots_ptr, start, slot, n, BLOCK_N: tl.constexpr):
    """One past the last sorted position of ``slot``'s run from ``start`` (runs of
    equal slots are contiguous: each block's matches are a prefix)."""
    end = start
    more = start < n
    while more:
        idx = end + tl.arange(0, BLOCK_N)
        found = tl.load(sorted_slots_ptr + idx, mask=idx < n, other=-2) == slot
        matched = tl.sum(found.to(tl.int64), axis=0)
        end += matched
        more = matched == BLOCK_N
    return end


@triton.jit
def group_fused_bwd_kernel(
    weights_ptr,
    state_ptr,
    grad_ptr,
    order_ptr,
    sorted_slots_ptr,
    bag_of_ptr,
    scale_ptr,
    slot_table_ptr,
    lr_ptr,
    bias1_ptr,
    bias2_ptr,
    n,
    dim,
    state_dim,
    go_stride,
    eps,
    beta1,
    beta2,
    decay,
    max_gradient,
    KIND: tl.constexpr,
    L2: tl.constexpr,
    DECOUPLE: tl.constexpr,
    CLIP: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # Sorted position ``start``'s program works when it is the first of a stored row's run.
    start = tl.program_id(0).to(tl.int64)
    slot = tl.load(sorted_slots_ptr + start)
    prev = tl.load(sorted_slots_ptr + start - 1, mask=start > 0, other=-2)  # slots are >= -1
    live = (slot >= 0) & (prev != slot)
    if live:
        end = _run_end(sorted_slots_ptr, start, slot, n, BLOCK_N)
        table = tl.load(slot_table_ptr + tl.load(order_ptr + start))
        lr = tl.load(lr_ptr + table)
        w_row = weights_ptr + slot * dim
        s_row = state_ptr + slot * state_dim
        multiplier = lr
        if KIND == ROWWISE_ADAGRAD:
            sq = tl.zeros([BLOCK_D], dtype=tl.float32)
            for d0 in range(0, dim, BLOCK_D):
                cols = d0 + tl.arange(0, BLOCK_D)
                col_mask = cols < dim
                g = _row_gradient(
                    grad_ptr, order_ptr, bag_of_ptr, scale_ptr, start, end, cols, col_mask,
                    go_stride, max_gradient, CLIP, HAS_SCALE, BLOCK_N, BLOCK_D,
                )  # fmt: skip
                w = tl.load(w_row + cols, mask=col_mask, other=0.0).to(tl.float32)
                g = _transformed(g, w, decay, L2)
                sq += tl.where(col_mask, g * g, 0.0)
            acc = tl.load(s_row) + tl.sum(sq, axis=0) / dim
            tl.store(s_row, acc)
            multiplier = lr / (tl.sqrt(acc) + eps)
        for d0 in range(0, dim, BLOCK_D):
            cols = d0 + tl.arange(0, BLOCK_D)
            col_mask = cols < dim
            g = _row_gradient(
                grad_ptr, order_ptr, bag_of_ptr, scale_ptr, start, end, cols, col_mask,
                go_stride, max_gradient, CLIP, HAS_SCALE, BLOCK_N, BLOCK_D,
            )  # fmt: skip
            w = tl.load(w_row + cols, mask=col_mask, other=0.0).to(tl.float32)
            g = _transformed(g, w, decay, L2)
            if KIND == ADAM:
                m_ptrs = s_row + cols
                v_ptrs = s_row + EXP_AVG_SQ * dim + cols
                m = beta1 * tl.load(m_ptrs, mask=col_mask, other=0.0) + (1.0 - beta1) * g
                v = beta2 * tl.load(v_ptrs, mask=col_mask, other=0.0) + (1.0 - beta2) * g * g
                tl.store(m_ptrs, m, mask=col_mask)
                tl.store(v_ptrs, v, mask=col_mask)
                bias1 = tl.load(bias1_ptr + table)
                bias2 = tl.load(bias2_ptr + table)
                new_w = w - lr * (m / bias1) / (tl.sqrt(v / bias2) + eps)
            else:
                new_w = w - multiplier * g
            if DECOUPLE:
                new_w = new_w - lr * decay * w
            # Half-precision rows: float32 math, rounded to nearest-even on store.
            tl.store(w_row + cols, round_to(new_w, weights_ptr.dtype.element_ty), mask=col_mask)


@triton.jit
def _transformed(g, w, decay, L2: tl.constexpr):
    """The gradient the optimizer sees: plus L2 decay."""
    if L2:
        g = g + decay * w
    return g


# ----------------------------------------------------------------- launchers
def group_pooled_forward_triton(
    layout: GroupLayout,
    weights: torch.Tensor,
    slots: torch.Tensor,
    ids: torch.Tensor,
    table_idx: torch.Tensor,
    bags: Bags,
    bag_list: torch.Tensor,
    missing_as_zero: bool,
) -> torch.Tensor:
    """Pooled rows ``[B, dim]`` of a group's batch (``group_pooled_forward_torch``),
    computed for the bags in ``bag_list`` (the group's; the other rows are zeros)."""
    dim = weights.shape[1]
    num_bags = bags.offsets.numel() - 1
    out = torch.zeros(num_bags, dim, dtype=torch.float32, device=weights.device)
    if bag_list.numel() == 0 or dim == 0:
        return out
    scale = bags.scale.contiguous() if bags.scale is not None else slots
    block_d = _block_d(dim)
    group_pooled_fwd_kernel[(bag_list.numel(), triton.cdiv(dim, block_d))](
        weights,
        slots.contiguous(),
        ids.contiguous(),
        table_idx.contiguous(),
        bag_list,
        bags.offsets,
        scale,
        layout.seed_mix,
        layout.init_normal,
        layout.init_a,
        layout.init_b,
        layout.init_col,
        out,
        dim,
        HAS_SCALE=bags.scale is not None,
        MISSING_AS_ZERO=bool(missing_as_zero),
        BLOCK_N=BLOCK_N,
        BLOCK_D=block_d,
    )
    return out


def group_fused_backward_triton(
    weights: torch.Tensor,
    state: torch.Tensor,
    grad_out: torch.Tensor,
    slots: torch.Tensor,
    slot_table: torch.Tensor,
    bags: Bags,
    kind: int,
    learning_rates: torch.Tensor,
    bias1: torch.Tensor,
    bias2: torch.Tensor,
    eps: float,
    beta1: float,
    beta2: float,
    decay: float,
    l2: bool,
    decouple: bool,
    clip: bool,
    max_gradient: float,
) -> None:
    """Reduce ``grad_out [B, dim]`` per row of ``slots`` (-1: none) and apply each
    row's table's optimizer in place. ``slot_table [n]``: the table of each id;
    ``learning_rates``, ``bias1``, ``bias2``: per table (``1 - beta ** step`` for Adam)."""
    n = slots.numel()
    dim = weights.shape[1]
    if n == 0 or dim == 0:
        return
    grad_out = grad_out.contiguous()
    # One program per sorted position; the first of each run of equal slots works.
    sorted_slots, order = torch.sort(slots, stable=True)
    block_d = _block_d(dim)
    group_fused_bwd_kernel[(n,)](
        weights,
        state if state.numel() else weights,  # SGD has no state; the pointer is never read
        grad_out,
        order,
        sorted_slots,
        bags.bag_of,
        bags.scale if bags.scale is not None else grad_out,
        slot_table,
        learning_rates,
        bias1,
        bias2,
        n,
        dim,
        state.shape[1],
        grad_out.stride(0),
        eps,
        beta1,
        beta2,
        decay,
        max_gradient,
        KIND=kind,
        L2=l2,
        DECOUPLE=decouple,
        CLIP=clip,
        HAS_SCALE=bags.scale is not None,
        BLOCK_N=BLOCK_N,
        BLOCK_D=block_d,
    )
