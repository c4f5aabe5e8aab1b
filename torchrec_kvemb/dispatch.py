"""Which implementation runs each op: the one place where a backend is chosen.

``TORCHREC_KVEMB_BACKEND`` (``backend.py``) decides per call, by device:

* CUDA tensors: the Triton kernels (``kernels/``);
* CPU tensors: the native kernels (``csrc/``, ``ops/native.py``) for a group's
  id -> slot work and fused backward, where the library was built; fbgemm's CPU
  kernels where they compute exactly the same thing (``fbgemm_supports``); the
  torch path otherwise, which is also the reference all of them are tested
  against (``TORCHREC_KVEMB_BACKEND=torch`` forces it).

The Triton kernel modules are imported on first use, so that a CPU-only process
never compiles them.
"""

from __future__ import annotations

import torch

from torchrec_kvemb.backend import use_triton
from torchrec_kvemb.contracts import (
    INDEX_SALT,
    ROUTE_SALT,
    Bags,
    BucketizeResult,
    GroupLayout,
    GroupLookup,
    GroupOptimizer,
    InitSpec,
    InsertResult,
    TableStorage,
    to_signed,
)
from torchrec_kvemb.ops import hashing, native
from torchrec_kvemb.ops.block_bucketize import (
    IntsLike,
    bucketize_prepared_fbgemm,
    bucketize_prepared_torch,
    prepare_inputs,
)
from torchrec_kvemb.ops.export_order import export_order_torch
from torchrec_kvemb.ops.insert import insert_torch
from torchrec_kvemb.ops.optimizer_update import (
    fbgemm_supports,
    fused_backward_fbgemm,
    optimizer_update_torch,
)
from torchrec_kvemb.ops.place import bulk_load_torch, place_torch
from torchrec_kvemb.ops.pooled_lookup import (
    group_pooled_backward_torch,
    group_pooled_forward_torch,
    group_rows_forward_torch,
)
from torchrec_kvemb.ops.probe import probe_torch
from torchrec_kvemb.optimizer import OptimKind, WeightDecay
from torchrec_kvemb.options import WAYS


def index_bucket(ids: torch.Tensor, num_buckets: int) -> torch.Tensor:
    """``ops.hashing.index_bucket``: natively on the CPU where the library was built
    (the same bits; why: 7 ms against 150 ms of torch ops for 1M ids)."""
    if native.use_native(ids.device) and ids.dtype == torch.int64 and ids.dim() == 1:
        return native.index_bucket(ids.contiguous(), num_buckets)
    return hashing.index_bucket(ids, num_buckets)


def route_bucket(ids: torch.Tensor, num_buckets: int) -> torch.Tensor:
    """``ops.hashing.route_bucket`` among one bucket count: natively on the CPU where
    the library was built. The native op hashes ``fmix64(x ^ INDEX_SALT)``; for
    ``x = id ^ ROUTE_SALT ^ INDEX_SALT`` that is ``fmix64(id ^ ROUTE_SALT)``, the
    routing hash (the same bits; why: a checkpoint hashes every id it saves or loads,
    110 ms per 1M ids with torch ops)."""
    if native.use_native(ids.device) and ids.dtype == torch.int64 and ids.dim() == 1:
        salted = ids ^ to_signed(ROUTE_SALT ^ INDEX_SALT)
        return native.index_bucket(salted, num_buckets)
    return hashing.route_bucket(ids, num_buckets)


