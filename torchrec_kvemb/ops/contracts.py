"""Op contracts: what every backend of an op takes and gives, and the rules they share.

Each op has a vectorized torch path (``torchrec_kvemb/ops/<op>.py``: the readable
reference), a Triton kernel (``kernels/<op>.py``) and, for the id -> slot work, a
native CPU kernel (``csrc/``). All of them import their result types and shared
conventions from here, never from one another; ``ops/dispatch.py`` picks one.

**The index.** A bucketed index is ``keys [num_buckets, WAYS]`` int64 (-1: empty
way) with ``scores`` of the same shape. An id lives only in its own bucket
(``index_bucket``), at ``slot = bucket * WAYS + way``; row arrays are addressed
by slot.

**The ranking rule** of a find-or-insert over unique ids with per-id score
``values`` (``InsertResult``):

1. Each id is probed in its bucket. A hit updates its score: ``score += value``
   when ``accumulate`` (LFU counts), else ``score = value`` (LRU steps, custom
   scores).
2. Per bucket, the stored entries (scores already updated) and the bucket's new
   ids compete for the bucket's ``WAYS`` ways. Candidates are ranked: protected
   stored entries first (those hit by this batch, so an id in use never loses its
   row mid-batch; with ``keep_existing`` every stored entry), then by score
   (higher first), then new before stored (a new id replaces a stored one of
   equal score, so LFU keeps admitting), then id (smaller first). The first
   ``WAYS`` stay.
3. Stored entries that lose are evicted. Winning new ids take the freed and
   empty ways, in ascending way order, in rank order.

The outcome depends only on the index and the batch, never on thread timing.

**Initial rows** depend only on (id, seed, column): see ``InitSpec`` and
``ops.hashing.init_rows``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

#: The 64-bit multipliers of MurmurHash3's finalizer (``fmix64``).
FMIX_M1 = 0xFF51AFD7ED558CCD
FMIX_M2 = 0xC4CEB9FE1A85EC53
#: The 64-bit golden ratio: column stride of the initial-value streams.
GOLDEN = 0x9E3779B97F4A7C15
#: Salts that make the index hash, the routing hash and the seed mix differ.
INDEX_SALT = 0x1B873593A5A5A5A5
ROUTE_SALT = 0x2545F4914F6CDD1D
SEED_SALT = 0x5851F42D4C957F2D
INT64_MAX = (1 << 63) - 1
_U64 = (1 << 64) - 1


def to_signed(value: int) -> int:
    """The int64 with the same 64 bits as the unsigned ``value``."""
    value &= _U64
    return value - (1 << 64) if value >= 1 << 63 else value


def fmix64_int(value: int) -> int:
    """``fmix64`` of one Python int, as an int64."""
    x = value & _U64
    x ^= x >> 33
    x = (x * FMIX_M1) & _U64
    x ^= x >> 33
    x = (x * FMIX_M2) & _U64
    x ^= x >> 33
    return to_signed(x)


def seed_mix(seed: int) -> int:
    """The per-table constant that the seed contributes to every initial value."""
    return fmix64_int(seed ^ SEED_SALT)


class InsertResult(NamedTuple):
    """What a find-or-insert did, per input id and per evicted entry."""

    slots: torch.Tensor  # [n] int64, -1 where the id holds no row after the call
    hit: torch.Tensor  # [n] bool, the id was stored before the call
    inserted: torch.Tensor  # [n] bool, the id got a new row in this call
    evicted_ids: torch.Tensor  # [e] int64
    evicted_slots: torch.Tensor  # [e] int64, now reused by inserted ids


class InitSpec(NamedTuple):
    """How a table makes a row for an id that has none (see ``ops.hashing.init_rows``):
    uniform on ``[a, b)``, or normal with mean ``a`` and standard deviation ``b``."""

    seed: int
    normal: bool
    a: float
    b: float


def bag_scale(
    offsets: torch.Tensor, per_sample_weights: torch.Tensor | None, mean: bool, n: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-id bag index ``[n]`` and multiplier ``[n]`` (sample weight, / bag length if
    ``mean``): what a pooled backward scales each id's gradient by."""
    lengths = offsets[1:] - offsets[:-1]
    bags = torch.repeat_interleave(
        torch.arange(lengths.numel(), device=offsets.device), lengths, output_size=n
    )
    scale = (
        per_sample_weights.to(torch.float32)
        if per_sample_weights is not None
        else torch.ones(n, dtype=torch.float32, device=offsets.device)
    )
    if mean:
        scale = scale / lengths.clamp(min=1).to(torch.float32)[bags]
    return bags, scale


class BucketizeResult(NamedTuple):
    """Outputs of ``block_bucketize_2d``.

    * ``lengths``: ``[world_size * num_bags]``, rank-major, dtype of the input lengths.
    * ``indices``: ``[N]``, the new ids grouped by rank then bag, dtype of the input ids.
    * ``weights``: ``[N]`` or ``[N, k]``, rows permuted like ``indices``; ``None`` without weights.
    * ``pos``: ``[N]``, each output id's position inside its original bag; ``None``
      unless ``bucketize_pos``.
    * ``unbucketize_permute``: ``[N]``, the output position of each input id
      (``out[unbucketize_permute[i]]`` came from input ``i``).
    """

    lengths: torch.Tensor
    indices: torch.Tensor
    weights: torch.Tensor | None
    pos: torch.Tensor | None
    unbucketize_permute: torch.Tensor


class BucketizeInputs(NamedTuple):
    """Validated, normalized inputs of ``block_bucketize_2d`` (``ops.block_bucketize.
    prepare_inputs``), shared by every backend.

    ``block_sizes`` and ``num_blocks`` (blocks of each feature over all ranks) are int64
    ``[T]``; ``feature_ends`` is the int64 ``[T]`` inclusive prefix sum of the per-feature
    batch sizes (bag ``b`` belongs to the first feature ``t`` with ``b < feature_ends[t]``);
    ``lengths``, ``indices`` and ``weights`` are contiguous.
    """

    lengths: torch.Tensor
    indices: torch.Tensor
    block_sizes: torch.Tensor
    num_blocks: torch.Tensor
    feature_ends: torch.Tensor
    world_size: int
    weights: torch.Tensor | None
    bucketize_pos: bool
    keep_orig_idx: bool


def stable_argsort(values: torch.Tensor, descending: bool = False) -> torch.Tensor:
    """The stable sort permutation of ``values`` (the ranking sorts rely on stability)."""
    return torch.sort(values, stable=True, descending=descending).indices
