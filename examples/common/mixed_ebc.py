"""One collection of KV and stock tables at world size 1, keyed like one ``EmbeddingBagCollection``.

The sharded DLRM has one ``EmbeddingBagCollection`` whose KV tables the
sharder replaces; unsharded, KV tables need a ``KVEmbeddingBagCollection``
and the others a stock collection. :class:`MixedEmbeddingBagCollection` holds
both and shows them as one: one ``KeyedTensor`` of every feature, and the
``state_dict`` keys of one collection, so the sharded model's checkpoint loads
into it.

Example::

    ebc = MixedEmbeddingBagCollection(configs, kv_options, fused_params, torch.device("cpu"))
    checkpoint.load(build_dlrm(ebc, args, device), "demo_out/ckpt")
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from torchrec_kvemb import KVEmbeddingBagCollection, KVTableOptions


@torch.fx.wrap
def select_features(features: KeyedJaggedTensor, names: list[str]) -> KeyedJaggedTensor:
    """The features ``names`` of a batch (one call in an fx graph)."""
    jts = features.to_dict()
    return KeyedJaggedTensor.from_jt_dict({n: jts[n] for n in names})


class MixedEmbeddingBagCollection(nn.Module):
    """KV tables in a ``KVEmbeddingBagCollection``, the others in a stock
    ``EmbeddingBagCollection``, seen from outside as one collection of every
    table: ``forward`` returns one ``KeyedTensor`` of all features and the
    ``state_dict`` keys are those of one ``EmbeddingBagCollection``
    (``embedding_bags.<table>...``), so a checkpoint of the sharded model loads
    into it."""

    def __init__(
        self,
        tables: list[EmbeddingBagConfig],
        options: dict[str, KVTableOptions],
        fused: dict[str, Any],
        device: torch.device,
    ) -> None:
        super().__init__()
        self._configs = list(tables)
        self._kv_names = set(options)
        kv = [c for c in tables if c.name in options]
        stock = [c for c in tables if c.name not in options]
        self.kv = KVEmbeddingBagCollection(kv, options, device=device, fused_params=fused)
        self.stock = EmbeddingBagCollection(stock, device=device) if stock else None
        self._kv_features = [f for c in kv for f in c.feature_names]
        self._stock_features = [f for c in stock for f in c.feature_names]
        self._features = [f for c in tables for f in c.feature_names]
        self._dims = [c.embedding_dim for c in tables for _ in c.feature_names]
        self.register_state_dict_post_hook(self._flatten_keys)
        self.register_load_state_dict_pre_hook(self._nest_keys)

    def embedding_bag_configs(self) -> list[EmbeddingBagConfig]:
        return self._configs

    def is_weighted(self) -> bool:
        return False

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        """One ``KeyedTensor`` of every feature; fx-traceable (the split of the
        batch between the two collections is one call in the graph)."""
        outputs = {}
        for module, names in ((self.kv, self._kv_features), (self.stock, self._stock_features)):
            if names:
                out = module(select_features(features, names))
                outputs.update({n: out for n in names})
        return KeyedTensor(
            keys=self._features,
            length_per_key=self._dims,
            values=torch.cat([outputs[f][f] for f in self._features], dim=1),
        )

    @staticmethod
    def _flatten_keys(module: nn.Module, state: dict, prefix: str, _metadata: Any) -> None:
        for sub in ("kv.", "stock."):
            for key in [k for k in state if k.startswith(prefix + sub)]:
                state[prefix + key[len(prefix + sub) :]] = state.pop(key)

    def _nest_keys(self, _module: nn.Module, state: dict, prefix: str, *_: Any) -> None:
        head = prefix + "embedding_bags."
        for key in [k for k in state if k.startswith(head)]:
            table = key[len(head) :].split(".", 1)[0]
            sub = "kv." if table in self._kv_names else "stock."
            state[prefix + sub + key[len(prefix) :]] = state.pop(key)
