"""KV collections under TorchRec's inference quantization (docs/inference.md).

``torchrec.inference.modules.quantize_inference_model`` swaps each module whose
type name is in its mapping (``DEFAULT_QUANT_MAPPING``) for the mapped type's
``from_float`` of it, through torch's ``quantize_dynamic``. Importing
``torchrec_kvemb`` adds the KV collections to that mapping (``KV_QUANT_MAPPING``),
so the call never passes over a KV table silently. By the dtype asked for each
table (``quantization_dtype``, or ``per_table_weight_dtype`` by table name):

* every table ``torch.float16`` / ``torch.bfloat16``: a read-only collection of
  the same class whose tables hold every stored id's row in that dtype, keyed by
  id as before (``QuantKVEmbeddingBagCollection`` / ``QuantKVEmbeddingCollection``);
* some table ``torch.int8`` (the function's default), the others int8 or half:
  an int8 inference collection (``inference_int8``: row-wise int8 codes with a
  scale and bias per row, ids found by binary search);
* any other dtype (int4, ...): refused with a ``ValueError`` naming the tables.

Outputs equal the float module's in eval mode to the rows' rounding. Sharded KV
collections are refused: quantize the unsharded model (as TorchRec's inference
flow does: quantize, then shard).

Example::

    model.eval()
    quantize_inference_model(model)  # int8 rows
    quantize_inference_model(other, quantization_dtype=torch.float16)
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch import nn
from torchrec.inference.modules import (
    DEFAULT_QUANT_MAPPING,
    trim_torch_package_prefix_from_typename,
)

from torchrec_kvemb.ebc import KVEmbeddingBagCollection
from torchrec_kvemb.ec import KVEmbeddingCollection
from torchrec_kvemb.inference_int8 import INT8_ROW_DTYPES, int8_copy
from torchrec_kvemb.options import EvictionPolicy, KVTableOptions

__all__ = [
    "KV_QUANT_MAPPING",
    "QUANT_ROW_DTYPES",
    "QuantKVEmbeddingBagCollection",
    "QuantKVEmbeddingCollection",
    "quantized_copy",
    "register_quant_mapping",
]

#: Row dtypes a KV table can be quantized to.
QUANT_ROW_DTYPES = (torch.float16, torch.bfloat16)


def requested_dtypes(module: nn.Module) -> dict[str, torch.dtype]:
    """Each KV table's row dtype asked for by the ``qconfig`` torch's quantization
    gave ``module`` (its weight observer's dtype; ``per_table_weight_dtype`` by
    table name where TorchRec's ``QuantConfig`` has one)."""
    qconfig = getattr(module, "qconfig", None)
    if qconfig is None:
        raise ValueError(f"{type(module).__name__}: no qconfig to quantize by")
    default = qconfig.weight().dtype
    per_table = getattr(qconfig, "per_table_weight_dtype", None) or {}
    return {name: per_table.get(name, default) for name in module.kv_tables()}


def _inference_options(options: KVTableOptions, capacity: int) -> KVTableOptions:
    """A table's options for its read-only copy: every row in memory (no SSD tier),
    none evicted or waiting for admission, at the table's capacity now (no growth)."""
    return replace(
        options,
        capacity=capacity,
        memory_budget_bytes=None,
        eviction=EvictionPolicy.NONE,
        admission_threshold=1,
        admission_counter_capacity=None,
        ssd=None,
        initial_capacity=None,
    )


def _refused_names(dtypes: dict[str, torch.dtype], allowed: tuple[torch.dtype, ...]) -> str:
    """The tables of ``dtypes`` whose dtype is not in ``allowed``, as ``'t' (dtype)``
    joined by commas in name order; empty when every table's dtype is allowed."""
    refused = {n: d for n, d in dtypes.items() if d not in allowed}
    return ", ".join(f"{n!r} ({d})" for n, d in sorted(refused.items(), key=str))


def quantized_copy(
    module: KVEmbeddingBagCollection | KVEmbeddingCollection,
    dtypes: dict[str, torch.dtype],
) -> nn.Module:
    """A read-only copy of ``module`` (``QuantKVEmbeddingBagCollection`` or
    ``QuantKVEmbeddingCollection``, in eval mode) whose tables store every id of
    ``module``'s (memory and SSD tiers) with its row in ``dtypes[table]``, one of
    ``QUANT_ROW_DTYPES``; other dtypes are refused, naming the tables."""
    names = _refused_names(dtypes, QUANT_ROW_DTYPES)
    if names:
        raise ValueError(
            f"{type(module).__name__}: KV table(s) {names} cannot be quantized to that "
            "dtype: a KV table's rows are float32, float16 or bfloat16. Pass "
            "quantization_dtype=torch.float16 (or per_table_weight_dtype={table: "
            "torch.float16}) to quantize_inference_model (on a freshly built or loaded "
            "model: torch keeps the qconfig a failed call left on its modules), or keep "
            "the float model for inference (docs/inference.md)"
        )
    tables = module.kv_tables()
    if _device_of(module).type == "meta":  # no rows to copy: the same tables, on meta
        options = {
            name: replace(_inference_options(t.options, t.capacity), weights_dtype=dtypes[name])
            for name, t in tables.items()
        }
        return _build(module, options).eval()
    exports = {name: table.export() for name, table in tables.items()}
    capacity = {name: max(table.capacity, 1) for name, table in tables.items()}
    while True:
        options = {
            name: replace(_inference_options(t.options, capacity[name]), weights_dtype=dtypes[name])
            for name, t in tables.items()
        }
        quant = _build(module, options)
        full = []
        for name, table in quant.kv_tables().items():
            rows = exports[name]
            if rows["ids"].numel():
                slots = table.insert(rows["ids"], rows["weights"].to(torch.float32))
                if bool((slots < 0).any()):  # a bucket overflowed: twice the room
                    full.append(name)
        if not full:
            return quant.eval()
        for name in full:
            capacity[name] *= 2


def _from_float(module: nn.Module) -> nn.Module:
    try:
        dtypes = requested_dtypes(module)
        if all(d in QUANT_ROW_DTYPES for d in dtypes.values()):
            return quantized_copy(module, dtypes)
        names = _refused_names(dtypes, INT8_ROW_DTYPES)
        if names:
            raise ValueError(
                f"{type(module).__name__}: KV table(s) {names} cannot be quantized to "
                "that dtype: KV tables quantize to torch.int8, torch.float16 or "
                "torch.bfloat16 rows. Pass one of them as quantization_dtype (or "
                "per_table_weight_dtype={table: ...}) to quantize_inference_model, on a "
                "freshly built or loaded model (torch keeps the qconfig a failed call "
                "left on its modules); see docs/inference.md"
            )
        return int8_copy(module, dtypes)
    except ValueError:
        # why: torch keeps a module's qconfig over the next call's; a retry with
        # another dtype must see the new one.
        module.__dict__.pop("qconfig", None)
        raise


def _device_of(module: nn.Module) -> torch.device:
    tables = list(module.kv_tables().values())
    return tables[0].device if tables else torch.get_default_device()


def _build(module: nn.Module, options: dict[str, KVTableOptions]) -> nn.Module:
    if isinstance(module, KVEmbeddingBagCollection):
        return QuantKVEmbeddingBagCollection(
            module.embedding_bag_configs(),
            options,
            device=_device_of(module),
            is_weighted=module.is_weighted(),
        )
    return QuantKVEmbeddingCollection(
        module.embedding_configs(), options, device=_device_of(module),
        need_indices=module.need_indices(),
    )  # fmt: skip


class QuantKVEmbeddingBagCollection(KVEmbeddingBagCollection):
    """A ``KVEmbeddingBagCollection`` quantized for inference: float16 or bfloat16
    rows, keyed by id, read-only (what ``quantize_inference_model`` makes of one).

    Example::

        quant = QuantKVEmbeddingBagCollection.from_float(ebc)  # ebc.qconfig set
        quant(kjt)  # the float module's eval outputs, to float16 rounding
    """

    @classmethod
    def from_float(cls, module: nn.Module) -> nn.Module:
        """The quantized copy of ``module`` by the dtypes its ``qconfig`` asks for."""
        return _from_float(module)

    def train(self, mode: bool = True) -> QuantKVEmbeddingBagCollection:
        """Read-only whatever ``mode`` says: an inference table stays in eval mode."""
        return super().train(False)


class QuantKVEmbeddingCollection(KVEmbeddingCollection):
    """A ``KVEmbeddingCollection`` quantized for inference: float16 or bfloat16 rows,
    keyed by id, read-only (what ``quantize_inference_model`` makes of one).

    Example::

        quant = QuantKVEmbeddingCollection.from_float(ec)  # ec.qconfig set
        quant(kjt)["f"].values()  # the float module's rows, to float16 rounding
    """

    @classmethod
    def from_float(cls, module: nn.Module) -> nn.Module:
        """The quantized copy of ``module`` by the dtypes its ``qconfig`` asks for."""
        return _from_float(module)

    def train(self, mode: bool = True) -> QuantKVEmbeddingCollection:
        """Read-only whatever ``mode`` says: an inference table stays in eval mode."""
        return super().train(False)


class ShardedKVRefusal:
    """What ``quantize_inference_model`` maps sharded KV collections to: a refusal."""

    @classmethod
    def from_float(cls, module: nn.Module) -> Any:
        raise ValueError(
            f"{type(module).__name__}: quantize_inference_model quantizes unsharded "
            "modules; quantize the unsharded model (KV collections to float16 / bfloat16 "
            "rows), then shard it (docs/inference.md)"
        )


def _typename(cls: type) -> str:
    return trim_torch_package_prefix_from_typename(torch.typename(cls))


def _sharded_types() -> list[type]:
    from torchrec_kvemb.sharding.sharded_ebc import ShardedKVEmbeddingBagCollection
    from torchrec_kvemb.sharding.sharded_ec import ShardedKVEmbeddingCollection

    return [ShardedKVEmbeddingBagCollection, ShardedKVEmbeddingCollection]


#: KV module type names -> what ``quantize_inference_model`` swaps them for; merge
#: it into a ``quantization_mapping`` of your own.
KV_QUANT_MAPPING: dict[str, type] = {
    _typename(KVEmbeddingBagCollection): QuantKVEmbeddingBagCollection,
    _typename(KVEmbeddingCollection): QuantKVEmbeddingCollection,
    **{_typename(t): ShardedKVRefusal for t in _sharded_types()},
}


def register_quant_mapping() -> None:
    """Add ``KV_QUANT_MAPPING`` to TorchRec's default quantization mapping (done when
    ``torchrec_kvemb`` is imported)."""
    DEFAULT_QUANT_MAPPING.update(KV_QUANT_MAPPING)


register_quant_mapping()
