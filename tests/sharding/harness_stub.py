"""A stand-in for ``torchrec.distributed.tests.test_sequence_model``: the installed
TorchRec wheel does not ship ``torchrec/distributed/tests``, yet
``torchrec.distributed.test_utils.test_sharding`` imports its
``TestEmbeddingCollectionSharder`` (used on its 2D-parallel path only)."""

from __future__ import annotations

import importlib.util
import sys
import types


class TestEmbeddingCollectionSharder:
    """Only the 2D-parallel path of the harness builds one; the tests here do not."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        raise NotImplementedError("the 2D-parallel harness path is not available here")


def install_missing_test_module() -> None:
    """Register the stand-in unless TorchRec ships the real module."""
    name = "torchrec.distributed.tests.test_sequence_model"
    if name in sys.modules or importlib.util.find_spec("torchrec.distributed.tests"):
        return
    package = types.ModuleType("torchrec.distributed.tests")
    package.__path__ = []
    module = types.ModuleType(name)
    module.TestEmbeddingCollectionSharder = TestEmbeddingCollectionSharder
    sys.modules["torchrec.distributed.tests"] = package
    sys.modules[name] = module


def install_missing_hypothesis() -> None:
    """``torchrec.distributed.test_utils.test_model_parallel_base`` decorates its
    property-based tests with ``hypothesis``, which this environment lacks: a
    stand-in whose decorators leave the functions as they are (the tests run here
    do not use it) is registered unless hypothesis is installed."""
    if "hypothesis" in sys.modules or importlib.util.find_spec("hypothesis"):
        return

    def passthrough(*args: object, **kwargs: object) -> object:
        return lambda fn: fn

    class _Anything:
        def __getattr__(self, name: str) -> object:
            return lambda *args, **kwargs: None

    module = types.ModuleType("hypothesis")
    module.given = passthrough
    module.settings = passthrough
    module.assume = lambda condition: None
    module.strategies = _Anything()
    module.Verbosity = _Anything()
    sys.modules["hypothesis"] = module
    sys.modules["hypothesis.strategies"] = module.strategies
