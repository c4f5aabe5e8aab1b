"""A synthetic stream shaped like Criteo, with a learnable label and drifting ids.

13 dense count features and 26 categorical features whose vocabulary sizes
follow the Criteo 1TB cardinalities (:data:`common.criteo.CARDINALITIES`); ids
are drawn from a Zipf law and hashed into an ``id_space`` of raw ids. On the
features with more than a million values new ids keep arriving: ``drift`` new
ids per step enter at the head of the popularity ranking and age towards the
tail. The label's probability is a sigmoid of a fixed random linear function of
the dense features plus a hidden per-id effect of four categorical features.

Example::

    stream = SyntheticCriteo(id_space=2**40, zipf=1.05, drift=2.0, seed=0)
    raw = stream.batch(step=0, rank=0, size=512)   # a common.criteo.RawBatch
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torchrec.datasets.criteo import CAT_FEATURE_COUNT, INT_FEATURE_COUNT

from common.criteo import CARDINALITIES, RawBatch

#: Features whose vocabulary keeps growing in the synthetic stream (over a million values).
DRIFTING = frozenset(f for f, n in enumerate(CARDINALITIES) if n > 1_000_000)
#: Features with a hidden per-id effect on the label: two large, two small.
SIGNAL = (19, 0, 7, 15)
#: Streams of one seed: the training batches and the held-out ones never meet.
EVAL_STREAM, TRAIN_STREAM = 1, 0


def _signed(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


_MIX1, _MIX2 = _signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB)


def mix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer on int64 (wrapping arithmetic, logical shifts)."""

    def shr(v: torch.Tensor, k: int) -> torch.Tensor:
        return (v >> k) & ((1 << (64 - k)) - 1)

    x = x ^ shr(x, 30)
    x = x * _MIX1
    x = x ^ shr(x, 27)
    x = x * _MIX2
    return x ^ shr(x, 31)


def zipf_ranks(n: int, alpha: float, size: int, g: torch.Generator) -> torch.Tensor:
    """``size`` ranks in ``[1, n]``, P(rank) ~ rank**-alpha (inverse CDF of the
    continuous power law, floored)."""
    u = torch.rand(size, generator=g, dtype=torch.float64)
    if abs(alpha - 1.0) < 1e-9:
        r = torch.exp(u * math.log(n + 1))
    else:
        a = 1.0 - alpha
        r = (1.0 + u * ((n + 1) ** a - 1.0)) ** (1.0 / a)
    return r.floor().to(torch.int64).clamp_(1, n)


class SyntheticCriteo:
    """The synthetic stream: ``batch(step, rank, size)`` is the same for a given seed
    on any machine and world size (rank ``r``'s samples are its own draw)."""

    def __init__(self, id_space: int, zipf: float, drift: float, seed: int) -> None:
        self.id_space = id_space
        self.zipf = zipf
        self.drift = drift
        self.seed = seed
        g = torch.Generator().manual_seed(seed)
        self.dense_weight = torch.randn(INT_FEATURE_COUNT, generator=g) / INT_FEATURE_COUNT**0.5
        self.dense_mean = torch.rand(INT_FEATURE_COUNT, generator=g) * 3.0
        self.bias = -1.0

    def _generator(self, stream: int, step: int, rank: int) -> torch.Generator:
        state = np.random.SeedSequence([self.seed, stream, step, rank]).generate_state(1)
        return torch.Generator().manual_seed(int(state[0]))

    def items(self, feature: int, ranks: torch.Tensor, step: int) -> torch.Tensor:
        """The item behind each popularity rank at ``step``: on drifting features the
        head moves on by ``drift`` new items per step."""
        if feature in DRIFTING:
            return ranks - int(self.drift * step)
        return ranks

    def raw_ids(self, feature: int, items: torch.Tensor) -> torch.Tensor:
        """Raw ids in ``[0, id_space)``: a hash of (feature, item)."""
        h = mix64(items * CAT_FEATURE_COUNT + feature + (self.seed << 48))
        return (h & (2**63 - 1)) % self.id_space

    def effect(self, feature: int, items: torch.Tensor) -> torch.Tensor:
        """The hidden per-item effect on the label logit, mean 0, std 1."""
        h = mix64(items * 7919 + feature * 104729 + self.seed * 15485863 + 1)
        u = ((h >> 11) & ((1 << 53) - 1)).to(torch.float64) / float(1 << 53)
        return ((u - 0.5) * 12**0.5).to(torch.float32)

    def batch(self, step: int, rank: int, size: int, stream: int = TRAIN_STREAM) -> RawBatch:
        """``size`` samples of ``rank`` at ``step`` of ``stream``."""
        g = self._generator(stream, step, rank)
        z = torch.randn(size, INT_FEATURE_COUNT, generator=g)
        dense = torch.exp(self.dense_mean + 1.2 * z).floor().to(torch.int64) - 1
        logit = self.bias + 0.9 * (z @ self.dense_weight)
        sparse = torch.empty(size, CAT_FEATURE_COUNT, dtype=torch.int64)
        for f, n in enumerate(CARDINALITIES):
            items = self.items(f, zipf_ranks(n, self.zipf, size, g), step)
            sparse[:, f] = self.raw_ids(f, items)
            if f in SIGNAL:
                logit = logit + 0.8 * self.effect(f, items)
        labels = torch.bernoulli(torch.sigmoid(logit), generator=g).to(torch.int64)
        return RawBatch(dense=dense, sparse=sparse, labels=labels)
