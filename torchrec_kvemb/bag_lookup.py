"""``KVBagLookup``: the pooled lookup of a collection's KV tables, one grouped call per step.

It holds the KV tables of an ``EmbeddingBagCollection`` (unsharded) or of one
rank's grouped config (sharded), grouped: tables of one dim and optimizer
share arrays (:class:`~torchrec_kvemb.group.KVTableGroup`) and are looked up
together, whatever their number; a table with an SSD tier is a group of its
own. ``pooled(features, training)`` takes a ``KeyedJaggedTensor`` and gives
``[stride, sum of feature dims]`` (features in the order the tables were given),
as TorchRec's TBE kernels do.

The batch is checked before any table changes; on the fast paths the check
reads one device flag (one host sync), and the id -> table map, the bags and
the per-id scale are built with no other sync.

Example::

    lookup = KVBagLookup([BagTable("user", 8, ("u",), mean=False)],
                         {"user": KVTableOptions(capacity=1000)}, FusedOptimConfig())
    pooled = lookup.pooled(kjt, training=True)   # [kjt.stride(), 8]
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_kvemb.contracts import Bags
from torchrec_kvemb.group import KVTableGroup
from torchrec_kvemb.lookup import pooled_eval, pooled_train
from torchrec_kvemb.optimizer import FusedOptimConfig
from torchrec_kvemb.options import KVTableOptions
from torchrec_kvemb.table import KVTable
from torchrec_kvemb.validation import KVInputError, check_bags, check_ids


@dataclass(frozen=True)
class _Plan:
    """How a KJT of some key order (and stride) maps to the groups of a lookup.

    ``table_maps[g]``: per KJT feature, its table in group ``g`` (-1: not the
    group's); ``bag_lists[g]``: the bags of group ``g``'s features; ``positions[g]``:
    the KJT features group ``g`` outputs, in output order (None: all, in KJT order);
    ``columns``: the permutation of the groups' output columns into the lookup's
    feature order (None: already in order); ``expand``: when one KJT key feeds
    several tables (a shared feature), the KJT key each (table, feature) reads,
    whose bags are copied once per reader before the lookup (None: no copy)."""

    table_maps: list[torch.Tensor]
    mean_of_feature: torch.Tensor
    bag_lists: list[torch.Tensor]
    positions: list[torch.Tensor | None]
    columns: torch.Tensor | None
    expand: torch.Tensor | None = None

    @property
    def num_keys(self) -> int:
        """Features the groups see (the KJT's, or its expanded readers)."""
        return self.mean_of_feature.numel()

    @classmethod
    def make(
        cls,
        specs: Sequence[BagTable],
        where: dict,
        num_groups: int,
        sources: list[int],
        num_keys: int,
        stride: int,
    ) -> _Plan:
        """``sources``: the KJT key each (table, feature) of ``specs`` reads, in spec
        order; no key is read twice (shared features are expanded first)."""
        maps = [torch.full((num_keys,), -1, dtype=torch.int64) for _ in range(num_groups)]
        mean = torch.zeros(num_keys, dtype=torch.bool)
        outputs: list[list[int]] = [[] for _ in range(num_groups)]
        dims: list[int] = [0] * num_groups
        order = []  # (group, index in the group's output) of each output feature
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
        bag_lists = [
            (torch.tensor(out, dtype=torch.int64) * stride)
            .unsqueeze(1)
            .add(torch.arange(stride))
            .reshape(-1)
            for out in (sorted(out) for out in outputs)
        ]
        positions = [
            None if out == list(range(num_keys)) else torch.tensor(out, dtype=torch.int64)
            for out in outputs
        ]
        starts, total = [], 0
        for g in range(num_groups):
            starts.append(total)
            total += len(outputs[g]) * dims[g]
        columns = (
            torch.cat(
                [
                    torch.arange(starts[g] + i * dims[g], starts[g] + (i + 1) * dims[g])
                    for g, i in order
                ]
            )
            if order
            else torch.empty(0, dtype=torch.int64)
        )
        identity = torch.equal(columns, torch.arange(columns.numel()))
        return cls(maps, mean, bag_lists, positions, None if identity else columns)

    @classmethod
    def for_keys(
        cls, specs: Sequence[BagTable], where: dict, num_groups: int, keys: list[str], stride: int
    ) -> _Plan:
        """The plan of a KJT with these keys. The j-th table reading a feature takes
        the j-th key of that name (a sharded input dist sends a shared feature once
        per table), or the last one when there are fewer (an unsharded KJT has each
        feature once): such a key's bags are then expanded once per reader."""
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
        if len(set(sources)) == len(sources):
            return cls.make(specs, where, num_groups, sources, len(keys), stride)
        plan = cls.make(specs, where, num_groups, list(range(len(sources))), len(sources), stride)
        return replace(plan, expand=torch.tensor(sources, dtype=torch.int64))

    def to(self, device: torch.device) -> _Plan:
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device)

        return _Plan(
            [m.to(device) for m in self.table_maps],
            self.mean_of_feature.to(device),
            [b.to(device) for b in self.bag_lists],
            [move(p) for p in self.positions],
            move(self.columns),
            move(self.expand),
        )


@dataclass(frozen=True)
class BagTable:
    """A pooled table of a collection: name, dim, the features it reads, and whether
    it pools by MEAN (else SUM)."""

    name: str
    dim: int
    features: tuple[str, ...]
    mean: bool = False


class KVBagLookup:
    """The KV tables of a collection, grouped, and their pooled lookup (see the module
    docstring). ``optims``: one optimizer for all tables, or one per table name.
    ``weights``: what the batch's per-sample weights are: ``"ignore"`` (an unweighted
    collection), ``"required"`` (a weighted one) or ``"if_present"`` (a sharded
    kernel, whose input dist may send them).

    A feature may feed several tables (as in TorchRec's collections): its bags are
    then copied once per table before the lookup."""

    #: Whether a feature may feed several tables (the sequence lookup says no).
    shared_features: bool = True

    def __init__(
        self,
        tables: Sequence[BagTable],
        options: Mapping[str, KVTableOptions],
        optims: FusedOptimConfig | Mapping[str, FusedOptimConfig],
        device: torch.device | str | None = None,
        weights: str = "ignore",
    ) -> None:
        if weights not in ("ignore", "required", "if_present"):
            raise ValueError(
                f"KVBagLookup: weights must be ignore, required or if_present, got {weights!r}"
            )
        self.device = torch.device(device or "cpu")
        self._weights = weights
        self._specs = list(tables)
        for spec in tables:
            if len(set(spec.features)) != len(spec.features):
                raise ValueError(f"table {spec.name!r} reads a feature twice: {spec.features}")
        features = [f for t in tables for f in t.features]
        if not self.shared_features and len(set(features)) != len(features):
            shared = sorted({f for f in features if features.count(f) > 1})
            raise ValueError(f"feature {shared[0]!r} is used by two tables")

        def optim_of(name: str) -> FusedOptimConfig:
            return optims if isinstance(optims, FusedOptimConfig) else optims[name]

        by_key: dict[tuple, list[BagTable]] = {}
        alone: list[BagTable] = []
        for spec in tables:
            if options[spec.name].ssd is not None:
                if self.device.type == "meta":
                    raise ValueError(
                        f"table {spec.name!r}: an SSD tier cannot be built on the meta "
                        "device (it writes files); build the collection on a real device"
                    )
                alone.append(spec)
            else:
                optim = optim_of(spec.name)
                key = (spec.dim, replace(optim, learning_rate=0.0))
                by_key.setdefault(key, []).append(spec)
        self.groups: list[KVTableGroup] = []
        for (dim, _), specs in by_key.items():
            names = [s.name for s in specs]
            self.groups.append(
                KVTableGroup(
                    names,
                    [options[n] for n in names],
                    dim,
                    device=self.device,
                    optims=[optim_of(n) for n in names],
                )
            )
        for spec in alone:
            table = KVTable(
                spec.name, spec.dim, options[spec.name], optim_of(spec.name), self.device
            )
            self.groups.append(KVTableGroup.alone(table))
        # Where each table is: (group, index in the group).
        self._where = {
            table.name: (g, t)
            for g, group in enumerate(self.groups)
            for t, table in enumerate(group.tables)
        }
        self._anchor = torch.empty(0, requires_grad=True)
        self._plans: dict[tuple, _Plan] = {}

    # ----------------------------------------------------------------- tables
    def tables(self) -> dict[str, KVTable]:
        """Every KV table by name, in the order they were given."""
        out = {}
        for spec in self._specs:
            g, t = self._where[spec.name]
            out[spec.name] = self.groups[g].tables[t]
        return out

    def feature_names(self) -> list[str]:
        return [f for spec in self._specs for f in spec.features]

    # ----------------------------------------------------------------- lookup
    def pooled(
        self,
        features: KeyedJaggedTensor,
        training: bool,
        eviction_scores: Mapping[str, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Pool every feature's bags: ``[stride, sum of feature dims]``, features in the
        order of the tables' ``features``. Training stores new ids and ties the output
        into autograd (backward updates the rows); eval is read-only and ids without
        a row pool zeros. ``eviction_scores``: per feature, one int per id, for tables
        with ``EvictionPolicy.CUSTOM_SCORE``."""
        keys = features.keys()
        stride = features.stride()
        if self.device.type == "meta":
            # Tables on meta hold no rows: the output's shape, on meta, as stock
            # modules on meta give (nothing is looked up, stored or checked).
            out = torch.empty(stride, self._output_dim(keys), device=self.device)
            return out.requires_grad_(training and torch.is_grad_enabled())
        ids, lengths, weights = self._checked(features)
        if stride == 0 or not keys:
            return torch.empty(stride, sum(s.dim * len(s.features) for s in self._specs))
        plan = self._plan(keys, stride)
        custom = self._custom_scores(features, eviction_scores) if eviction_scores else None
        num_keys = plan.num_keys
        offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=ids.device)
        torch.cumsum(lengths, 0, out=offsets[1:])
        if plan.expand is not None:
            lengths, offsets, index = expand_bags(lengths, offsets, plan.expand, stride)
            ids = ids.index_select(0, index)
            weights = None if weights is None else weights.index_select(0, index)
            if custom is not None:
                custom = (custom[0].index_select(0, index), custom[1])
        n = ids.numel()
        mean = False
        if any(spec.mean for spec in self._specs):
            mean = plan.mean_of_feature.unsqueeze(1).expand(num_keys, stride).reshape(-1)
        bags = Bags.build(offsets, n, weights, mean)
        feature_of_id = torch.div(bags.bag_of, stride, rounding_mode="floor")
        blocks = []
        for group, table_of_feature, bag_list, positions in zip(
            self.groups, plan.table_maps, plan.bag_lists, plan.positions, strict=True
        ):
            table_idx = table_of_feature[feature_of_id]
            if training:
                scores, flags = custom if custom is not None else (None, None)
                out = pooled_train(
                    self._anchor,
                    group,
                    ids,
                    table_idx,
                    bags,
                    bag_list,
                    scores,
                    None if flags is None else [flags.get(t.name, False) for t in group.tables],
                )
            else:
                out = pooled_eval(group, ids, table_idx, bags, bag_list)
            # [features x stride, dim] (feature-major bags) -> [stride, features x dim]
            out = out.view(num_keys, stride, group.dim)
            if positions is not None:
                out = out.index_select(0, positions)
            blocks.append(out.transpose(0, 1).reshape(stride, -1))
        if not blocks:
            return torch.empty(stride, 0, device=ids.device)
        out = blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=1)
        return out if plan.columns is None else out.index_select(1, plan.columns)

    def _output_dim(self, keys: list[str]) -> int:
        """Columns of the pooled output of a KJT with these keys (its missing
        features are refused as a real lookup refuses them)."""
        for spec in self._specs:
            for feature in spec.features:
                if feature not in keys:
                    raise KVInputError(f"table {spec.name!r}: feature {feature!r} is missing")
        return sum(spec.dim * len(spec.features) for spec in self._specs)

    def _plan(self, keys: list[str], stride: int) -> _Plan:
        """How a batch of these KJT keys maps to the groups (made once per key order)."""
        cached = self._plans.get((tuple(keys), stride))
        if cached is None:
            cached = _Plan.for_keys(self._specs, self._where, len(self.groups), keys, stride)
            cached = cached.to(self.device)
            self._plans[(tuple(keys), stride)] = cached
        return cached

    def _checked(
        self, features: KeyedJaggedTensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The batch's ``(ids int64, lengths int64, per-sample weights float32 | None)``
        after every check (one host sync on the fast path); raises ``KVInputError``
        naming the table and feature."""
        if features.variable_stride_per_key():
            raise KVInputError("variable batch size per feature is not supported unsharded")
        keys = features.keys()
        position = {k: i for i, k in enumerate(keys)}
        for spec in self._specs:
            for feature in spec.features:
                if feature not in position:
                    raise KVInputError(f"table {spec.name!r}: feature {feature!r} is missing")
        values = features.values()
        lengths = features.lengths()
        weights = features.weights_or_none()
        if self._weights == "ignore":
            weights = None
        elif self._weights == "required" and weights is None:
            raise KVInputError("weighted collection: the KeyedJaggedTensor has no weights")
        stride = features.stride()
        if lengths.numel() != stride * len(keys):
            raise KVInputError(
                f"lengths has {lengths.numel()} entries, expected {stride} x {len(keys)} features"
            )
        if weights is not None and weights.numel() != values.numel():
            raise KVInputError(
                f"weights has {weights.numel()} entries but there are {values.numel()} ids"
            )
        lengths = lengths.to(torch.int64)
        if (
            values.dtype not in (torch.int64, torch.int32)
            or values.dim() != 1
            or (weights is not None and not weights.is_floating_point())
        ):
            self._explain(features)
        bad = lengths.sum() != values.numel()
        if lengths.numel():
            bad |= lengths.min() < 0
        if values.numel():
            bad |= values.min() < 0
        if bool(bad):  # the one sync of the fast path
            self._explain(features)
        w = weights.to(torch.float32) if weights is not None else None
        return values.to(torch.int64), lengths, w

    def _explain(self, features: KeyedJaggedTensor) -> None:
        """Raise the error a bad batch deserves, naming its table and feature (returns
        when the only fault is a negative id of a feature no KV table reads)."""
        keys = features.keys()
        stride = features.stride()
        values = features.values()
        lengths = features.lengths()
        length_per_key = lengths.view(len(keys), stride).sum(dim=1).tolist()
        if sum(length_per_key) != values.numel():
            raise KVInputError(
                f"lengths sum to {sum(length_per_key)} but there are {values.numel()} ids"
            )
        starts = [0]
        for n in length_per_key:
            starts.append(starts[-1] + n)
        position = {k: i for i, k in enumerate(keys)}
        weights = features.weights_or_none() if self._weights != "ignore" else None
        for spec in self._specs:
            for feature in spec.features:
                k = position[feature]
                lo, hi = starts[k], starts[k + 1]
                ids = check_ids(spec.name, values[lo:hi], what=f"ids of feature {feature!r}")
                w = weights[lo:hi] if weights is not None else None
                check_bags(spec.name, ids, lengths[k * stride : (k + 1) * stride], w)
        if bool((lengths < 0).any()):
            raise KVInputError("lengths must be >= 0")

    def _custom_scores(
        self, features: KeyedJaggedTensor, eviction_scores: Mapping[str, torch.Tensor]
    ) -> tuple[torch.Tensor, dict[str, bool]]:
        """Per-id custom scores (0 where none is given) and which tables have them."""
        keys = features.keys()
        lengths = features.lengths().view(len(keys), features.stride()).sum(dim=1).tolist()
        starts = [0]
        for n in lengths:
            starts.append(starts[-1] + n)
        position = {k: i for i, k in enumerate(keys)}
        scores = torch.zeros(features.values().numel(), dtype=torch.int64, device=self.device)
        flags = {}
        for spec in self._specs:
            given = [f for f in spec.features if f in eviction_scores]
            if not given:
                continue
            if len(given) != len(spec.features):
                raise KVInputError(
                    f"table {spec.name!r}: eviction_scores must cover all its features"
                )
            for feature in spec.features:
                k = position[feature]
                lo, hi = starts[k], starts[k + 1]
                score = eviction_scores[feature]
                if score.numel() != hi - lo:
                    raise KVInputError(
                        f"table {spec.name!r}: eviction_scores of {feature!r} has "
                        f"{score.numel()} entries for {hi - lo} ids"
                    )
                scores[lo:hi] = score.to(device=self.device, dtype=torch.int64)
            flags[spec.name] = True
        return scores, flags


def expand_bags(
    lengths: torch.Tensor, offsets: torch.Tensor, sources: torch.Tensor, stride: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The bags of keys ``sources`` (a key may repeat), key-major like a KJT's:
    ``(lengths, offsets, index)`` where ``index`` picks each new id from the old ids.
    One host sync (the new number of ids). Example: keys ``[a, b]`` with
    ``sources = [0, 0, 1]`` give the bags of ``a``, ``a`` again, then ``b``."""
    bag_source = (sources.unsqueeze(1) * stride + torch.arange(stride, device=sources.device)).view(
        -1
    )
    new_lengths = lengths.index_select(0, bag_source)
    new_offsets = offsets.new_zeros(new_lengths.numel() + 1)
    torch.cumsum(new_lengths, 0, out=new_offsets[1:])
    total = int(new_offsets[-1])
    shift = offsets.index_select(0, bag_source) - new_offsets[:-1]
    index = torch.arange(total, device=lengths.device) + torch.repeat_interleave(
        shift, new_lengths, output_size=total
    )
    return new_lengths, new_offsets, index
