"""The ops as the rest of the package calls them: the registered ops
(``torch.ops.kvemb.*``, ``library/``), or the torch path.

``backend.implementation`` (the one backend decision) says, per device, whether
the registered ops run (PyTorch's dispatcher then picks their kernel by device:
native C++ on the CPU, Triton on CUDA) or the torch path (``ops/``: the
reference). With ``TORCHREC_KVEMB_BACKEND=triton`` on CPU tensors, an op's CUDA
kernel is called directly and runs in Triton's interpreter. Each function here
normalizes its inputs (contiguous int64 ids) and calls that one implementation.

The Triton kernel modules are imported on first use, so that a CPU-only process
never compiles them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import is_in_torch_dispatch_mode

from torchrec_kvemb import library
from torchrec_kvemb.backend import implementation
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
from torchrec_kvemb.ops import hashing
from torchrec_kvemb.ops.block_bucketize import (
    IntsLike,
    bucketize_prepared_torch,
    prepare_inputs,
)
from torchrec_kvemb.ops.export_order import export_order_torch
from torchrec_kvemb.ops.host_exchange import host_exchange_torch
from torchrec_kvemb.ops.insert import insert_torch
from torchrec_kvemb.ops.optimizer_update import clip_output_gradient, optimizer_update_torch
from torchrec_kvemb.ops.place import bulk_load_torch, place_torch
from torchrec_kvemb.ops.pooled_lookup import (
    group_pooled_backward_torch,
    group_pooled_forward_torch,
    group_rows_forward_torch,
)
from torchrec_kvemb.ops.probe import probe_torch


def registered(name: str, device: torch.device | str) -> Callable[..., Any] | None:
    """What runs ``kvemb::name`` on ``device``'s tensors: the registered op (the
    dispatcher picks its kernel), its CUDA kernel called directly (Triton forced on
    other tensors: the interpreter), or None where the torch path runs."""
    impl = implementation(device)
    if impl == "torch":
        return None
    if impl == "triton" and torch.device(device).type != "cuda":
        return library.cuda_kernel(name)
    if torch.device(device).type == "cpu" and not torch.compiler.is_compiling():
        return _eager_cpu_op(name)
    return getattr(torch.ops.kvemb, name)


@functools.cache
def _eager_cpu_op(name: str) -> Callable[..., Any]:
    """``kvemb::name`` on CPU tensors: its CPU kernel called directly where the
    dispatcher would just run it (``_plain_eager_cpu``: plain tensors, eager, no
    mode active; the profiler still names the op, and the arguments it writes get
    their version bumped as the op's in-place layer does), else the op. Why: a
    ``custom_op``'s Python layers cost about 150-190 us a call on top of the
    kernel (a tiered training step makes a dozen small calls: docs/native.md)."""
    op = getattr(torch.ops.kvemb, name)
    kernel = _traced_cpu_kernel(name)
    writes = tuple(
        i for i, a in enumerate(op.default._schema.arguments)
        if a.alias_info is not None and a.alias_info.is_write
    )  # fmt: skip

    def run(*args: Any, **kwargs: Any) -> Any:
        if kwargs or not _plain_eager_cpu(*args):
            return op(*args, **kwargs)
        out = kernel(*args)
        for i in writes:
            if i < len(args) and isinstance(args[i], torch.Tensor):
                torch.autograd.graph.increment_version(args[i])
        return out

    run.op = op  # type: ignore[attr-defined]
    return run


def _ids64(ids: torch.Tensor) -> bool:
    return ids.dtype == torch.int64 and ids.dim() == 1


def index_bucket(ids: torch.Tensor, num_buckets: int) -> torch.Tensor:
    """``ops.hashing.index_bucket`` (natively on the CPU: the same bits; why: 7 ms
    against 150 ms of torch ops for 1M ids)."""
    op = registered("index_bucket", ids.device)
    if op is not None and _ids64(ids):
        return op(ids.contiguous(), num_buckets)
    return hashing.index_bucket(ids, num_buckets)


def route_bucket(ids: torch.Tensor, num_buckets: int) -> torch.Tensor:
    """``ops.hashing.route_bucket`` among one bucket count. The index hash is
    ``fmix64(x ^ INDEX_SALT)``; for ``x = id ^ ROUTE_SALT ^ INDEX_SALT`` that is
    ``fmix64(id ^ ROUTE_SALT)``, the routing hash (the same bits; why: a checkpoint
    hashes every id it saves or loads, 110 ms per 1M ids with torch ops)."""
    op = registered("index_bucket", ids.device)
    if op is not None and _ids64(ids):
        return op(ids ^ to_signed(ROUTE_SALT ^ INDEX_SALT), num_buckets)
    return hashing.route_bucket(ids, num_buckets)


def probe(keys: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Slots ``[n]`` of ``ids`` in the index ``keys``; -1 where absent."""
    op = registered("probe", ids.device)
    if op is None:
        return probe_torch(keys, ids)
    # why native on the CPU: 0.13-0.18 ms against 0.84-1.15 ms (torch ops, 1 thread)
    # for 20k ids in an index of 2,508 buckets.
    return op(keys.contiguous(), ids.to(torch.int64).contiguous())


def place(keys: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Absent ``ids`` into the first empty ways of their buckets (``ops/place.py``)."""
    op = registered("place", ids.device)
    if op is None:
        return place_torch(keys, ids)
    # why native on the CPU: ~5x less time than the dozen torch ops for the SSD
    # tier's 5k demotions a step (0.5 against 2.5 ms, one thread).
    return op(keys, ids.to(torch.int64).contiguous())


def bulk_load(
    keys: torch.Tensor, scores: torch.Tensor, ids: torch.Tensor, values: torch.Tensor
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Unique ``ids`` with score ``values`` into an EMPTY index (``ops/place.py``):
    ``(src, slots)``, the input positions that got a slot (``None``: all) and theirs."""
    op = registered("bulk_load", ids.device)
    if op is None:
        return bulk_load_torch(keys, scores, ids, values)
    # why native on the CPU: a counting sort by bucket instead of up to four stable
    # sorts (a checkpoint load plans each table's index this way: 0.13-0.2 s per 1M ids).
    slots = op(keys, scores, ids.to(torch.int64).contiguous(), values.to(torch.int64).contiguous())
    if bool((slots >= 0).all()):
        return None, slots
    src = (slots >= 0).nonzero().squeeze(1)
    return src, slots[src]


def export_order(
    keys: torch.Tensor, route_buckets: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(ids, slots, counts)``: the ids stored in ``keys`` by routing bucket, then id,
    their slots, and ids per routing bucket (``ops/export_order.py``)."""
    op = registered("export_order", keys.device)
    if op is None:
        return export_order_torch(keys, route_buckets)
    # why native on the CPU: a counting sort by routing bucket instead of a radix sort
    # of every id (a checkpoint orders each table it saves: 70 ms per 1M ids).
    return op(keys.contiguous(), route_buckets)


def scatter_rows(dest: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """``dest.index_copy_(0, slots, rows)`` (rows of a table's arrays at ``slots``)."""
    op = registered("scatter_rows", dest.device)
    if op is None:
        dest.index_copy_(0, slots, rows)
        return
    op(dest, slots.to(torch.int64).contiguous(), rows)


def gather_rows(src: torch.Tensor, slots: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``torch.index_select(src, 0, slots, out=out)`` (rows of a table's or a tier's
    arrays at ``slots``; ``out`` may be a column block of a wider buffer)."""
    op = registered("gather_rows", src.device)
    if op is None:
        return torch.index_select(src, 0, slots, out=out)
    op(src, slots.to(torch.int64).contiguous(), out)
    return out


def host_exchange(*args: torch.Tensor) -> None:
    """A host tier's row exchange (the arguments of ``library.tier_ops.ExchangeArgs``;
    ``ops/host_exchange.py`` says what it writes): natively on the CPU."""
    op = registered("host_exchange", args[0].device)
    if op is None:
        host_exchange_torch(*args)
        return
    op(*args)


def init_rows(ids: torch.Tensor, dim: int, spec: InitSpec) -> torch.Tensor:
    """Initial rows ``[len(ids), dim]`` of ``ids`` by ``spec`` (``ops.hashing.init_rows``)."""
    op = registered("init_rows", ids.device)
    if op is None or not _ids64(ids) or spec.first_col:  # column shards: the torch path
        return hashing.init_rows(ids, dim, spec.seed, spec.normal, spec.a, spec.b, spec.first_col)
    return op(ids.contiguous(), dim, spec.seed, spec.normal, spec.a, spec.b)


def insert(
    keys: torch.Tensor,
    scores: torch.Tensor,
    ids: torch.Tensor,
    values: torch.Tensor,
    accumulate: bool,
    keep_existing: bool,
) -> InsertResult:
    """Find-or-insert unique ``ids`` by the ranking rule (``contracts``), in place."""
    op = registered("insert", ids.device)
    if op is None:
        return insert_torch(keys, scores, ids, values, accumulate, keep_existing)
    # why native on the CPU: the torch path ranks full buckets in ~40 tensor ops
    # (~14 ms a step of the SSD-tier benchmark's demotions); the same bits in one pass.
    ids = ids.to(torch.int64).contiguous()
    values = values.to(scores.dtype).contiguous()
    return InsertResult(*op(keys, scores, ids, values, accumulate, keep_existing))


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
    op = registered("block_bucketize", indices.device)
    if op is None:
        return bucketize_prepared_torch(inp)
    lengths, indices, weights, pos, permute = op(*inp)
    return BucketizeResult(
        lengths,
        indices,
        weights if inp.weights is not None else None,
        pos if inp.bucketize_pos else None,
        permute,
    )


# -------------------------------------------------------------- grouped ops
def group_lookup_train(
    layout: GroupLayout,
    storage: TableStorage,
    ids: torch.Tensor,
    table_idx: torch.Tensor,
    step: torch.Tensor,
    metrics: torch.Tensor,
    custom_scores: torch.Tensor | None = None,
    use_custom: torch.Tensor | None = None,
) -> GroupLookup:
    """A group's training lookup by ``kvemb::lookup_train_group`` (see
    ``KVTableGroup.lookup_train``; the torch path is the group's own, table by table):
    ``step [T]``: each table's clock, advanced by one for this batch; counters add to
    ``metrics``."""
    op = registered("lookup_train_group", ids.device)
    if op is None:
        raise RuntimeError("group_lookup_train: the torch path looks a group up table by table")
    out = op(
        *storage, *layout.tensors(), layout.has_admission, layout.has_normal,
        ids, table_idx, step, metrics, custom_scores, use_custom,
    )  # fmt: skip
    return GroupLookup(*out)


def group_lookup_eval(
    layout: GroupLayout,
    storage: TableStorage,
    ids: torch.Tensor,
    table_idx: torch.Tensor,
    metrics: torch.Tensor,
) -> torch.Tensor:
    """A group's evaluation lookup by ``kvemb::lookup_eval_group`` (see
    ``KVTableGroup.lookup_eval``); hits and misses add to ``metrics``."""
    op = registered("lookup_eval_group", ids.device)
    if op is None:
        raise RuntimeError("group_lookup_eval: the torch path looks a group up table by table")
    return op(storage.keys, layout.bucket_offset, layout.num_buckets, ids, table_idx, metrics)


def group_pooled_eval(
    layout: GroupLayout,
    storage: TableStorage,
    ids: torch.Tensor,
    offsets: torch.Tensor | None,
    table_of_bag: torch.Tensor,
    per_sample_weights: torch.Tensor | None,
    mean_of_bag: torch.Tensor | None,
    bag_list: torch.Tensor,
    out_offset: torch.Tensor | None,
    out_shape: tuple[int, int],
    metrics: torch.Tensor,
    unpooled: bool = False,
    into: torch.Tensor | None = None,
) -> torch.Tensor:
    """A group's evaluation batch, probed and pooled by ``kvemb::pooled_eval_group``
    (see ``KVTableGroup.pooled_eval``); hits and misses add to ``metrics``. ``into``:
    memory the output may be written into, where the CPU kernel runs directly (an
    op's output cannot be an input); the result is the returned tensor."""
    op = registered("pooled_eval_group", ids.device)
    if op is None:
        raise RuntimeError("group_pooled_eval: the torch path is KVTableGroup.pooled_eval's own")
    args = (
        storage.keys, layout.bucket_offset, layout.num_buckets, storage.weights, ids, offsets,
        table_of_bag, per_sample_weights, mean_of_bag, bag_list, out_offset, *out_shape,
        *_init_tensors(layout), metrics, unpooled,
    )  # fmt: skip
    if getattr(op, "op", None) is torch.ops.kvemb.pooled_eval_group and _plain_eager_cpu(*args):
        return _traced_cpu_kernel("pooled_eval_group")(*args, into=into)
    return op(*args)


def _plain_eager_cpu(*args: Any) -> bool:
    """Whether the dispatcher, given these arguments, would just run the op's CPU
    kernel: plain CPU tensors, eager, no dispatch or function mode active."""
    if (
        torch.compiler.is_compiling()
        or is_in_torch_dispatch_mode()
        or torch._C._is_torch_function_mode_enabled()
    ):
        return False
    return all(
        type(a) is torch.Tensor and a.device.type == "cpu"
        for a in args
        if isinstance(a, torch.Tensor)
    )


def _traced_cpu_kernel(name: str) -> Callable[..., Any]:
    """``kvemb::name``'s CPU kernel, called directly (``_plain_eager_cpu``) and named
    in the profiler as the op. Why: a ``custom_op``'s Python layers (autograd,
    ADInplaceOrView, the defaults) cost 190 us a call on top of the kernel's own 43
    (a sequence eval step of 4 keys makes 4 calls)."""
    kernel = library.cpu_kernel(name)

    def run(*args: Any, **kwargs: Any) -> Any:
        if not torch.autograd.profiler._is_profiler_enabled:
            return kernel(*args, **kwargs)
        with torch.profiler.record_function(f"{library.NAMESPACE}::{name}"):
            return kernel(*args, **kwargs)

    return run


def _init_tensors(layout: GroupLayout) -> tuple[torch.Tensor, ...]:
    return (
        layout.seed, layout.seed_mix, layout.init_normal, layout.init_a, layout.init_b,
        layout.init_col,
    )  # fmt: skip


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
    op = registered("pooled_forward", slots.device)
    if op is None:
        return group_pooled_forward_torch(
            weights, slots, ids, table_idx, bags, layout.init_specs, missing_as_zero
        )
    return op(
        weights, slots, ids, table_idx, bags.offsets, bags.bag_of, bags.scale, bag_list,
        *_init_tensors(layout), missing_as_zero,
    )  # fmt: skip


def group_rows_forward(
    layout: GroupLayout,
    weights: torch.Tensor,
    slots: torch.Tensor,
    ids: torch.Tensor,
    table_idx: torch.Tensor,
    missing_as_zero: bool,
) -> torch.Tensor:
    """One row per id ``[n, dim]`` of a group's batch, unpooled (ids of another
    group's tables get zeros): a sequence lookup's forward."""
    op = registered("rows_forward", slots.device)
    if op is None:
        return group_rows_forward_torch(
            weights, slots, ids, table_idx, layout.init_specs, missing_as_zero
        )
    return op(weights, slots, ids, table_idx, *_init_tensors(layout), missing_as_zero)


def group_fused_backward(
    storage: TableStorage,
    optim: GroupOptimizer,
    lookup: GroupLookup,
    grad_out: torch.Tensor,
    bags: Bags,
) -> None:
    """Reduce ``grad_out [B, dim]`` (or ``[G, B, dim]``) per stored row of the group and
    apply one step of each table's optimizer (``optim``), in place. A lookup made by
    the registered ops (its unique rows given) is reduced by ``kvemb::fused_backward``,
    one of the torch path by the torch path.

    Gradient clipping clamps ``grad_out`` itself, bag by bag (id by id for a
    sequence lookup), before it reaches the rows, as FBGEMM's TBE clamps the
    gradient of its output (``clip_output_gradient``; the kernels as they read it)."""
    weights, state = storage.weights, storage.state
    if lookup.unique_index is None:
        grad_out = clip_output_gradient(grad_out, optim.config)
        _fused_backward_torch(weights, state, optim, lookup.slots, grad_out, bags)
        return
    op = registered("fused_backward", weights.device)
    if op is None:
        raise RuntimeError(
            "group_fused_backward: a lookup of the registered ops under the torch path "
            "(TORCHREC_KVEMB_BACKEND changed between forward and backward?)"
        )
    config = optim.config
    grad = grad_out.to(torch.float32).contiguous()
    op(
        weights, state, grad, bags.offsets, bags.bag_of, bags.scale,
        lookup.slots, lookup.unique_index, lookup.unique_slots, lookup.unique_table,
        optim.learning_rates, optim.steps, config.kind.code,
        config.eps, config.beta1, config.beta2, config.weight_decay,
        int(config.weight_decay_mode), config.gradient_clipping, config.max_gradient,
    )  # fmt: skip


def _fused_backward_torch(
    weights: torch.Tensor,
    state: torch.Tensor,
    optim: GroupOptimizer,
    slots: torch.Tensor,
    grad_out: torch.Tensor,
    bags: Bags,
) -> None:
    """The torch path of ``group_fused_backward``: the gradient of each stored row
    (``ops/pooled_lookup.py``), then each table's optimizer step on its rows."""
    grad = grad_out.to(torch.float32)
    if grad.dim() == 3:  # [G, B, dim]: bag b at [b // B, b % B]
        grad = grad.reshape(-1, grad.shape[2])
    uniq, grads = group_pooled_backward_torch(grad.contiguous(), slots, bags)
    table = optim.table_of(uniq)
    steps = optim.steps.add_(1).tolist()
    rates = optim.learning_rates.tolist()
    for t, config in enumerate(optim.configs):
        mine = (table == t).nonzero().squeeze(1)
        config = config.with_learning_rate(rates[t])
        optimizer_update_torch(weights, state, uniq[mine], grads[mine], config, steps[t])
