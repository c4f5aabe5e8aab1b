"""Which implementation runs each op: the one place where a backend is chosen.

``backend.use_triton(device)`` decides per call (``TORCHREC_KVEMB_BACKEND``
overrides the default of Triton on CUDA, torch elsewhere). On the torch side,
CPU tensors take fbgemm's CPU kernels where they compute exactly the same
thing (``fbgemm_supports``). The Triton kernel modules are imported on first
use, so that a CPU-only process never compiles them.
"""

from __future__ import annotations

import torch

from torchrec_kvemb.backend import use_triton
from torchrec_kvemb.ops.block_bucketize import (
    IntsLike,
    bucketize_prepared_fbgemm,
    bucketize_prepared_torch,
    prepare_inputs,
)
from torchrec_kvemb.ops.contracts import BucketizeResult, InitSpec, InsertResult, bag_scale
from torchrec_kvemb.ops.insert import insert_torch
from torchrec_kvemb.ops.optimizer_update import (
    fbgemm_supports,
    fused_backward_fbgemm,
    optimizer_update_torch,
)
from torchrec_kvemb.ops.pooled_lookup import pooled_backward_torch, pooled_forward_torch
from torchrec_kvemb.ops.probe import probe_torch
from torchrec_kvemb.optimizer import FusedOptimConfig


