"""Integer hashing and initial row values, torch path.

Every function here has a Triton twin in ``kernels/hashing.py`` that gives the
same bits: 64-bit arithmetic wraps modulo 2**64 and right shifts are logical.
torch has no uint64 arithmetic, so the torch path works on int64 and masks
after each arithmetic shift.
"""

from __future__ import annotations

import math

import torch

from torchrec_kvemb.contracts import (
    FMIX_M1,
    FMIX_M2,
    GOLDEN,
    INDEX_SALT,
    INT64_MAX,
    ROUTE_SALT,
    seed_mix,
    to_signed,
)

__all__ = ["INT64_MAX", "fmix64", "index_bucket", "init_rows", "route_bucket", "seed_mix"]

_M1_S = to_signed(FMIX_M1)
_M2_S = to_signed(FMIX_M2)
_GOLDEN_S = to_signed(GOLDEN)
_MASK31 = (1 << 31) - 1


def _lsr33(x: torch.Tensor) -> torch.Tensor:
    return (x >> 33) & _MASK31


def fmix64(x: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 64-bit finalizer on int64 bits (wrapping arithmetic)."""
    x = x ^ _lsr33(x)
    x = x * _M1_S
    x = x ^ _lsr33(x)
    x = x * _M2_S
    return x ^ _lsr33(x)


def index_bucket(ids: torch.Tensor, num_buckets: int) -> torch.Tensor:
    """The index bucket of each id in a table of ``num_buckets`` buckets."""
    x = ids ^ to_signed(INDEX_SALT)
    _fmix64_(x, torch.empty_like(x))
    return x.bitwise_and_(INT64_MAX).remainder_(num_buckets)


def route_bucket(ids: torch.Tensor, num_buckets: int | torch.Tensor) -> torch.Tensor:
    """The routing bucket (int64) of each id among ``num_buckets``, a count per table
    fixed for the table's life (or one count per id).

    A hash, not ``id % num_buckets``: ids with a stride that is a multiple of
    ``num_buckets`` would all share one bucket, and so one rank. Torch ops on
    any device; it runs once per batch before the all-to-all (no Triton twin).
    """
    x = ids.to(torch.int64) ^ to_signed(ROUTE_SALT)
    _fmix64_(x, torch.empty_like(x))
    return x.bitwise_and_(INT64_MAX).remainder_(num_buckets)


def init_rows(
    ids: torch.Tensor,
    dim: int,
    seed: int,
    normal: bool,
    a: float,
    b: float,
) -> torch.Tensor:
    """Initial rows ``[len(ids), dim]`` float32, a pure function of (id, seed, column).

    ``normal=False``: uniform on [a, b). ``normal=True``: normal with mean ``a`` and
    standard deviation ``b`` (Box-Muller on two 24-bit uniforms of one hash).
    """
    base = fmix64(ids.to(torch.int64) ^ seed_mix(seed))
    cols = torch.arange(1, dim + 1, dtype=torch.int64, device=ids.device) * _GOLDEN_S
    bits = base.unsqueeze(1) + cols.unsqueeze(0)
    tmp = torch.empty_like(bits)
    _fmix64_(bits, tmp)
    torch.bitwise_right_shift(bits, 40, out=tmp)
    u1 = tmp.bitwise_and_(0xFFFFFF).to(torch.float32).mul_(1.0 / (1 << 24))
    if not normal:
        return u1.mul_(b - a).add_(a)
    torch.bitwise_right_shift(bits, 16, out=tmp)
    u2 = tmp.bitwise_and_(0xFFFFFF).to(torch.float32).mul_(1.0 / (1 << 24))
    radius = torch.sqrt(-2.0 * torch.log(1.0 - u1))
    return a + b * radius * torch.cos((2.0 * math.pi) * u2)


def _fmix64_(x: torch.Tensor, tmp: torch.Tensor) -> None:
    """``fmix64`` in place on ``x`` (why: 3x faster on an [n, dim] block than with temporaries)."""
    for multiplier in (_M1_S, _M2_S, None):
        torch.bitwise_right_shift(x, 33, out=tmp)
        x.bitwise_xor_(tmp.bitwise_and_(_MASK31))
        if multiplier is not None:
            x.mul_(multiplier)
