"""KVEmbeddingBagCollection: the unsharded drop-in for TorchRec's EmbeddingBagCollection."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from torchrec_kvemb.lookup import KVPooledLookup, pooled_forward
from torchrec_kvemb.optimizer import FusedOptimConfig
from torchrec_kvemb.options import KVTableOptions
from torchrec_kvemb.state_dict.hooks import register_unsharded_hooks
from torchrec_kvemb.state_dict.layout import TableLayout
from torchrec_kvemb.table import KVTable
from torchrec_kvemb.validation import KVInputError, check_bags, check_ids


def options_for(options: KVTableOptions | dict[str, KVTableOptions], table: str) -> KVTableOptions:
    """The options of ``table`` from one shared KVTableOptions or a dict by table name."""
    if isinstance(options, KVTableOptions):
        return options
    if table not in options:
        raise KeyError(f"no KVTableOptions for table {table!r}")
    return options[table]


class KVEmbeddingBagCollection(nn.Module):
    """EmbeddingBagCollection whose tables are KV (zero-collision) tables.

    Takes the same ``EmbeddingBagConfig``s; ``num_embeddings`` is the id-space
    size and may be up to 2**63 - 1 (memory follows ``options``, not it).
    In training mode forward stores new ids (admission and eviction apply) and
    backward updates rows with the fused optimizer from ``fused_params``; in
    eval mode it is read-only and ids without a row pool as zeros.

    Example::

        ebc = KVEmbeddingBagCollection(
            tables=[EmbeddingBagConfig(name="t", embedding_dim=8,
                                       num_embeddings=2**63 - 1, feature_names=["f"])],
            options=KVTableOptions(capacity=10_000),
            fused_params={"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
                          "learning_rate": 0.05},
        )
        kt = ebc(KeyedJaggedTensor.from_lengths_sync(
            keys=["f"], values=torch.tensor([3, 2**40, 7]), lengths=torch.tensor([2, 1])))
        kt["f"].sum().backward()
    """

    def __init__(
        self,
        tables: list[EmbeddingBagConfig],
        options: KVTableOptions | dict[str, KVTableOptions],
        device: torch.device | str | None = None,
        is_weighted: bool = False,
        fused_params: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self._is_weighted = is_weighted
        self._embedding_bag_configs = list(tables)
        self._device = torch.device(device or "cpu")
        self._optim = FusedOptimConfig.from_fused_params(fused_params)
        self._tables: dict[str, KVTable] = {}
        self._mean: dict[str, bool] = {}
        seen_features: set[str] = set()
        for config in tables:
            if config.name in self._tables:
                raise ValueError(f"duplicate table name {config.name!r}")
            if config.pooling not in (PoolingType.SUM, PoolingType.MEAN):
                raise ValueError(f"table {config.name!r}: pooling {config.pooling} not supported")
            for feature in config.feature_names:
                if feature in seen_features:
                    raise ValueError(f"feature {feature!r} is used by two tables")
                seen_features.add(feature)
            self._tables[config.name] = KVTable(
                config.name,
                config.embedding_dim,
                options_for(options, config.name),
                self._optim,
                self._device,
            )
            self._mean[config.name] = config.pooling == PoolingType.MEAN
        self._anchor = torch.empty(0, requires_grad=True)
        self._feature_names = [f for c in tables for f in c.feature_names]
        self._dims = [c.embedding_dim for c in tables for _ in c.feature_names]
        register_unsharded_hooks(self)  # state_dict: docs/checkpoint-format.md

    # ---------------------------------------------------------- TorchRec API
    def embedding_bag_configs(self) -> list[EmbeddingBagConfig]:
        return self._embedding_bag_configs

    def is_weighted(self) -> bool:
        return self._is_weighted

    @property
    def device(self) -> torch.device:
        return self._device

    def table(self, name: str) -> KVTable:
        """The KVTable named ``name``."""
        return self._tables[name]

    def kv_tables(self) -> dict[str, KVTable]:
        """Every KVTable by name (``tables`` is not used: TorchRec's planner reads it)."""
        return dict(self._tables)

    def kv_layouts(self) -> list[TableLayout]:
        """Every table as its state_dict and checkpoints see it (whole, in this process)."""
        return [TableLayout.unsharded(table) for table in self._tables.values()]

    def metrics(self) -> dict[str, dict[str, float]]:
        """``KVTable.metrics()`` of every table, by name."""
        return {name: t.metrics() for name, t in self._tables.items()}

    # -------------------------------------------------------------- prefetch
    def prefetch(
        self,
        features: KeyedJaggedTensor,
        forward_stream: torch.Stream | None = None,
        ctx: object | None = None,
    ) -> None:
        """Start reading the SSD rows a coming batch needs, on each SSD table's
        background thread, so the reads overlap the current batch's compute; the
        next forward uses them (its results are the same with or without this).

        The signature follows TorchRec's ``prefetch`` hook (``TrainPipelinePrefetch``
        calls it with the next batch while the current one runs);
        ``forward_stream`` and ``ctx`` are accepted and unused. Tables without an
        SSD tier ignore it. Example::

            for batch, upcoming in zip(batches, batches[1:] + [None]):
                if upcoming is not None:
                    ebc.prefetch(upcoming)
                model(ebc(batch)).backward()
        """
        batches = self._split(features, None)
        for name, (ids, _, _, _) in batches.items():
            self._tables[name].prefetch(ids)

    # --------------------------------------------------------------- forward
    def forward(
        self,
        features: KeyedJaggedTensor,
        eviction_scores: dict[str, torch.Tensor] | None = None,
    ) -> KeyedTensor:
        """Pool every feature's bags; ``eviction_scores`` (per feature, one int per id)
        feeds tables with ``EvictionPolicy.CUSTOM_SCORE``."""
        batches = self._split(features, eviction_scores)
        pooled = []
        for config in self._embedding_bag_configs:
            table = self._tables[config.name]
            ids, offsets, weights, scores = batches[config.name]
            mean = self._mean[config.name]
            if self.training:
                slots = table.lookup_train(ids, scores)
                out = KVPooledLookup.apply(
                    self._anchor, table, slots, ids, offsets, weights, mean, True
                )
            else:
                slots = table.lookup_eval(ids)
                out = pooled_forward(table, slots, ids, offsets, weights, mean, True)
            pooled.extend(out.split(features.stride(), dim=0))
        return KeyedTensor(
            keys=self._feature_names,
            length_per_key=self._dims,
            values=torch.cat(pooled, dim=1),
        )

    def _split(
        self,
        features: KeyedJaggedTensor,
        eviction_scores: dict[str, torch.Tensor] | None,
    ) -> dict[str, tuple]:
        """Validate the whole batch, then group it by table: (ids, offsets, weights, scores)."""
        if features.variable_stride_per_key():
            raise KVInputError("variable batch size per feature is not supported unsharded")
        keys = features.keys()
        position = {k: i for i, k in enumerate(keys)}
        values = features.values()
        lengths = features.lengths()
        weights = features.weights_or_none()
        if self._is_weighted and weights is None:
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
        length_per_key = lengths.view(len(keys), stride).sum(dim=1).tolist() if keys else []
        if sum(length_per_key) != values.numel():
            raise KVInputError(
                f"lengths sum to {sum(length_per_key)} but there are {values.numel()} ids"
            )
        starts = [0]
        for n in length_per_key:
            starts.append(starts[-1] + n)
        out = {}
        for config in self._embedding_bag_configs:
            parts_ids, parts_len, parts_w, parts_s = [], [], [], []
            for feature in config.feature_names:
                if feature not in position:
                    raise KVInputError(f"table {config.name!r}: feature {feature!r} is missing")
                k = position[feature]
                lo, hi = starts[k], starts[k + 1]
                ids = check_ids(config.name, values[lo:hi], what=f"ids of feature {feature!r}")
                parts_ids.append(ids)
                parts_len.append(lengths[k * stride : (k + 1) * stride])
                if self._is_weighted:
                    parts_w.append(weights[lo:hi])
                if eviction_scores is not None and feature in eviction_scores:
                    score = eviction_scores[feature]
                    if score.numel() != hi - lo:
                        raise KVInputError(
                            f"table {config.name!r}: eviction_scores of {feature!r} has "
                            f"{score.numel()} entries for {hi - lo} ids"
                        )
                    parts_s.append(score)
            ids = torch.cat(parts_ids)
            table_lengths = torch.cat(parts_len).to(torch.int64)
            w = torch.cat(parts_w).to(torch.float32) if self._is_weighted else None
            check_bags(config.name, ids, table_lengths, w)
            scores = None
            if parts_s:
                if len(parts_s) != len(config.feature_names):
                    raise KVInputError(
                        f"table {config.name!r}: eviction_scores must cover all its features"
                    )
                scores = torch.cat(parts_s)
            offsets = torch.zeros(table_lengths.numel() + 1, dtype=torch.int64, device=ids.device)
            torch.cumsum(table_lengths, 0, out=offsets[1:])
            out[config.name] = (
                ids.to(self._device),
                offsets.to(self._device),
                None if w is None else w.to(self._device),
                scores,
            )
        return out
