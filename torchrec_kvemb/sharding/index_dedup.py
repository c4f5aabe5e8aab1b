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

Each unique id keeps the place of its first occurrence: it stays in that
occurrence's bag, in the same order, so the de-duplicated batch is an ordinary
``KeyedJaggedTensor`` (the same keys and batch size, fewer ids) that routing
and the all-to-all take as they take any batch.

Example::

    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=["f"], values=torch.tensor([7, 5, 7, 7]), lengths=torch.tensor([2, 2]))
    dedup, reverse = dedup_features(kjt, table_of_key=[0])
    dedup.values()    # tensor([7, 5])
    dedup.lengths()   # tensor([2, 0])
    reverse           # tensor([0, 1, 0, 0]): row i of the output is row reverse[i]
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
    once). Returns ``(dedup, reverse)``: ``dedup`` has the same keys and stride, each
    unique id in the bag of its first occurrence, in input order; its per-sample
    weights, when ``features`` has some, are the sums of the weights of each unique
    id's occurrences. ``reverse[i]`` is the position in ``dedup.values()`` of input id
    ``i``. A batch with a batch size per feature (VBE) is refused.
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
    n = ids.numel()
    device = ids.device
    if n == 0:
        return features, torch.empty(0, dtype=torch.int64, device=device)
    key_of_id = torch.repeat_interleave(
        torch.arange(len(keys), device=device),
        torch.tensor(features.length_per_key(), device=device),
        output_size=n,
    )
    table_of_id = torch.tensor(list(table_of_key), dtype=torch.int64, device=device)[key_of_id]
    # (table, id) as one int64: ids compacted to their rank among the batch's ids.
    distinct_ids, id_rank = torch.unique(ids, return_inverse=True)
    pair = table_of_id * distinct_ids.numel() + id_rank
    unique_pairs, pair_of_id = torch.unique(pair, return_inverse=True)
    m = unique_pairs.numel()
    positions = torch.arange(n, device=device)
    first = torch.full((m,), n, dtype=torch.int64, device=device)
    first.scatter_reduce_(0, pair_of_id, positions, reduce="amin")
    # Unique ids in the order of their first occurrence.
    kept, order = torch.sort(first)
    place = torch.empty_like(order)
    place[order] = torch.arange(m, device=device)
    reverse = place[pair_of_id]
    bag_of_id = torch.repeat_interleave(
        torch.arange(lengths.numel(), device=device), lengths.to(torch.int64), output_size=n
    )
    new_lengths = torch.bincount(bag_of_id[kept], minlength=lengths.numel()).to(lengths.dtype)
    new_weights = None
    if weights is not None:
        new_weights = torch.zeros(m, dtype=weights.dtype, device=device)
        new_weights.index_add_(0, reverse, weights)
    dedup = KeyedJaggedTensor(
        keys=keys,
        values=ids[kept],
        weights=new_weights,
        lengths=new_lengths,
        stride=features.stride(),
    )
    return dedup, reverse


def table_labels(tables: Sequence[object]) -> list[int]:
    """``table_of_key`` for a sharding's KJT: one label per feature of each of its
    tables (``ShardedEmbeddingTable``s, in the sharding's order)."""
    return [i for i, table in enumerate(tables) for _ in range(table.num_features())]