def probe(keys: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Slots ``[n]`` of ``ids`` in the index ``keys``; -1 where absent."""
    if use_triton(ids.device):
        from torchrec_kvemb.kernels import probe as kernel

        return kernel.probe_triton(keys, ids)
    if native.use_native(ids.device) and keys.is_contiguous() and ids.dtype == torch.int64:
        # why native: 0.13-0.18 ms against 0.84-1.15 ms (torch ops, 1 thread) for 20k ids
        # in an index of 2,508 buckets; the same slots (the group probe of one table).
        ids = ids.contiguous()
        one = torch.tensor([keys.shape[0]], dtype=torch.int64)
        table = torch.zeros(ids.numel(), dtype=torch.int64)
        return native.lookup_eval_group(keys, one.new_zeros(1), one, ids, table)[0]
    return probe_torch(keys, ids)


def place(keys: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Absent ``ids`` into the first empty ways of their buckets (``ops/place.py``)."""
    if (
        native.use_native(ids.device)
        and keys.is_contiguous()
        and keys.shape[1] == WAYS
        and ids.dtype == torch.int64
    ):
        # why native: ~5x less time than the dozen torch ops for the SSD tier's
        # 5k demotions a step (0.5 against 2.5 ms, one thread).
        return native.place(keys, ids.contiguous())
    return place_torch(keys, ids)


def bulk_load(
    keys: torch.Tensor, scores: torch.Tensor, ids: torch.Tensor, values: torch.Tensor
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Unique ``ids`` with score ``values`` into an EMPTY index (``ops/place.py``):
    ``(src, slots)``, the input positions that got a slot (``None``: all) and theirs."""
    if (
        native.use_native(ids.device)
        and keys.is_contiguous()
        and scores.is_contiguous()
        and keys.shape[1] == WAYS
        and ids.dtype == torch.int64
        and values.dtype == torch.int64
    ):
        # why native: a counting sort by bucket instead of up to four stable sorts
        # (a checkpoint load plans each table's index this way: 0.13-0.2 s per 1M ids).
        slots = native.bulk_load(keys, scores, ids.contiguous(), values.contiguous())
        if bool((slots >= 0).all()):
            return None, slots
        src = (slots >= 0).nonzero().squeeze(1)
        return src, slots[src]
    return bulk_load_torch(keys, scores, ids, values)


def export_order(
    keys: torch.Tensor, route_buckets: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(ids, slots, counts)``: the ids stored in ``keys`` by routing bucket, then id,
    their slots, and ids per routing bucket (``ops/export_order.py``)."""
    if native.use_native(keys.device) and keys.is_contiguous() and keys.dtype == torch.int64:
        # why native: a counting sort by routing bucket instead of a radix sort of
        # every id (a checkpoint orders each table it saves: 70 ms per 1M ids).
        return native.export_order(keys.view(-1), route_buckets, ROUTE_SALT)
    return export_order_torch(keys, route_buckets)


def scatter_rows(dest: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """``dest.index_copy_(0, slots, rows)`` (rows of a table's arrays at ``slots``)."""
    if (
        native.use_native(dest.device)
        and dest.dtype == rows.dtype == torch.float32
        and dest.dim() == rows.dim() == 2
        and (dest.shape[1] == 1 or dest.stride(1) == 1)
        and (rows.shape[1] == 1 or rows.stride(1) == 1)
        and slots.dtype == torch.int64
    ):
        # why native: destination rows prefetched ahead; index_copy_ waits on each
        # random row's cache misses (a checkpoint load scatters 1.1 GB of rows).
        native.scatter_rows(dest, slots.contiguous(), rows)
        return
    dest.index_copy_(0, slots, rows)


def init_rows(ids: torch.Tensor, dim: int, spec: InitSpec) -> torch.Tensor:
    """Initial rows ``[len(ids), dim]`` of ``ids`` by ``spec`` (``ops.hashing.init_rows``)."""
    if (
        not spec.normal
        and native.use_native(ids.device)
        and ids.dtype == torch.int64
        and ids.dim() == 1
    ):
        # why native: the same bits without the [n, dim] int64 temporaries (~4x faster).
        return native.init_uniform(ids.contiguous(), dim, spec.seed, spec.a, spec.b)
    return hashing.init_rows(ids, dim, spec.seed, spec.normal, spec.a, spec.b)


def insert(
    keys: torch.Tensor,
    scores: torch.Tensor,
    ids: torch.Tensor,
    values: torch.Tensor,
    accumulate: bool,
    keep_existing: bool,
) -> InsertResult:
    """Find-or-insert unique ``ids`` by the ranking rule (``contracts``), in place."""
    if use_triton(ids.device):
        from torchrec_kvemb.kernels import insert as kernel

        return kernel.insert_triton(keys, scores, ids, values, accumulate, keep_existing)
    if (
        native.use_native(ids.device)
        and keys.shape[1] == WAYS
        and keys.is_contiguous()
        and scores.is_contiguous()
        and ids.dtype == torch.int64
        and values.dtype == torch.int64
    ):
        # why native: the torch path ranks full buckets in ~40 tensor ops (~14 ms a
        # step of the SSD-tier benchmark's demotions); the same bits in one pass.
        return native.insert(
            keys, scores, ids.contiguous(), values.contiguous(), accumulate, keep_existing
        )
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
def group_backend(device: torch.device, per_table_only: bool = False) -> str:
    """The backend of a group's lookups: ``"triton"``, ``"native"``, or ``"torch"``
    (the per-table path, which the group runs itself; also for a group that only
    it can serve). The native lookup serves every row dtype, its backward float32
    rows only (``group_fused_backward`` chooses)."""
    if per_table_only:
        return "torch"
    if use_triton(device):
        return "triton"
    if native.use_native(device):
        return "native"
    return "torch"


def workspace(backend: str) -> object | None:
    """Scratch memory a group keeps for ``backend``'s calls (the native kernels')."""
    return native.Workspace() if backend == "native" else None


def group_lookup_train(
    backend: str,
    layout: GroupLayout,
    storage: TableStorage,
    ids: torch.Tensor,
    table_idx: torch.Tensor,
    step: torch.Tensor,
    metrics: torch.Tensor,
    custom_scores: torch.Tensor | None = None,
    use_custom: torch.Tensor | None = None,
    scratch: object | None = None,
) -> GroupLookup:
    """A group's training lookup on ``backend`` (see ``KVTableGroup.lookup_train``);
    ``step [T]``: each table's clock for this batch; counters add to ``metrics``;
    ``scratch``: the group's ``workspace``."""
    s = storage
    if backend == "native":
        counter = None
        if layout.has_admission:
            counter = native.CounterIndex(s.counter_keys, s.counter_scores, s.counts)
        out = native.lookup_train_group(
            layout,
            s.keys,
            s.scores,
            s.weights,
            s.state,
            ids,
            table_idx,
            step,
            custom_scores,
            use_custom,
            counter,
            num_threads=torch.get_num_threads(),
            workspace=scratch,
        )
        metrics[:, : out.metrics.shape[1]] += out.metrics
        return GroupLookup(out.slots, out.unique_index, out.unique_slots, out.unique_table)
    from torchrec_kvemb.kernels import group_lookup as kernel

    return kernel.group_lookup_train_triton(
        layout,
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
        metrics,
        custom_scores,
        use_custom,
    )


def group_lookup_eval(
    backend: str,
    layout: GroupLayout,
    storage: TableStorage,
    ids: torch.Tensor,
    table_idx: torch.Tensor,
    metrics: torch.Tensor,
) -> torch.Tensor:
    """A group's evaluation lookup on ``backend`` (see ``KVTableGroup.lookup_eval``)."""
    if backend == "native":
        slots, hits = native.lookup_eval_group(
            storage.keys,
            layout.bucket_offset,
            layout.num_buckets,
            ids,
            table_idx,
            num_threads=torch.get_num_threads(),
        )
        T = layout.num_tables
        seen = torch.zeros(T + 1, dtype=torch.int64)
        seen.index_add_(0, torch.where(table_idx >= 0, table_idx, T), torch.ones_like(ids))
        metrics[:, 0] += hits
        metrics[:, 1] += seen[:T] - hits
        return slots
    from torchrec_kvemb.kernels import group_lookup as kernel

    return kernel.group_lookup_eval_triton(layout, storage.keys, ids, table_idx, metrics)


def group_pooled_forward(
    layout: GroupLayout,
    weights: torch.Tensor,
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
            layout, weights, slots, ids, table_idx, bags, bag_list, missing_as_zero
        )
    return group_pooled_forward_torch(
        weights, slots, ids, table_idx, bags, layout.init_specs, missing_as_zero
    )


def group_rows_forward(
    layout: GroupLayout,
    weights: torch.Tensor,
    slots: torch.Tensor,
    ids: torch.Tensor,
    table_idx: torch.Tensor,
    bags: Bags,
    missing_as_zero: bool,
) -> torch.Tensor:
    """One row per id ``[n, dim]`` of a group's batch whose every id is a bag of its
    own (``bags``), unpooled: a sequence lookup's forward."""
    if use_triton(slots.device):
        from torchrec_kvemb.kernels import group_pooled as kernel

        return kernel.group_pooled_forward_triton(
            layout, weights, slots, ids, table_idx, bags, bags.bag_of, missing_as_zero
        )
    return group_rows_forward_torch(
        weights, slots, ids, table_idx, layout.init_specs, missing_as_zero
    )


def group_fused_backward(
    storage: TableStorage,
    optim: GroupOptimizer,
    lookup: GroupLookup,
    grad_out: torch.Tensor,
    bags: Bags,
    scratch: object | None = None,
) -> None:
    """Reduce ``grad_out [B, dim]`` per stored row of the group and apply one step of
    each table's optimizer (``optim``), in place."""
    grad_out = grad_out.to(torch.float32).contiguous()
    slots = lookup.slots
    config = optim.config
    weights, state = storage.weights, storage.state
    native_rows = weights.dtype == torch.float32  # the native backward's rows
    if lookup.unique_index is not None and native_rows and native.use_native(slots.device):
        native.fused_backward_group(
            weights,
            state,
            grad_out,
            bags.offsets,
            lookup.unique_index,
            lookup.unique_slots,
            lookup.unique_table,
            config,
            learning_rate=[c.learning_rate for c in optim.configs],
            optim_step=list(optim.steps),
            per_sample_weights=bags.scale,
            num_threads=torch.get_num_threads(),
            workspace=scratch,
        )
        return
    if use_triton(slots.device):
        from torchrec_kvemb.kernels import group_pooled as kernel

        decay = config.weight_decay
        steps = optim.device_steps.to(torch.float64)
        kernel.group_fused_backward_triton(
            weights,
            state,
            grad_out,
            slots,
            optim.table_of(slots),
            bags,
            _OPTIM_CODES[config.kind],
            optim.learning_rates,
            (1.0 - config.beta1**steps).to(torch.float32),
            (1.0 - config.beta2**steps).to(torch.float32),
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
    lrs = {c.learning_rate for c in optim.configs}
    if fbgemm_supports(config, weights) and len(lrs) == 1:
        stored = slots >= 0
        if bags.scale is None and bool(stored.all()):
            fused_backward_fbgemm(grad_out, weights, state, slots, bags.offsets, None, config)
            return
        kept = torch.bincount(bags.bag_of[stored], minlength=bags.offsets.numel() - 1)
        offsets = torch.zeros_like(bags.offsets)
        torch.cumsum(kept, 0, out=offsets[1:])
        scale = bags.scale[stored] if bags.scale is not None else None
        fused_backward_fbgemm(grad_out, weights, state, slots[stored], offsets, scale, config)
        return
    uniq, grads = group_pooled_backward_torch(grad_out, slots, bags)
    table = optim.table_of(uniq)
    for t, (table_config, step) in enumerate(zip(optim.configs, optim.steps, strict=True)):
        mine = (table == t).nonzero().squeeze(1)
        optimizer_update_torch(weights, state, uniq[mine], grads[mine], table_config, step)


_OPTIM_CODES = {OptimKind.SGD: 0, OptimKind.ROWWISE_ADAGRAD: 1, OptimKind.ADAM: 2}
