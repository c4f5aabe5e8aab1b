"""Int8 inference tables made from KV collections (docs/inference.md).

What ``quantize_inference_model`` makes of a KV collection when a table asks for
``torch.int8`` rows: a read-only module holding, per table, the ids stored in the
float tables (memory and SSD tiers) sorted, and their rows quantized row-wise as
FBGEMM's int8 tables are (``uint8`` codes with a float32 scale and bias per row:
``row = code * scale + bias``, ``scale = (max - min) / 255``, ``bias = min``).
Tables that ask for ``torch.float16`` / ``torch.bfloat16`` in the same
collection keep their rows in that dtype. A lookup finds an id by binary search
(``torch.searchsorted``); ids without a row give zeros, as a read-only KV table
does.

Example::

    quant = int8_copy(ebc, {"t": torch.int8})
    quant(kjt)  # ebc's eval outputs, to the rows' quantization step
"""

from __future__ import annotations

import torch
from torch import nn
from torchrec.modules.embedding_configs import (
    EmbeddingBagConfig,
    EmbeddingConfig,
    PoolingType,
)
from torchrec.modules.embedding_modules import get_embedding_names_by_table
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor, KeyedTensor

__all__ = [
    "INT8_ROW_DTYPES",
    "Int8KVEmbeddingBagCollection",
    "Int8KVEmbeddingCollection",
    "QuantizedRows",
    "int8_copy",
]

#: Row dtypes a table of an int8 inference collection can hold.
INT8_ROW_DTYPES = (torch.int8, torch.float16, torch.bfloat16)


class QuantizedRows(nn.Module):
    """One table's rows for inference: ``ids`` sorted ``[n]``, ``rows`` ``[n, dim]``
    (``uint8`` codes with ``scale_bias`` ``[n, 2]`` for int8, else float16 or
    bfloat16 values).

    Example::

        table = QuantizedRows.of(ids, weights, torch.int8)
        rows = table.lookup(torch.tensor([3, 2**40]))  # [2, dim] float32
    """

    def __init__(
        self, ids: torch.Tensor, rows: torch.Tensor, scale_bias: torch.Tensor | None
    ) -> None:
        super().__init__()
        self.register_buffer("ids", ids)
        self.register_buffer("rows", rows)
        self.register_buffer("scale_bias", scale_bias)

    @classmethod
    def of(cls, ids: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype) -> QuantizedRows:
        """The table of ``ids`` (sorted, unique) with float rows ``weights`` in ``dtype``."""
        weights = weights.to(torch.float32)
        if dtype != torch.int8:
            return cls(ids, weights.to(dtype), None)
        low = weights.amin(dim=1, keepdim=True) if weights.numel() else weights[:, :1]
        high = weights.amax(dim=1, keepdim=True) if weights.numel() else weights[:, :1]
        scale = (high - low) / 255.0
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        codes = torch.round((weights - low) / safe).clamp_(0, 255).to(torch.uint8)
        return cls(ids, codes, torch.cat([scale, low], dim=1))

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the rows were quantized to."""
        return torch.int8 if self.scale_bias is not None else self.rows.dtype

    def dequantized(self) -> torch.Tensor:
        """Every row as float32 ``[n, dim]``."""
        rows = self.rows.to(torch.float32)
        if self.scale_bias is None:
            return rows
        return rows * self.scale_bias[:, :1] + self.scale_bias[:, 1:]

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows of ``ids`` ``[len(ids), dim]`` float32; zeros for ids without one."""
        n, dim = self.rows.shape
        if n == 0:
            return torch.zeros(ids.numel(), dim, device=ids.device)
        pos = torch.searchsorted(self.ids, ids).clamp_(max=n - 1)
        found = self.ids.index_select(0, pos) == ids
        rows = self.rows.index_select(0, pos).to(torch.float32)
        if self.scale_bias is not None:
            scale_bias = self.scale_bias.index_select(0, pos)
            rows = rows * scale_bias[:, :1] + scale_bias[:, 1:]
        return rows * found.unsqueeze(1)


