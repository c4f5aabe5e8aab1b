"""Evaluation lookups of a group of tables over tiers (``tiered_eval.py``).

Three tables of one dim over host tiers (and over small host tiers above SSD
tiers, with admission) share their group's arrays (the tables and batches of
tests/test_transfers.py: odd dim, LRU and LFU tables, batches that overfill a
memory bucket). Training steps move rows down to the tiers; evaluation steps
then look up ids the tiers hold: the group's evaluation moves the evicted rows
of the three tables down in one gather and the promoted rows up in one scatter
(spies count the calls; no table moves rows of its own), and it equals, bit for
bit, the same tables evaluated table by table (``lookup_eval_per_table``, each
table's own ``lookup_eval``): outputs, and by id every tier's rows, optimizer
state and scores, and every counter, at evaluation steps interleaved with
training steps, among them batches whose promoted ids find no memory row
(scratch rows). Against an all-in-memory collection no row is lost.
"""

import pytest
import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig

from tests.device_support import assert_tables_equal, backend, kjt_to
from tests.test_transfers import CASES, DIM, FUSED, TABLES, _batches, _ebc, _spy
from torchrec_kvemb import (
    EvictionPolicy,
    HostTierOptions,
    KVEmbeddingBagCollection,
    KVTableOptions,
    native_lib,
    tiered_eval,
)
from torchrec_kvemb.group import KVTableGroup
from torchrec_kvemb.options import WAYS
from torchrec_kvemb.tiered import TieredKVTable

#: The metrics a step's moves show in.
MOVES = ("promotions", "demotions", "scratch_rows")


def _train(ebc, kjt, step: int) -> torch.Tensor:
    """One training step (a fixed gradient per step); the pooled output."""
    ebc.train()
    out = ebc(kjt).values()
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(step))
    (out * grad.to(out.device)).sum().backward()
    return out.detach()


def _evaluate(ebc, kjt) -> torch.Tensor:
    ebc.eval()
    with torch.no_grad():
        return ebc(kjt).values()


def _per_table(monkeypatch, ebc) -> None:
    """``ebc``'s groups over tiers evaluate table by table (the torch path's
    ``lookup_eval_per_table``), all else as they are."""
    for group in ebc._lookup.groups:

        def per_table(ids, table_idx, group=group):
            group._begin_tiered_batch()
            return group.lookup_eval_per_table(ids, table_idx)

        monkeypatch.setattr(group, "lookup_eval", per_table)


def _moved(ebc, before: dict) -> dict:
    """Per table, what the metrics of ``MOVES`` grew by since ``before``."""
    return {t: {k: ebc.table(t).metrics()[k] - before[t][k] for k in MOVES} for t in TABLES}


@pytest.mark.parametrize("case", list(CASES))
def test_a_group_evaluates_with_one_gather_and_one_scatter(case, device, tmp_path, monkeypatch):
    """On the device under test, by its default kernels (CPU: native; CUDA: Triton,
    the copies on the side stream): per evaluation step one gather down and one
    scatter up for the three tables, none per table and no training transfer;
    rows of at least two tables move each way at every evaluation step."""
    if device.type == "cpu":
        assert native_lib.available(), native_lib.unavailable_reason()
    with backend("auto"):
        tiered = _ebc(False, device, case, tmp_path)
        assert len(tiered._lookup.groups) == 1, "the three tables form one group"
        assert tiered._lookup.groups[0].pad is not None
        calls: dict = {}
        for name in ("gather_down", "scatter_up"):
            _spy(monkeypatch, tiered_eval, name, calls)
        for name in ("demote", "promote", "lookup_eval", "set_rows", "rows_at"):
            _spy(monkeypatch, TieredKVTable, name, calls)  # a table's own moves
        _spy(monkeypatch, KVTableGroup, "lookup_eval_per_table", calls)
        batches = _batches()
        scratch = 0
        batches = [kjt_to(kjt, device) for kjt in batches]
        for step, kjt in enumerate(batches):
            _train(tiered, kjt, step)
            if step == 0:
                continue
            before = {t: tiered.table(t).metrics() for t in TABLES}
            calls.clear()
            _evaluate(tiered, batches[step - 1])  # ids the last training step demoted
            moved = _moved(tiered, before)
            assert calls == {"gather_down": 1, "scatter_up": 1}, (step, calls, moved)
            assert sum(m["promotions"] > 0 for m in moved.values()) >= 2, (step, moved)
            assert sum(m["demotions"] > 0 for m in moved.values()) >= 2, (step, moved)
            scratch += sum(m["scratch_rows"] for m in moved.values())
        assert scratch > 0, "promoted ids of some evaluation step found no memory row"
        for t in TABLES:
            tiered.table(t).close()


