"""The routing op: ``torch.ops.kvemb.block_bucketize`` (``block_bucketize_2d`` on
validated inputs, ``ops.block_bucketize.prepare_inputs``).

Kernels: on the CPU, FBGEMM's ``block_bucketize_sparse_features(_2d_weights)``
where it takes the arguments (3x the torch path; tests hold it equal to the torch
path on every case they cover), the torch path otherwise; on CUDA, Triton
(``kernels/block_bucketize.py``). ``weights`` and ``pos`` come back empty where
not asked for (an op's outputs are tensors).

Example::

    out = torch.ops.kvemb.block_bucketize(*inp)   # inp: BucketizeInputs; five tensors
"""

import torch

from torchrec_kvemb.contracts import BucketizeInputs, BucketizeResult
from torchrec_kvemb.library.registry import define
from torchrec_kvemb.ops.block_bucketize import bucketize_prepared_fbgemm, bucketize_prepared_torch

Tensor = torch.Tensor


def _inputs(
    lengths: Tensor,
    indices: Tensor,
    block_sizes: Tensor,
    num_blocks: Tensor,
    feature_ends: Tensor,
    world_size: int,
    weights: Tensor | None,
    bucketize_pos: bool,
    keep_orig_idx: bool,
) -> BucketizeInputs:
    return BucketizeInputs(lengths, indices, block_sizes, num_blocks, feature_ends, world_size,
                           weights, bucketize_pos, keep_orig_idx)  # fmt: skip


def _outputs(result: BucketizeResult, inp: BucketizeInputs) -> tuple[Tensor, ...]:
    weights = result.weights if result.weights is not None else inp.indices.new_empty(0)
    pos = result.pos if result.pos is not None else inp.indices.new_empty(0)
    return result.lengths, result.indices, weights, pos, result.unbucketize_permute


def _bucketize_cpu(
    lengths: Tensor,
    indices: Tensor,
    block_sizes: Tensor,
    num_blocks: Tensor,
    feature_ends: Tensor,
    world_size: int,
    weights: Tensor | None,
    bucketize_pos: bool,
    keep_orig_idx: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    inp = _inputs(lengths, indices, block_sizes, num_blocks, feature_ends, world_size, weights,
                  bucketize_pos, keep_orig_idx)  # fmt: skip
    result = bucketize_prepared_fbgemm(inp)
    return _outputs(result if result is not None else bucketize_prepared_torch(inp), inp)


def _bucketize_cuda(
    lengths: Tensor,
    indices: Tensor,
    block_sizes: Tensor,
    num_blocks: Tensor,
    feature_ends: Tensor,
    world_size: int,
    weights: Tensor | None,
    bucketize_pos: bool,
    keep_orig_idx: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    from torchrec_kvemb.kernels.block_bucketize import block_bucketize_triton

    inp = _inputs(lengths, indices, block_sizes, num_blocks, feature_ends, world_size, weights,
                  bucketize_pos, keep_orig_idx)  # fmt: skip
    return _outputs(block_bucketize_triton(inp), inp)


def _bucketize_fake(
    lengths: Tensor,
    indices: Tensor,
    block_sizes: Tensor,
    num_blocks: Tensor,
    feature_ends: Tensor,
    world_size: int,
    weights: Tensor | None,
    bucketize_pos: bool,
    keep_orig_idx: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    out_weights = torch.empty_like(weights) if weights is not None else indices.new_empty(0)
    pos = torch.empty_like(indices) if bucketize_pos else indices.new_empty(0)
    return (
        lengths.new_empty(world_size * lengths.shape[0]),
        torch.empty_like(indices),
        out_weights,
        pos,
        torch.empty_like(indices),
    )


block_bucketize = define(
    "block_bucketize",
    _bucketize_cpu,
    _bucketize_cuda,
    _bucketize_fake,
    cpu_name="fbgemm (where it takes the arguments) / torch",
)
