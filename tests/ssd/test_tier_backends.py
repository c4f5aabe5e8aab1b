"""A table with an SSD tier on the native CPU kernels against the torch path.

The same batches through two ``KVEmbeddingBagCollection``s whose tables hold a
few buckets in memory over an SSD tier (unbounded, and bounded so the tier
drops rows too): one with ``TORCHREC_KVEMB_BACKEND=torch``, one with the
native kernels. Batches overfill buckets (scratch rows), bring back ids the
tier holds (promotions), and add new ids (demotions). Outputs, both tiers'
rows, optimizer state, scores and every counter must agree at every step
(ids, slots and counters exactly; floats within 1e-6). The native run's backward
is the native fused backward over the unique rows its lookup made (scratch rows
included), the torch run's the torch path.
"""

import pytest
import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_kvemb import (
    EvictionPolicy,
    KVEmbeddingBagCollection,
    KVTable,
    KVTableOptions,
    SSDOptions,
)
from torchrec_kvemb.backend import ENV_VAR
from torchrec_kvemb.ops import native
from torchrec_kvemb.ops.hashing import index_bucket
from torchrec_kvemb.options import WAYS

DIM = 5
MEMORY_BUCKETS = 3
STEPS = 9

CASES = {
    "lru-unbounded": (EvictionPolicy.LRU, None, 1),
    "lfu-bounded": (EvictionPolicy.LFU, 200, 1),
    "lru-admission": (EvictionPolicy.LRU, None, 2),
}


#: Whether the collection has an in-memory table ``u`` (feature ``g``) beside the
#: tiered one (another group, so the tiered table's group sees ids not its own:
#: they must leave its rows alone), and the optimizer: Adam there, whose moments
#: would change under a zero gradient.
LAYOUTS = {
    "alone-rowwise-adagrad": (False, EmbOptimType.EXACT_ROWWISE_ADAGRAD),
    "beside-in-memory-table-adam": (True, EmbOptimType.ADAM),
}


def _batches(beside: bool = False) -> list[KeyedJaggedTensor]:
    gen = torch.Generator().manual_seed(11)
    pool = torch.randperm(40_000, generator=gen)[:331] * 7_919 + 2**40
    crowded = pool[index_bucket(pool, MEMORY_BUCKETS) == 1]  # > 16 of them per batch
    batches = []
    for step in range(STEPS):
        ids = torch.cat(
            [
                crowded[torch.randperm(crowded.numel(), generator=gen)[:23]],
                pool[torch.randint(0, pool.numel(), (41 + step,), generator=gen)],
            ]
        )
        lengths = torch.tensor([5, 0, 9, ids.numel() - 14])
        if not beside:
            batches.append(KeyedJaggedTensor.from_lengths_sync(["f"], ids, lengths))
            continue
        other = pool[torch.randint(0, pool.numel(), (11,), generator=gen)]
        ids, lengths = torch.cat([ids, other]), torch.cat([lengths, torch.tensor([3, 2, 0, 6])])
        batches.append(KeyedJaggedTensor.from_lengths_sync(["f", "g"], ids, lengths))
    return batches


