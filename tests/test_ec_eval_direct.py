"""An eager CPU evaluation runs ``kvemb::pooled_eval_group``'s CPU kernel without the
dispatcher's Python layers (``dispatch._plain_eager_cpu``): the same bits as the
registered op and as the torch path, for 1, 2 and 3 threads; the profiler still
names the op; under a dispatch mode, the op goes through the dispatcher; a large
output is asked for 2 MB pages and holds the same values."""

import pytest
import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torch.utils._python_dispatch import TorchDispatchMode
from torchrec.modules.embedding_configs import EmbeddingConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_kvemb import (
    KVEmbeddingCollection,
    KVTableOptions,
    dispatch,
    huge_pages,
    library,
    sequence_lookup,
)
from torchrec_kvemb.backend import ENV_VAR
from torchrec_kvemb.ops import native

DIM = 7
KEYS = ("h", "skip", "c", "u")
BAGS = 1_001  # per key: three keys of ~4.5k ids, several 4096-id tasks a call


def _ec() -> KVEmbeddingCollection:
    configs = [
        EmbeddingConfig(name="items", embedding_dim=DIM, num_embeddings=10**9,
                        feature_names=["h", "c"]),
        EmbeddingConfig(name="users", embedding_dim=DIM, num_embeddings=10**9,
                        feature_names=["u"]),
    ]  # fmt: skip
    options = {
        "items": KVTableOptions(capacity=3_000, seed=3, init_low=-0.1, init_high=0.1),
        "users": KVTableOptions(capacity=1_000, init_low=-0.1, init_high=0.1),
    }
    fused = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.1}
    return KVEmbeddingCollection(configs, options, fused_params=fused)


def _kjt(seed: int) -> KeyedJaggedTensor:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 10, (len(KEYS) * BAGS,), generator=gen)
    values = torch.randint(0, 5_000, (int(lengths.sum()),), generator=gen)
    return KeyedJaggedTensor.from_lengths_sync(keys=list(KEYS), values=values, lengths=lengths)


def _trained() -> KVEmbeddingCollection:
    ec = _ec()
    for step in range(2):
        out = ec(_kjt(step))
        rows = torch.cat([jt.values() for jt in out.values()])
        rows.backward(torch.randn(rows.shape, generator=torch.Generator().manual_seed(step)))
    return ec.eval()


def _eval(ec: KVEmbeddingCollection, kjt: KeyedJaggedTensor) -> tuple[dict, dict]:
    """The rows of each output, and each table's hits and misses in this evaluation."""
    before = ec.metrics()
    with torch.no_grad():
        out = ec(kjt)
    after = ec.metrics()
    counts = {t: {k: after[t][k] - before[t][k] for k in ("hits", "misses")} for t in after}
    return {k: jt.values().clone() for k, jt in out.items()}, counts


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_direct_kernel_equals_the_op_and_the_torch_path(monkeypatch, threads):
    ec = _trained()
    kjt = _kjt(10)
    kernel = library.cpu_kernel("pooled_eval_group")
    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return kernel(*args, **kwargs)

    monkeypatch.setitem(library.registry._CPU_KERNELS, "pooled_eval_group", counted)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        monkeypatch.setenv(ENV_VAR, "torch")
        want, want_counts = _eval(ec, kjt)
        assert not calls
        monkeypatch.setenv(ENV_VAR, "auto")
        got, got_counts = _eval(ec, kjt)
        direct_calls = len(calls)
        assert direct_calls >= 1, "the eager evaluation did not call the CPU kernel directly"
        monkeypatch.setattr(dispatch, "_plain_eager_cpu", lambda *args: False)
        via_op, op_counts = _eval(ec, kjt)
        assert len(calls) == direct_calls  # through the dispatcher, not the direct call
    finally:
        torch.set_num_threads(previous)
    assert list(got) == list(want) == list(via_op)
    for name in want:
        assert torch.equal(got[name], want[name]), name
        assert torch.equal(via_op[name], want[name]), name
    assert got_counts == want_counts == op_counts
    missing = [v for v in got.values() if v.numel() and bool((v == 0).all(dim=1).any())]
    found = [v for v in got.values() if v.numel() and bool((v != 0).any(dim=1).any())]
    assert missing and found, "the batch must hold ids with and without rows"


def test_the_profiler_still_names_the_op(monkeypatch):
    ec = _trained()
    with torch.no_grad(), torch.profiler.profile() as prof:
        ec(_kjt(10))
    names = {event.name for event in prof.events()}
    assert "kvemb::pooled_eval_group" in names


