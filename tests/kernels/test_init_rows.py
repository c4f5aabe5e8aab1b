"""Initial rows the Triton kernels draw inline (interpreter, CPU tensors) against the
torch path: every kind of draw (uniform, constant, normal, truncated normal).

* The pooled forward of ids with no row (``group_pooled_forward_triton``, each id a
  bag of its own) gives each id its table's initial row (on the device under test:
  ``KVEMB_TEST_DEVICE=cuda`` compiles it for the GPU).
* The group lookup (``group_lookup_train_triton``) writes new rows of a truncated
  normal table to float tolerance and of a constant table bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from tests.ops.test_init_rows import check_new_rows, new_rows_group
from torchrec_kvemb.contracts import INT64_MAX, Bags, GroupLayout
from torchrec_kvemb.kernels.group_pooled import group_pooled_forward_triton
from torchrec_kvemb.ops.hashing import init_rows
from torchrec_kvemb.options import WAYS, Initializer, KVTableOptions

OPTIONS = (
    KVTableOptions(capacity=WAYS, seed=11, init_low=-0.25, init_high=0.75),
    KVTableOptions(capacity=WAYS, seed=12, init_low=0.37, init_high=0.37),
    KVTableOptions(
        capacity=WAYS, seed=3, initializer=Initializer.NORMAL, init_mean=0.5, init_std=2.0
    ),
    KVTableOptions(
        capacity=WAYS, seed=4, initializer=Initializer.TRUNC_NORMAL, init_mean=0.0,
        init_std=1.0, init_low=-2.0, init_high=2.0,
    ),
    KVTableOptions(
        capacity=WAYS, seed=5, initializer=Initializer.TRUNC_NORMAL, init_mean=-1.5,
        init_std=0.75, init_low=-1.0, init_high=0.5,
    ),
    KVTableOptions(capacity=WAYS, seed=11, init_low=-0.25, init_high=0.75, column_offset=7),
    KVTableOptions(
        capacity=WAYS, seed=3, initializer=Initializer.NORMAL, init_mean=0.5, init_std=2.0,
        column_offset=5,
    ),
)  # fmt: skip
NAMES = ("uniform", "constant", "normal", "trunc-normal", "trunc-normal-off-centre",
         "uniform-column-shard", "normal-column-shard")  # fmt: skip


@pytest.mark.parametrize("dim", [3, 37], ids=lambda d: f"dim{d}")
def test_missing_rows_pool_as_each_tables_initial_rows(dim: int, device: torch.device) -> None:
    """On the device under test (the interpreter on the CPU, compiled on CUDA)."""
    layout = GroupLayout.build([1] * len(OPTIONS), [0] * len(OPTIONS), OPTIONS, device)
    g = torch.Generator().manual_seed(dim)
    n = 61
    ids = torch.randint(0, INT64_MAX, (n,), generator=g)
    ids[0] = INT64_MAX
    table_idx = torch.arange(n) % len(OPTIONS)
    on = {"device": device}
    bags = Bags.build(torch.arange(n + 1, **on), n)
    weights = torch.zeros(WAYS * len(OPTIONS), dim, **on)
    got = group_pooled_forward_triton(
        layout, weights, torch.full((n,), -1, **on), ids.to(device), table_idx.to(device), bags,
        torch.arange(n, **on), False,
    ).cpu()  # fmt: skip
    layout = layout.to("cpu")
    for t, spec in enumerate(layout.init_specs):
        mine = table_idx == t
        want = init_rows(ids[mine], dim, spec.seed, spec.normal, spec.a, spec.b, spec.first_col)
        if NAMES[t] in ("uniform", "constant", "uniform-column-shard"):
            assert torch.equal(got[mine], want), NAMES[t]
        else:
            torch.testing.assert_close(
                got[mine], want, atol=2e-6, rtol=1e-5, msg=lambda m, t=t: f"{NAMES[t]}: {m}"
            )


def test_group_lookup_writes_the_torch_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    check_new_rows(
        new_rows_group("triton", monkeypatch), new_rows_group("torch", monkeypatch), False
    )
