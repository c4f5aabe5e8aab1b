"""Initial rows of every kind of draw, torch path and native CPU kernels.

* The torch reference's truncated normal against its documented recipe in float64
  Python (the 24-bit uniform of ``docs/kv-table.md``'s hash, mapped into the bounds
  by ``statistics.NormalDist``'s inverse CDF), to float32 tolerance.
* Constants (uniform of zero width): exactly the value on the torch path and the
  native kernel (``kv_init_uniform``), whatever the uniform draw.
* The registered ``init_rows`` op on the CPU and the native group lookup (new
  rows of a TRUNC_NORMAL and a constant table) against the torch path, bit for bit.
"""

from __future__ import annotations

import math
from statistics import NormalDist

import pytest
import torch

from tests.kernels.checks import assert_same
from torchrec_kvemb import dispatch
from torchrec_kvemb.backend import ENV_VAR
from torchrec_kvemb.contracts import INIT_TRUNC_NORMAL, INIT_UNIFORM, InitSpec, seed_mix
from torchrec_kvemb.group import KVTableGroup
from torchrec_kvemb.ops import native
from torchrec_kvemb.ops.hashing import init_rows
from torchrec_kvemb.options import Initializer, KVTableOptions

U64 = (1 << 64) - 1
IDS = torch.tensor([0, 1, 7, 12345, 2**31 + 3, 2**40 + 7, 2**62 + 11, 2**63 - 1])
#: (mean, std, low, high) of truncated normals.
TRUNCATED = {
    "torch-default": (0.0, 1.0, -2.0, 2.0),
    "one-sided": (0.25, 0.5, 0.0, 3.0),
    "narrow": (0.0, 0.02, -0.01, 0.03),
    "off-centre": (-1.5, 0.75, -1.0, 0.5),
}


def _fmix64(x: int) -> int:
    x &= U64
    x ^= x >> 33
    x = (x * 0xFF51AFD7ED558CCD) & U64
    x ^= x >> 33
    x = (x * 0xC4CEB9FE1A85EC53) & U64
    return x ^ (x >> 33)


def truncated_row_python(id_: int, dim: int, seed: int, params) -> list[float]:
    """One truncated normal row from the recipe, in float64 Python arithmetic."""
    mean, std, low, high = params
    law = NormalDist()
    p_lo, p_hi = law.cdf((low - mean) / std), law.cdf((high - mean) / std)
    base = _fmix64(id_ ^ (seed_mix(seed) & U64))
    row = []
    for col in range(dim):
        bits = _fmix64(base + (col + 1) * 0x9E3779B97F4A7C15)
        u = ((bits >> 40) & 0xFFFFFF) / float(1 << 24)
        row.append(min(max(mean + std * law.inv_cdf(p_lo + u * (p_hi - p_lo)), low), high))
    return row


@pytest.mark.parametrize("name", list(TRUNCATED))
def test_truncated_normal_rows_match_the_recipe(name: str) -> None:
    params = TRUNCATED[name]
    spec = InitSpec.trunc_normal(9, *params)
    assert spec.trunc_normal_params == tuple(torch.tensor(params).tolist())  # float32
    got = init_rows(IDS, 11, spec.seed, spec.normal, spec.a, spec.b)
    want = torch.tensor([truncated_row_python(int(i), 11, 9, params) for i in IDS])
    std = params[1]
    torch.testing.assert_close(got, want.float(), atol=2e-6 * std, rtol=1e-5)
    low, high = params[2:]
    assert float(got.min()) >= low and float(got.max()) <= high


@pytest.mark.parametrize("value", [0.0, 1.0, 0.37, -2.5, 1e-30, 3.0e38], ids=str)
def test_a_uniform_of_zero_width_is_exactly_its_value(value: float) -> None:
    want = torch.full((IDS.numel(), 13), value, dtype=torch.float32)
    assert_same("torch path", init_rows(IDS, 13, 4, INIT_UNIFORM, value, value), want)
    assert_same("native", native.init_uniform(IDS, 13, 4, value, value), want)
    spec = InitSpec(4, INIT_UNIFORM, value, value)
    assert_same("registered op", dispatch.init_rows(IDS, 13, spec), want)


