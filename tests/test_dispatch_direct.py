"""Registered ops on plain eager CPU tensors run their CPU kernel without the
dispatcher's Python layers (``dispatch.registered`` -> ``_eager_cpu_op``): the
same bits as the op, written arguments get a new version as the op's in-place
layer gives them, the profiler names the op, and under a dispatch mode or
compile the op itself runs."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from torchrec_kvemb import dispatch, native_lib
from torchrec_kvemb.backend import ENV_VAR

pytestmark = pytest.mark.skipif(
    not native_lib.available(), reason="the native kernels are not built here"
)


@pytest.fixture(autouse=True)
def _native(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_VAR, "auto")  # the CPU: native kernels


def _rows(n: int, cols: int, seed: int) -> torch.Tensor:
    return torch.randn(n, cols, generator=torch.Generator().manual_seed(seed))


class _SeenOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def test_a_cpu_op_is_its_kernel_called_directly() -> None:
    op = dispatch.registered("scatter_rows", "cpu")
    assert op is not torch.ops.kvemb.scatter_rows and op.op is torch.ops.kvemb.scatter_rows


@pytest.mark.parametrize("cols", [1, 13, 65], ids=lambda c: f"cols{c}")
def test_scatter_and_gather_equal_the_op_and_bump_versions(cols: int) -> None:
    src = _rows(1_003, cols, 1)
    slots = torch.randperm(1_003, generator=torch.Generator().manual_seed(2))[:517]
    rows = _rows(517, cols, 3)
    direct, through_op = src.clone(), src.clone()
    version = direct._version
    dispatch.scatter_rows(direct, slots, rows)
    torch.ops.kvemb.scatter_rows(through_op, slots, rows)
    assert torch.equal(direct, through_op)
    assert torch.equal(direct[slots], rows)
    assert direct._version > version  # as the op's in-place layer does
    out = torch.empty(517, cols)
    before = out._version
    got = dispatch.gather_rows(src, slots, out)
    assert torch.equal(got, src[slots]) and got.data_ptr() == out.data_ptr()
    assert out._version > before


def test_the_profiler_names_the_op() -> None:
    src, slots = _rows(101, 9, 4), torch.arange(0, 101, 3)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        dispatch.gather_rows(src, slots, torch.empty(slots.numel(), 9))
    assert "kvemb::gather_rows" in {e.key for e in prof.key_averages()}


def test_a_dispatch_mode_sees_the_op() -> None:
    src, slots = _rows(101, 9, 5), torch.arange(0, 101, 7)
    out = torch.empty(slots.numel(), 9)
    with _SeenOps() as mode:
        dispatch.gather_rows(src, slots, out)
    assert any("kvemb.gather_rows" in name for name in mode.names), mode.names
    assert torch.equal(out, src[slots])


def test_eager_calls_skip_the_op_and_a_mode_does_not(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel the direct call runs is ``library.cpu_kernel``'s (the op runs the
    function it registered): a spy there sees the eager call, not the one under a
    dispatch mode."""
    calls: list[str] = []
    real = dispatch.library.cpu_kernel

    def spying(name: str):
        kernel = real(name)

        def spy(*args):
            calls.append(name)
            return kernel(*args)

        return spy

    dispatch._eager_cpu_op.cache_clear()
    monkeypatch.setattr(dispatch.library, "cpu_kernel", spying)
    try:
        src, slots = _rows(57, 5, 6), torch.arange(0, 57, 2)
        dispatch.gather_rows(src, slots, torch.empty(slots.numel(), 5))
        assert calls == ["gather_rows"]
        with _SeenOps():
            dispatch.gather_rows(src, slots, torch.empty(slots.numel(), 5))
        assert calls == ["gather_rows"]
    finally:
        dispatch._eager_cpu_op.cache_clear()