@pytest.mark.parametrize("case", list(CASES))
def test_group_evaluation_equals_tables_evaluated_alone(case, tmp_path, monkeypatch):
    """The group's evaluation (one move per direction) against the same tables
    evaluated table by table, bit for bit: each step's outputs, and after it every
    table's export (memory, tiers, scratch rows settled) and counters; both trained
    alike between evaluation steps. Against all in memory: the same ids and scores
    (nothing lost), rows within float tolerance."""
    assert native_lib.available(), native_lib.unavailable_reason()
    with backend("auto"):
        group = _ebc(False, None, case, tmp_path / "group")
        alone = _ebc(False, None, case, tmp_path / "alone")
        full = _ebc(True, None, case)
        _per_table(monkeypatch, alone)
        batches = _batches()
        scratch = promotions = 0
        for step, kjt in enumerate(batches):
            # evaluation before and after each training step: the ids of the last
            # batches, held by the tiers, and this step's, some in memory
            plan = [(batches[step - 1], False)] if step else []
            plan += [(kjt, True), (kjt, False), (batches[max(step - 2, 0)], False)]
            for k, (batch, train) in enumerate(plan):
                what = f"step {step}.{k} ({'train' if train else 'eval'})"
                before = {t: group.table(t).metrics() for t in TABLES}
                outs = [
                    _train(ebc, batch, step) if train else _evaluate(ebc, batch)
                    for ebc in (group, alone, full)
                ]
                assert torch.equal(outs[0], outs[1]), what
                torch.testing.assert_close(outs[0], outs[2], rtol=1e-6, atol=1e-7)
                if not train:
                    moved = _moved(group, before)
                    scratch += sum(m["scratch_rows"] for m in moved.values())
                    promotions += sum(m["promotions"] for m in moved.values())
                for t in TABLES:
                    got, want = group.table(t).export(), alone.table(t).export()
                    assert got.keys() == want.keys(), what
                    for key in want:
                        assert torch.equal(got[key], want[key]), f"{what} {t} {key}"
                    assert group.table(t).metrics() == alone.table(t).metrics(), (what, t)
                    assert_tables_equal(f"{what} {t}", got, full.table(t).export(), 1e-7, 1e-6)
                    assert group.table(t).total_size == full.table(t).size, (what, t)
        assert promotions > 0 and scratch > 0, (promotions, scratch)
        for ebc in (group, alone):
            for t in TABLES:
                ebc.table(t).close()


def _growing(all_in_memory: bool) -> KVEmbeddingBagCollection:
    """Three LRU tables: "a" over a host tier at its maximum (2 buckets), "b" and "c"
    over host tiers growing from 2 buckets to 16; or all in memory."""
    configs = [
        EmbeddingBagConfig(name=t, embedding_dim=DIM, num_embeddings=2**50, feature_names=[f"f{t}"])
        for t in TABLES
    ]
    common = dict(eviction=EvictionPolicy.LRU, init_low=-0.1, init_high=0.1, seed=7)
    options = {}
    for t in TABLES:
        if all_in_memory:
            options[t] = KVTableOptions(capacity=64 * WAYS, **common)
        else:
            grows = {} if t == "a" else {"initial_capacity": 2 * WAYS}
            options[t] = KVTableOptions(
                capacity=(2 if t == "a" else 16) * WAYS,
                host_tier=HostTierOptions(capacity=None),
                **grows,
                **common,
            )
    return KVEmbeddingBagCollection(configs, options, fused_params=FUSED)


@pytest.mark.parametrize("implementation", ["auto", "torch"])
def test_a_table_growing_in_a_group_evaluation_keeps_the_others_scratch_rows(implementation):
    """Rows held by the tiers only: evaluation promotes them; "a" (at its maximum)
    serves some from scratch rows, "b" and "c" grow to take theirs, which
    reallocates the group's arrays and pad. The outputs and every table's rows
    equal all in memory's, on the native kernels and on the torch path. (Table by
    table, ``lookup_eval_per_table``, "a"'s scratch rows are written before "b"
    grows and are lost with the old pad.)"""
    assert native_lib.available(), native_lib.unavailable_reason()
    with backend(implementation):
        tiered, full = _growing(False), _growing(True)
        kjt = _batches()[0]
        gen = torch.Generator().manual_seed(3)
        for t in TABLES:
            ids = torch.unique(kjt[f"f{t}"].values())
            weights = torch.randn(ids.numel(), DIM, generator=gen)
            zeros = torch.zeros(ids.numel(), dtype=torch.int64)
            full.table(t).insert(ids, weights, scores=zeros, exact_scores=True)
            table = tiered.table(t)
            rows = torch.cat([weights, torch.zeros(ids.numel(), table.state_dim)], dim=1)
            table.tier.put(ids, zeros, zeros, rows)  # the tier's rows, none in memory
        assert [tiered.table(t).capacity for t in TABLES] == [2 * WAYS] * 3
        got, want = _evaluate(tiered, kjt), _evaluate(full, kjt)
        assert [tiered.table(t).capacity for t in TABLES] == [2 * WAYS, 8 * WAYS, 8 * WAYS]
        assert tiered.table("a").metrics()["scratch_rows"] > 0
        assert torch.equal(got, want)
        for t in TABLES:
            assert_tables_equal(t, tiered.table(t).export(), full.table(t).export(), 0.0, 0.0)
