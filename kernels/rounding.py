"""Storing float32 values in a row array of half precision (Triton).

Rows of a KV table are float32, float16 or bfloat16; kernels compute in float32
and round to nearest (ties to even) when they store, exactly as
``tensor.to(dtype)`` does in the torch path. bfloat16 is rounded by hand, on
the float32 bits, so that every backend (and Triton's interpreter, whose
bfloat16 cast truncates) gives the same bits.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def round_to(x, dtype: tl.constexpr):
    """``x`` (float32) rounded to nearest-even in ``dtype`` (a row array's element type)."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(dtype)
