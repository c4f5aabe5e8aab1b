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

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_kvemb.bag_plan import BagPlan, expand_bags
from torchrec_kvemb.contracts import Bags
from torchrec_kvemb.group import KVTableGroup
from torchrec_kvemb.lookup import pooled_eval, pooled_train
from torchrec_kvemb.optimizer import FusedOptimConfig
from torchrec_kvemb.options import KVTableOptions
from torchrec_kvemb.table import KVTable
from torchrec_kvemb.validation import KVInputError, check_bags, check_ids


@dataclass(frozen=True)
class BagTable:
    """A pooled table of a collection: name, dim, the features it reads, and whether
    it pools by MEAN (else SUM)."""

    name: str
    dim: int
    features: tuple[str, ...]
    mean: bool = False


#: What a traced lookup says of a bad batch (an eager one names the table and feature).
BAD_BATCH = (
    "KV lookup: a negative id, or lengths that do not sum to the ids "
    "(run the batch eagerly for the table and feature)"
)


class KVBagLookup:
    """The KV tables of a collection, grouped, and their pooled lookup (see the module
    docstring). ``optims``: one optimizer for all tables, or one per table name.
    ``weights``: what the batch's per-sample weights are: ``"ignore"`` (an unweighted
    collection), ``"required"`` (a weighted one) or ``"if_present"`` (a sharded
    kernel, whose input dist may send them).

    A feature may feed several tables (as in TorchRec's collections): its bags are
    then copied once per table before the lookup."""

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

        def optim_of(name: str) -> FusedOptimConfig:
            return optims if isinstance(optims, FusedOptimConfig) else optims[name]

        # Tables of one dim, optimizer and row dtype share a group; those with an SSD
        # tier a group of their own (one of a kind: a group of one keeping its arrays).
        by_key: dict[tuple, list[BagTable]] = {}
        for spec in tables:
            tiered = options[spec.name].tiered
            if tiered and self.device.type == "meta":
                raise ValueError(
                    f"table {spec.name!r}: an SSD tier cannot be built on the meta "
                    "device (it writes files); build the collection on a real device"
                )
            key = (
                tiered,
                spec.dim,
                replace(optim_of(spec.name), learning_rate=0.0),
                options[spec.name].weights_dtype,
            )
            by_key.setdefault(key, []).append(spec)
        self.groups: list[KVTableGroup] = []
        for (tiered, dim, _, _), specs in sorted(by_key.items(), key=lambda kv: kv[0][0]):
            self.groups.append(self._group(specs, dim, tiered, options, optim_of))
        # Where each table is: (group, index in the group).
        self._where = {
            table.name: (g, t)
            for g, group in enumerate(self.groups)
            for t, table in enumerate(group.tables)
        }
        self._anchor = torch.empty(0, requires_grad=True)
        self._plans: dict[tuple, BagPlan] = {}

    def _group(
        self,
        specs: list[BagTable],
        dim: int,
        tiered: bool,
        options: Mapping[str, KVTableOptions],
        optim_of: Callable[[str], FusedOptimConfig],
    ) -> KVTableGroup:
        """The group of ``specs`` (one dim, optimizer and row dtype)."""
        if tiered and len(specs) == 1:
            (spec,) = specs
            table = KVTable(
                spec.name, spec.dim, options[spec.name], optim_of(spec.name), self.device
            )
            return KVTableGroup.alone(table)
        names = [s.name for s in specs]
        return KVTableGroup(
            names,
            [options[n] for n in names],
            dim,
            device=self.device,
            optims=[optim_of(n) for n in names],
        )

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
        variable_batch: bool = False,
    ) -> torch.Tensor:
        """Pool every feature's bags: ``[stride, sum of feature dims]``, features in the
        order of the tables' ``features``. Training stores new ids and ties the output
        into autograd (backward updates the rows); eval is read-only and ids without
        a row pool zeros. ``eviction_scores``: per feature, one int per id, for tables
        with ``EvictionPolicy.CUSTOM_SCORE``. ``variable_batch``: a KJT with a batch
        size per feature and source rank (VBE, from a sharded input dist) is allowed
        and gives TorchRec's flat VBE layout (:mod:`torchrec_kvemb.bag_plan`)."""
        keys = features.keys()
        stride = features.stride()
        vbe = features.variable_stride_per_key()
        if vbe and not variable_batch:
            raise KVInputError(
                "variable batch size per feature (VBE) is only supported sharded (row-wise "
                "and table-wise KV tables); give every feature the same batch size"
            )
        if self.device.type == "meta":
            # Tables on meta hold no rows: the output's shape, on meta, as stock
            # modules on meta give (nothing is looked up, stored or checked).
            dim = self._output_dim(keys)
            shape = (sum(features.stride_per_key()) * dim,) if vbe else (stride, dim)
            out = torch.empty(shape, device=self.device)
            return out.requires_grad_(training and torch.is_grad_enabled())
        ids, lengths, weights = self._checked(features, variable_batch)
        if not vbe and (stride == 0 or not keys):
            width = sum(s.dim * len(s.features) for s in self._specs)
            return torch.empty(stride, width, device=ids.device)
        plan = self._plan(keys, stride, features.stride_per_key_per_rank() if vbe else None)
        custom = self._custom_scores(features, eviction_scores) if eviction_scores else None
        offsets = bag_offsets(lengths)
        if plan.expand is not None:
            lengths, offsets, index = expand_bags(lengths, offsets, plan.expand)
            ids = ids.index_select(0, index)
            weights = None if weights is None else weights.index_select(0, index)
            if custom is not None:
                custom = (custom[0].index_select(0, index), custom[1])
        n = ids.numel()
        any_mean = any(spec.mean for spec in self._specs)
        if not training:
            return self._pooled_eval(plan, ids, offsets, weights, any_mean, stride, vbe)
        mean = plan.mean_of_bag if any_mean else False
        bags = Bags.build(offsets, n, weights, mean)
        outputs = []
        for group, table_of_bag, bag_list in zip(
            self.groups, plan.table_of_bag, plan.bag_lists, strict=True
        ):
            table_idx = table_of_bag[bags.bag_of]
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
            outputs.append(out)  # [bags, dim], bags feature-major
        if vbe:
            return plan.variable_batch_output(outputs).to(ids.device)
        blocks = []
        for group, out, positions in zip(self.groups, outputs, plan.positions, strict=True):
            # [features x stride, dim] -> [stride, features x dim]
            out = out.view(plan.num_keys, stride, group.dim)
            if positions is not None:
                out = out.index_select(0, positions)
            blocks.append(out.transpose(0, 1).reshape(stride, -1))
        if not blocks:
            return torch.empty(stride, 0, device=ids.device)
        out = blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=1)
        return out if plan.columns is None else out.index_select(1, plan.columns)

    def _pooled_eval(
        self,
        plan: BagPlan,
        ids: torch.Tensor,
        offsets: torch.Tensor,
        weights: torch.Tensor | None,
        any_mean: bool,
        stride: int,
        vbe: bool,
    ) -> torch.Tensor:
        """``pooled``'s evaluation batch: one fused probe-and-pool call per group
        (``KVTableGroup.pooled_eval``), each writing its bags straight into its block
        ``[stride, features x dim]`` of the output (no bag-of-id map, scale or
        transpose built here); under VBE, ``[bags, dim]`` per group put in VBE order."""
        mean = plan.mean_of_bag if any_mean else None
        in_place = not vbe and plan.out_offsets is not None
        blocks = []
        for g, group in enumerate(self.groups):
            if in_place:
                out_offset, bag_list = plan.out_offsets[g], plan.out_bags[g]
                shape = (stride, plan.widths[g])
            else:
                out_offset, bag_list, shape = None, plan.bag_lists[g], None
            args = (ids, offsets, plan.table_of_bag[g], weights, mean, bag_list)
            blocks.append(pooled_eval(group, *args, out_offset, shape))
        if not in_place:
            return plan.variable_batch_output(blocks).to(ids.device)
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

    def _plan(
        self, keys: list[str], stride: int, rank_strides: list[list[int]] | None = None
    ) -> BagPlan:
        """How a batch of these KJT keys maps to the groups (made once per key order
        and stride; under VBE, ``rank_strides`` per key and rank, made per batch)."""
        if rank_strides is not None:
            strides = [sum(r) for r in rank_strides]
            plan = BagPlan.for_keys(
                self._specs, self._where, len(self.groups), keys, strides, rank_strides
            )
            return plan.to(self.device)
        cached = self._plans.get((tuple(keys), stride))
        if cached is None:
            cached = BagPlan.for_keys(
                self._specs, self._where, len(self.groups), keys, [stride] * len(keys)
            )
            cached = cached.to(self.device)
            self._plans[(tuple(keys), stride)] = cached
        return cached

    def _checked(
        self, features: KeyedJaggedTensor, variable_batch: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The batch's ``(ids int64, lengths int64, per-sample weights float32 | None)``
        after every check (one host sync on the fast path); raises ``KVInputError``
        naming the table and feature. ``variable_batch``: a batch size per feature
        (VBE) is allowed."""
        if features.variable_stride_per_key() and not variable_batch:
            raise KVInputError("variable batch size per feature is not supported here")
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
        if lengths.numel() != sum(features.stride_per_key()):
            raise KVInputError(
                f"lengths has {lengths.numel()} entries, expected {features.stride_per_key()} "
                f"bags for {len(keys)} features"
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
        if lengths.numel() and values.numel():
            # why amin: torch's min() of a whole tensor took 1.4 ms for 327k ids, amin 0.36.
            bad |= torch.minimum(lengths.amin(), values.amin()) < 0
        elif lengths.numel():  # (ids without lengths: ``bad`` already)
            bad |= lengths.amin() < 0
        if torch.compiler.is_compiling():
            # Traced (torch.compile, torch.export): checked on the device, no branch;
            # the eager lookup names the table and feature.
            torch._assert_async(~bad, BAD_BATCH)
        elif bool(bad):  # the one sync of the fast path
            self._explain(features)
        w = weights.to(torch.float32) if weights is not None else None
        return values.to(torch.int64), lengths, w

    def _explain(self, features: KeyedJaggedTensor) -> None:
        """Raise the error a bad batch deserves, naming its table and feature (returns
        when the only fault is a negative id of a feature no KV table reads)."""
        keys = features.keys()
        values = features.values()
        lengths = features.lengths()
        bag_starts = [0]
        for b in features.stride_per_key():
            bag_starts.append(bag_starts[-1] + b)
        length_per_key = per_key_sums(lengths, features.stride_per_key())
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
                check_bags(spec.name, ids, lengths[bag_starts[k] : bag_starts[k + 1]], w)
        if bool((lengths < 0).any()):
            raise KVInputError("lengths must be >= 0")

    def _custom_scores(
        self, features: KeyedJaggedTensor, eviction_scores: Mapping[str, torch.Tensor]
    ) -> tuple[torch.Tensor, dict[str, bool]]:
        """Per-id custom scores (0 where none is given) and which tables have them."""
        keys = features.keys()
        lengths = per_key_sums(features.lengths(), features.stride_per_key())
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


def bag_offsets(lengths: torch.Tensor) -> torch.Tensor:
    """``offsets [B + 1]`` (int64) of bags of these ``lengths``: bag ``b``'s ids are
    ``[offsets[b], offsets[b + 1])``."""
    return torch.nn.functional.pad(torch.cumsum(lengths, 0, dtype=torch.int64), (1, 0))


def per_key_sums(lengths: torch.Tensor, bags_per_key: list[int]) -> list[int]:
    """Ids per key of a KJT whose keys have ``bags_per_key`` bags (one host sync)."""
    if not bags_per_key:
        return []
    counts = torch.tensor(bags_per_key, device=lengths.device)
    key_of_bag = torch.arange(len(bags_per_key), device=lengths.device).repeat_interleave(counts)
    sums = torch.zeros(len(bags_per_key), dtype=torch.int64, device=lengths.device)
    return sums.index_add_(0, key_of_bag, lengths.to(torch.int64)).tolist()
