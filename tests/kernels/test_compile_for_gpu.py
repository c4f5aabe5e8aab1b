"""Every Triton kernel, as the package launches it, compiles for a Hopper GPU (sm_90).

The interpreter runs a kernel's Python; it does not type-check it the way the
compiler does. So the launches of a KV EBC training and evaluating (every
optimizer, pooling, weighting and eviction policy) and of ``block_bucketize_2d``
(every option) are recorded in the interpreter, and each variant (argument
types and constexpr values) is compiled by Triton's real compiler down to a
cubin for sm_90, in a fresh process. No GPU is needed to compile.
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


def test_every_kernel_is_launched(launches: list[dict]) -> None:
    launched = {f"{x['module'].rsplit('.', 1)[-1]}.{x['name']}" for x in launches}
    assert len(_all_kernels()) >= 8
    assert launched == _all_kernels()


def test_variants_cover_the_options(launches: list[dict]) -> None:
    seen = {}
    for x in launches:
        for key, value in x["constexprs"].items():
            seen.setdefault((x["name"], key), set()).add(value)
    assert seen[("optimizer_update_fwd_kernel", "KIND")] == {0, 1, 2}  # SGD, Adagrad, Adam
    assert seen[("pooled_lookup_fwd_kernel", "HAS_PSW")] == {False, True}
    assert seen[("pooled_lookup_fwd_kernel", "MEAN")] == {False, True}
    assert seen[("pooled_lookup_fwd_kernel", "NORMAL")] == {False, True}
    assert seen[("insert_find_fwd_kernel", "ACCUMULATE")] == {False, True}
    assert seen[("block_bucketize_fwd_kernel", "BUCKETIZE_POS")] == {False, True}
    assert seen[("block_bucketize_route_kernel", "KEEP_ORIG_IDX")] == {False, True}


def test_every_variant_compiles_for_sm90(compiled: dict) -> None:
    assert compiled["target"] == TARGET
    failed = [v for v in compiled["variants"] if "error" in v]
    report = "\n\n".join(f"{v['kernel']} {v['constexprs']}:\n{v['error']}" for v in failed)
    assert not failed, report
    assert compiled["variants"]
    assert all(v["cubin_bytes"] > 1000 for v in compiled["variants"])
