"""Test-wide settings.

Triton reads ``TRITON_INTERPRET`` when a kernel is decorated, so it is set here,
before any kernel module is imported: every Triton kernel in the tests runs in
Triton's interpreter on CPU tensors and is compared with the torch path.

``KVEMB_TEST_DEVICE`` picks the device of the tests that take the ``device``
fixture (they carry the ``device`` marker): ``cpu`` (default, ``make test``: they
run with the rest, the Triton kernels interpreted) or ``cuda`` (``make test-gpu``):
then ``TRITON_INTERPRET`` is dropped, so the kernels are compiled for the GPU,
and only the device tests are collected (the others assume the interpreter).
"""

import os
import re
from pathlib import Path

import pytest

DEVICE_ENV = "KVEMB_TEST_DEVICE"
DEVICES = ("cpu", "cuda")
TEST_DEVICE = os.environ.get(DEVICE_ENV, "cpu").strip().lower() or "cpu"

if TEST_DEVICE == "cuda":
    os.environ.pop("TRITON_INTERPRET", None)
else:
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("OMP_NUM_THREADS", "2")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"device: takes the `device` fixture: runs on ${DEVICE_ENV} (cpu in make test, "
        "cuda in make test-gpu); set automatically",
    )
    if TEST_DEVICE not in DEVICES:
        raise pytest.UsageError(f"{DEVICE_ENV}={TEST_DEVICE!r}: expected one of {DEVICES}")
    if TEST_DEVICE == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise pytest.UsageError(f"{DEVICE_ENV}=cuda, but torch.cuda.is_available() is False")


#: A test function that takes the ``device`` fixture, in a module's source.
_TAKES_DEVICE = re.compile(r"def test_\w+\([^)]*\bdevice\b", re.S)


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """On cuda, test modules without a test that takes ``device`` are not even
    imported (they hold no test to run, and some expect the interpreter)."""
    if TEST_DEVICE == "cpu" or collection_path.suffix != ".py":
        return None
    if not collection_path.name.startswith("test_"):
        return None
    return None if _TAKES_DEVICE.search(collection_path.read_text()) else True


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test that takes ``device``; on cuda, deselect the others."""
    kept, dropped = [], []
    for item in items:
        if "device" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.device)
            kept.append(item)
        else:
            dropped.append(item)
    if TEST_DEVICE != "cpu" and dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


@pytest.fixture
def device():
    """The device under test (``KVEMB_TEST_DEVICE``): ``cpu`` or ``cuda``."""
    import torch

    return torch.device(TEST_DEVICE)
