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
def erfinv_f32(x):
    """``erfinv`` on float32 for |x| <= 1 (M. Giles, "Approximating the erfinv
    function", GPU Computing Gems Jade, 2011: two polynomials in ``w = -log(1 - x^2)``;
    a few units in the last place of float32). Triton has no erfinv of its own."""
    w = -tl.log((1.0 - x) * (1.0 + x))
    c = w - 2.5
    central = 2.81022636e-08
    central = 3.43273939e-07 + central * c
    central = -3.5233877e-06 + central * c
    central = -4.39150654e-06 + central * c
    central = 0.00021858087 + central * c
    central = -0.00125372503 + central * c
    central = -0.00417768164 + central * c
    central = 0.246640727 + central * c
    central = 1.50140941 + central * c
    t = tl.sqrt(w) - 3.0
    tail = -0.000200214257
    tail = 0.000100950558 + tail * t
    tail = 0.00134934322 + tail * t
    tail = -0.00367342844 + tail * t
    tail = 0.00573950773 + tail * t
    tail = -0.0076224613 + tail * t
    tail = 0.00943887047 + tail * t
    tail = 1.00167406 + tail * t
    tail = 2.83297682 + tail * t
    return tl.where(w < 5.0, central, tail) * x


@triton.jit
def float32_pair(packed):
    """The two float32 values (low half, high half) of a float64's bits
    (``contracts.pack_float32_pair``)."""
    bits = packed.to(tl.int64, bitcast=True)
    low = (bits & 0xFFFFFFFF).to(tl.uint32).to(tl.float32, bitcast=True)
    high = ((bits >> 32) & 0xFFFFFFFF).to(tl.uint32).to(tl.float32, bitcast=True)
    return low, high


@triton.jit
def trunc_normal_values(u, a, b):
    """N(mean, std) truncated to [low, high] from uniforms ``u`` [n, d], with (mean,
    std) packed in float64 ``a`` [n] and (low, high) in ``b`` [n]: the steps of
    ``ops.hashing.trunc_normal_rows`` in its order."""
    mean, std = float32_pair(a)
    low, high = float32_pair(b)
    inv_sqrt2 = 0.7071067811865476
    p_lo = 0.5 * (1.0 + tl.math.erf((low - mean) / std * inv_sqrt2))
    p_hi = 0.5 * (1.0 + tl.math.erf((high - mean) / std * inv_sqrt2))
    v = (u * (p_hi - p_lo)[:, None] + p_lo[:, None]) * 2.0 - 1.0
    z = erfinv_f32(v) * 1.4142135623730951
    x = z * std[:, None] + mean[:, None]
    return tl.minimum(tl.maximum(x, low[:, None]), high[:, None])


@triton.jit
def init_values_any(ids, cols, seed_mix, normal, a, b, first_col):
    """Initial values (``ops.hashing.init_rows``) of ids of several tables:
    ``seed_mix``, ``normal`` (the kind of draw: 0 uniform, 1 normal, 2 truncated
    normal), float64 ``a``, ``b`` and ``first_col`` (a column shard's first column)
    are per id, rounded as the torch path rounds them (``b - a`` and ``a`` to
    float32). Values of ``ids[:, None]`` x ``(first_col[:, None] + cols[None, :])``."""
    base = fmix64(ids ^ seed_mix)
    col = first_col.to(tl.int64)[:, None] + cols.to(tl.int64)[None, :]
    step = (col + 1).to(tl.uint64, bitcast=True) * 0x9E3779B97F4A7C15
    mixed = base.to(tl.uint64, bitcast=True)[:, None] + step
    bits = fmix64(mixed.to(tl.int64, bitcast=True))
    u1 = ((bits >> 40) & 0xFFFFFF).to(tl.float32) * (1.0 / 16777216.0)
    u2 = ((bits >> 16) & 0xFFFFFF).to(tl.float32) * (1.0 / 16777216.0)
    width = (b - a).to(tl.float32)[:, None]
    low = a.to(tl.float32)[:, None]
    uniform = u1 * width + low
    radius = tl.sqrt(-2.0 * tl.log(1.0 - u1))
    gaussian = low + b.to(tl.float32)[:, None] * radius * tl.cos(6.283185307179586 * u2)
    out = tl.where((normal == 1)[:, None], gaussian, uniform)
    if tl.sum((normal == 2).to(tl.int32), axis=0) > 0:
        truncated = trunc_normal_values(u1, a, b)
        out = tl.where((normal == 2)[:, None], truncated, out)
    return out
