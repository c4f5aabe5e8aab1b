"""2-D block bucketization: route each id (and its weight row) to the rank that owns it.

The semantics are those of FBGEMM's ``block_bucketize_sparse_features`` and
``block_bucketize_sparse_features_2d_weights`` with ``sequence=True``. For an id
``x`` of feature ``t`` with block size ``s = block_sizes[t]``, ``G`` blocks in all
(``total_num_blocks[t]``, or ``world_size`` when not given) and ``G // world_size``
blocks per rank:

* ``x < s * G``: owner ``x // (s * G // world_size)``, new id ``x % (s * G // world_size)``;
* ``x >= s * G``: owner ``(x % G) // (G // world_size)``, new id ``x // G``.

``keep_orig_idx=True`` keeps ``x`` as the new id. Within one (rank, bag) the ids keep
their original order; the output bags are ordered rank-major: all bags of rank 0,
then all bags of rank 1, and so on.
"""

from __future__ import annotations

from collections.abc import Sequence

import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm: the CPU fast path and oracle)
import torch

from torchrec_kvemb.contracts import BucketizeInputs, BucketizeResult

__all__ = ["block_bucketize_2d_torch", "bucketize_prepared_torch", "prepare_inputs"]

IntsLike = torch.Tensor | Sequence[int]


_INDEX_DTYPES = (torch.int32, torch.int64)


def _int_vector(value: IntsLike, name: str, num: int, device: torch.device) -> torch.Tensor:
    """``value`` as an int64 vector of ``num`` entries on ``device``."""
    if isinstance(value, torch.Tensor):
        if value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
            raise TypeError(f"{name} must hold integers, got dtype {value.dtype}")
        if value.dim() != 1:
            raise ValueError(f"{name} must be 1-D, got shape {tuple(value.shape)}")
        out = value.to(device=device, dtype=torch.int64)
    else:
        out = torch.tensor(list(value), dtype=torch.int64, device=device)
    if out.numel() != num:
        raise ValueError(
            f"{name} has {out.numel()} entries but block_sizes has {num} (one per feature)"
        )
    return out