def _run(
    backend: str,
    case: str,
    path,
    monkeypatch: pytest.MonkeyPatch,
    beside: bool = False,
    optimizer: EmbOptimType = EmbOptimType.EXACT_ROWWISE_ADAGRAD,
):
    policy, ssd_capacity, threshold = CASES[case]
    monkeypatch.setenv(ENV_VAR, backend)
    tier_calls, backward_calls, spied = [], [], {}
    real, real_backward = native.lookup_train_group, native.fused_backward_group

    def spy(*args, **kwargs):
        if kwargs.get("tier") is not None:  # the tiered table's (not u's)
            tier_calls.append(True)
        return real(*args, **kwargs)

    def backward_spy(*args, **kwargs):
        backward_calls.append(args[0] is spied["rows"])  # t's rows (and scratch), not u's
        return real_backward(*args, **kwargs)

    monkeypatch.setattr(native, "lookup_train_group", spy)
    monkeypatch.setattr(native, "fused_backward_group", backward_spy)
    configs = [
        EmbeddingBagConfig(name="t", embedding_dim=DIM, num_embeddings=2**40, feature_names=["f"])
    ]
    if beside:
        configs.append(
            EmbeddingBagConfig(
                name="u", embedding_dim=DIM, num_embeddings=2**40, feature_names=["g"]
            )
        )
    tiered = KVTableOptions(
        capacity=MEMORY_BUCKETS * WAYS,
        eviction=policy,
        admission_threshold=threshold,
        seed=5,
        init_low=-0.1,
        init_high=0.1,
        ssd=SSDOptions(str(path / backend), capacity=ssd_capacity, resume=False),
    )
    in_memory = KVTableOptions(capacity=64 * WAYS, seed=6, init_low=-0.1, init_high=0.1)
    ebc = KVEmbeddingBagCollection(
        configs,
        {"t": tiered, "u": in_memory},
        fused_params={"optimizer": optimizer, "learning_rate": 0.3},
    )
    spied["rows"] = ebc.table("t").batch_rows()[0]  # one tensor object, grown in place
    outputs = []
    for kjt in _batches(beside):
        out = ebc(kjt).values()
        out.backward(torch.sin(torch.arange(out.numel(), dtype=torch.float32)).view_as(out))
        outputs.append(out.detach())
    table = ebc.table("t")
    # the native run takes the tier's native lookup and the native fused backward
    # over its unique rows at every step, the torch run never
    assert tier_calls == ([True] * STEPS if backend == "auto" else []), tier_calls
    assert sum(backward_calls) == (STEPS if backend == "auto" else 0), backward_calls
    rows = {
        f"{name}.{key}": value
        for name, each in ebc.kv_tables().items()
        for key, value in each.export().items()
    }
    result = outputs, rows, table.metrics()
    table.ssd.close()
    return result


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("case", list(CASES))
def test_native_tier_matches_torch(case: str, layout: str, tmp_path, monkeypatch) -> None:
    assert native.available(), native.unavailable_reason()  # make test builds it
    beside, optim = LAYOUTS[layout]
    ref = _run("torch", case, tmp_path / "ref", monkeypatch, beside, optim)
    ref_out, ref_rows, ref_metrics = ref
    out, rows, metrics = _run("auto", case, tmp_path / "native", monkeypatch, beside, optim)
    for step, (a, b) in enumerate(zip(ref_out, out)):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-6, msg=f"output of step {step}")
    assert rows.keys() == ref_rows.keys()
    for key, ref in ref_rows.items():
        if ref.dtype == torch.int64:
            assert torch.equal(rows[key], ref), key
        else:
            torch.testing.assert_close(rows[key], ref, atol=1e-6, rtol=1e-6, msg=key)
    assert metrics == ref_metrics
    assert ref_metrics["promotions"] > 0 and ref_metrics["demotions"] > 0
    assert ref_metrics["scratch_rows"] > 0


def _custom_run(backend: str, path, monkeypatch: pytest.MonkeyPatch):
    """A CUSTOM_SCORE table over an SSD tier, looked up directly with custom scores
    that tie and fall, so stored, promoted and new ids lose and win by score."""
    monkeypatch.setenv(ENV_VAR, backend)
    policy = EvictionPolicy.CUSTOM_SCORE
    table = KVTable(
        "c",
        DIM,
        KVTableOptions(
            capacity=2 * WAYS,
            eviction=policy,
            seed=2,
            ssd=SSDOptions(str(path / f"custom-{backend}"), eviction=policy, resume=False),
        ),
    )
    gen = torch.Generator().manual_seed(3)
    slots = []
    for _ in range(STEPS):
        ids = torch.randint(0, 90, (57,), generator=gen) * 1_000_003
        custom = torch.randint(0, 6, (57,), generator=gen)
        slot = table.lookup_train(ids, custom)
        weights = table.batch_rows()[0]  # memory rows, then scratch rows
        weights[slot[slot >= 0]] += 0.25  # as a backward would change them
        slots.append(slot >= 0)
    result = slots, table.export(), table.metrics()
    table.ssd.close()
    return result


def test_native_tier_matches_torch_with_custom_scores(tmp_path, monkeypatch) -> None:
    ref_slots, ref_rows, ref_metrics = _custom_run("torch", tmp_path, monkeypatch)
    slots, rows, metrics = _custom_run("auto", tmp_path, monkeypatch)
    for step, (a, b) in enumerate(zip(ref_slots, slots)):
        assert torch.equal(a, b), f"which ids got a row, step {step}"
    for key, ref in ref_rows.items():
        assert torch.equal(rows[key], ref), key
    assert metrics == ref_metrics
    assert ref_metrics["promotions"] > 0 and ref_metrics["demotions"] > 0
