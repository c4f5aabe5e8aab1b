"""Key-value, zero-collision embedding tables for TorchRec."""

import torchrec_kvemb.inference  # noqa: F401 (KV collections in quantize_inference_model)
from torchrec_kvemb.contracts import BucketizeResult
from torchrec_kvemb.dispatch import block_bucketize_2d
from torchrec_kvemb.ebc import KVEmbeddingBagCollection
from torchrec_kvemb.ec import KVEmbeddingCollection
from torchrec_kvemb.optimizer import FusedOptimConfig
from torchrec_kvemb.options import (
    EvictionPolicy,
    HostTierOptions,
    Initializer,
    KVTableOptions,
    SSDOptions,
    TTLOptions,
)
from torchrec_kvemb.sharding import KVEmbeddingBagCollectionSharder, KVEmbeddingCollectionSharder
from torchrec_kvemb.table import KVTable
from torchrec_kvemb.tiered import TieredKVTable
from torchrec_kvemb.validation import KVInputError

__all__ = [
    "BucketizeResult",
    "block_bucketize_2d",
    "EvictionPolicy",
    "FusedOptimConfig",
    "HostTierOptions",
    "Initializer",
    "KVEmbeddingBagCollection",
    "KVEmbeddingBagCollectionSharder",
    "KVEmbeddingCollection",
    "KVEmbeddingCollectionSharder",
    "KVInputError",
    "KVTable",
    "KVTableOptions",
    "SSDOptions",
    "TieredKVTable",
    "TTLOptions",
]
