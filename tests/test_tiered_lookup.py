"""Several tables with SSD tiers as one group against each of them alone.

A ``KVEmbeddingBagCollection`` with three tables over SSD tiers of one dim
(different capacities, policies, admission and learning rates) groups them: one
set of arrays, one scratch pad, one native lookup and one fused backward per
step for the three (``tiered_lookup.py``). The reference is each table alone in
a collection of its own on the torch path. Batches overfill buckets (scratch
rows), bring back ids the tiers hold (promotions) and add new ids (demotions);
an in-memory table beside them feeds ids the group must leave alone, and one
evaluation step reads through the shared pad. Outputs, both tiers' rows,
optimizer state, scores and counters must agree at every step (ids, scores and
counters exactly; floats within 1e-6, 1e-5 relative for the Triton kernels), on
the native kernels, on the Triton kernels (the interpreter) and on the group's
own torch path.
"""

import errno
import os

import pytest
import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_kvemb import (
    EvictionPolicy,
    KVEmbeddingBagCollection,
    KVEmbeddingCollection,
    KVTableOptions,
    SSDOptions,
    checkpoint,
)
from torchrec_kvemb.backend import ENV_VAR
from torchrec_kvemb.group import KVTableGroup
from torchrec_kvemb.ops import native
from torchrec_kvemb.ops.hashing import index_bucket
from torchrec_kvemb.options import WAYS
from torchrec_kvemb.ssd import KVStorageError
from torchrec_kvemb.ssd import slab as slab_module

DIM = 3
STEPS = 7
EVAL_STEP = 4
#: table -> (feature, memory buckets, policy, SSD capacity, admission, learning rate)
TIERED = {
    "a": ("fa", 3, EvictionPolicy.LRU, None, 1, 0.3),
    "b": ("fb", 5, EvictionPolicy.LFU, 150, 1, 0.1),
    "c": ("fc", 2, EvictionPolicy.LRU, None, 2, 0.3),
}
OPTIMIZERS = {
    "rowwise-adagrad": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
    "adam": EmbOptimType.ADAM,
}


def _batches() -> list[KeyedJaggedTensor]:
    gen = torch.Generator().manual_seed(17)
    pool = torch.randperm(50_000, generator=gen)[:277] * 6_007 + 2**41
    keys, per_key = [], []
    for feature, buckets, *_ in TIERED.values():
        # > 16 of a batch in one bucket, and seen again (admitted after two sightings)
        crowded = pool[index_bucket(pool, buckets) == 1][:31]
        keys.append(feature)
        per_key.append(crowded)
    batches = []
    for step in range(STEPS):
        values, lengths = [], []
        for crowded in per_key:
            ids = torch.cat(
                [
                    crowded[torch.randperm(crowded.numel(), generator=gen)[:19]],
                    pool[torch.randint(0, pool.numel(), (29 + step,), generator=gen)],
                ]
            )
            values.append(ids)
            lengths.append(torch.tensor([4, 0, 7, ids.numel() - 11]))
        other = pool[torch.randint(0, pool.numel(), (9,), generator=gen)]
        values.append(other)
        lengths.append(torch.tensor([2, 3, 0, 4]))
        batches.append(
            KeyedJaggedTensor.from_lengths_sync([*keys, "g"], torch.cat(values), torch.cat(lengths))
        )
    return batches


def _select(kjt: KeyedJaggedTensor, features: list[str]) -> KeyedJaggedTensor:
    parts = kjt.to_dict()
    return KeyedJaggedTensor.from_lengths_sync(
        features,
        torch.cat([parts[f].values() for f in features]),
        torch.cat([parts[f].lengths() for f in features]),
    )


def _tiered_options(name: str, path, resume: bool = False) -> KVTableOptions:
    _, buckets, policy, ssd_capacity, threshold, _ = TIERED[name]
    return KVTableOptions(
        capacity=buckets * WAYS,
        eviction=policy,
        admission_threshold=threshold,
        seed=ord(name),
        init_low=-0.1,
        init_high=0.1,
        ssd=SSDOptions(str(path / name), capacity=ssd_capacity, resume=resume),
    )


