"""Integer hashing and initial row values, Triton side.

Bit-for-bit twins of ``torchrec_kvemb/ops/hashing.py``: uint64 arithmetic
wraps modulo 2**64 and shifts on uint64 are logical.
"""

import triton
import triton.language as tl


@triton.jit
def fmix64(x):
    """MurmurHash3's 64-bit finalizer; takes and returns int64 bits."""
    h = x.to(tl.uint64, bitcast=True)
    h = h ^ (h >> 33)
    h = h * 0xFF51AFD7ED558CCD
    h = h ^ (h >> 33)
    h = h * 0xC4CEB9FE1A85EC53
    h = h ^ (h >> 33)
    return h.to(tl.int64, bitcast=True)


@triton.jit
def index_bucket(ids, num_buckets):
    """The index bucket of each id (see ``ops.hashing.index_bucket``)."""
    h = fmix64(ids ^ 0x1B873593A5A5A5A5)
    return (h & 0x7FFFFFFFFFFFFFFF) % num_buckets


@triton.jit
def init_values_any(ids, cols, seed_mix, normal, a, b):
    """Initial values (``ops.hashing.init_rows``) of ids of several tables:
    ``seed_mix``, ``normal`` (a run-time flag) and float64 ``a``, ``b`` are per id,
    rounded as the torch path rounds them (``b - a`` and ``a`` to float32). Values
    of ``ids[:, None]`` x ``cols[None, :]``."""
    base = fmix64(ids ^ seed_mix)
    step = (cols + 1).to(tl.uint64) * 0x9E3779B97F4A7C15
    mixed = base.to(tl.uint64, bitcast=True)[:, None] + step[None, :]
    bits = fmix64(mixed.to(tl.int64, bitcast=True))
    u1 = ((bits >> 40) & 0xFFFFFF).to(tl.float32) * (1.0 / 16777216.0)
    u2 = ((bits >> 16) & 0xFFFFFF).to(tl.float32) * (1.0 / 16777216.0)
    width = (b - a).to(tl.float32)[:, None]
    low = a.to(tl.float32)[:, None]
    uniform = u1 * width + low
    radius = tl.sqrt(-2.0 * tl.log(1.0 - u1))
    gaussian = low + b.to(tl.float32)[:, None] * radius * tl.cos(6.283185307179586 * u2)
    return tl.where((normal != 0)[:, None], gaussian, uniform)
