"""Every Triton kernel, as the package launches it, compiles for a Hopper GPU (sm_90).

The interpreter runs a kernel's Python; it does not type-check it the way the
compiler does. So the launches of KV EBCs training and evaluating (the group
kernels: every optimizer, decay mode, clipping, pooling, weighting and
eviction policy, admission, custom scores, dims over one column block), of
``KVTable`` on its own (the per-table probe and find-or-insert: ``find``,
``insert``, checkpoint-style loads, a table with an SSD tier), of a group of
tables over host tiers and of
``block_bucketize_2d`` (every option) are recorded in the interpreter, and each
variant (argument types and constexpr values) is compiled by Triton's real
compiler down to a cubin for sm_90, in a fresh process. No GPU is needed to
compile.
"""

import importlib
import json
import os
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import torchrec_kvemb.kernels as kernels_pkg
from torchrec_kvemb.kernels import group_lookup, group_pooled

WORKER = Path(__file__).with_name("compile_worker.py")
TARGET = "cuda:90"


def _run(args: list[str], stdin: str | None = None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    job = subprocess.run(
        [sys.executable, str(WORKER), *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=WORKER.parents[2],
    )
    assert job.returncode == 0, f"{args}: exit {job.returncode}\n{job.stderr[-4000:]}"
    return job.stdout


@pytest.fixture(scope="module")
def launches() -> list[dict]:
    return json.loads(_run(["record"]))


@pytest.fixture(scope="module")
def compiled(launches: list[dict]) -> dict:
    return json.loads(_run(["compile", TARGET], json.dumps(launches)))


def _all_kernels() -> set[str]:
    """``module.name`` of every ``*_kernel`` Triton function in the kernels package."""
    names = set()
    for info in pkgutil.iter_modules(kernels_pkg.__path__):
        module = importlib.import_module(f"{kernels_pkg.__name__}.{info.name}")
        for name, value in vars(module).items():
            if name.endswith("_kernel") and hasattr(value, "fn"):
                names.add(f"{info.name}.{name}")
    return names


#: Every kernel of the package (``module.name``); a kernel added or removed shows here.
KERNELS = {
    "block_bucketize.block_bucketize_fwd_kernel",
    "block_bucketize.block_bucketize_route_kernel",
    "group_lookup.group_find_kernel",
    "group_lookup.group_insert_kernel",
    "group_lookup.group_probe_kernel",
    "group_pooled.group_fused_bwd_kernel",
    "group_pooled.group_pooled_fwd_kernel",
    "insert.insert_find_fwd_kernel",
    "insert.insert_fwd_kernel",
    "probe.probe_fwd_kernel",
}


def test_every_kernel_is_launched(launches: list[dict]) -> None:
    launched = {f"{x['module'].rsplit('.', 1)[-1]}.{x['name']}" for x in launches}
    assert _all_kernels() == KERNELS
    assert launched == KERNELS, f"never launched: {sorted(KERNELS - launched)}"


#: (kernel, constexpr) -> every value the recorded launches must take.
VARIANTS = {
    ("group_find_kernel", "HAS_CUSTOM"): {False, True},
    ("group_find_kernel", "HAS_ADMISSION"): {False, True},
    ("group_find_kernel", "TIER"): {False, True},  # a group over lower tiers
    ("group_insert_kernel", "COUNTER"): {False, True},
    ("group_insert_kernel", "TIER"): {False, True},
    ("group_pooled_fwd_kernel", "HAS_SCALE"): {False, True},
    ("group_pooled_fwd_kernel", "MISSING_AS_ZERO"): {False, True},
    ("group_fused_bwd_kernel", "KIND"): {0, 1, 2},  # SGD, row-wise Adagrad, Adam
    ("group_fused_bwd_kernel", "L2"): {False, True},
    ("group_fused_bwd_kernel", "DECOUPLE"): {False, True},
    ("group_fused_bwd_kernel", "CLIP"): {False, True},
    ("group_fused_bwd_kernel", "HAS_SCALE"): {False, True},
    ("insert_find_fwd_kernel", "ACCUMULATE"): {False, True},
    ("block_bucketize_fwd_kernel", "BUCKETIZE_POS"): {False, True},
    ("block_bucketize_fwd_kernel", "HAS_WEIGHTS"): {False, True},
    ("block_bucketize_route_kernel", "KEEP_ORIG_IDX"): {False, True},
}
#: Kernels that loop over column blocks, and their widest block: one launch at it
#: (rows wider than it, several blocks) and one narrower.
WIDE = {
    "group_insert_kernel": group_lookup.MAX_BLOCK_D,
    "group_pooled_fwd_kernel": group_pooled.MAX_BLOCK_D,
    "group_fused_bwd_kernel": group_pooled.MAX_BLOCK_D,
}


def test_variants_cover_the_options(launches: list[dict]) -> None:
    seen: dict[tuple[str, str], set] = {}
    for x in launches:
        for key, value in x["constexprs"].items():
            seen.setdefault((x["name"], key), set()).add(value)
    for (kernel, name), values in VARIANTS.items():
        assert seen.get((kernel, name)) == values, f"{kernel} {name}: {seen.get((kernel, name))}"
    for kernel, widest in WIDE.items():
        widths = seen[(kernel, "BLOCK_D")]
        assert max(widths) == widest > min(widths), f"{kernel} BLOCK_D: {sorted(widths)}"


def test_every_variant_compiles_for_sm90(compiled: dict) -> None:
    assert compiled["target"] == TARGET
    failed = [v for v in compiled["variants"] if "error" in v]
    report = "\n\n".join(f"{v['kernel']} {v['constexprs']}:\n{v['error']}" for v in failed)
    assert not failed, report
    assert compiled["variants"]
    assert all(v["cubin_bytes"] > 1000 for v in compiled["variants"])