def _collection(
    names: list[str], path, optimizer: EmbOptimType, resume: bool = False
) -> KVEmbeddingBagCollection:
    configs, options = [], {}
    for name in names:
        if name == "u":
            configs.append(
                EmbeddingBagConfig(
                    name="u", embedding_dim=DIM, num_embeddings=2**40, feature_names=["g"]
                )
            )
            options["u"] = KVTableOptions(capacity=32 * WAYS, seed=6, init_low=-0.1, init_high=0.1)
            continue
        configs.append(
            EmbeddingBagConfig(
                name=name, embedding_dim=DIM, num_embeddings=2**40, feature_names=[TIERED[name][0]]
            )
        )
        options[name] = _tiered_options(name, path, resume)
    ebc = KVEmbeddingBagCollection(
        configs, options, fused_params={"optimizer": optimizer, "learning_rate": 0.3}
    )
    for name in names:
        if name != "u":
            ebc.table(name).learning_rate = TIERED[name][5]
    return ebc


def _grad(key: str, out: torch.Tensor) -> torch.Tensor:
    start = float(sum(map(ord, key)))
    return torch.sin(torch.arange(out.numel(), dtype=torch.float32) + start).view_as(out)


def _step(ebc: KVEmbeddingBagCollection, kjt: KeyedJaggedTensor, train: bool):
    """Per key: the pooled output of this step (trained with ``_grad`` when ``train``)."""
    ebc.train(train)
    with torch.set_grad_enabled(train):
        outs = ebc(kjt).to_dict()
    if train:
        torch.autograd.backward(list(outs.values()), [_grad(k, v) for k, v in outs.items()])
    return {k: v.detach() for k, v in outs.items()}


def _state(ebc: KVEmbeddingBagCollection) -> dict:
    rows = {}
    for name, table in ebc.kv_tables().items():
        for key, value in table.export().items():
            rows[f"{name}.{key}"] = value
        rows[f"{name}.metrics"] = table.metrics()
    return rows


def _grouped(backend: str, path, optimizer, monkeypatch) -> tuple[list, dict, list]:
    monkeypatch.setenv(ENV_VAR, backend)
    calls = []
    real = native.lookup_train_group

    def spy(*args, **kwargs):
        tier = kwargs.get("tier")
        if tier is not None:
            calls.append(None if tier.offsets is None else tier.offsets.numel() - 1)
        return real(*args, **kwargs)

    monkeypatch.setattr(native, "lookup_train_group", spy)
    ebc = _collection([*TIERED, "u"], path, optimizer)
    pads = {id(ebc.table(name).scratch.pad) for name in TIERED}
    assert len(pads) == 1, "the three tiered tables share one group and pad"
    outputs = [_step(ebc, kjt, step != EVAL_STEP) for step, kjt in enumerate(_batches())]
    state = _state(ebc)
    for name in TIERED:
        ebc.table(name).close()
    return outputs, state, calls


def _alone(path, optimizer, monkeypatch) -> tuple[list, dict]:
    """Each tiered table in a collection of its own, on the torch path."""
    monkeypatch.setenv(ENV_VAR, "torch")
    ebcs = {name: _collection([name], path, optimizer) for name in TIERED}
    ebcs["u"] = _collection(["u"], path, optimizer)
    features = {name: [TIERED[name][0]] if name != "u" else ["g"] for name in ebcs}
    outputs = []
    for step, kjt in enumerate(_batches()):
        out = {}
        for name, ebc in ebcs.items():
            out.update(_step(ebc, _select(kjt, features[name]), step != EVAL_STEP))
        outputs.append(out)
    state = {}
    for ebc in ebcs.values():
        state.update(_state(ebc))
    for name in TIERED:
        ebcs[name].table(name).close()
    return outputs, state


