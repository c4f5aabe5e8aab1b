"""The GPU benchmark's harness, run on CPU with the Triton kernels interpreted.

The figures of such a run mean nothing; what is checked is that every part
runs, counts what it claims, agrees with FBGEMM before it is timed, and that
the suite writes its GPU table and plots. Device refusals exit 2.
"""

import math
from pathlib import Path

import pytest
import torch

from benchmarks import gpu_kernels, run
from benchmarks.common import time_interleaved
from torchrec_kvemb.backend import ENV_VAR
from torchrec_kvemb.options import WAYS

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def quick_result() -> gpu_kernels.GpuResult:
    return gpu_kernels.run(gpu_kernels.QUICK, torch.device("cpu"), verbose=False)


@pytest.mark.parametrize(
    ("kernel", "expected"),
    [
        ("probe", 13 * (8 + 8 + WAYS * 8 + 8)),
        ("find+insert", 13 * (8 + 8 + 8) + 11 * (WAYS * 8 + 16) + 4 * (5 * 4 + 3 * 4)),
        ("pooled fwd", 13 * (8 + 5 * 4) + 4 * 8 + 3 * 5 * 4),
        ("fused bwd", 13 * (8 + 5 * 4) + 11 * (2 * 5 * 4 + 2 * 3 * 4)),
    ],
    ids=lambda v: str(v).replace(" ", "-"),
)
def test_kernel_bytes(kernel: str, expected: int) -> None:
    got = gpu_kernels.kernel_bytes(kernel, ids=13, bags=3, rows=11, dim=5, state_dim=3, inserted=4)
    assert got == expected


def test_kernel_bytes_rejects_unknown_kernel() -> None:
    with pytest.raises(ValueError, match="unknown kernel 'gather'"):
        gpu_kernels.kernel_bytes("gather", 1, 1, 1, 4)


def test_every_part_is_timed(quick_result: gpu_kernels.GpuResult) -> None:
    config = gpu_kernels.QUICK
    r = quick_result
    assert r.copy.nbytes == 2 * config.copy_mb * (1 << 20)
    bags = config.kernel_ids // (config.tables * config.bag) * config.tables
    n = bags * config.bag
    for name in gpu_kernels.KERNELS:
        rate = r.get("kernels", name, gpu_kernels.KV)
        assert rate.items == n and rate.seconds > 0 and math.isfinite(rate.gb_per_s), name
        expected = gpu_kernels.kernel_bytes(
            name, n, bags, rate.rows, config.dim, state_dim=1, inserted=rate.inserted
        )
        assert rate.nbytes == expected, name
    # Every new id of a training batch takes a row in the full group (by eviction).
    train = r.get("kernels", "find+insert", gpu_kernels.KV)
    new = math.ceil(n / gpu_kernels.NEW_EVERY)
    assert train.inserted == new
    probe = r.get("kernels", "probe", gpu_kernels.KV)
    assert 0 < probe.rows <= n and new < train.rows <= n
    assert r.get("kernels", "fused bwd", gpu_kernels.KV).rows == probe.rows
    for mode in ("train", "eval"):
        for system in (gpu_kernels.KV, gpu_kernels.TBE):
            rate = r.get("ebc", mode, system)
            assert rate.items == config.ids_per_step and rate.items_per_s > 0
    assert "interpreter" in r.device
    with pytest.raises(KeyError):
        r.get("kernels", "probe", gpu_kernels.TBE)


def test_the_kernel_group_is_full() -> None:
    config = gpu_kernels.QUICK
    group, stored = gpu_kernels.full_group(config, torch.device("cpu"))
    assert group.num_tables == config.tables
    assert bool((group.storage.keys >= 0).all()), "every way of every bucket holds an id"
    assert [s.numel() for s in stored] == [t.capacity for t in group.tables]


def test_ratios_and_report(quick_result: gpu_kernels.GpuResult) -> None:
    ratios = gpu_kernels.ratios(quick_result)
    assert [x.what for x in ratios][:2] == ["KV EBC / TBE train", "KV EBC / TBE eval"]
    assert [x.target for x in ratios] == [0.7, 0.7, None, None]
    for x in ratios:
        assert x.value == pytest.approx(x.kv.items_per_s / x.baseline.items_per_s)
    text = gpu_kernels.report(quick_result)
    assert "copy bandwidth:" in text and "pooled fwd kernel / TBE fwd" in text


def test_backend_setting_is_restored(quick_result: gpu_kernels.GpuResult) -> None:
    import os

    assert os.environ.get(ENV_VAR) != "triton"


def test_disagreement_with_fbgemm_stops_the_run() -> None:
    a = torch.zeros(3, 4)
    gpu_kernels.check_same_as_tbe("pooled forward", a, a.clone())
    with pytest.raises(RuntimeError, match="pooled forward: .* disagree"):
        gpu_kernels.check_same_as_tbe("pooled forward", a, a + 0.5)


def test_sync_runs_around_every_block() -> None:
    calls: list[str] = []
    time_interleaved(
        {"a": lambda i: calls.append("a"), "b": lambda i: calls.append("b")},
        steps_per_block=2,
        repeats=3,
        warmup=1,
        sync=lambda: calls.append("sync"),
    )
    # 2 warm-up blocks + 2 x 3 timed blocks, each with a sync before and after.
    assert calls.count("sync") == 2 * (2 + 6)
    assert calls.count("a") == calls.count("b") == 1 + 6


def test_suite_gpu_mode_writes_its_table_and_plots(tmp_path: Path) -> None:
    rows = run.main(["--gpu", "--device", "cpu", "--quick", "--out-dir", str(tmp_path)])
    assert {r.benchmark for r in rows} == {"gpu"}
    assert len(rows) == 4 + len(gpu_kernels.KERNELS)
    assert all(r.kv > 0 and r.baseline > 0 for r in rows)
    text = (tmp_path / run.GPU_RESULTS_FILE).read_text()
    assert "interpreter" in text and "copy bandwidth" in text
    assert "| gpu | KV EBC / TBE train |" in text
    assert not (tmp_path / run.RESULTS_FILE).exists()
    for name in ("gpu_ratios.png", "gpu_bandwidth.png"):
        data = (tmp_path / "plots" / name).read_bytes()
        assert data[:8] == PNG_MAGIC and len(data) > 5_000, name


def test_cpu_without_interpreter_exits_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(SystemExit) as exc:
        gpu_kernels.main(["--device", "cpu", "--quick"])
    assert exc.value.code == 2
    assert "set TRITON_INTERPRET=1" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["tpu", "meta", "nonsense"])
def test_unknown_device_exits_2(name: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exc:
        gpu_kernels.check_device(name)
    assert exc.value.code == 2
    assert f"unsupported device {name!r}" in capsys.readouterr().err


def test_dim_must_suit_fbgemm() -> None:
    with pytest.raises(SystemExit) as exc:
        gpu_kernels.parse_args(["--quick", "--dim", "7"])
    assert exc.value.code == 2


def test_rows_must_fill_a_bucket() -> None:
    with pytest.raises(SystemExit) as exc:
        gpu_kernels.parse_args(["--quick", "--rows", str(WAYS - 1)])
    assert exc.value.code == 2
