"""The Criteo click logs: the TSV format, its batches, and the 1TB vocabulary sizes.

The format of the Criteo 1TB click logs (``day_0`` ... ``day_23``, plain or
``.gz``) and of the Kaggle Display Advertising challenge (``train.txt``): one
sample per line, 40 tab-separated columns::

    label  int_0 ... int_12  cat_0 ... cat_25

``label`` is 0 or 1; the 13 ``int_*`` columns are counts (may be negative or
empty); the 26 ``cat_*`` columns are hashed categorical values in hex (32-bit
hashes in the public data; up to 64 bits are accepted) or empty.

What a sample becomes (the conventions of TorchRec's Criteo preprocessing,
``torchrec.datasets.criteo.BinaryCriteoUtils``, and of the DLRM reference):

* an empty column is 0;
* dense features: ``log(1 + max(x, 0))`` as float32;
* categorical values: hex -> int, kept raw (no modulo) for KV tables, which
  take any 63-bit id (values above ``2**63 - 1`` keep their low 63 bits);
  modulo the table's size for stock tables (``to_batch(table_sizes=...)``).

Batches are ``torchrec.datasets.utils.Batch``: ``dense_features [B, 13]``,
``sparse_features`` a ``KeyedJaggedTensor`` with keys ``cat_0`` ... ``cat_25``
and one id per bag, ``labels [B]``. The synthetic stream
(:mod:`common.synthetic`) yields the same ``RawBatch``es.

With several processes, the file is read in global blocks of
``batch_size * world_size`` lines; rank ``r`` takes lines ``[r * B, (r + 1) * B)``
of each block, and the stream ends at the first incomplete block, so every
rank gets the same number of batches (a sharded step is a collective).

Example::

    from common.criteo import read_criteo_tsv, to_batch

    for raw in read_criteo_tsv(["day_0.gz"], batch_size=512, rank=0, world_size=2):
        batch = to_batch(raw, table_sizes=[None] * 4 + [100_000] * 22)
"""

from __future__ import annotations

import gzip
import io
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import islice

import torch
from torchrec.datasets.criteo import CAT_FEATURE_COUNT, DEFAULT_CAT_NAMES, INT_FEATURE_COUNT
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

NUM_COLUMNS = 1 + INT_FEATURE_COUNT + CAT_FEATURE_COUNT
#: Vocabulary sizes of the 26 categorical features: Criteo 1TB's, as in TorchRec's
#: DLRM example (``--num_embeddings_per_feature``).
CARDINALITIES = [
    45833188, 36746, 17245, 7413, 20243, 3, 7114, 1441, 62, 29275261, 1572176, 345138, 10,
    2209, 11267, 128, 4, 974, 14, 48937457, 11316796, 40094537, 452104, 12606, 104, 35,
]  # fmt: skip
#: Raw ids are int64 >= 0: hex values keep their low 63 bits.
ID_MASK = 2**63 - 1


@dataclass
class RawBatch:
    """Samples before the model's conventions: dense counts ``[B, 13]`` int64, raw
    categorical ids ``[B, 26]`` int64 (>= 0), labels ``[B]`` int64."""

    dense: torch.Tensor
    sparse: torch.Tensor
    labels: torch.Tensor

    def __len__(self) -> int:
        return self.labels.numel()


def to_batch(raw: RawBatch, table_sizes: Sequence[int | None]) -> Batch:
    """The ``Batch`` of ``raw``: dense ``log(1 + max(x, 0))``; feature ``f``'s ids
    modulo ``table_sizes[f]`` (a stock table) or raw where it is None (a KV table)."""
    if len(table_sizes) != CAT_FEATURE_COUNT:
        raise ValueError(f"table_sizes needs {CAT_FEATURE_COUNT} entries, got {len(table_sizes)}")
    sparse = raw.sparse
    modulo = [f for f, size in enumerate(table_sizes) if size is not None]
    if modulo:
        sparse = sparse.clone()
        sizes = torch.tensor([table_sizes[f] for f in modulo], dtype=torch.int64)
        sparse[:, modulo] = sparse[:, modulo] % sizes
    values = sparse.t().reshape(-1)  # feature-major, as a KeyedJaggedTensor stores them
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=list(DEFAULT_CAT_NAMES),
        values=values,
        lengths=torch.ones(values.numel(), dtype=torch.int32),
    )
    dense = torch.log1p(raw.dense.clamp(min=0).to(torch.float32))
    return Batch(dense_features=dense, sparse_features=kjt, labels=raw.labels.to(torch.float32))


def parse_lines(lines: Sequence[str], where: str = "") -> RawBatch:
    """The ``RawBatch`` of Criteo TSV lines; a malformed line raises ``ValueError``
    naming it (``where``: the file and first line number, for the message)."""
    labels = []
    dense = []
    sparse = []
    for i, line in enumerate(lines):
        cols = line.rstrip("\r\n").split("\t")
        if len(cols) != NUM_COLUMNS:
            raise ValueError(
                f"{where}+{i}: expected {NUM_COLUMNS} tab-separated columns "
                f"(label, {INT_FEATURE_COUNT} ints, {CAT_FEATURE_COUNT} hex), got {len(cols)}"
            )
        try:
            labels.append(int(cols[0] or 0))
            dense.append([int(c or 0) for c in cols[1 : 1 + INT_FEATURE_COUNT]])
            sparse.append([int(c or "0", 16) & ID_MASK for c in cols[1 + INT_FEATURE_COUNT :]])
        except ValueError as e:
            raise ValueError(f"{where}+{i}: {e}") from None
    return RawBatch(
        dense=torch.tensor(dense, dtype=torch.int64).reshape(-1, INT_FEATURE_COUNT),
        sparse=torch.tensor(sparse, dtype=torch.int64).reshape(-1, CAT_FEATURE_COUNT),
        labels=torch.tensor(labels, dtype=torch.int64),
    )


def _open(path: str) -> io.TextIOBase:
    if path.endswith(".gz"):
        return gzip.open(path, "rt", newline="")
    return open(path, newline="")


def _lines(paths: Iterable[str | os.PathLike]) -> Iterator[tuple[str, int, str]]:
    for path in paths:
        path = os.fspath(path)
        with _open(path) as f:
            for number, line in enumerate(f, start=1):
                if line.strip():
                    yield path, number, line


def read_criteo_tsv(
    paths: Iterable[str | os.PathLike],
    batch_size: int,
    rank: int = 0,
    world_size: int = 1,
    skip_batches: int = 0,
    max_batches: int | None = None,
) -> Iterator[RawBatch]:
    """Stream ``paths`` (in order) as this rank's ``RawBatch``es of ``batch_size``.

    Global block ``k`` is lines ``[k * batch_size * world_size, (k + 1) * ...)``;
    this rank gets its slice of each block. ``skip_batches`` blocks are skipped
    first (without parsing), then at most ``max_batches`` are yielded; an
    incomplete last block is dropped.
    """
    if batch_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"bad batch_size {batch_size} or rank {rank} of {world_size}")
    block = batch_size * world_size
    lines = _lines(paths)
    yielded = 0
    skipped = 0
    while max_batches is None or yielded < max_batches:
        chunk = list(islice(lines, block))
        if len(chunk) < block:
            return
        if skipped < skip_batches:
            skipped += 1
            continue
        mine = chunk[rank * batch_size : (rank + 1) * batch_size]
        path, number, _ = mine[0]
        yield parse_lines([line for _, _, line in mine], where=f"{path}:{number}")
        yielded += 1
