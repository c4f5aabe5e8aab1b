"""The benchmark matrix and the step breakdown at tiny sizes: the report's structure,
and each stream has the property it is named for (no timing asserts)."""

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from benchmarks import breakdown, matrix
from benchmarks.common import UniformIds, ZipfIds

TINY = [
    "--quick",
    "--tables", "2",
    "--batch", "16",
    "--bag", "3",
    "--rows", "1000",
    "--dim", "8",
    "--steps", "1",
    "--repeats", "1",
    "--warmup", "1",
    "--prime", "2",
]  # fmt: skip
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> tuple[list, str]:
    out = tmp_path_factory.mktemp("matrix") / "matrix.md"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(matrix, "PROFILE_CALLS", 1)
        results = matrix.main([*TINY, "--profile", "--out", str(out)])
    return results, out.read_text()


def _by_name(results: list) -> dict:
    return {r.stream.name: r for r in results}


def test_every_stream_times_kv_and_tbe_in_both_modes(report: tuple[list, str]) -> None:
    results, text = report
    assert [r.stream.name for r in results] == list(matrix.STREAMS)
    for r in results:
        for mode in ("train", "eval"):
            assert r.ratio(mode) > 0, (r.stream.name, mode)
            assert f"| {r.stream.name} | {mode} |" in text
    assert _by_name(results)["zipf1.05"].target("train") == 0.8
    assert _by_name(results)["zipf1.05"].target("eval") == 1.0
    assert {r.target("train") for r in results[1:]} == {0.7}


def test_streams_have_their_properties(report: tuple[list, str]) -> None:
    streams = {name: r.kv_steady for name, r in _by_name(report[0]).items()}
    # A heavier skew hits more often.
    assert streams["zipf1.2"]["hit_rate"] > streams["zipf1.05"]["hit_rate"]
    # Uniform over 100M ids: almost every id is new, in training and in eval.
    assert streams["uniform100m"]["hit_rate"] < 0.05
    assert streams["uniform100m"]["eval_hit_rate"] < 0.05
    # Tables at capacity evict in every step.
    for name in ("uniform100m", "capacity"):
        assert streams[name]["load_factor"] >= matrix.FULL, name
        assert streams[name]["evictions_per_step"] > 0, name
        assert streams[name]["evicting_steps"] == matrix.CHECK_STEPS, name
    assert streams["zipf1.05"]["evictions_per_step"] == 0
    by_name = _by_name(report[0])
    assert by_name["capacity"].config.rows == 100  # a tenth of --rows
    assert by_name["capacity"].tbe_hashed and by_name["uniform100m"].tbe_hashed
    assert not by_name["zipf1.05"].tbe_hashed


def test_profile_splits_each_kv_step(report: tuple[list, str]) -> None:
    results, text = report
    for r in results:
        train, evaluation = r.breakdowns
        assert (train.mode, evaluation.mode) == ("train", "eval")
        assert r.kv_path == "native"  # the native library is built where the tests run
        assert train.lookup_ms > 0 and train.forward_ms > 0 and train.backward_ms > 0
        # Eval probes then pools, or does both in one op (probe + pool).
        assert evaluation.lookup_ms + evaluation.fused_ms > 0
        assert evaluation.forward_ms + evaluation.fused_ms > 0
        assert evaluation.backward_ms == 0
        assert set(r.profiles) == {"train", "eval"}
        assert "kvemb::lookup_train_group" in r.profiles["train"]
        assert "kvemb::" in r.profiles["eval"]
        assert f"## Where the KV step's time goes: {r.stream.name}" in text
    assert (
        "| KV step | lookup | probe + pool | pooled forward | fused backward | other "
        "| KV profiled | KV timed | TBE timed | KV / TBE |"
    ) in text
    assert "KV ops: native" in text


def test_unknown_stream_is_refused() -> None:
    with pytest.raises(SystemExit) as exc:
        matrix.main([*TINY, "--streams", "zipf1.05,nope"])
    assert exc.value.code == 2


@pytest.mark.parametrize(
    ("name", "part"),
    [
        ("kvemb::lookup_train_group", "lookup"),
        ("kvemb::lookup_eval_group", "lookup"),
        ("kvemb::probe", "lookup"),
        ("kvemb::pooled_forward", "pooled forward"),
        ("kvemb::pooled_eval_group", "probe + pool"),
        ("kvemb::rows_forward", "pooled forward"),
        ("kvemb::fused_backward", "fused backward"),
        ("kvemb::init_rows", "other"),
        ("aten::embedding_bag", None),
    ],
    ids=lambda v: str(v),
)
def test_op_parts(name: str, part: str | None) -> None:
    assert breakdown.op_part(name) == part


def test_other_is_the_rest_of_the_step() -> None:
    step = breakdown.StepBreakdown("train", 10.0, 4.0, 1.5, 2.0, 8.0)
    assert step.other_ms == pytest.approx(2.5)
    fused = breakdown.StepBreakdown("eval", 10.0, 0.0, 0.0, 0.0, 8.0, fused_ms=6.0)
    assert fused.parts()["probe + pool"] == 6.0 and fused.other_ms == pytest.approx(4.0)
    profiled = breakdown.StepBreakdown("eval", 10.0, 3.0, 3.0, 0.0, 8.0, profiled_ms=12.0)
    assert profiled.step_ms == 12.0 and profiled.other_ms == pytest.approx(6.0)
    assert profiled.ratio == pytest.approx(0.8)  # the timed steps' ratio
    assert sum(step.parts().values()) == pytest.approx(10.0)
    assert step.ratio == pytest.approx(0.8)
    assert breakdown.StepBreakdown.from_json(json.loads(json.dumps(step.to_json()))) == step


def test_kept_before_run_plots_beside_a_new_one(tmp_path: Path) -> None:
    before = breakdown.load_record(breakdown.BEFORE_JSON)
    assert [s.mode for s in before["steps"]] == ["train", "eval"]
    for step in before["steps"]:
        assert step.total_ms > 0 and step.tbe_ms > 0 and step.lookup_ms > 0
    after = {**before, "label": "after"}
    data = breakdown.plot([before, after], tmp_path / "b.png").read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 5_000


def test_packed_zipf_ranks_are_the_ids() -> None:
    packed = ZipfIds(rows=1000, alpha=1.2, seed=5, scatter=False).sample(5000)
    scattered = ZipfIds(rows=1000, alpha=1.2, seed=5).sample(5000)
    assert torch.bincount(packed, minlength=1000).argmax() == 0  # rank 1 is id 0
    # The same draws: the scattered ids are the packed ones under one permutation.
    assert torch.unique(packed).numel() == torch.unique(scattered).numel()
    pairs = torch.unique(torch.stack([packed, scattered]), dim=1)
    assert pairs.shape[1] == torch.unique(packed).numel()


def test_uniform_ids_cover_their_range() -> None:
    ids = UniformIds(id_range=100_000_000, seed=1).sample(10_000)
    assert ids.dtype == torch.int64
    assert int(ids.min()) >= 0 and int(ids.max()) < 100_000_000
    assert int(ids.max()) > 90_000_000 and torch.unique(ids).numel() > 9_990


def test_locality_times_stock_eval_on_packed_and_scattered_ranks() -> None:
    config = replace(matrix.QUICK, rows=1000, batch=16)
    ms = breakdown.locality(config, calls_per_block=1, repeats=1)
    assert set(ms) == {"TBE scattered", "TBE packed", "EC scattered", "EC packed"}
    assert all(value > 0 for value in ms.values())
