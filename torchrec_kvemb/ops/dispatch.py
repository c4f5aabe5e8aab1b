"""Which implementation runs each op: the one place where a backend is chosen.

``backend.use_triton(device)`` decides per call (``TORCHREC_KVEMB_BACKEND``
overrides the default of Triton on CUDA, torch elsewhere). On the torch side,
CPU tensors take fbgemm's CPU kernels where they compute exactly the same
thing (``fbgemm_supports``). The Triton kernel modules are imported on first
use, so that a CPU-only process never compiles them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from torchrec_kvemb.backend import use_triton
from torchrec_kvemb.ops.block_bucketize import (
    IntsLike,
    bucketize_prepared_fbgemm,
    bucketize_prepared_torch,
    prepare_inputs,
)
from torchrec_kvemb.ops.contracts import (
    Bags,
    BucketizeResult,
    GroupLookup,
    InsertResult,
)
from torchrec_kvemb.ops.insert import insert_torch
from torchrec_kvemb.ops.optimizer_update import (
    fbgemm_supports,
    fused_backward_fbgemm,
    optimizer_update_torch,
)
from torchrec_kvemb.ops.pooled_lookup import (
    group_pooled_backward_torch,
    group_pooled_forward_torch,
)
from torchrec_kvemb.ops.probe import probe_torch
from torchrec_kvemb.optimizer import OptimKind, WeightDecay

if TYPE_CHECKING:
    from torchrec_kvemb.group import KVTableGroup


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


# -------------------------------------------------------------- grouped ops
def group_backend(group: KVTableGroup, device: torch.device) -> str:
    """The backend of a group's ops: ``"triton"``, or ``"torch"`` (the per-table path)."""
    if group.per_table_only:
        return "torch"
    if use_triton(device):
        return "triton"
    return "torch"


def group_lookup_train(
    group: KVTableGroup,
    ids: torch.Tensor,
    table_idx: torch.Tensor,
    custom_scores: torch.Tensor | None,
    custom_tables: Sequence[bool] | None,
) -> GroupLookup:
    """A group's training lookup (see ``KVTableGroup.lookup_train``)."""
    backend = group_backend(group, ids.device)
    if backend == "torch":
        return group.lookup_train_per_table(ids, table_idx, custom_scores, custom_tables)
    step = group.advance_clocks()
    use_custom = None
    if custom_scores is not None:
        flags = [True] * group.num_tables if custom_tables is None else list(custom_tables)
        use_custom = torch.tensor(flags, dtype=torch.int64, device=ids.device)
    from torchrec_kvemb.kernels import group_lookup as kernel

    s = group.storage
    return kernel.group_lookup_train_triton(
        group.layout,
        s.keys,
        s.scores,
        s.weights,
        s.state,
        s.counter_keys,
        s.counter_scores,
        s.counts,
        ids,
        table_idx,
        step,
        group.metrics,
        custom_scores,
        use_custom,
    )


def group_lookup_eval(
    group: KVTableGroup, ids: torch.Tensor, table_idx: torch.Tensor
) -> torch.Tensor:
    """A group's evaluation lookup (see ``KVTableGroup.lookup_eval``)."""
    backend = group_backend(group, ids.device)
    if backend == "torch":
        return group.lookup_eval_per_table(ids, table_idx)
    from torchrec_kvemb.kernels import group_lookup as kernel

    return kernel.group_lookup_eval_triton(
        group.layout, group.storage.keys, ids, table_idx, group.metrics
    )


def group_pooled_forward(
    group: KVTableGroup,
    slots: torch.Tensor,
    ids: torch.Tensor,
    table_idx: torch.Tensor,
    bags: Bags,
    bag_list: torch.Tensor,
    missing_as_zero: bool,
) -> torch.Tensor:
    """Pooled rows ``[B, dim]`` of a group's batch (``ops.pooled_lookup.
    group_pooled_forward_torch`` states the result); only the rows of the bags in
    ``bag_list`` (the group's) are meaningful."""
    if use_triton(slots.device):
        from torchrec_kvemb.kernels import group_pooled as kernel

        return kernel.group_pooled_forward_triton(
            group.layout, group.weights, slots, ids, table_idx, bags, bag_list, missing_as_zero
        )
    return group_pooled_forward_torch(
        group.weights, slots, ids, table_idx, bags, group.layout.init_specs, missing_as_zero
    )


def group_fused_backward(
    group: KVTableGroup, lookup: GroupLookup, grad_out: torch.Tensor, bags: Bags
) -> None:
    """Reduce ``grad_out [B, dim]`` per stored row of the group and apply one step of
    each table's optimizer, in place."""
    steps = group.advance_optimizer_steps()
    grad_out = grad_out.to(torch.float32).contiguous()
    slots = lookup.slots
    config = group.optim
    if use_triton(slots.device):
        from torchrec_kvemb.kernels import group_pooled as kernel

        decay = config.weight_decay
        kernel.group_fused_backward_triton(
            group.weights,
            group.state,
            grad_out,
            slots,
            group.table_of(slots),
            bags,
            _OPTIM_CODES[config.kind],
            group.learning_rate_tensor(),
            (1.0 - config.beta1 ** steps.to(torch.float64)).to(torch.float32),
            (1.0 - config.beta2 ** steps.to(torch.float64)).to(torch.float32),
            config.eps,
            config.beta1,
            config.beta2,
            decay,
            bool(decay) and config.weight_decay_mode == WeightDecay.L2,
            bool(decay) and config.weight_decay_mode == WeightDecay.DECOUPLE,
            bool(config.gradient_clipping),
            config.max_gradient,
        )
        return
    lrs = group.learning_rates()
    if fbgemm_supports(config, group.weights) and len(set(lrs)) == 1:
        stored = slots >= 0
        if bags.scale is None and bool(stored.all()):
            fused_backward_fbgemm(
                grad_out, group.weights, group.state, slots, bags.offsets, None, config
            )
            return
        kept = torch.bincount(bags.bag_of[stored], minlength=bags.offsets.numel() - 1)
        offsets = torch.zeros_like(bags.offsets)
        torch.cumsum(kept, 0, out=offsets[1:])
        scale = bags.scale[stored] if bags.scale is not None else None
        fused_backward_fbgemm(
            grad_out, group.weights, group.state, slots[stored], offsets, scale, config
        )
        return
    uniq, grads = group_pooled_backward_torch(grad_out, slots, bags)
    for table, start in zip(group.tables, group.row_offsets, strict=True):
        mine = ((uniq >= start) & (uniq < start + table.capacity)).nonzero().squeeze(1)
        optimizer_update_torch(
            table.weights,
            table.state,
            uniq[mine] - start,
            grads[mine],
            table.optim,
            table.optim_step,
        )


_OPTIM_CODES = {OptimKind.SGD: 0, OptimKind.ROWWISE_ADAGRAD: 1, OptimKind.ADAM: 2}