def prepare_inputs(
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
) -> BucketizeInputs:
    """Check the arguments of ``block_bucketize_2d`` and normalize them."""
    if not isinstance(lengths, torch.Tensor) or not isinstance(indices, torch.Tensor):
        raise TypeError("lengths and indices must be tensors")
    if indices.dtype not in _INDEX_DTYPES:
        raise TypeError(f"indices must be int32 or int64, got {indices.dtype}")
    if lengths.dtype not in _INDEX_DTYPES:
        raise TypeError(f"lengths must be int32 or int64, got {lengths.dtype}")
    if indices.dim() != 1 or lengths.dim() != 1:
        raise ValueError(
            f"lengths and indices must be 1-D, got shapes {tuple(lengths.shape)} "
            f"and {tuple(indices.shape)}"
        )
    if lengths.device != indices.device:
        raise ValueError(f"lengths is on {lengths.device} but indices is on {indices.device}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    device = indices.device
    num_ids = indices.numel()
    num_bags = lengths.numel()

    if isinstance(block_sizes, torch.Tensor) and block_sizes.dim() != 1:
        raise ValueError(f"block_sizes must be 1-D, got shape {tuple(block_sizes.shape)}")
    num_features = (
        block_sizes.numel() if isinstance(block_sizes, torch.Tensor) else len(block_sizes)
    )
    if num_features == 0:
        raise ValueError("block_sizes is empty: need one block size per feature")
    sizes = _int_vector(block_sizes, "block_sizes", num_features, device)
    if bool((sizes < 0).any()):
        raise ValueError(f"block_sizes must be >= 0, got {sizes.tolist()}")

    if total_num_blocks is None:
        num_blocks = torch.full((num_features,), world_size, dtype=torch.int64, device=device)
    else:
        num_blocks = _int_vector(total_num_blocks, "total_num_blocks", num_features, device)
        if bool(((num_blocks < 1) | (num_blocks % world_size != 0)).any()):
            raise ValueError(
                f"total_num_blocks must be positive multiples of world_size={world_size}, "
                f"got {num_blocks.tolist()}"
            )
    # fbgemm computes block_size * num_blocks in the id dtype; beyond it, it wraps around.
    limit = torch.iinfo(indices.dtype).max
    if bool((sizes > limit // num_blocks).any()):
        raise ValueError(
            f"block_sizes * total_num_blocks must fit in {indices.dtype}; got block_sizes="
            f"{sizes.tolist()}, total_num_blocks={num_blocks.tolist()}"
        )

    if batch_size_per_feature is None:
        if max_batch_size is not None:
            raise ValueError("max_batch_size only applies together with batch_size_per_feature")
        if num_bags % num_features != 0:
            raise ValueError(
                f"lengths has {num_bags} entries, not a multiple of the {num_features} features "
                "(pass batch_size_per_feature for a variable batch size)"
            )
        batch_sizes = torch.full(
            (num_features,), num_bags // num_features, dtype=torch.int64, device=device
        )
    else:
        batch_sizes = _int_vector(
            batch_size_per_feature, "batch_size_per_feature", num_features, device
        )
        if bool((batch_sizes < 0).any()):
            raise ValueError(f"batch_size_per_feature must be >= 0, got {batch_sizes.tolist()}")
        if int(batch_sizes.sum()) != num_bags:
            raise ValueError(
                f"batch_size_per_feature sums to {int(batch_sizes.sum())} but lengths has "
                f"{num_bags} entries"
            )
        if max_batch_size is not None and max_batch_size < int(batch_sizes.max()):
            raise ValueError(
                f"max_batch_size={max_batch_size} is below the largest batch size "
                f"{int(batch_sizes.max())}"
            )

    if num_bags and bool((lengths < 0).any()):
        raise ValueError("lengths must be >= 0")
    total = int(lengths.sum()) if num_bags else 0
    if total != num_ids:
        raise ValueError(f"lengths sum to {total} but indices has {num_ids} ids")
    if num_ids and bool((indices < 0).any()):
        raise ValueError("indices must be >= 0 (ids are non-negative)")

    if weights is not None:
        if not isinstance(weights, torch.Tensor):
            raise TypeError("weights must be a tensor or None")
        if weights.device != device:
            raise ValueError(f"weights is on {weights.device} but indices is on {device}")
        if weights.is_complex():
            raise TypeError(f"weights must be real, got {weights.dtype}")
        if weights.dim() not in (1, 2) or weights.shape[0] != num_ids:
            raise ValueError(
                f"weights must be [N] or [N, k] with N={num_ids} (one row per id), "
                f"got shape {tuple(weights.shape)}"
            )
        weights = weights.contiguous()

    return BucketizeInputs(
        lengths=lengths.contiguous(),
        indices=indices.contiguous(),
        block_sizes=sizes,
        num_blocks=num_blocks,
        feature_ends=torch.cumsum(batch_sizes, 0),
        world_size=world_size,
        weights=weights,
        bucketize_pos=bool(bucketize_pos),
        keep_orig_idx=bool(keep_orig_idx),
    )


def bucketize_prepared_torch(inp: BucketizeInputs) -> BucketizeResult:
    """The vectorized torch implementation over validated inputs."""
    lengths, indices = inp.lengths, inp.indices
    device = indices.device
    num_ids = indices.numel()
    num_bags = lengths.numel()
    world_size = inp.world_size

    lengths64 = lengths.to(torch.int64)
    positions = torch.arange(num_ids, device=device)
    bag = torch.repeat_interleave(
        torch.arange(num_bags, device=device), lengths64, output_size=num_ids
    )
    # Ids are feature-major: spread each feature's constants over its run of ids.
    bag_ends = torch.cumsum(lengths64, 0)
    feature_id_ends = torch.cat([bag_ends.new_zeros(1), bag_ends])[inp.feature_ends]
    ids_per_feature = torch.diff(feature_id_ends, prepend=feature_id_ends.new_zeros(1))
    block_size = torch.repeat_interleave(inp.block_sizes, ids_per_feature, output_size=num_ids)
    global_blocks = torch.repeat_interleave(inp.num_blocks, ids_per_feature, output_size=num_ids)
    local_blocks = global_blocks // world_size

    ids = indices.to(torch.int64)
    # A block size of 0 sends every id down the modulo branch; clamping keeps `//` defined.
    local_range = (block_size * local_blocks).clamp_min(1)
    in_range = ids < block_size * global_blocks
    block_quot = ids // local_range
    wrap_quot = ids // global_blocks
    wrap_rem = ids - wrap_quot * global_blocks
    owner = torch.where(in_range, block_quot, wrap_rem // local_blocks)
    if inp.keep_orig_idx:
        new_ids = ids
    else:
        new_ids = torch.where(in_range, ids - block_quot * local_range, wrap_quot)

    new_lengths = torch.bincount(owner * num_bags + bag, minlength=world_size * num_bags)
    # Input ids are already in bag order, so a stable sort by owner alone yields the
    # (owner, bag, original position) order of the output.
    order = torch.sort(owner, stable=True).indices
    permute = torch.empty_like(order)
    permute[order] = positions

    pos = None
    if inp.bucketize_pos:
        bag_starts = bag_ends - lengths64
        pos = (positions - bag_starts[bag])[order].to(indices.dtype)
    weights = None if inp.weights is None else inp.weights.index_select(0, order)
    return BucketizeResult(
        lengths=new_lengths.to(lengths.dtype),
        indices=new_ids[order].to(indices.dtype),
        weights=weights,
        pos=pos,
        unbucketize_permute=permute.to(indices.dtype),
    )


def block_bucketize_2d_torch(
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
    """``block_bucketize_2d`` on the vectorized torch path, whatever the device."""
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
    return bucketize_prepared_torch(inp)


def bucketize_prepared_fbgemm(inp: BucketizeInputs) -> BucketizeResult | None:
    """fbgemm's CPU op on validated inputs (3x the torch path); ``None`` where it can't.

    The tests hold it equal to ``bucketize_prepared_torch`` on every case they cover.
    """
    weights = inp.weights
    if not hasattr(torch.ops.fbgemm, "block_bucketize_sparse_features"):
        return None
    if (
        weights is not None
        and weights.dim() == 1
        and weights.dtype
        not in (
            torch.float32,
            torch.float64,
        )
    ):
        return None
    if weights is not None and weights.dim() == 2 and weights.shape[1] == 0:
        return None
    idx_dtype = inp.indices.dtype
    batch_sizes = torch.diff(inp.feature_ends, prepend=inp.feature_ends.new_zeros(1))
    variable = batch_sizes.numel() > 0 and bool((batch_sizes != batch_sizes[0]).any())
    common = dict(
        batch_size_per_feature=batch_sizes.to(inp.lengths.dtype) if variable else None,
        max_B=int(batch_sizes.max()) if variable else -1,
        keep_orig_idx=inp.keep_orig_idx,
        total_num_blocks=inp.num_blocks.to(idx_dtype),
    )
    args = (
        inp.lengths,
        inp.indices,
        inp.bucketize_pos,
        True,
        inp.block_sizes.to(idx_dtype),
        inp.world_size,
    )
    if weights is not None and weights.dim() == 2:
        out = torch.ops.fbgemm.block_bucketize_sparse_features_2d_weights(
            *args, weights, weights_dim=weights.shape[1], **common
        )
    else:
        out = torch.ops.fbgemm.block_bucketize_sparse_features(*args, weights=weights, **common)
    return BucketizeResult(*out)