@pytest.mark.parametrize(
    "backend", ["auto", "torch", "triton"], ids=["native", "torch", "triton-interpreted"]
)
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_tiered_group_matches_tables_alone(backend, optimizer, tmp_path, monkeypatch) -> None:
    assert native.available(), native.unavailable_reason()  # make test builds it
    optim = OPTIMIZERS[optimizer]
    ref_out, ref_state = _alone(tmp_path / "alone", optim, monkeypatch)
    triton_passes = []
    if backend == "triton":  # the group kernels' tier pass, once per training step
        from torchrec_kvemb.kernels import group_lookup

        real = group_lookup.group_lookup_train_tiers_triton
        monkeypatch.setattr(
            group_lookup,
            "group_lookup_train_tiers_triton",
            lambda *a, **k: triton_passes.append(a[0].num_tables) or real(*a, **k),
        )
    out, state, calls = _grouped(backend, tmp_path / "group", optim, monkeypatch)
    # the native run: one tier lookup of the three tables per training step
    train_steps = STEPS - 1
    assert calls == ([len(TIERED)] * train_steps if backend == "auto" else []), calls
    assert triton_passes == ([len(TIERED)] * train_steps if backend == "triton" else [])
    # The Triton kernels pool and reduce a bag in another order than the torch path.
    tol = {"atol": 1e-6, "rtol": 1e-5 if backend == "triton" else 1e-6}
    for step, (want, got) in enumerate(zip(ref_out, out, strict=True)):
        assert got.keys() == want.keys()
        for key in want:
            torch.testing.assert_close(got[key], want[key], **tol, msg=f"{key} at step {step}")
    assert state.keys() == ref_state.keys()
    for key, want in ref_state.items():
        if key.endswith(".metrics"):
            assert state[key] == want, key
        elif want.dtype == torch.int64:
            assert torch.equal(state[key], want), key
        else:
            torch.testing.assert_close(state[key], want, **tol, msg=key)
    for name in TIERED:
        metrics = ref_state[f"{name}.metrics"]
        assert metrics["promotions"] > 0 and metrics["demotions"] > 0, name
        assert metrics["scratch_rows"] > 0, name


def _rows(ebc: KVEmbeddingBagCollection) -> dict:
    return {k: v for k, v in _state(ebc).items() if not k.endswith(".metrics")}


def _assert_rows_equal(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert torch.equal(got[key], value), key


def test_grouped_tiered_tables_save_load_and_resume(tmp_path) -> None:
    """A checkpoint of the group loads into a new group (which then trains as the
    original does), and reopening the SSD paths after ``close`` restores it."""
    optim = EmbOptimType.EXACT_ROWWISE_ADAGRAD
    batches = _batches()
    first = _collection([*TIERED, "u"], tmp_path / "first", optim)
    for kjt in batches[:4]:
        _step(first, kjt, True)
    checkpoint.save(first, tmp_path / "ckpt")
    saved = _rows(first)
    second = _collection([*TIERED, "u"], tmp_path / "second", optim)
    _step(second, batches[5], True)  # rows the load must replace
    checkpoint.load(second, tmp_path / "ckpt")
    _assert_rows_equal(_rows(second), saved)
    for kjt in batches[4:]:
        want, got = _step(first, kjt, True), _step(second, kjt, True)
        for key in want:
            torch.testing.assert_close(got[key], want[key], atol=1e-6, rtol=1e-6, msg=key)
    trained = _rows(first)
    for name in TIERED:
        first.table(name).close()
        second.table(name).close()
    reopened = _collection([*TIERED, "u"], tmp_path / "first", optim, resume=True)
    resumed = _rows(reopened)
    for name in TIERED:  # "u" has no SSD tier: it starts empty
        _assert_rows_equal(
            {k: v for k, v in resumed.items() if k.startswith(f"{name}.")},
            {k: v for k, v in trained.items() if k.startswith(f"{name}.")},
        )
        reopened.table(name).close()


def test_group_of_tables_with_and_without_ssd_tier_is_refused(tmp_path) -> None:
    options = [
        KVTableOptions(capacity=WAYS, ssd=SSDOptions(str(tmp_path), resume=False)),
        KVTableOptions(capacity=WAYS),
    ]
    with pytest.raises(ValueError, match="'b': the tables of a group all have a lower tier"):
        KVTableGroup(["a", "b"], options, dim=DIM)


def _no_space(*args):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _many_new_ids(step: int) -> KeyedJaggedTensor:
    """A batch of new ids for every tiered table: their slabs must grow."""
    ids = torch.arange(2_001) * 7 + 3 + step * 100_000
    features = [TIERED[name][0] for name in TIERED]
    values = torch.cat([ids + 2**42 * (t + 1) for t in range(len(features))] + [ids[:5]])
    lengths = torch.tensor([2_001] * len(features) + [5])
    return KeyedJaggedTensor.from_lengths_sync([*features, "g"], values, lengths)


def test_full_disk_in_a_group_step_changes_no_table(tmp_path, monkeypatch) -> None:
    """A full disk while the group's tables reserve room (on the tier threads) raises
    ``KVStorageError`` naming the table and changes none of the group's tables; with
    room again, the same batch trains as if nothing had happened."""
    optim = EmbOptimType.EXACT_ROWWISE_ADAGRAD
    batches = _batches()
    group = _collection([*TIERED, "u"], tmp_path / "group", optim)
    reference = _collection([*TIERED, "u"], tmp_path / "reference", optim)
    for kjt in batches[:3]:
        _step(group, kjt, True)
        _step(reference, kjt, True)
    before = {k: v for k, v in _rows(group).items() if not k.startswith("u.")}
    monkeypatch.setattr(slab_module, "_fallocate", _no_space)
    with pytest.raises(KVStorageError, match=r"table '[abc]'.*no space left on device"):
        _step(group, _many_new_ids(0), True)
    after = {k: v for k, v in _rows(group).items() if not k.startswith("u.")}
    _assert_rows_equal(after, before)
    monkeypatch.undo()
    for kjt in [_many_new_ids(0), *batches[3:]]:
        want, got = _step(reference, kjt, True), _step(group, kjt, True)
        for key in TIERED:
            feature = TIERED[key][0]
            torch.testing.assert_close(got[feature], want[feature], atol=1e-6, rtol=1e-6)
    got = {k: v for k, v in _rows(group).items() if not k.startswith("u.")}
    want = {k: v for k, v in _rows(reference).items() if not k.startswith("u.")}
    assert got.keys() == want.keys()
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, atol=1e-6, rtol=1e-6, msg=key)
    for name in TIERED:
        group.table(name).close()
        reference.table(name).close()