def _tables(module: nn.Module, dtypes: dict[str, torch.dtype]) -> nn.ModuleDict:
    refused = {n: d for n, d in dtypes.items() if d not in INT8_ROW_DTYPES}
    if refused:
        names = ", ".join(f"{n!r} ({d})" for n, d in sorted(refused.items(), key=str))
        raise ValueError(f"{type(module).__name__}: no inference table of KV table(s) {names}")
    out = nn.ModuleDict()
    for name, table in module.kv_tables().items():
        if table.weights.device.type == "meta":  # no rows to copy
            ids = torch.empty(0, dtype=torch.int64, device="meta")
            weights = torch.empty(0, table.dim, device="meta")
        else:
            rows = table.export()
            ids, weights = rows["ids"], rows["weights"]
        out[name] = QuantizedRows.of(ids, weights, dtypes[name])
    return out


def int8_copy(module: nn.Module, dtypes: dict[str, torch.dtype]) -> nn.Module:
    """The int8 inference collection of a ``KVEmbeddingBagCollection`` /
    ``KVEmbeddingCollection``: each table's rows in ``dtypes[table]`` (one of
    ``INT8_ROW_DTYPES``)."""
    tables = _tables(module, dtypes)
    if hasattr(module, "embedding_bag_configs"):
        return Int8KVEmbeddingBagCollection(
            module.embedding_bag_configs(), tables, module.is_weighted()
        )
    return Int8KVEmbeddingCollection(module.embedding_configs(), tables, module.need_indices())


class Int8KVEmbeddingBagCollection(nn.Module):
    """A KV ``EmbeddingBagCollection`` for inference with int8 (or half) rows:
    forward(KeyedJaggedTensor) -> KeyedTensor, as the float collection in eval
    mode (SUM and MEAN pooling, per-sample weights, ``feature@table`` keys).

    Example::

        quant = int8_copy(ebc, {"t": torch.int8})
        quant(kjt).values()
    """

    def __init__(
        self, configs: list[EmbeddingBagConfig], tables: nn.ModuleDict, is_weighted: bool
    ) -> None:
        super().__init__()
        self._configs = list(configs)
        self.tables = tables
        self._is_weighted = is_weighted
        self._embedding_names = [n for ns in get_embedding_names_by_table(configs) for n in ns]
        self._dims = [c.embedding_dim for c in configs for _ in c.feature_names]

    def embedding_bag_configs(self) -> list[EmbeddingBagConfig]:
        return self._configs

    def is_weighted(self) -> bool:
        return self._is_weighted

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        jagged = features.to_dict()
        pooled = []
        for config in self._configs:
            table = self.tables[config.name]
            for feature in config.feature_names:
                jt = jagged[feature]
                lengths = jt.lengths()
                rows = table.lookup(jt.values())
                if self._is_weighted:
                    rows = rows * jt.weights().unsqueeze(1)
                bags = torch.repeat_interleave(
                    torch.arange(lengths.numel(), device=lengths.device), lengths
                )
                out = rows.new_zeros(lengths.numel(), rows.shape[1]).index_add_(0, bags, rows)
                if config.pooling == PoolingType.MEAN:
                    out = out / lengths.clamp(min=1).unsqueeze(1).to(out.dtype)
                pooled.append(out)
        return KeyedTensor(
            keys=self._embedding_names, length_per_key=self._dims, values=torch.cat(pooled, 1)
        )


class Int8KVEmbeddingCollection(nn.Module):
    """A KV ``EmbeddingCollection`` for inference with int8 (or half) rows:
    forward(KeyedJaggedTensor) -> Dict[str, JaggedTensor], as the float collection
    in eval mode.

    Example::

        quant = int8_copy(ec, {"t": torch.int8})
        quant(kjt)["f"].values()
    """

    def __init__(
        self, configs: list[EmbeddingConfig], tables: nn.ModuleDict, need_indices: bool
    ) -> None:
        super().__init__()
        self._configs = list(configs)
        self.tables = tables
        self._need_indices = need_indices
        self._names = get_embedding_names_by_table(configs)

    def embedding_configs(self) -> list[EmbeddingConfig]:
        return self._configs

    def need_indices(self) -> bool:
        return self._need_indices

    def forward(self, features: KeyedJaggedTensor) -> dict[str, JaggedTensor]:
        jagged = features.to_dict()
        out: dict[str, JaggedTensor] = {}
        for config, names in zip(self._configs, self._names, strict=True):
            table = self.tables[config.name]
            for feature, name in zip(config.feature_names, names, strict=True):
                jt = jagged[feature]
                out[name] = JaggedTensor(
                    values=table.lookup(jt.values()),
                    lengths=jt.lengths(),
                    weights=jt.values() if self._need_indices else None,
                )
        return out
