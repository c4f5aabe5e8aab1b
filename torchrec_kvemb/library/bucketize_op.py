"""The routing op: ``torch.ops.kvemb.block_bucketize`` (``block_bucketize_2d`` on
validated inputs: its arguments are ``contracts.BucketizeInputs``, made by
``ops.block_bucketize.prepare_inputs``).

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
from torchrec_kvemb.library.registry import define, schema
from torchrec_kvemb.ops.block_bucketize import bucketize_prepared_fbgemm, bucketize_prepared_torch

Tensor = torch.Tensor
Outputs = tuple[Tensor, Tensor, Tensor, Tensor, Tensor]


def _outputs(result: BucketizeResult, inp: BucketizeInputs) -> Outputs:
    weights = result.weights if result.weights is not None else inp.indices.new_empty(0)
    pos = result.pos if result.pos is not None else inp.indices.new_empty(0)
    return result.lengths, result.indices, weights, pos, result.unbucketize_permute


def _bucketize_cpu(*args: object) -> Outputs:
    inp = BucketizeInputs(*args)
    result = bucketize_prepared_fbgemm(inp)
    return _outputs(result if result is not None else bucketize_prepared_torch(inp), inp)


def _bucketize_cuda(*args: object) -> Outputs:
    from torchrec_kvemb.kernels.block_bucketize import block_bucketize_triton

    inp = BucketizeInputs(*args)
    return _outputs(block_bucketize_triton(inp), inp)


def _bucketize_fake(*args: object) -> Outputs:
    inp = BucketizeInputs(*args)
    indices = inp.indices
    weights = torch.empty_like(inp.weights) if inp.weights is not None else indices.new_empty(0)
    pos = torch.empty_like(indices) if inp.bucketize_pos else indices.new_empty(0)
    lengths = inp.lengths.new_empty(inp.world_size * inp.lengths.shape[0])
    return lengths, torch.empty_like(indices), weights, pos, torch.empty_like(indices)


block_bucketize = define(
    "block_bucketize",
    _bucketize_cpu,
    _bucketize_cuda,
    _bucketize_fake,
    cpu_name="fbgemm (where it takes the arguments) / torch",
    op_schema=schema(BucketizeInputs, "(Tensor, Tensor, Tensor, Tensor, Tensor)"),
)