def _sequence_collection(names: list[str], path) -> KVEmbeddingCollection:
    configs, options = [], {}
    for name in names:
        configs.append(
            EmbeddingConfig(
                name=name, embedding_dim=DIM, num_embeddings=2**40, feature_names=[TIERED[name][0]]
            )
        )
        options[name] = _tiered_options(name, path)
    fused = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.2}
    return KVEmbeddingCollection(configs, options, fused_params=fused)


def test_sequence_collection_groups_tiered_tables_as_alone(tmp_path, monkeypatch) -> None:
    """A ``KVEmbeddingCollection`` (one row per id) of three tiered tables: one group
    on the native kernels, the same rows and outputs as each table in a collection
    of its own on the torch path."""
    features = [TIERED[name][0] for name in TIERED]
    group = _sequence_collection(list(TIERED), tmp_path / "group")
    alone = {name: _sequence_collection([name], tmp_path / "alone") for name in TIERED}
    assert len({id(group.table(name).scratch.pad) for name in TIERED}) == 1
    for step, kjt in enumerate(_batches()):
        kjt = _select(kjt, features)
        got = group(kjt)
        grads = {f: _grad(f, got[f].values()) for f in features}
        torch.autograd.backward([got[f].values() for f in features], list(grads.values()))
        for name, ec in alone.items():
            feature = TIERED[name][0]
            with monkeypatch.context() as torch_path:
                torch_path.setenv(ENV_VAR, "torch")
                want = ec(_select(kjt, [feature]))[feature].values()
                want.backward(grads[feature])
            torch.testing.assert_close(
                got[feature].values(), want, atol=1e-6, rtol=1e-6, msg=f"{name}, step {step}"
            )
    for name, ec in alone.items():
        metrics = ec.table(name).metrics()
        assert metrics["scratch_rows"] > 0 and metrics["promotions"] > 0, name
        assert group.table(name).metrics() == metrics  # before exports read the tiers
        want, got = ec.table(name).export(), group.table(name).export()
        for key, value in want.items():
            torch.testing.assert_close(got[key], value, atol=1e-6, rtol=1e-6, msg=key)
        ec.table(name).close()
        group.table(name).close()
