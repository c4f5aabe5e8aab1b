"""The GPU benchmark's harness, run on CPU with the Triton kernels interpreted.

The figures of such a run mean nothing; what is checked is that every part
runs, counts what it claims, reports each step's own time under its own name,
agrees with its baselines before it is timed (and stops when they disagree),
runs without FBGEMM's fused tables (a GPU machine with FBGEMM's CPU build), and
that the suite writes its GPU table and plots. Device refusals exit 2.
"""

import math
import time
from pathlib import Path

import pytest
import torch

from benchmarks import gpu_kernels, run
from benchmarks.common import format_ratio, time_interleaved
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
        assert rate.items == n, name
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
        for system in (gpu_kernels.KV, gpu_kernels.EBC, gpu_kernels.TBE):
            assert r.get("ebc", mode, system).items == config.ids_per_step, (mode, system)
    for system in (gpu_kernels.BAG, gpu_kernels.TBE):
        for name in ("fwd", "fwd+bwd+update"):
            assert r.get("kernels", name, system).items == n, (name, system)
    assert r.notes == (), "FBGEMM's CPU tables run on CPU: nothing is left out"
    assert "interpreter" in r.device
    with pytest.raises(KeyError):
        r.get("kernels", "probe", gpu_kernels.TBE)


def test_the_kernel_group_is_full() -> None:
    config = gpu_kernels.QUICK
    group, stored = gpu_kernels.full_group(config, torch.device("cpu"))
    assert group.num_tables == config.tables
    assert bool((group.storage.keys >= 0).all()), "every way of every bucket holds an id"
    assert [s.numel() for s in stored] == [t.capacity for t in group.tables]


def test_ratios_name_their_own_rates(quick_result: gpu_kernels.GpuResult) -> None:
    """Every ratio divides KV's rate by the baseline it names (and only FBGEMM's carry
    targets); the report prints each one."""
    r = quick_result
    got = {x.what: x for x in gpu_kernels.ratios(r)}
    assert list(got) == [what for what, *_ in gpu_kernels.RATIOS], "every baseline ran"
    expected = {
        "KV EBC / stock EBC train": (("ebc", "train"), ("ebc", "train", gpu_kernels.EBC)),
        "pooled fwd kernel / EmbeddingBag fwd": (
            ("kernels", "pooled fwd"), ("kernels", "fwd", gpu_kernels.BAG)),
        "fwd+bwd+update kernels / TBE fwd+bwd": (
            ("kernels", "fwd+bwd+update"), ("kernels", "fwd+bwd+update", gpu_kernels.TBE)),
        "KV EBC / TBE eval": (("ebc", "eval"), ("ebc", "eval", gpu_kernels.TBE)),
    }  # fmt: skip
    for what, ((part, kv_name), baseline) in expected.items():
        assert got[what].kv is r.get(part, kv_name, gpu_kernels.KV), what
        assert got[what].baseline is r.get(*baseline), what
    targets = {x.what: x.target for x in got.values() if x.target is not None}
    assert targets == {"KV EBC / TBE train": 0.7, "KV EBC / TBE eval": 0.7}
    text = gpu_kernels.report(r)
    for x in got.values():
        kv, base = x.kv, x.baseline
        ratio = (kv.items / kv.seconds) / (base.items / base.seconds)
        assert f"{x.what}  " in text and format_ratio(ratio) in text, x.what


def test_each_rate_is_the_time_of_its_own_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the clock replaced by one that gives each step function a time of its own
    (after calling it once), each rate reports the time of the step it names; without
    FBGEMM's fused tables the torch baselines still run and the report says why."""
    calls: list[dict[str, float]] = []

    def fake_median(device, steps, config):
        for step in steps.values():
            step(0)
        base = 100.0 * (len(calls) + 1)
        calls.append({name: base + k for k, name in enumerate(steps)})
        return dict(calls[-1])

    def no_tbe(config, device, tables):
        raise gpu_kernels.BaselineUnavailableError("FBGEMM's fused tables do not run (test)")

    monkeypatch.setattr(gpu_kernels, "_median_s", fake_median)
    monkeypatch.setattr(gpu_kernels, "build_tbe", no_tbe)
    r = gpu_kernels.run(gpu_kernels.QUICK, torch.device("cpu"), verbose=False)
    KV, BAG, EBC = gpu_kernels.KV, gpu_kernels.BAG, gpu_kernels.EBC
    copy, launchers, baselines, train, evaluation = calls  # in the order they are timed
    assert r.copy.seconds == copy["copy"]
    for name in gpu_kernels.KERNELS:
        assert r.get("kernels", name, KV).seconds == launchers[name], name
    assert r.get("kernels", "fwd", BAG).seconds == baselines["bag fwd"]
    assert r.get("kernels", "fwd+bwd+update", KV).seconds == baselines["kv"]
    assert r.get("kernels", "fwd+bwd+update", BAG).seconds == baselines["bag"]
    for mode, timed in (("train", train), ("eval", evaluation)):
        assert sorted(timed) == sorted([KV, EBC]), mode
        for system in (KV, EBC):
            assert r.get("ebc", mode, system).seconds == timed[system], (mode, system)
    assert not any(rate.system == gpu_kernels.TBE for rate in r.rates)
    assert [x.what for x in gpu_kernels.ratios(r)] == [w for w, *_ in gpu_kernels.RATIOS[:4]]
    assert r.notes == ("FBGEMM's fused tables do not run (test)",)
    assert "not run: FBGEMM's fused tables do not run (test)" in gpu_kernels.report(r)


def test_disagreement_stops_the_run() -> None:
    a = torch.zeros(3, 4)
    gpu_kernels.check_agree("pooled forward", a, a.clone(), gpu_kernels.TBE)
    with pytest.raises(RuntimeError, match="pooled forward: .* and TBE disagree"):
        gpu_kernels.check_agree("pooled forward", a, a + 0.5, gpu_kernels.TBE)
    with pytest.raises(RuntimeError, match="shapes"):
        gpu_kernels.check_agree("pooled forward", a, a[:2], gpu_kernels.BAG)


def test_a_baseline_from_other_rows_stops_the_ebc_part(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stock EBC that does not start from the KV tables' initial rows pools other
    rows: the EBC part refuses to time it."""
    copy = gpu_kernels.copy_initial_rows

    def shifted(table, weights, rows):
        copy(table, weights, rows)
        with torch.no_grad():
            weights.add_(0.25)

    monkeypatch.setattr(gpu_kernels, "copy_initial_rows", shifted)
    monkeypatch.setenv(ENV_VAR, "triton")
    with pytest.raises(RuntimeError, match="EBC pooled rows: the Triton kernels and stock EBC"):
        gpu_kernels.measure_ebc(gpu_kernels.QUICK, torch.device("cpu"))


def test_median_is_seconds_per_call() -> None:
    """Rates divide items per call by this: a block's total would make them 10x off."""
    config = gpu_kernels.GpuConfig(steps=10, repeats=2, warmup=0)
    seconds = gpu_kernels._median_s(
        torch.device("cpu"), {"sleep": lambda i: time.sleep(0.005)}, config
    )["sleep"]
    assert 0.005 <= seconds < 0.03


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
    assert len(rows) == len(gpu_kernels.RATIOS) + len(gpu_kernels.KERNELS)
    assert {r.what for r in rows} >= {what for what, *_ in gpu_kernels.RATIOS}
    text = (tmp_path / run.GPU_RESULTS_FILE).read_text()
    assert "interpreter" in text and "copy bandwidth" in text
    assert "| gpu | KV EBC / TBE train |" in text and "| gpu | KV EBC / stock EBC eval |" in text
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