@pytest.mark.parametrize("name", list(TRUNCATED))
def test_registered_op_draws_truncated_normal_as_the_torch_path(name: str) -> None:
    spec = InitSpec.trunc_normal(2, *TRUNCATED[name])
    want = init_rows(IDS, 9, spec.seed, INIT_TRUNC_NORMAL, spec.a, spec.b)
    assert_same("init_rows op", dispatch.init_rows(IDS, 9, spec), want, ("native", "torch"))


def group_options() -> list[KVTableOptions]:
    """A truncated normal, a constant and a plain uniform table."""
    return [
        KVTableOptions(
            capacity=64, initializer=Initializer.TRUNC_NORMAL, init_mean=0.1, init_std=0.5,
            init_low=-0.4, init_high=0.9, seed=3,
        ),
        KVTableOptions(capacity=48, init_low=0.37, init_high=0.37, seed=5),
        KVTableOptions(capacity=32, init_low=-1.0, init_high=1.0, seed=7),
    ]  # fmt: skip


def new_rows_group(backend: str | None, monkeypatch: pytest.MonkeyPatch) -> KVTableGroup:
    """A group after one training lookup of fresh ids (each table's rows as they are
    made), by ``backend`` (None: the default, native on the CPU) or table by table."""
    group = KVTableGroup(["a", "b", "c"], group_options(), 7)
    group.weights.fill_(float("nan"))  # rows a lookup does not write show
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(0, 2**62, (60,), generator=g)
    table_idx = torch.arange(60) % 3
    with monkeypatch.context() as m:
        if backend == "torch":
            m.setenv(ENV_VAR, "torch")
            group.lookup_train_per_table(ids, table_idx, None, None)
        else:
            if backend is not None:
                m.setenv(ENV_VAR, backend)
            group.lookup_train(ids, table_idx)
    return group


def check_new_rows(got: KVTableGroup, want: KVTableGroup, exact_truncated: bool) -> None:
    for k, (tg, tw) in enumerate(zip(got.tables, want.tables, strict=True)):
        assert_same(f"table {k} keys", tg.keys, tw.keys)
        stored = tw.keys.reshape(-1) >= 0
        assert int(stored.sum()) == 20, f"table {k}: {int(stored.sum())} rows"
        rows, ref = tg.weights[stored], tw.weights[stored]
        if k == 0 and not exact_truncated:
            torch.testing.assert_close(rows, ref, atol=2e-6, rtol=1e-5)
        else:
            assert_same(f"table {k} rows", rows, ref)
    constant = want.tables[1].weights[want.tables[1].keys.reshape(-1) >= 0]
    assert bool((constant == torch.tensor(0.37, dtype=torch.float32)).all())
    truncated = want.tables[0].weights[want.tables[0].keys.reshape(-1) >= 0]
    assert float(truncated.min()) >= -0.4 and float(truncated.max()) <= 0.9


def test_native_group_lookup_makes_the_torch_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    check_new_rows(new_rows_group(None, monkeypatch), new_rows_group("torch", monkeypatch), True)


def test_trunc_normal_mean_matches_its_formula() -> None:
    """The torch path's truncated normal over many ids: its mean against the formula."""
    mean, std, low, high = TRUNCATED["off-centre"]
    spec = InitSpec.trunc_normal(1, mean, std, low, high)
    rows = init_rows(torch.arange(20011), 5, spec.seed, spec.normal, spec.a, spec.b).double()
    alpha, beta = (low - mean) / std, (high - mean) / std
    law = NormalDist()
    z = law.cdf(beta) - law.cdf(alpha)
    want = mean + std * (law.pdf(alpha) - law.pdf(beta)) / z
    assert abs(float(rows.mean()) - want) < 5 * std / math.sqrt(rows.numel())
