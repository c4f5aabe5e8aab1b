"""De-duplicating a batch's ids before the input all-to-all (``use_index_dedup``).

With ``use_index_dedup=True`` a sharded collection sends each id once per
table per batch instead of once per occurrence: an id that several samples
(or several features of one table) read travels to its owner once, its row
comes back once, and each occurrence takes a copy of it. The gradients of the
copies add up (autograd's ``index_select`` backward) into one gradient per
unique id, which goes back to the owner, where the fused optimizer applies it
as it applies the sum of an id's gradients without dedup (FBGEMM's exact
optimizers reduce a batch's gradients per id too). Rows are the same with and
without dedup up to the order of that float sum.

A table's unique ids, sorted, go to the first bag of its first feature (the
other bags are empty): the de-duplicated batch is an ordinary
``KeyedJaggedTensor`` (the same keys and batch size, fewer ids) that routing
and the all-to-all take as they take any batch; where an id sits among the
bags does not matter to a lookup that gives one row per id.

Example::

    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=["f"], values=torch.tensor([7, 5, 7, 7]), lengths=torch.tensor([2, 2]))
    dedup, reverse = dedup_features(kjt, table_of_key=[0])
    dedup.values()    # tensor([5, 7])
    dedup.lengths()   # tensor([2, 0])
    reverse           # tensor([1, 0, 1, 1]): row i of the output is row reverse[i]
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor


def dedup_features(
    features: KeyedJaggedTensor, table_of_key: Sequence[int]
) -> tuple[KeyedJaggedTensor, torch.Tensor]:
    """The batch with each ``(table, id)`` once, and where each input id went.

    ``table_of_key``: the table (any int label) each key of ``features`` belongs to;
    keys of one table share their ids (an id two features of a table read is sent
    once) and must be consecutive. Returns ``(dedup, reverse)``: ``dedup`` has the same
    keys and stride, each table's unique ids sorted in the first bag of its first
    key; its per-sample weights, when ``features`` has some, are the sums of the
    weights of each unique id's occurrences. ``reverse[i]`` is the position in
    ``dedup.values()`` of input id ``i``. A batch with a batch size per feature (VBE)
    is refused.
    """
    keys = features.keys()
    if len(table_of_key) != len(keys):
        raise ValueError(
            f"use_index_dedup: {len(table_of_key)} table labels for {len(keys)} features"
        )
    if features.variable_stride_per_key():
        raise ValueError(
            "use_index_dedup: a batch with a batch size per feature (VBE) cannot be "
            "de-duplicated; give every feature the same batch size or drop use_index_dedup"
        )
    ids = features.values()
    lengths = features.lengths()
    weights = features.weights_or_none()
    stride = features.stride()
    device = ids.device
    per_key = features.length_per_key()
    # Runs of consecutive keys with one label (a sharding lists each table's
    # features together): (first key, end key, first id, end id).
    runs: list[tuple[int, int, int, int]] = []
    start = 0
    for k in range(1, len(keys) + 1):
        if k == len(keys) or table_of_key[k] != table_of_key[start]:
            lo = sum(per_key[:start])
            runs.append((start, k, lo, lo + sum(per_key[start:k])))
            start = k
    if len({table_of_key[r[0]] for r in runs}) != len(runs):
        raise ValueError(
            f"use_index_dedup: the features of a table must be consecutive, got labels "
            f"{list(table_of_key)}"
        )
    values, reverses, counts = [], [], []
    found = 0
    for _, _, lo, hi in runs:
        # why one sorted unique per table: ordering by first occurrence took 3 sorts.
        unique, inverse = torch.unique(ids[lo:hi], return_inverse=True)
        values.append(unique)
        reverses.append(inverse + found)
        counts.append(unique.numel())
        found += unique.numel()
    new_lengths = torch.zeros_like(lengths)
    for (first_key, _, _, _), count in zip(runs, counts, strict=True):
        new_lengths[first_key * stride] = count
    reverse = torch.cat(reverses) if reverses else torch.empty(0, dtype=torch.int64, device=device)
    new_weights = None
    if weights is not None:
        new_weights = torch.zeros(found, dtype=weights.dtype, device=device)
        new_weights.index_add_(0, reverse, weights)
    dedup = KeyedJaggedTensor(
        keys=keys,
        values=torch.cat(values) if values else ids[:0],
        weights=new_weights,
        lengths=new_lengths,
        stride=stride,
    )
    return dedup, reverse


def table_labels(tables: Sequence[object]) -> list[int]:
    """``table_of_key`` for a sharding's KJT: one label per feature of each of its
    tables (``ShardedEmbeddingTable``s, in the sharding's order)."""
    return [i for i, table in enumerate(tables) for _ in range(table.num_features())]