def probe(keys: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Slots ``[n]`` of ``ids`` in the index ``keys``; -1 where absent."""
    if use_triton(ids.device):
        from torchrec_kvemb.kernels import probe as kernel

        return kernel.probe_triton(keys, ids)
    return probe_torch(keys, ids)


def insert(
    keys: torch.Tensor,
    scores: torch.Tensor,
    ids: torch.Tensor,
    values: torch.Tensor,
    accumulate: bool,
    keep_existing: bool,
) -> InsertResult:
    """Find-or-insert unique ``ids`` by the ranking rule (``ops.contracts``), in place."""
    if use_triton(ids.device):
        from torchrec_kvemb.kernels import insert as kernel

        return kernel.insert_triton(keys, scores, ids, values, accumulate, keep_existing)
    return insert_torch(keys, scores, ids, values, accumulate, keep_existing)


def block_bucketize_2d(
    lengths: torch.Tensor,
    indices: torch.Tensor,
    block_sizes: IntsLike,
    world_size: int,
    weights: torch.Tensor | None = None,
    total_num_blocks: IntsLike | None = None,
    bucketize_pos: bool = False,
    keep_orig_idx: bool = False,
    batch_size_per_feature: IntsLike | None = None,
    max_batch_size: int | None = None,
) -> BucketizeResult:
    """Split a jagged batch of ids into ``world_size`` buckets by block.

    Equal to ``torch.ops.fbgemm.block_bucketize_sparse_features`` (1-D or no weights)
    and ``block_bucketize_sparse_features_2d_weights`` (2-D weights) with
    ``sequence=True``; see ``ops/block_bucketize.py`` and ``docs/bucketization.md``.

    Args:
        lengths: ``[num_bags]`` int32/int64, feature-major like KJT lengths.
        indices: ``[N]`` int32/int64 ids, all ``>= 0``.
        block_sizes: one block size per feature (tensor or list of ints, ``>= 0``).
        world_size: number of ranks (output buckets).
        weights: optional ``[N]`` or ``[N, k]`` rows that travel with their ids.
        total_num_blocks: optional blocks per feature over all ranks, each a positive
            multiple of ``world_size``; default ``world_size`` (one block per rank).
        bucketize_pos: also return each id's position inside its original bag.
        keep_orig_idx: keep the original ids instead of block-relative ones.
        batch_size_per_feature: optional batch size of each feature (variable batch);
            default ``len(lengths) // num_features`` for every feature.
        max_batch_size: optional largest batch size (accepted for FBGEMM parity, checked).

    Returns:
        ``BucketizeResult(lengths, indices, weights, pos, unbucketize_permute)``.

    Example::

        >>> lengths = torch.tensor([2, 1, 3])  # 3 bags, one feature
        >>> ids = torch.tensor([1, 7, 4, 0, 9, 5])
        >>> out = block_bucketize_2d(lengths, ids, block_sizes=[5], world_size=2)
        >>> out.lengths  # rank 0: bags 0..2, then rank 1: bags 0..2
        tensor([1, 1, 1, 1, 0, 2])
        >>> out.indices  # ids 1, 4, 0 on rank 0; 7, 9, 5 on rank 1 as 7-5, 9-5, 5-5
        tensor([1, 4, 0, 2, 4, 0])
        >>> out.unbucketize_permute
        tensor([0, 3, 1, 2, 4, 5])
    """
    inp = prepare_inputs(
        lengths,
        indices,
        block_sizes,
        world_size,
        weights,
        total_num_blocks,
        bucketize_pos,
        keep_orig_idx,
        batch_size_per_feature,
        max_batch_size,
    )
    if use_triton(indices.device):
        from torchrec_kvemb.kernels import block_bucketize as kernel

        return kernel.block_bucketize_triton(inp)
    if inp.indices.device.type == "cpu":
        fast = bucketize_prepared_fbgemm(inp)
        if fast is not None:
            return fast
    return bucketize_prepared_torch(inp)


def pooled_forward(
    weights: torch.Tensor,
    slots: torch.Tensor,
    ids: torch.Tensor,
    offsets: torch.Tensor,
    per_sample_weights: torch.Tensor | None,
    mean: bool,
    init: InitSpec,
    missing_as_zero: bool,
) -> torch.Tensor:
    """Pooled rows ``[B, dim]``; ids without a row (slot -1) pool their initial value
    (``init``), or zeros when ``missing_as_zero`` (read-only lookups)."""
    if use_triton(slots.device):
        from torchrec_kvemb.kernels import pooled_lookup as kernel

        if missing_as_zero:
            stored = (slots >= 0).to(torch.float32)
            per_sample_weights = (
                stored if per_sample_weights is None else per_sample_weights * stored
            )
        return kernel.pooled_forward_triton(
            weights, slots, ids, offsets, per_sample_weights, mean, init
        )
    return pooled_forward_torch(
        weights, slots, ids, offsets, per_sample_weights, mean, None if missing_as_zero else init
    )


def fused_backward(
    weights: torch.Tensor,
    state: torch.Tensor,
    grad_out: torch.Tensor,
    slots: torch.Tensor,
    offsets: torch.Tensor,
    per_sample_weights: torch.Tensor | None,
    mean: bool,
    config: FusedOptimConfig,
    step: int,
) -> None:
    """Reduce ``grad_out`` per stored row (slot >= 0) and apply one optimizer step to
    ``weights`` / ``state`` in place; ``step`` counts optimizer steps from 1."""
    grad_out = grad_out.to(torch.float32).contiguous()
    if use_triton(slots.device):
        from torchrec_kvemb.kernels import optimizer_update, pooled_lookup

        uniq, grads = pooled_lookup.pooled_backward_triton(
            grad_out, slots, offsets, per_sample_weights, mean
        )
        optimizer_update.optimizer_update_triton(weights, state, uniq, grads, config, step)
        return
    if fbgemm_supports(config, weights):
        stored = slots >= 0
        if per_sample_weights is None and bool(stored.all()):
            fused_backward_fbgemm(grad_out, weights, state, slots, offsets, None, config, mean)
            return
        bags, scale = bag_scale(offsets, per_sample_weights, mean, slots.numel())
        kept = torch.bincount(bags[stored], minlength=offsets.numel() - 1)
        compact_offsets = torch.zeros(offsets.numel(), dtype=torch.int64, device=offsets.device)
        torch.cumsum(kept, 0, out=compact_offsets[1:])
        fused_backward_fbgemm(
            grad_out, weights, state, slots[stored], compact_offsets, scale[stored], config
        )
        return
    uniq, grads = pooled_backward_torch(grad_out, slots, offsets, per_sample_weights, mean)
    optimizer_update_torch(weights, state, uniq, grads, config, step)
