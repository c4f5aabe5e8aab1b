"""TorchRec's ``ModelParallelStateDictBase`` (installed ``torchrec.distributed.test_utils``)
with the KV sharder as the default sharder, gloo, world size 1:
``test_meta_device_dmp_state_dict`` (a model sharded on CPU and the same model
sharded on meta give state_dict entries of the same sizes, KV tables' included)
and ``test_parameter_init``. The class's other tests pick stock kernels and
sharding types by name (FUSED, UVM caching, column-wise...), which a KV table
does not take. Adaptations: the stand-ins of ``tests/sharding/harness_stub.py``
(a module the wheel lacks; ``hypothesis``, absent here, whose decorators only the
other tests use) and ``get_default_sharders`` patched to return the KV sharder."""

import unittest
from unittest import mock

from fbgemm_gpu.split_embedding_configs import EmbOptimType

from tests.sharding.harness_stub import install_missing_hypothesis, install_missing_test_module
from torchrec_kvemb import KVEmbeddingBagCollectionSharder, KVTableOptions

SGD = {"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": 0.1}
CALLS: list[int] = []


def kv_sharder() -> list:
    CALLS.append(1)
    names = [f"table_{i}" for i in range(4)] + [f"weighted_table_{i}" for i in range(2)]
    return [KVEmbeddingBagCollectionSharder({n: KVTableOptions(capacity=64) for n in names}, SGD)]


def test_model_parallel_state_dict_base_with_the_kv_sharder():
    install_missing_test_module()
    install_missing_hypothesis()
    from torchrec.distributed.test_utils import test_model_parallel_base as base

    class KVStateDict(base.ModelParallelStateDictBase):
        backend = "gloo"

    names = ["test_meta_device_dmp_state_dict", "test_parameter_init"]
    suite = unittest.TestSuite(KVStateDict(name) for name in names)
    with mock.patch.object(base, "get_default_sharders", kv_sharder):
        result = unittest.TextTestRunner(verbosity=2).run(suite)
    assert result.testsRun == len(names)
    assert result.wasSuccessful(), [str(e[1]) for e in result.errors + result.failures]
    assert not result.skipped, result.skipped
    assert CALLS, "the harness never asked for the default sharders"
