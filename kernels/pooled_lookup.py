"""Pooled lookup by slot: forward and per-row gradient reduction (Triton).

Twins of ``torchrec_kvemb/ops/pooled_lookup.py``, same signatures and results.

* Forward: one program per (bag, block of columns) walks its bag's ids in
  blocks, gathers stored rows (slot >= 0) or computes the initial values of
  ids without a row in registers, and accumulates row * sample weight in fp32.
* Backward: deterministic, no atomics. The launcher stable-sorts the stored
  ids by slot, so each unique slot owns one contiguous segment; one program
  per (unique slot, block of columns) sums ``grad_out[bag] * scale`` over its
  segment in a fixed order.
"""

# Triton's convention: constexpr kernel arguments are UPPER_CASE.
# ruff: noqa: N803

from __future__ import annotations

import torch
import triton
import triton.language as tl

from torchrec_kvemb.kernels.hashing import init_values
from torchrec_kvemb.ops.contracts import InitSpec, bag_scale, seed_mix

# why 128: a warp reads 128 fp32 columns (512 B) of a row as whole cache
# lines; wider tables take more column blocks, i.e. more programs per bag.
MAX_BLOCK_D = 128
# why 16: 16 ids x 128 columns = 2048 independent loads in flight per step of
# the bag loop, while typical bags (tens of ids) need only a few steps.
BLOCK_N = 16


def _block_d(dim: int) -> int:
    return min(triton.next_power_of_2(max(dim, 1)), MAX_BLOCK_D)


@triton.jit
def pooled_lookup_fwd_kernel(
    weights_ptr,
    slots_ptr,
    ids_ptr,
    offsets_ptr,
    psw_ptr,
    out_ptr,
    dim,
    w_stride,
    seed_mix,
    a,
    b,
    HAS_PSW: tl.constexpr,
    MEAN: tl.constexpr,
    NORMAL: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    bag = tl.program_id(0).to(tl.int64)
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
            weights_ptr + slots[:, None] * w_stride + cols[None, :],
            mask=stored[:, None] & col_mask[None, :],
            other=0.0,
        ).to(tl.float32)
        missing = mask & (slots < 0)
        # why the branch: hashing costs ~2 fmix64 per value; most blocks are all stored.
        if tl.sum(missing.to(tl.int32), axis=0) > 0:
            ids = tl.load(ids_ptr + idx, mask=missing, other=0)
            init = init_values(ids, cols, seed_mix, NORMAL, a, b)
            rows = tl.where(missing[:, None], init, rows)
        if HAS_PSW:
            psw = tl.load(psw_ptr + idx, mask=mask, other=0.0).to(tl.float32)
            rows = rows * psw[:, None]
        else:
            rows = tl.where(mask[:, None], rows, 0.0)
        acc += tl.sum(rows, axis=0)
    if MEAN:
        acc = acc / tl.maximum(end - start, 1).to(tl.float32)
    tl.store(out_ptr + bag * dim + cols, acc.to(out_ptr.dtype.element_ty), mask=col_mask)


@triton.jit
def pooled_lookup_bwd_kernel(
    grad_out_ptr,
    seg_ptr,
    bags_ptr,
    scale_ptr,
    grads_ptr,
    dim,
    go_stride,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_D + tl.arange(0, BLOCK_D)
    col_mask = cols < dim
    start = tl.load(seg_ptr + row)
    end = tl.load(seg_ptr + row + 1)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for i0 in range(start, end, BLOCK_N):
        idx = i0 + tl.arange(0, BLOCK_N)
        mask = idx < end
        bags = tl.load(bags_ptr + idx, mask=mask, other=0)
        scale = tl.load(scale_ptr + idx, mask=mask, other=0.0)
        g = tl.load(
            grad_out_ptr + bags[:, None] * go_stride + cols[None, :],
            mask=mask[:, None] & col_mask[None, :],
            other=0.0,
        ).to(tl.float32)
        acc += tl.sum(g * scale[:, None], axis=0)
    tl.store(grads_ptr + row * dim + cols, acc.to(grads_ptr.dtype.element_ty), mask=col_mask)


def _check_rows(name: str, t: torch.Tensor) -> None:
    if t.dim() != 2 or (t.shape[1] > 1 and t.stride(1) != 1):
        raise ValueError(f"{name} must be 2-D with contiguous columns, got strides {t.stride()}")


def pooled_forward_triton(
    weights: torch.Tensor,
    slots: torch.Tensor,
    ids: torch.Tensor,
    offsets: torch.Tensor,
    per_sample_weights: torch.Tensor | None,
    mean: bool,
    init: InitSpec,
) -> torch.Tensor:
    """Pooled rows ``[B, dim]``: sum (or mean) over each bag of row * sample weight.

    ``weights`` may be a column slice of a wider value-row tensor (row stride is free).
    """
    _check_rows("weights", weights)
    dim = weights.shape[1]
    num_bags = offsets.numel() - 1
    out = torch.empty(num_bags, dim, dtype=weights.dtype, device=weights.device)
    if num_bags == 0 or dim == 0:
        return out.zero_()
    psw = per_sample_weights.contiguous() if per_sample_weights is not None else slots
    block_d = _block_d(dim)
    grid = (num_bags, triton.cdiv(dim, block_d))
    pooled_lookup_fwd_kernel[grid](
        weights,
        slots.contiguous(),
        ids.contiguous(),
        offsets.to(torch.int64).contiguous(),
        psw,
        out,
        dim,
        weights.stride(0),
        seed_mix(init.seed),
        float(init.a),
        float(init.b),
        HAS_PSW=per_sample_weights is not None,
        MEAN=bool(mean),
        NORMAL=bool(init.normal),
        BLOCK_N=BLOCK_N,
        BLOCK_D=block_d,
    )
    return out


def pooled_backward_triton(
    grad_out: torch.Tensor,
    slots: torch.Tensor,
    offsets: torch.Tensor,
    per_sample_weights: torch.Tensor | None,
    mean: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradient per stored row: ``(unique slots [u] ascending, grads [u, dim])``."""
    _check_rows("grad_out", grad_out)
    dim = grad_out.shape[1]
    bags, scale = bag_scale(offsets, per_sample_weights, mean, slots.numel())
    stored = slots >= 0
    # why stable: ids of one slot keep their input order, so the sum order is fixed.
    sorted_slots, order = torch.sort(slots[stored], stable=True)
    uniq, counts = torch.unique_consecutive(sorted_slots, return_counts=True)
    grads = torch.empty(uniq.numel(), dim, dtype=grad_out.dtype, device=grad_out.device)
    if uniq.numel() == 0 or dim == 0:
        return uniq, grads.zero_()
    seg = torch.zeros(uniq.numel() + 1, dtype=torch.int64, device=slots.device)
    torch.cumsum(counts, 0, out=seg[1:])
    seg_bags = bags[stored][order].contiguous()
    seg_scale = scale[stored][order].contiguous()
    block_d = _block_d(dim)
    grid = (uniq.numel(), triton.cdiv(dim, block_d))
    pooled_lookup_bwd_kernel[grid](
        grad_out,
        seg,
        seg_bags,
        seg_scale,
        grads,
        dim,
        grad_out.stride(0),
        BLOCK_N=BLOCK_N,
        BLOCK_D=block_d,
    )
    return uniq, grads
