"""``KVSequenceLookup``: the unpooled lookup of a collection's KV tables (one row per id).

The sequence twin of :class:`~torchrec_kvemb.bag_lookup.KVBagLookup`, over the
same groups of tables and the same grouped ops: a sequence lookup is a pooled
lookup whose every id is a bag of its own, so the forward gathers each id's row
(its table's initial value where it has none in training, zeros in eval) and
the backward reduces each row's gradient over its ids and applies the fused
optimizer, in one call per group.

Example::

    lookup = KVSequenceLookup([BagTable("items", 8, ("history",))],
                              {"items": KVTableOptions(capacity=1000)}, FusedOptimConfig())
    rows = lookup.embeddings(kjt, training=True)   # [number of ids, 8], in kjt's order
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_kvemb.bag_lookup import KVBagLookup
from torchrec_kvemb.contracts import Bags, run_of_each
from torchrec_kvemb.lookup import pooled_eval, pooled_train


class KVSequenceLookup(KVBagLookup):
    """The KV tables of a sequence collection, grouped (see the module docstring)."""

    shared_features = False

    def embeddings(
        self,
        features: KeyedJaggedTensor,
        training: bool,
        eviction_scores: Mapping[str, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Every id's row, ``[number of ids, dim]`` in the KJT's value order (all
        tables of a sequence collection share one dim). Training stores new ids
        (their rows are their initial values) and ties the output into autograd;
        eval is read-only and ids without a row get zeros. ``eviction_scores``: per
        feature, one int per id, for tables with ``EvictionPolicy.CUSTOM_SCORE``."""
        keys = features.keys()
        stride = features.stride()
        ids, lengths, _ = self._checked(features)
        n = ids.numel()
        dim = self.groups[0].dim if self.groups else 0
        if stride == 0 or not keys or n == 0:
            out = torch.zeros(n, dim, device=ids.device)
            return out.requires_grad_(training and torch.is_grad_enabled())
        plan = self._plan(keys, stride)
        bag_of = run_of_each(lengths, n)
        # Every id a bag of its own.
        each = torch.arange(n + 1, device=ids.device)
        bags = Bags(each, each[:n], None)
        custom = self._custom_scores(features, eviction_scores) if eviction_scores else None
        out = None
        for group, table_of_bag in zip(self.groups, plan.table_of_bag, strict=True):
            table_idx = table_of_bag[bag_of]
            if training:
                scores, flags = custom if custom is not None else (None, None)
                rows = pooled_train(
                    self._anchor,
                    group,
                    ids,
                    table_idx,
                    bags,
                    None,
                    scores,
                    None if flags is None else [flags.get(t.name, False) for t in group.tables],
                )
            else:
                rows = pooled_eval(group, ids, table_idx, bags, None)
            # Ids of another group's tables get zeros here: the groups' rows add up.
            out = rows if out is None else out + rows
        return out
