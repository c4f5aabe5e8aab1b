"""``BagPlan``: how the bags of a KeyedJaggedTensor map to a bag lookup's groups.

Made once per key order and batch sizes (and cached by the lookup): which
table of each group a KJT key feeds, which bags each group pools, how the
groups' outputs are put back in the lookup's feature order, and, when one key
feeds several tables (a shared feature), which bags are copied for each.

Batch sizes are per key (``strides``); with a variable batch per feature (VBE),
``rank_strides`` gives each key's batch size per source rank, and the output is
TorchRec's VBE layout: one flat tensor, rank-major, then feature, sample, column
(what fbgemm's TBE gives for ``batch_size_per_feature_per_rank``).

Example::

    plan = BagPlan.for_keys(specs, where, num_groups, ["u", "i"], strides=(4, 4))
    plan.bag_lists[0]   # bags of group 0's features
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch


@dataclass(frozen=True)
class BagPlan:
    """How a KJT of some key order and batch sizes maps to the groups of a lookup.

    ``table_maps[g]``: per key, its table in group ``g`` (-1: not the group's);
    ``table_of_bag[g]``: the same per bag (what a batch's ids index by their bag);
    ``bag_lists[g]``: the bags of group ``g``'s features; ``positions[g]``: the keys
    group ``g`` outputs, in output order (None: all, in KJT order); ``columns``: the
    permutation of the groups' output columns into the lookup's feature order (None:
    already in order); ``expand``: when a key feeds several tables, the source bag
    of each bag the groups see (None: no copy); ``slots``: (group, key) of each
    output feature; ``strides`` / ``rank_strides``: batch size per key (the groups'
    keys), and per key and source rank under VBE (else None). ``out_offsets[g]``:
    where group ``g``'s block ``[stride, widths[g]]`` (its output features in order,
    sample-major: what ``columns`` then permutes) takes each bag's row, a flat
    offset per bag (-1: not the group's), so an eval lookup writes its bags in
    place, and ``out_bags[g]`` the group's bags in the block's row order (rows of
    the group's dim; None: batch sizes differ per key)."""

    table_maps: list[torch.Tensor]
    table_of_bag: list[torch.Tensor]
    mean_of_bag: torch.Tensor
    key_of_bag: torch.Tensor
    bag_lists: list[torch.Tensor]
    positions: list[torch.Tensor | None]
    columns: torch.Tensor | None
    slots: tuple[tuple[int, int], ...]
    strides: tuple[int, ...]
    rank_strides: tuple[tuple[int, ...], ...] | None = None
    expand: torch.Tensor | None = None
    out_offsets: list[torch.Tensor] | None = None
    out_bags: list[torch.Tensor] | None = None
    widths: tuple[int, ...] = ()

    @property
    def num_keys(self) -> int:
        """Keys the groups see (the KJT's, or its expanded readers)."""
        return len(self.strides)

    @classmethod
    def make(
        cls,
        specs: Sequence[Any],
        where: dict,
        num_groups: int,
        sources: list[int],
        strides: Sequence[int],
    ) -> BagPlan:
        """``sources``: the key each (table, feature) of ``specs`` reads, in spec order;
        no key is read twice (shared features are expanded first)."""
        num_keys = len(strides)
        starts = [0]
        for s in strides:
            starts.append(starts[-1] + s)
        maps = [torch.full((num_keys,), -1, dtype=torch.int64) for _ in range(num_groups)]
        mean = torch.zeros(num_keys, dtype=torch.bool)
        outputs: list[list[int]] = [[] for _ in range(num_groups)]
        dims: list[int] = [0] * num_groups
        order = []  # (group, index in the group's output) of each output feature
        slots = []
        slot = iter(sources)
        for spec in specs:
            g, t = where[spec.name]
            dims[g] = spec.dim
            for _ in spec.features:
                key = next(slot)
                maps[g][key] = t
                mean[key] = spec.mean
                order.append((g, len(outputs[g])))
                outputs[g].append(key)
                slots.append((g, key))
        bag_lists = [
            torch.cat(
                [torch.arange(starts[k], starts[k + 1]) for k in sorted(out)]
                or [torch.empty(0, dtype=torch.int64)]
            )
            for out in outputs
        ]
        positions = [
            None if out == list(range(num_keys)) else torch.tensor(out, dtype=torch.int64)
            for out in outputs
        ]
        first, total = [], 0
        for g in range(num_groups):
            first.append(total)
            total += len(outputs[g]) * dims[g]
        # Plain ints and sizes known on the host: a plan made while torch.compile
        # traces the lookup has no data-dependent op.
        column_list = [
            column
            for g, i in order
            for column in range(first[g] + i * dims[g], first[g] + (i + 1) * dims[g])
        ]
        identity = column_list == list(range(len(column_list)))
        columns = torch.tensor(column_list, dtype=torch.int64)
        out_offsets = out_bags = None
        widths = tuple(len(outputs[g]) * dims[g] for g in range(num_groups))
        if len(set(strides)) <= 1:
            out_offsets, out_bags = [], []
            stride = strides[0] if strides else 0
            for g in range(num_groups):
                offsets = torch.full((starts[-1],), -1, dtype=torch.int64)
                first = torch.tensor([starts[key] for key in outputs[g]], dtype=torch.int64)
                # [stride, features]: sample s of the group's i-th feature at row s * F + i
                rows = torch.arange(stride).unsqueeze(1) + first
                offsets[rows.reshape(-1)] = torch.arange(rows.numel()) * dims[g]
                out_offsets.append(offsets)
                out_bags.append(rows.reshape(-1))
        counts = torch.tensor(list(strides), dtype=torch.int64)
        bags = starts[-1]
        key_of_bag = torch.arange(num_keys).repeat_interleave(counts, output_size=bags)
        return cls(
            table_maps=maps,
            table_of_bag=[m[key_of_bag] for m in maps],
            mean_of_bag=mean.repeat_interleave(counts, output_size=bags),
            key_of_bag=key_of_bag,
            bag_lists=bag_lists,
            positions=positions,
            columns=None if identity else columns,
            slots=tuple(slots),
            strides=tuple(strides),
            out_offsets=out_offsets,
            out_bags=out_bags,
            widths=widths,
        )

    @classmethod
    def for_keys(
        cls,
        specs: Sequence[Any],
        where: dict,
        num_groups: int,
        keys: list[str],
        strides: Sequence[int],
        rank_strides: Sequence[Sequence[int]] | None = None,
    ) -> BagPlan:
        """The plan of a KJT with these keys and batch sizes per key (and per key and
        rank under VBE). The j-th table reading a feature takes the j-th key of that
        name (a sharded input dist sends a shared feature once per table), or the
        last one when there are fewer (an unsharded KJT has each feature once):
        such a key's bags are then expanded once per reader."""
        occurrences: dict[str, list[int]] = {}
        for i, key in enumerate(keys):
            occurrences.setdefault(key, []).append(i)
        taken: dict[str, int] = {}
        sources = []
        for spec in specs:
            for feature in spec.features:
                found = occurrences[feature]
                j = taken.get(feature, 0)
                taken[feature] = j + 1
                sources.append(found[min(j, len(found) - 1)])
        ranks = None if rank_strides is None else tuple(tuple(r) for r in rank_strides)
        if len(set(sources)) == len(sources):
            plan = cls.make(specs, where, num_groups, sources, strides)
            return replace(plan, rank_strides=ranks)
        starts = [0]
        for s in strides:
            starts.append(starts[-1] + s)
        new_strides = [strides[k] for k in sources]
        plan = cls.make(specs, where, num_groups, list(range(len(sources))), new_strides)
        bag_source = torch.cat([torch.arange(starts[k], starts[k + 1]) for k in sources])
        return replace(
            plan,
            expand=bag_source,
            rank_strides=None if ranks is None else tuple(ranks[k] for k in sources),
        )

    def to(self, device: torch.device) -> BagPlan:
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device)

        return replace(
            self,
            table_maps=[m.to(device) for m in self.table_maps],
            table_of_bag=[t.to(device) for t in self.table_of_bag],
            mean_of_bag=self.mean_of_bag.to(device),
            key_of_bag=self.key_of_bag.to(device),
            bag_lists=[b.to(device) for b in self.bag_lists],
            positions=[move(p) for p in self.positions],
            columns=move(self.columns),
            expand=move(self.expand),
            out_offsets=None if self.out_offsets is None else [move(o) for o in self.out_offsets],
            out_bags=None if self.out_bags is None else [move(b) for b in self.out_bags],
        )

    def variable_batch_output(self, outputs: list[torch.Tensor]) -> torch.Tensor:
        """The groups' per-bag outputs (``[bags, dim]`` each) in TorchRec's VBE layout:
        flat, rank-major, then output feature, sample, column."""
        assert self.rank_strides is not None
        starts = [0]
        for s in self.strides:
            starts.append(starts[-1] + s)
        num_ranks = len(self.rank_strides[0]) if self.rank_strides else 0
        segments = []
        for r in range(num_ranks):
            for g, key in self.slots:
                begin = starts[key] + sum(self.rank_strides[key][:r])
                rows = outputs[g][begin : begin + self.rank_strides[key][r]]
                segments.append(rows.reshape(-1))
        if not segments:
            return torch.empty(0)
        return torch.cat(segments)


def expand_bags(
    lengths: torch.Tensor, offsets: torch.Tensor, bag_source: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The bags ``bag_source`` (a bag may repeat) of a batch: ``(lengths, offsets,
    index)`` where ``index`` picks each new id from the old ids. One host sync (the
    new number of ids). Example: bags ``[a0, a1, b0]`` with ``bag_source = [0, 1, 0,
    1, 2]`` give feature ``a``'s bags twice, then ``b``'s."""
    new_lengths = lengths.index_select(0, bag_source)
    new_offsets = offsets.new_zeros(new_lengths.numel() + 1)
    torch.cumsum(new_lengths, 0, out=new_offsets[1:])
    total = int(new_offsets[-1])
    shift = offsets.index_select(0, bag_source) - new_offsets[:-1]
    index = torch.arange(total, device=lengths.device) + torch.repeat_interleave(
        shift, new_lengths, output_size=total
    )
    return new_lengths, new_offsets, index
