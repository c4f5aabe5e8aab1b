"""KVEmbeddingBagCollection: the unsharded drop-in for TorchRec's EmbeddingBagCollection."""

from typing import Any

import torch
from torch import nn
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import get_embedding_names_by_table
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from torchrec_kvemb.bag_lookup import BagTable, KVBagLookup
from torchrec_kvemb.collection import KVTablesMixin
from torchrec_kvemb.optimizer import FusedOptimConfig
from torchrec_kvemb.options import KVTableOptions, with_config_init
from torchrec_kvemb.state_dict.hooks import register_unsharded_hooks
from torchrec_kvemb.traceable import KVPooledModule


def options_for(options: KVTableOptions | dict[str, KVTableOptions], table: str) -> KVTableOptions:
    """The options of ``table`` from one shared KVTableOptions or a dict by table name."""
    if isinstance(options, KVTableOptions):
        return options
    if table not in options:
        raise KeyError(f"no KVTableOptions for table {table!r}")
    return options[table]


class KVEmbeddingBagCollection(KVTablesMixin, nn.Module):
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
        # No device: the default one, as the stock module's parameters take it
        # (``with torch.device("meta"):`` builds the tables on meta).
        self._device = torch.device(device) if device is not None else torch.get_default_device()
        self._fused_params = dict(fused_params or {})
        self._optim = FusedOptimConfig.from_fused_params(fused_params)
        names = [c.name for c in tables]
        if len(set(names)) != len(names):
            raise ValueError(
                f"duplicate table name {sorted(n for n in names if names.count(n) > 1)[0]!r}"
            )
        for config in tables:
            if config.pooling not in (PoolingType.SUM, PoolingType.MEAN):
                raise ValueError(f"table {config.name!r}: pooling {config.pooling} not supported")
        self._specs = [
            BagTable(c.name, c.embedding_dim, tuple(c.feature_names), c.pooling == PoolingType.MEAN)
            for c in tables
        ]
        self._options = {c.name: with_config_init(options_for(options, c.name), c) for c in tables}
        self._build_lookup({c.name: self._optim for c in tables})
        # Output keys as the stock module names them: a feature read by several
        # tables is "feature@table" for each.
        self._embedding_names = [n for names in get_embedding_names_by_table(tables) for n in names]
        self._dims = [c.embedding_dim for c in tables for _ in c.feature_names]
        # state_dict: docs/checkpoint-format.md; apply_optimizer_in_backward: KVTablesMixin
        self._entries_attribute = "embedding_bags"
        self._marks_pending = False
        self._data_parallel_checked = False
        register_unsharded_hooks(self, on_mark=self.optimizer_marked)

    def _build_lookup(self, optims: dict[str, FusedOptimConfig]) -> None:
        """The tables (empty) and their lookup, each table with its optimizer."""
        self._optims = dict(optims)
        self._lookup = KVBagLookup(
            self._specs,
            self._options,
            self._optims,
            self._device,
            weights="required" if self._is_weighted else "ignore",
        )
        self._tables = self._lookup.tables()
        # The lookup as one module call: what fx tracing and scripting see of it.
        self._pooled = KVPooledModule(self._lookup)

    # ---------------------------------------------------------- TorchRec API
    def embedding_bag_configs(self) -> list[EmbeddingBagConfig]:
        return self._embedding_bag_configs

    def is_weighted(self) -> bool:
        return self._is_weighted

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
        keys = features.keys()
        lengths = features.lengths().view(len(keys), -1).sum(dim=1).tolist() if keys else []
        starts = [0]
        for n in lengths:
            starts.append(starts[-1] + n)
        position = {k: i for i, k in enumerate(keys)}
        values = features.values()
        tables = self.kv_tables()
        for config in self._embedding_bag_configs:
            table = tables[config.name]
            parts = [
                values[starts[position[f]] : starts[position[f] + 1]]
                for f in config.feature_names
                if f in position
            ]
            if parts and table.ssd is not None:
                table.prefetch(torch.cat(parts))

    # --------------------------------------------------------------- forward
    def forward(
        self,
        features: KeyedJaggedTensor,
        eviction_scores: dict[str, torch.Tensor] | None = None,
    ) -> KeyedTensor:
        """Pool every feature's bags; ``eviction_scores`` (per feature, one int per id)
        feeds tables with ``EvictionPolicy.CUSTOM_SCORE``.

        ``torch.fx.symbolic_trace`` / ``torchrec.fx.symbolic_trace`` and
        ``torch.jit.script`` take this module (the lookup is one opaque call, see
        :mod:`torchrec_kvemb.traceable`)."""
        if not torch.jit.is_scripting() and self._marks_pending:
            self.apply_marked_optimizers()
        if (
            not torch.jit.is_scripting()
            and not torch.compiler.is_compiling()
            and not self._data_parallel_checked
        ):
            self.refuse_data_parallel()
        pooled = self._pooled(features, eviction_scores)
        return KeyedTensor(keys=self._embedding_names, length_per_key=self._dims, values=pooled)