def test_a_dispatch_mode_sees_the_op(monkeypatch):
    """Under a dispatch mode (FakeTensor, export, op counters) the dispatcher runs."""

    class Seen(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    ec = _trained()
    kjt = _kjt(10)
    want, _ = _eval(ec, kjt)
    with Seen() as seen:
        got, _ = _eval(ec, kjt)
    assert any("kvemb.pooled_eval_group" in op for op in seen.ops), sorted(set(seen.ops))
    for name in want:
        assert torch.equal(got[name], want[name]), name


@pytest.mark.skipif(not huge_pages.supported(), reason="no transparent huge pages here")
def test_a_large_output_is_on_huge_pages_with_the_same_rows(monkeypatch):
    """An output of at least ``huge_pages.MIN_BYTES`` is advised before it is written,
    and holds what an output too small to be advised holds (the ids' rows)."""
    monkeypatch.setenv("TORCHREC_KVEMB_HUGE_PAGES", "1")
    ec = _trained()
    group = ec._lookup.groups[0]
    layout, storage = group.layout, group.storage
    n = huge_pages.MIN_BYTES // (4 * DIM) + 3
    ids = torch.randint(0, 5_000, (n,), generator=torch.Generator().manual_seed(5))
    table_of_bag = torch.randint(0, 2, (n,), generator=torch.Generator().manual_seed(6))

    def rows(lo: int, hi: int) -> torch.Tensor:
        out, _, _ = native.pooled_eval(
            storage.keys, layout.bucket_offset, layout.num_buckets, storage.weights,
            ids[lo:hi], None, table_of_bag[lo:hi], num_threads=3, unpooled=True,
        )  # fmt: skip
        return out

    big = rows(0, n)
    assert big.shape == (n, DIM) and huge_pages.advised(big)
    small = torch.cat([rows(lo, min(lo + 1_001, n)) for lo in range(0, n, 1_001)])
    assert torch.equal(big, small)
    assert bool((big != 0).any(dim=1).any()) and bool((big == 0).all(dim=1).any())


def test_pieces_reuse_released_memory_and_never_overwrite_held_outputs(monkeypatch):
    """A batch in pieces writes into the last batch's memory once nothing holds it;
    an output still held (or a view of it) keeps its rows while later batches run."""
    monkeypatch.setattr(sequence_lookup, "EVAL_PIECE_BYTES", DIM * 4 * 3_000)  # 3 pieces
    ec = _trained()
    first, second = _kjt(10), _kjt(11)
    monkeypatch.setenv(ENV_VAR, "torch")
    want_first, _ = _eval(ec, first)
    want_second, _ = _eval(ec, second)
    monkeypatch.setenv(ENV_VAR, "auto")

    def pointers(out: dict) -> set[int]:
        return {jt.values().data_ptr() for jt in out.values() if jt.values().numel()}

    with torch.no_grad():
        held = ec(first)
        view = held["c"].values()[1:]
        again = ec(second)  # ``held`` is alive: other memory
        assert not pointers(held) & pointers(again)
        again_pointers = pointers(again)
        del again
        reused = ec(second)  # into the memory ``again`` let go
        assert pointers(reused) == again_pointers
        assert not pointers(held) & pointers(reused)
    for name in want_first:
        assert torch.equal(held[name].values(), want_first[name]), name
        assert torch.equal(reused[name].values(), want_second[name]), name
    assert torch.equal(view, want_first["c"][1:])
    assert ec._lookup._outputs.nbytes() > 0


@pytest.mark.parametrize("dim", [12, 64])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_a_large_output_streamed_around_the_caches_holds_the_rows(monkeypatch, dim, threads):
    """Rows of a multiple of 4 floats into an output of at least 8 MB are written by
    non-temporal stores (csrc/pooled_forward.cpp, kStreamBytes): the same bits as
    rows gathered by the torch path's slots, zeros for ids without a row, in a new
    output and in a given one."""
    configs = [
        EmbeddingConfig(name=n, embedding_dim=dim, num_embeddings=10**9, feature_names=[n])
        for n in ("a", "b")
    ]
    ec = KVEmbeddingCollection(configs, KVTableOptions(capacity=2_000, seed=1))
    gen = torch.Generator().manual_seed(dim)
    seen = torch.randint(0, 3_000, (2 * 997,), generator=gen)
    ec(KeyedJaggedTensor.from_lengths_sync(["a", "b"], seen, torch.full((2,), 997)))
    group = ec._lookup.groups[0]
    layout, storage = group.layout, group.storage
    n = (8 << 20) // (4 * dim) + 1_001  # just above the 8 MB line
    ids = torch.randint(0, 4_000, (n,), generator=gen)
    table = torch.randint(0, 2, (n,), generator=gen)
    monkeypatch.setenv(ENV_VAR, "torch")
    slots = group.lookup_eval(ids, table)
    want = torch.where((slots >= 0)[:, None], storage.weights[slots.clamp(min=0)], 0.0)
    assert bool((slots < 0).any()) and bool((slots >= 0).any())
    args = (storage.keys, layout.bucket_offset, layout.num_buckets, storage.weights)
    fresh, _, _ = native.pooled_eval(*args, ids, None, table, num_threads=threads, unpooled=True)
    into = torch.full((n, dim), float("nan"))
    given, _, _ = native.pooled_eval(
        *args, ids, None, table, num_threads=threads, unpooled=True, into=into
    )
    small, _, _ = native.pooled_eval(  # under the line: cached stores
        *args, ids[:999], None, table[:999], num_threads=threads, unpooled=True
    )
    assert given.data_ptr() == into.data_ptr()
    assert torch.equal(fresh, want) and torch.equal(given, want)
    assert torch.equal(small, want[:999])
