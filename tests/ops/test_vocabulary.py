"""One vocabulary: the codes, state layout and metric columns the kernels use are
defined once in Python (``OptimKind``, ``POLICY_CODES``, ``METRIC_NAMES``), and the C
header (``csrc/kvemb_native.h``) and the Triton kernels agree with them."""

from __future__ import annotations

import re
from pathlib import Path

from torchrec_kvemb.contracts import KERNEL_METRICS, METRIC_NAMES, POLICY_CODES
from torchrec_kvemb.optimizer import STATE_PER_COLUMN, FusedOptimConfig, OptimKind

HEADER = Path(__file__).resolve().parents[2] / "csrc" / "kvemb_native.h"


def enum(name: str) -> dict[str, int]:
    """The members of C ``enum name { ... }`` in the header, by name."""
    body = re.search(rf"enum {name}\s*{{(.*?)}};", HEADER.read_text(), re.S)
    assert body, f"enum {name} not in {HEADER}"
    text = re.sub(r"//[^\n]*", "", body.group(1))
    return {k: int(v) for k, v in re.findall(r"(KV_\w+)\s*=\s*(\d+)", text)}


def test_optimizer_codes_match_the_header():
    assert enum("KvOptim") == {f"KV_{kind.name}": kind.code for kind in OptimKind}


def test_state_blocks_match_the_header():
    blocks = enum("KvStateBlock")
    for kind in OptimKind:
        for position, name in enumerate(kind.state_names):
            assert blocks[f"KV_{name.upper()}"] == position, (kind, name)
    config = FusedOptimConfig(kind=OptimKind.ADAM)
    assert config.state_columns(7) == {"exp_avg": 0, "exp_avg_sq": 7}
    assert STATE_PER_COLUMN == {"exp_avg", "exp_avg_sq"}


def test_policy_codes_match_the_header():
    assert enum("KvPolicy") == {f"KV_{p.name}": code for p, code in POLICY_CODES.items()}


def test_metric_columns_match_the_header():
    columns = enum("KvMetric")
    assert columns.pop("KV_NUM_METRICS") == KERNEL_METRICS
    assert columns == {f"KV_{m.upper()}": i for i, m in enumerate(METRIC_NAMES[:KERNEL_METRICS])}


def test_triton_kernels_read_the_codes_from_the_optimizer():
    from torchrec_kvemb.kernels import group_pooled

    for kind in OptimKind:
        assert getattr(group_pooled, kind.name).value == kind.code


def test_triton_lookups_add_to_the_metric_columns_by_name():
    from torchrec_kvemb.kernels import group_lookup

    columns = {
        "HITS": "hits",
        "MISSES": "misses",
        "INSERTS": "inserts",
        "EVICTIONS": "evictions",
        "REJECTS": "admission_rejects",
        "FAILURES": "insert_failures",
    }
    for constant, name in columns.items():
        assert getattr(group_lookup, constant).value == METRIC_NAMES.index(name), constant


def test_the_ttl_sweep_adds_to_a_column_of_its_own():
    from torchrec_kvemb import ttl

    assert "ttl_evictions" in METRIC_NAMES[KERNEL_METRICS:]
    assert METRIC_NAMES.index(ttl.TTL_EVICTIONS) == ttl.TTL_COLUMN
