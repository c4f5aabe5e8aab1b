"""Large host arrays of a table asked for 2 MB pages (torchrec_kvemb/huge_pages.py).

The marking is read back from ``/proc/self/smaps`` (``hg`` in the mapping's
VmFlags: what ``madvise(MADV_HUGEPAGE)`` set); whether the kernel then found
2 MB pages is its business. Values never depend on it: the arrays hold what
``torch.full`` / ``torch.zeros`` give, and a KV collection trains and
evaluates to the same bits with it and without it.
"""

from __future__ import annotations

import pytest
import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_kvemb import KVEmbeddingBagCollection, KVTableOptions, huge_pages
from torchrec_kvemb.contracts import TableStorage

pytestmark = pytest.mark.skipif(
    not huge_pages.supported(),
    reason="transparent huge pages are a Linux feature, off on this kernel",
)

ROWS = 3 * 16 * 4096 + 16 * 7  # 197,744 rows: weights of dim 17 are 13.4 MB
#: Rows whose weights (dim 17, 34.5 MB) are above glibc's largest mmap threshold
#: (32 MB), so they get a mapping of their own, never reused heap memory that an
#: earlier array had marked.
FRESH_ROWS = 16 * 31 * 1024


def test_a_large_tables_index_and_rows_are_marked_and_hold_their_values(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    asked = _advised_calls(monkeypatch)
    storage = TableStorage.allocate(ROWS, 17, 1, 16 * 5)
    assert huge_pages.advised(storage.weights)  # 13.4 MB
    # the keys (1.6 MB) and the counter are under MIN_BYTES: asked for nothing
    by_size = dict(asked)
    assert by_size[storage.weights.untyped_storage().nbytes()] > 0
    assert by_size.get(storage.keys.untyped_storage().nbytes(), 0) == 0
    assert by_size.get(storage.counts.untyped_storage().nbytes(), 0) == 0
    assert torch.equal(storage.weights, torch.zeros(ROWS, 17))
    assert torch.equal(storage.keys, torch.full((ROWS // 16, 16), -1))
    assert torch.equal(storage.state, torch.zeros(ROWS, 1))
    big = huge_pages.full((huge_pages.MIN_BYTES // 8 + 3,), -1, torch.int64)
    assert huge_pages.advised(big) and bool((big == -1).all())
    asked.clear()
    small = huge_pages.zeros((huge_pages.MIN_BYTES // 4 - 1,), torch.float32)
    assert asked == [(small.untyped_storage().nbytes(), 0)] and not bool(small.any())
    meta = TableStorage.allocate(FRESH_ROWS, 17, 1, 0, device="meta")  # no memory: left alone
    assert meta.weights.device.type == "meta" and huge_pages.advise(meta.weights) == 0


def _advised_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """``(bytes of the array, bytes asked 2 MB pages for)`` of each
    ``huge_pages.advise`` call, from now on.

    Why not ``advised()`` on a fresh array to show that none was asked: the
    allocator may hand out memory an earlier array of the process had advised,
    whose mapping keeps the mark (a fresh-clone run failed so once)."""
    asked: list[tuple[int, int]] = []
    real = huge_pages.advise

    def spy(tensor: torch.Tensor) -> int:
        asked.append((tensor.untyped_storage().nbytes(), real(tensor)))
        return asked[-1][1]

    monkeypatch.setattr(huge_pages, "advise", spy)
    return asked


def test_turned_off_by_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHREC_KVEMB_HUGE_PAGES", "0")
    assert not huge_pages.enabled()
    asked = _advised_calls(monkeypatch)
    storage = TableStorage.allocate(FRESH_ROWS, 17, 1, 0)
    assert asked and not any(
        done for _, done in asked
    )  # every large array went by, none was advised
    assert huge_pages.advise(storage.weights) == 0


def _collection() -> KVEmbeddingBagCollection:
    configs = [
        EmbeddingBagConfig(name="t", embedding_dim=17, num_embeddings=2**40, feature_names=["f"])
    ]
    options = KVTableOptions(capacity=FRESH_ROWS, init_low=-0.1, init_high=0.1)
    return KVEmbeddingBagCollection(configs, options, fused_params={"learning_rate": 0.05})


def test_a_collection_gives_the_same_bits_on_huge_pages(monkeypatch: pytest.MonkeyPatch) -> None:
    marked = _collection()
    monkeypatch.setenv("TORCHREC_KVEMB_HUGE_PAGES", "0")
    asked = _advised_calls(monkeypatch)
    plain = _collection()
    assert huge_pages.advised(marked.table("t").weights)
    assert asked and not any(
        done for _, done in asked
    )  # the plain collection's arrays: none advised
    g = torch.Generator().manual_seed(3)
    for step in range(3):
        lengths = torch.randint(0, 9, (257,), generator=g)
        ids = torch.randint(0, 50_000, (int(lengths.sum()),), generator=g) * 7919
        kjt = KeyedJaggedTensor.from_lengths_sync(keys=["f"], values=ids, lengths=lengths)
        outs = [m(kjt).values() for m in (marked, plain)]
        assert torch.equal(outs[0], outs[1]), step
        for out in outs:
            out.sum().backward()
    assert torch.equal(marked.table("t").weights, plain.table("t").weights)
    assert torch.equal(marked.table("t").keys, plain.table("t").keys)


def test_a_grown_tables_new_arrays_are_marked_and_hold_their_values(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A table that grows asks for 2 MB pages under its large new arrays once they
    are filled (``table.grown_storage``; khugepaged merges them later), and holds
    the rows of a table built at that capacity."""
    configs = [
        EmbeddingBagConfig(name="t", embedding_dim=17, num_embeddings=2**40, feature_names=["f"])
    ]

    def collection(initial: int | None) -> KVEmbeddingBagCollection:
        options = KVTableOptions(
            capacity=FRESH_ROWS, initial_capacity=initial, init_low=-0.1, init_high=0.1
        )
        return KVEmbeddingBagCollection(configs, options, fused_params={"learning_rate": 0.05})

    built, grown = collection(None), collection(FRESH_ROWS // 64)
    asked = _advised_calls(monkeypatch)
    ids = torch.arange(200_000) * 7919 + 5
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=["f"], values=ids, lengths=torch.full((1_000,), 200)
    )
    outs = [m(kjt).values() for m in (grown, built)]
    assert torch.equal(outs[0], outs[1])
    table = grown.table("t")
    assert table.capacity == FRESH_ROWS
    weights_bytes = table.weights.numel() * 4
    assert (
        max(done for _, done in asked) >= weights_bytes - 2 * huge_pages.HUGE_PAGE
    )  # the new rows, 34.5 MB
    assert huge_pages.advised(table.weights)
    assert torch.equal(table.weights, built.table("t").weights)
    assert torch.equal(table.keys, built.table("t").keys)
