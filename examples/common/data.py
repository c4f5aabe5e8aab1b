"""A run's batches: training and held-out, from the synthetic stream or Criteo TSV files.

The run's flags (``train_dlrm.py``'s, or those saved with its evaluation)
choose the source: ``--data`` files (:mod:`common.criteo`) or the synthetic
stream (:mod:`common.synthetic`). Held-out batches are never trained on: the
first ``--eval-batches`` blocks of the files (training skips them), or batches
of the stream's evaluation seed drawn after the last training step.

Example::

    data = Data(args, table_sizes(args))
    for batch in data.train(rank, world): ...
    held_out = data.held_out(rank, world)
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from common.criteo import read_criteo_tsv, to_batch
from common.synthetic import EVAL_STREAM, SyntheticCriteo


@dataclass
class Data:
    """Where batches come from: the synthetic stream or Criteo TSV files.

    ``args``: the run's flags (``data``, ``batch_size``, ``steps``,
    ``eval_batches``, and the stream's ``id_space``, ``zipf``, ``drift``,
    ``seed``); ``table_sizes``: per feature, the stock table's size or None for
    a KV table (:func:`common.criteo.to_batch`).
    """

    args: argparse.Namespace
    table_sizes: list[int | None]

    def _stream(self) -> SyntheticCriteo:
        a = self.args
        return SyntheticCriteo(a.id_space, a.zipf, a.drift, a.seed)

    def train(self, rank: int, world: int) -> Iterator[Batch]:
        """This rank's training batches, at most ``steps``."""
        a = self.args
        if a.data:
            raws = read_criteo_tsv(
                a.data, a.batch_size, rank, world, skip_batches=a.eval_batches, max_batches=a.steps
            )
            return (to_batch(raw, self.table_sizes) for raw in raws)
        stream = self._stream()
        return (
            to_batch(stream.batch(step, rank, a.batch_size), self.table_sizes)
            for step in range(a.steps)
        )

    def held_out(self, rank: int, world: int) -> list[Batch]:
        """This rank's held-out batches."""
        a = self.args
        if a.data:
            raws = list(read_criteo_tsv(a.data, a.batch_size, rank, world, 0, a.eval_batches))
            if len(raws) < a.eval_batches:
                raise SystemExit(
                    f"--data holds fewer than {a.eval_batches} blocks of "
                    f"{a.batch_size * world} lines for the held-out set"
                )
        else:
            stream = self._stream()
            raws = [
                stream.batch(a.steps + j, rank, a.batch_size, EVAL_STREAM)
                for j in range(a.eval_batches)
            ]
        return [to_batch(raw, self.table_sizes) for raw in raws]

    def held_out_global(self, world: int) -> list[Batch]:
        """Every rank's held-out batches, batch ``j`` of all ranks as one (rank-major)."""
        parts = [self.held_out(r, world) for r in range(world)]
        return [cat_batches([p[j] for p in parts]) for j in range(self.args.eval_batches)]


def cat_batches(batches: list[Batch]) -> Batch:
    """Several batches (same feature keys) as one, samples in order."""
    keys = batches[0].sparse_features.keys()
    dicts = [b.sparse_features.to_dict() for b in batches]
    values, lengths = [], []
    for key in keys:
        for d in dicts:
            values.append(d[key].values())
            lengths.append(d[key].lengths())
    return Batch(
        dense_features=torch.cat([b.dense_features for b in batches]),
        sparse_features=KeyedJaggedTensor.from_lengths_sync(
            keys=keys, values=torch.cat(values), lengths=torch.cat(lengths)
        ),
        labels=torch.cat([b.labels for b in batches]),
    )


def slice_batch(batch: Batch, start: int, end: int) -> Batch:
    """Samples ``[start, end)`` of a batch."""
    jts = batch.sparse_features.to_dict()
    keys = batch.sparse_features.keys()
    values, lengths = [], []
    for key in keys:
        jt = jts[key]
        offsets = jt.offsets()
        values.append(jt.values()[int(offsets[start]) : int(offsets[end])])
        lengths.append(jt.lengths()[start:end])
    return Batch(
        dense_features=batch.dense_features[start:end],
        sparse_features=KeyedJaggedTensor.from_lengths_sync(
            keys=keys, values=torch.cat(values), lengths=torch.cat(lengths)
        ),
        labels=batch.labels[start:end],
    )
