"""KVEmbeddingCollection: the unsharded drop-in for TorchRec's EmbeddingCollection."""

from typing import Any

import torch
from torch import nn
from torchrec.modules.embedding_configs import EmbeddingConfig
from torchrec.modules.embedding_modules import get_embedding_names_by_table
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor

from torchrec_kvemb.bag_lookup import BagTable
from torchrec_kvemb.collection import KVTablesMixin
from torchrec_kvemb.ebc import options_for
from torchrec_kvemb.optimizer import FusedOptimConfig
from torchrec_kvemb.options import KVTableOptions, with_config_init
from torchrec_kvemb.sequence_lookup import KVSequenceLookup
from torchrec_kvemb.state_dict.hooks import register_unsharded_hooks
from torchrec_kvemb.traceable import KVSequenceModule


class KVEmbeddingCollection(KVTablesMixin, nn.Module):
    """EmbeddingCollection whose tables are KV (zero-collision) tables: one row per id,
    unpooled, for sequence models.

    Takes the same ``EmbeddingConfig``s (one dim for all tables, as TorchRec's
    module requires); ``num_embeddings`` is the id-space size, up to 2**63 - 1.
    ``forward(kjt)`` gives ``{feature: JaggedTensor}`` with the rows ``[ids of the
    feature, dim]`` and the feature's lengths (and its ids as weights with
    ``need_indices``), exactly like ``EmbeddingCollection``; a feature read by several
    tables gives ``feature@table`` for each, as there. Training stores new ids
    (admission and eviction apply) and backward updates the rows with the fused
    optimizer from ``fused_params``; eval is read-only and ids without a row get
    zeros. ``.table(name)`` returns a table's ``KVTable``. In eval mode it traces
    with ``torch.fx`` / ``torchrec.fx`` and scripts with ``torch.jit.script``
    (:mod:`torchrec_kvemb.traceable`); built on the meta device, its forward gives
    meta rows of the stock module's shapes.

    Example::

        ec = KVEmbeddingCollection(
            tables=[EmbeddingConfig(name="items", embedding_dim=8,
                                    num_embeddings=2**63 - 1, feature_names=["history"])],
            options=KVTableOptions(capacity=10_000),
            fused_params={"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
                          "learning_rate": 0.05},
        )
        out = ec(KeyedJaggedTensor.from_lengths_sync(
            keys=["history"], values=torch.tensor([3, 2**40, 7]), lengths=torch.tensor([2, 1])))
        out["history"].values().sum().backward()
    """

    def __init__(
        self,
        tables: list[EmbeddingConfig],
        options: KVTableOptions | dict[str, KVTableOptions],
        device: torch.device | str | None = None,
        fused_params: dict[str, Any] | None = None,
        need_indices: bool = False,
    ) -> None:
        super().__init__()
        self._embedding_configs = list(tables)
        # No device: the default one, as the stock module's parameters take it
        # (``with torch.device("meta"):`` builds the tables on meta).
        self._device = torch.device(device) if device is not None else torch.get_default_device()
        self._need_indices = need_indices
        self._fused_params = dict(fused_params or {})
        self._optim = FusedOptimConfig.from_fused_params(fused_params)
        names = [c.name for c in tables]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate table name in {names}")
        dims = {c.embedding_dim for c in tables}
        if len(dims) > 1:
            raise ValueError(
                f"the tables of an EmbeddingCollection share one embedding_dim, got {sorted(dims)}"
            )
        self._specs = [BagTable(c.name, c.embedding_dim, tuple(c.feature_names)) for c in tables]
        self._options = {c.name: with_config_init(options_for(options, c.name), c) for c in tables}
        self._build_lookup({c.name: self._optim for c in tables})
        # Output keys as the stock module names them (a feature read by several
        # tables is "feature@table" for each), and the feature each one reads.
        self._embedding_names = [
            name for names in get_embedding_names_by_table(tables) for name in names
        ]
        self._source_features = [f for c in tables for f in c.feature_names]
        # state_dict: docs/checkpoint-format.md; apply_optimizer_in_backward: KVTablesMixin
        self._entries_attribute = "embeddings"
        self._marks_pending = False
        self._data_parallel_checked = False
        register_unsharded_hooks(self, attribute="embeddings", on_mark=self.optimizer_marked)

    def _build_lookup(self, optims: dict[str, FusedOptimConfig]) -> None:
        """The tables (empty) and their lookup, each table with its optimizer."""
        self._optims = dict(optims)
        self._lookup = KVSequenceLookup(self._specs, self._options, self._optims, self._device)
        self._tables = self._lookup.tables()
        # The lookup as one module call: what fx tracing and scripting see of it.
        self._sequences = KVSequenceModule(self._lookup)

    # ---------------------------------------------------------- TorchRec API
    def embedding_configs(self) -> list[EmbeddingConfig]:
        return self._embedding_configs

    def embedding_dim(self) -> int:
        return self._embedding_configs[0].embedding_dim if self._embedding_configs else -1

    def need_indices(self) -> bool:
        return self._need_indices

    def embedding_names_by_table(self) -> list[list[str]]:
        return get_embedding_names_by_table(self._embedding_configs)

    # --------------------------------------------------------------- forward
    def forward(
        self,
        features: KeyedJaggedTensor,
        eviction_scores: dict[str, torch.Tensor] | None = None,
    ) -> dict[str, JaggedTensor]:
        """Every feature's rows as a ``JaggedTensor`` (``feature@table`` for a feature
        several tables read); ``eviction_scores`` (per feature, one int per id) feeds
        tables with ``EvictionPolicy.CUSTOM_SCORE``."""
        if not torch.jit.is_scripting() and self._marks_pending:
            self.apply_marked_optimizers()
        if (
            not torch.jit.is_scripting()
            and not torch.compiler.is_compiling()
            and not self._data_parallel_checked
        ):
            self.refuse_data_parallel()
        rows = self._sequences(features, eviction_scores)
        jagged = features.to_dict()
        out: dict[str, JaggedTensor] = {}
        for i, name in enumerate(self._embedding_names):
            feature = jagged[self._source_features[i]]
            out[name] = JaggedTensor(
                values=rows[i],
                lengths=feature.lengths(),
                weights=feature.values() if self._need_indices else None,
            )
        return out
