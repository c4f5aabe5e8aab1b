"""``KVSequenceLookup``: the unpooled lookup of a collection's KV tables (one row per id).

The sequence twin of :class:`~torchrec_kvemb.bag_lookup.KVBagLookup`, over the
same groups of tables and the same grouped ops: a sequence lookup is a pooled
lookup whose every id is a bag of its own, so the forward gathers each id's row
(its table's initial value where it has none in training, zeros in eval) and
the backward reduces each row's gradient over its ids and applies the fused
optimizer, in one call per group (an evaluation batch above ``EVAL_PIECE_BYTES``
of rows: one call per piece of whole keys).

A feature may feed several tables, as in TorchRec's ``EmbeddingCollection``
(outputs ``feature@table``): the j-th table reading a feature takes the j-th key
of that name in the batch (a sharded input dist sends a shared feature once per
table), or its last one when there are fewer (an unsharded batch has each feature
once): the ids of such a key are then looked up once per table that reads it.

Example::

    lookup = KVSequenceLookup([BagTable("items", 8, ("history",))],
                              {"items": KVTableOptions(capacity=1000)}, FusedOptimConfig())
    rows = lookup.embeddings(kjt, training=True)   # [number of ids, 8], in kjt's order
    per_output = lookup.sequences(kjt, training=True)   # one [ids, 8] per (table, feature)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_kvemb.bag_lookup import KVBagLookup, bag_offsets
from torchrec_kvemb.bag_plan import expand_bags
from torchrec_kvemb.contracts import Bags, run_of_each
from torchrec_kvemb.lookup import pooled_eval, pooled_train
from torchrec_kvemb.reused_outputs import ReusedOutputs
from torchrec_kvemb.validation import KVInputError

#: The largest rows output (bytes) one evaluation call of a sequence lookup makes:
#: a batch's rows come in pieces of whole features up to this size. Why: glibc maps
#: an allocation above its largest mmap threshold (32 MB) afresh at every call and
#: the kernel faults its pages in as it writes (a 42 MB output cost 8-9 ms more
#: than four of 10.5 MB, which the allocator reuses, as it does a stock
#: ``EmbeddingCollection``'s one output per feature).
EVAL_PIECE_BYTES = 16 << 20


class KVSequenceLookup(KVBagLookup):
    """The KV tables of a sequence collection, grouped (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: The key each (table, feature) reads, by the batch's key order.
        self._sources_of: dict[tuple[str, ...], list[int]] = {}
        #: The evaluation pieces' output memory, reused once the caller let it go.
        self._outputs = ReusedOutputs()

    def embeddings(
        self,
        features: KeyedJaggedTensor,
        training: bool,
        eviction_scores: Mapping[str, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Every id's row, ``[ids, dim]`` (all tables of a sequence collection share
        one dim): in the KJT's value order when no key feeds two tables (always the
        case sharded); else, per (table, feature) in the tables' order, the ids of the
        key it reads. Training stores new ids (their rows are their initial values)
        and ties the output into autograd; eval is read-only and ids without a row get
        zeros. ``eviction_scores``: per feature, one int per id, for tables with
        ``EvictionPolicy.CUSTOM_SCORE``."""
        keys = features.keys()
        stride = features.stride()
        dim = self.groups[0].dim if self.groups else 0
        if self.device.type == "meta":
            # Tables on meta hold no rows: the output's shape, on meta (nothing is
            # looked up, stored or checked), as the stock module on meta gives.
            n = sum(self._counts(features)) if self._expands(keys) else features.values().numel()
            out = torch.empty(n, dim, device=self.device)
            return out.requires_grad_(training and torch.is_grad_enabled())
        ids, lengths, _ = self._checked(features)
        if stride == 0 or not keys or ids.numel() == 0:
            out = torch.zeros(ids.numel(), dim, device=ids.device)
            return out.requires_grad_(training and torch.is_grad_enabled())
        plan = self._plan(keys, stride)
        custom = self._custom_scores(features, eviction_scores) if eviction_scores else None
        if plan.expand is not None:
            lengths, _, index = expand_bags(lengths, bag_offsets(lengths), plan.expand)
            ids = ids.index_select(0, index)
            if custom is not None:
                custom = (custom[0].index_select(0, index), custom[1])
        n = ids.numel()
        if not training:  # one fused call per group: the bags give each id's table
            offsets, none = bag_offsets(lengths), ids.new_empty(0)
            out = None
            for group, table_of_bag in zip(self.groups, plan.table_of_bag, strict=True):
                rows = pooled_eval(group, ids, offsets, table_of_bag, None, None, none,
                                   unpooled=True)  # fmt: skip
                out = rows if out is None else out + rows  # other groups' ids: zeros
            return out
        bag_of = run_of_each(lengths, n)
        # Every id a bag of its own.
        each = torch.arange(n + 1, device=ids.device)
        bags = Bags(each, each[:n], None)
        out = None
        scores, flags = custom if custom is not None else (None, None)
        for group, table_of_bag in zip(self.groups, plan.table_of_bag, strict=True):
            rows = pooled_train(
                self._anchor,
                group,
                ids,
                table_of_bag[bag_of],
                bags,
                None,
                scores,
                None if flags is None else [flags.get(t.name, False) for t in group.tables],
            )
            # Ids of another group's tables get zeros here: the groups' rows add up.
            out = rows if out is None else out + rows
        return out

    def sequences(
        self,
        features: KeyedJaggedTensor,
        training: bool,
        eviction_scores: Mapping[str, torch.Tensor] | None = None,
    ) -> list[torch.Tensor]:
        """The rows of :meth:`embeddings` cut per (table, feature) in the tables'
        order (what ``EmbeddingCollection`` names ``feature`` or ``feature@table``):
        one ``[ids of the feature, dim]`` each."""
        if not training and self._evaluates_by_key(features):
            per_key = self._eval_by_key(features)
            return [per_key[k] for k in self._sources(features.keys())]
        rows = self.embeddings(features, training, eviction_scores)
        if self._expands(features.keys()):
            return list(rows.split(self._counts(features)))
        pieces = rows.split(features.length_per_key())
        return [pieces[k] for k in self._sources(features.keys())]

    def _evaluates_by_key(self, features: KeyedJaggedTensor) -> bool:
        """Whether an evaluation batch is looked up in pieces of whole keys
        (``_eval_by_key``): one group, every key read by one table at most, eager,
        not on meta, rows of the batch above ``EVAL_PIECE_BYTES``."""
        if len(self.groups) != 1 or self.device.type == "meta":
            return False
        if torch.compiler.is_compiling() or torch.jit.is_scripting():
            return False
        keys = features.keys()
        if not keys or features.stride() == 0 or self._expands(keys):
            return False
        row_bytes = self.groups[0].dim * 4
        return features.values().numel() * row_bytes > EVAL_PIECE_BYTES

    def _eval_by_key(self, features: KeyedJaggedTensor) -> list[torch.Tensor]:
        """Every key's rows ``[ids of the key, dim]`` (zeros for ids without a row), in
        KJT key order, each key's ids in one fused call with the keys beside it, up to
        ``EVAL_PIECE_BYTES`` of rows a call (a key above it alone), written into the
        memory of the last batch's piece where nothing holds it any more (why:
        ``reused_outputs``)."""
        ids, lengths, _ = self._checked(features)
        plan = self._plan(features.keys(), features.stride())
        group, table_of_bag = self.groups[0], plan.table_of_bag[0]
        dim = group.dim
        offsets, none = bag_offsets(lengths), ids.new_empty(0)
        ids_per_key = features.length_per_key()
        bag_starts = [0]
        for bags in plan.strides:
            bag_starts.append(bag_starts[-1] + bags)
        id_starts = [0]
        for n in ids_per_key:
            id_starts.append(id_starts[-1] + n)
        out: list[torch.Tensor] = []
        cpu = ids.device.type == "cpu"
        first = 0
        while first < len(ids_per_key):
            last = first + 1  # keys [first, last) in this call
            while (
                last < len(ids_per_key)
                and (id_starts[last + 1] - id_starts[first]) * dim * 4 <= EVAL_PIECE_BYTES
            ):
                last += 1
            lo, hi = id_starts[first], id_starts[last]
            if hi == lo:
                rows = torch.zeros(0, dim, device=ids.device)
            else:
                b_lo, b_hi = bag_starts[first], bag_starts[last]
                into = self._outputs.take(len(out), (hi - lo, dim)) if cpu else None
                rows = pooled_eval(group, ids[lo:hi], offsets[b_lo : b_hi + 1] - lo,
                                   table_of_bag[b_lo:b_hi], None, None, none,
                                   unpooled=True, into=into)  # fmt: skip
            out.extend(rows.split(ids_per_key[first:last]))
            first = last
        return out

    def _sources(self, keys: list[str]) -> list[int]:
        """The KJT key each (table, feature) reads, in the tables' order (see the
        module docstring); refuses a missing feature."""
        cached = self._sources_of.get(tuple(keys))
        if cached is not None:
            return cached
        occurrences: dict[str, list[int]] = {}
        for i, key in enumerate(keys):
            occurrences.setdefault(key, []).append(i)
        taken: dict[str, int] = {}
        sources = []
        for spec in self._specs:
            for feature in spec.features:
                found = occurrences.get(feature)
                if not found:
                    raise KVInputError(f"table {spec.name!r}: feature {feature!r} is missing")
                j = taken.get(feature, 0)
                taken[feature] = j + 1
                sources.append(found[min(j, len(found) - 1)])
        self._sources_of[tuple(keys)] = sources
        return sources

    def _expands(self, keys: list[str]) -> bool:
        """Whether a key of this batch feeds two tables (its ids looked up twice)."""
        sources = self._sources(keys)
        return len(set(sources)) != len(sources)

    def _counts(self, features: KeyedJaggedTensor) -> list[int]:
        """Ids of each (table, feature), in the tables' order."""
        per_key = features.length_per_key()
        return [per_key[k] for k in self._sources(features.keys())]
