"""The native host exchange (``native.host_exchange``) against its torch path
(``ops/host_exchange.py``), bit for bit, and its refusals.

Each case is a consistent host tier built by hand: held ids in the main part
and the stash, each with a record, the other records on the free list; the
down ids placed at empty index slots (key written, record -1), the up ids
chosen among the held ones, and table slots that go down and come up in the
same call. Clones of the arrays run through both and must be equal in every
bit (floats compared as their int32 words).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from torchrec_kvemb import backend, dispatch, native_lib
from torchrec_kvemb.library.tier_ops import ExchangeArgs
from torchrec_kvemb.ops import native
from torchrec_kvemb.ops.hashing import index_bucket
from torchrec_kvemb.ops.host_exchange import host_exchange_torch
from torchrec_kvemb.options import WAYS

THREADS = (1, 2, 3)
#: (down rows, up rows) of a move kind.
MOVES = {"both": (9, 11), "down-only": (9, 0), "up-only": (0, 11), "none": (0, 0)}


@pytest.fixture(autouse=True)
def build(native_build: str) -> str:
    """Every test runs on each build of the library (tests/ops/conftest.py)."""
    return native_build


@dataclass(frozen=True)
class Size:
    """The arrays' sizes: table rows, records, held ids, main and stash buckets."""

    table_rows: int = 37
    records: int = 61
    held: int = 29
    main_buckets: int = 5
    stash_buckets: int = 3


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` as integers (float32: its words), so that equal means bit-identical."""
    return t.view(torch.int32) if t.dtype == torch.float32 else t


def assert_same(got: ExchangeArgs, want: ExchangeArgs, at: str = "") -> None:
    for name, a, b in zip(ExchangeArgs._fields, got, want, strict=True):
        assert a.shape == b.shape and torch.equal(bits(a), bits(b)), f"{at}: {name} differs"


def clone(args: ExchangeArgs) -> ExchangeArgs:
    return ExchangeArgs(*(a.clone() for a in args))


def random_rows(n: int, width: int, gen: torch.Generator) -> torch.Tensor:
    """float32 rows with some -0.0 and NaN (their bits must travel unchanged)."""
    rows = torch.randn(n, width, generator=gen)
    flat = rows.view(-1)
    if flat.numel() >= 4:
        flat[torch.randperm(flat.numel(), generator=gen)[:2]] = -0.0
        flat[torch.randperm(flat.numel(), generator=gen)[:1]] = float("nan")
    return rows


def make_case(
    gen: torch.Generator,
    dim: int,
    state_dim: int,
    stash: bool,
    num_down: int,
    num_up: int,
    size: Size = Size(),
) -> ExchangeArgs:
    """A consistent host tier and table, and an exchange of ``num_down`` rows down and
    ``num_up`` rows up (from the main part and the stash), whose up table slots reuse
    down table slots and include some -1."""
    R, M, H = size.table_rows, size.records, size.held
    i64 = dict(dtype=torch.int64)
    main_slots = size.main_buckets * WAYS
    stash_slots = size.stash_buckets * WAYS if stash else 0
    slots = main_slots + stash_slots
    main_keys = torch.full((size.main_buckets, WAYS), -1, **i64)
    main_scores = torch.zeros_like(main_keys)
    main_record = torch.full((main_slots,), -1, **i64)
    stash_keys = torch.full((stash_slots // WAYS, WAYS), -1, **i64)
    stash_scores = torch.zeros_like(stash_keys)
    stash_record = torch.full((stash_slots,), -1, **i64)

    def write(column: tuple[torch.Tensor, torch.Tensor], at: torch.Tensor, values) -> None:
        main, st = column
        in_main = at < main_slots
        main.view(-1)[at[in_main]] = values[in_main]
        st.view(-1)[at[~in_main] - main_slots] = values[~in_main]

    # held ids: distinct ids at distinct slots (stash ones first when there is a stash)
    order = torch.randperm(slots, generator=gen)
    if stash:
        order = torch.cat([order[order >= main_slots], order[order < main_slots]])
        order = torch.cat([order[:6], order[6:][torch.randperm(slots - 6, generator=gen)]])
    held_slots, empty_slots = order[:H], order[H:]
    all_ids = torch.randperm(10_000, generator=gen)[: H + num_down] * 7 + 3
    held_ids, new_ids = all_ids[:H], all_ids[H:]
    perm = torch.randperm(M, generator=gen)
    held_records, free_records = perm[:H], perm[H:]
    write((main_keys, stash_keys), held_slots, held_ids)
    write((main_scores, stash_scores), held_slots, torch.randint(0, 50, (H,), generator=gen))
    write((main_record, stash_record), held_slots, held_records)

    record_ids = torch.full((M,), -1, **i64)
    record_ids[held_records] = held_ids
    record_scores = torch.randint(0, 1000, (M,), generator=gen)  # free ones: stale values
    free_list = torch.randint(0, M, (M,), generator=gen)  # past free_count: stale values
    free_list[: M - H] = free_records
    free_count = torch.tensor([M - H])

    # down: placed at empty slots (key and tier score written, record -1)
    table = torch.randperm(R, generator=gen)
    down_slots = table[:num_down].clone()
    down_host_slots = empty_slots[torch.randperm(empty_slots.numel(), generator=gen)[:num_down]]
    write((main_keys, stash_keys), down_host_slots, new_ids)
    write(
        (main_scores, stash_scores),
        down_host_slots,
        torch.randint(0, 50, (num_down,), generator=gen),
    )
    down_scores = torch.randint(0, 1000, (num_down,), generator=gen)

    # up: held slots (stash ones among them), to table slots that went down too
    pick = torch.randperm(H, generator=gen)[:num_up]
    if stash and num_up and not bool((pick < 6).any()):
        pick[0] = int(torch.randint(0, 6, (1,), generator=gen))  # held_slots[:6]: the stash's
    up_host_slots = held_slots[pick]
    start = num_down // 2
    up_slots = table[start : start + num_up].clone()
    up_slots[torch.rand(num_up, generator=gen) < 0.25] = -1

    return ExchangeArgs(
        weights=random_rows(R, dim, gen),
        state=random_rows(R, state_dim, gen),
        rows=random_rows(M, dim + state_dim, gen),
        record_ids=record_ids,
        record_scores=record_scores,
        free_list=free_list,
        free_count=free_count,
        main_keys=main_keys,
        main_scores=main_scores,
        main_record=main_record,
        stash_keys=stash_keys,
        stash_scores=stash_scores,
        stash_record=stash_record,
        down_slots=down_slots,
        down_ids=new_ids,
        down_scores=down_scores,
        down_host_slots=down_host_slots,
        up_host_slots=up_host_slots,
        up_slots=up_slots,
    )


def reference(args: ExchangeArgs) -> ExchangeArgs:
    want = clone(args)
    host_exchange_torch(*want)
    return want


# ------------------------------------------------------------ against torch
@pytest.mark.parametrize("moves", list(MOVES))
@pytest.mark.parametrize("stash", [False, True], ids=["no-stash", "stash"])
@pytest.mark.parametrize("state_dim", [0, 1, 3], ids=lambda s: f"state{s}")
@pytest.mark.parametrize("dim", [1, 7, 64], ids=lambda d: f"dim{d}")
def test_matches_torch_path(dim: int, state_dim: int, stash: bool, moves: str) -> None:
    """Every array bit-identical to the torch path's, on 1, 2 and 3 threads."""
    num_down, num_up = MOVES[moves]
    gen = torch.Generator().manual_seed(1000 * dim + 10 * state_dim + stash)
    args = make_case(gen, dim, state_dim, stash, num_down, num_up)
    if num_down and num_up:
        moved = args.up_slots[args.up_slots >= 0]
        assert bool(torch.isin(moved, args.down_slots).any()), "an up slot went down too"
    if stash and num_up:
        assert bool((args.up_host_slots >= args.main_record.numel()).any()), "up from the stash"
    want = reference(args)
    assert torch.equal(bits(want.rows), bits(args.rows)) == (num_down == 0)
    assert torch.equal(bits(want.weights), bits(args.weights)) == (num_up == 0)
    assert int(want.free_count[0]) == int(args.free_count[0]) - num_down + num_up
    for threads in THREADS:
        got = clone(args)
        native.host_exchange(*got, num_threads=threads)
        assert_same(got, want, f"{threads} threads")


@pytest.mark.parametrize("dim, state_dim", [(7, 3), (64, 0)], ids=["dim7-state3", "dim64-state0"])
def test_many_rows_over_threads(dim: int, state_dim: int) -> None:
    """Thousands of rows each way (several tasks of rows): 1, 2 and 3 threads give
    the torch path's bits."""
    size = Size(table_rows=3001, records=4001, held=2400, main_buckets=313, stash_buckets=11)
    gen = torch.Generator().manual_seed(dim + state_dim)
    args = make_case(gen, dim, state_dim, True, 1500, 1301, size)
    want = reference(args)
    for threads in THREADS:
        got = clone(args)
        native.host_exchange(*got, num_threads=threads)
        assert_same(got, want, f"{threads} threads")


# ---------------------------------------------------------- by hand
def test_small_case_by_hand() -> None:
    """One main bucket, one stash bucket, four records: each written value checked
    against what the semantics say (the torch path and the native op)."""
    i64 = dict(dtype=torch.int64)
    weights = torch.arange(6, dtype=torch.float32).view(3, 2) + 0.5
    state = torch.tensor([[10.0], [11.0], [12.0]])
    rows = torch.arange(12, dtype=torch.float32).view(4, 3) + 100
    main_keys = torch.full((1, WAYS), -1, **i64)
    main_scores = torch.zeros_like(main_keys)
    main_record = torch.full((WAYS,), -1, **i64)
    stash_keys, stash_scores = main_keys.clone(), main_scores.clone()
    stash_record = main_record.clone()
    # held: id 100 at main slot 3 (record 0), id 200 at stash slot 5 (global 21, record 2)
    main_keys[0, 3], main_scores[0, 3], main_record[3] = 100, 9, 0
    stash_keys[0, 5], stash_scores[0, 5], stash_record[5] = 200, 8, 2
    # down ids 7 and 8 placed at main slot 0 and stash slot 1 (global 17)
    main_keys[0, 0], main_scores[0, 0] = 7, 5
    stash_keys[0, 1], stash_scores[0, 1] = 8, 6
    args = ExchangeArgs(
        weights, state, rows,
        record_ids=torch.tensor([100, -1, 200, -1]),
        record_scores=torch.tensor([31, 32, 33, 34]),
        free_list=torch.tensor([3, 1, 9, 9]),
        free_count=torch.tensor([2]),
        main_keys=main_keys, main_scores=main_scores, main_record=main_record,
        stash_keys=stash_keys, stash_scores=stash_scores, stash_record=stash_record,
        down_slots=torch.tensor([2, 0]),
        down_ids=torch.tensor([7, 8]),
        down_scores=torch.tensor([70, 80]),
        down_host_slots=torch.tensor([0, 17]),
        up_host_slots=torch.tensor([21, 3]),
        up_slots=torch.tensor([2, -1]),
    )  # fmt: skip

    want = clone(args)
    # down: table row 2 to record 1 (the free list's last entry, popped first), row 0 to 3
    want.rows[1] = torch.tensor([4.5, 5.5, 12.0])
    want.rows[3] = torch.tensor([0.5, 1.5, 10.0])
    want.main_record[0], want.stash_record[1] = 1, 3
    want.main_scores[0, 0], want.stash_scores[0, 1] = 70, 80  # the index keeps memory scores
    # up: record 2 (id 200) to table row 2, after row 2 went down; record 0 not copied
    want.weights[2] = torch.tensor([106.0, 107.0])
    want.state[2] = torch.tensor([108.0])
    # the up ids leave; records 1 and 3 hold the down ids, 2 and 0 are free again
    want.record_ids.copy_(torch.tensor([-1, 7, -1, 8]))
    want.record_scores.copy_(torch.tensor([31, 70, 33, 80]))
    want.free_list.copy_(torch.tensor([2, 0, 9, 9]))
    want.free_count[0] = 2
    want.main_keys[0, 3], want.main_scores[0, 3], want.main_record[3] = -1, 0, -1
    want.stash_keys[0, 5], want.stash_scores[0, 5], want.stash_record[5] = -1, 0, -1

    assert_same(reference(args), want, "torch path")
    for threads in THREADS:
        got = clone(args)
        native.host_exchange(*got, num_threads=threads)
        assert_same(got, want, f"native, {threads} threads")


# ---------------------------------------------------------- refusals
def _held_slot(a: ExchangeArgs, exclude: torch.Tensor) -> int:
    records = torch.cat([a.main_record, a.stash_record])
    held = (records >= 0).nonzero().squeeze(1)
    return int(held[~torch.isin(held, exclude)][0])


def _empty_slot(a: ExchangeArgs) -> int:
    records = torch.cat([a.main_record, a.stash_record])
    empty = (records < 0).nonzero().squeeze(1)
    return int(empty[~torch.isin(empty, a.down_host_slots)][0])


def _set(field: str, index: int, value) -> object:
    """A break: ``args.<field>[index] = value(args)``."""

    def apply(a: ExchangeArgs) -> None:
        getattr(a, field)[index] = value(a)

    return apply


def _free_record_holds_id(a: ExchangeArgs) -> None:
    a.record_ids[a.free_list[int(a.free_count[0]) - 2]] = 12345  # the second one popped


def _free_record_out_of_range(a: ExchangeArgs) -> None:
    a.free_list[int(a.free_count[0]) - 1] = a.record_ids.numel()  # the first one popped


BREAKS = {
    "down-host-slot-holds-record": _set(
        "down_host_slots", 1, lambda a: _held_slot(a, a.up_host_slots)
    ),
    "up-host-slot-without-record": _set("up_host_slots", 2, _empty_slot),
    "up-host-slot-is-a-down-slot": _set("up_host_slots", 0, lambda a: a.down_host_slots[3]),
    "down-host-slot-past-the-index": _set(
        "down_host_slots", 0, lambda a: a.main_record.numel() + a.stash_record.numel()
    ),
    "up-host-slot-negative": _set("up_host_slots", 4, lambda a: -1),
    "down-table-slot-past-the-table": _set("down_slots", 2, lambda a: a.weights.shape[0]),
    "down-table-slot-negative": _set("down_slots", 2, lambda a: -1),
    "up-table-slot-past-the-table": _set("up_slots", 0, lambda a: a.weights.shape[0]),
    "up-table-slot-below-minus-one": _set("up_slots", 0, lambda a: -2),
    "more-down-rows-than-free-records": _set("free_count", 0, lambda a: a.down_slots.numel() - 1),
    "free-count-past-the-records": _set("free_count", 0, lambda a: a.record_ids.numel() + 1),
    "free-record-holds-an-id": _free_record_holds_id,
    "free-list-record-out-of-range": _free_record_out_of_range,
}


@pytest.mark.parametrize("stash", [False, True], ids=["no-stash", "stash"])
@pytest.mark.parametrize("bad", list(BREAKS))
def test_refusals_write_nothing(bad: str, stash: bool) -> None:
    """An inconsistent exchange is refused (``NativeOpError``) before any array is
    written."""
    gen = torch.Generator().manual_seed(7)
    args = make_case(gen, 5, 2, stash, 9, 11)
    BREAKS[bad](args)
    before = clone(args)
    for threads in THREADS:
        with pytest.raises(native_lib.NativeOpError, match="inconsistent"):
            native.host_exchange(*args, num_threads=threads)
        assert_same(args, before, f"{threads} threads")


def test_wrong_row_width_is_a_value_error() -> None:
    """The wrapper's checks: rows not ``dim + state_dim`` wide are refused."""
    gen = torch.Generator().manual_seed(8)
    args = make_case(gen, 5, 2, True, 9, 11)
    args = args._replace(rows=torch.zeros(args.rows.shape[0], 8))
    before = clone(args)
    with pytest.raises(ValueError, match="rows must have shape"):
        native.host_exchange(*args)
    assert_same(args, before)


# ---------------------------------------------------------- registered op
@pytest.fixture
def native_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts ``native.host_exchange`` calls (the registered op's CPU kernel)."""
    calls: list[int] = []
    run = native.host_exchange

    def spy(*args, **kwargs):
        calls.append(1)
        return run(*args, **kwargs)

    monkeypatch.setattr(native, "host_exchange", spy)
    monkeypatch.setenv(backend.ENV_VAR, "auto")
    return calls


@pytest.mark.parametrize("stash", [False, True], ids=["no-stash", "stash"])
@pytest.mark.parametrize(
    "entry",
    ["torch.ops.kvemb", "dispatch"],
)
def test_registered_op_matches_torch_path(entry: str, stash: bool, native_calls) -> None:
    """``torch.ops.kvemb.host_exchange`` and ``dispatch.host_exchange`` on CPU tensors
    run the native kernel and write the torch path's bits."""
    gen = torch.Generator().manual_seed(9 + stash)
    args = make_case(gen, 7, 3, stash, 9, 11)
    want = reference(args)
    got = clone(args)
    op = torch.ops.kvemb.host_exchange if entry == "torch.ops.kvemb" else dispatch.host_exchange
    op(*got)
    assert native_calls, "the native kernel ran"
    assert_same(got, want, entry)


# ------------------------------------------------------ placement by the call
def unplaced(args: ExchangeArgs, every: int) -> ExchangeArgs:
    """``args`` with every ``every``-th down id not placed yet: its key taken out
    (and its tier score), its slot -1, for the call to place."""
    args = clone(args)
    main_slots = args.main_record.numel()
    for k in range(0, args.down_ids.numel(), every):
        slot = int(args.down_host_slots[k])
        keys, scores = (args.main_keys, args.main_scores)
        if slot >= main_slots:
            keys, scores, slot = args.stash_keys, args.stash_scores, slot - main_slots
        keys.view(-1)[slot], scores.view(-1)[slot] = -1, 0
        args.down_host_slots[k] = -1
    return args


@pytest.mark.parametrize("every", [1, 2], ids=["all", "every-other"])
@pytest.mark.parametrize("stash", [False, True], ids=["no-stash", "stash"])
def test_the_call_places_unplaced_ids(stash: bool, every: int) -> None:
    """Down ids given slot -1 are placed by the call: the native op equals the torch
    path on 1, 2 and 3 threads, and each id sits in its main bucket, or (that one
    full) in its stash bucket, at the lowest way empty before it."""
    gen = torch.Generator().manual_seed(40 + stash + every)
    size = Size(table_rows=61, records=90, held=23, main_buckets=4, stash_buckets=3)
    args = unplaced(make_case(gen, 7, 1, stash, 9, 4, size), every)
    if stash:  # the main buckets of the ids to place left with one empty way each
        todo = args.down_ids[args.down_host_slots == -1]
        for bucket in index_bucket(todo, args.main_keys.shape[0]).unique().tolist():
            empty = (args.main_keys[bucket] < 0).nonzero().squeeze(1)[1:]
            args.main_keys[bucket, empty] = torch.arange(empty.numel()) + 800_000 + 16 * bucket
    want = reference(args)
    for threads in THREADS:
        got = clone(args)
        native.host_exchange(*got, num_threads=threads)
        assert_same(got, want, f"{threads} threads")
    main_slots = args.main_record.numel()
    placed = (args.down_host_slots == -1).nonzero().squeeze(1)
    slots = want.down_host_slots[placed]
    assert bool((slots >= 0).all())
    ids = args.down_ids[placed]
    main_bucket = index_bucket(ids, args.main_keys.shape[0])
    in_main = slots < main_slots
    assert torch.equal(slots[in_main] // WAYS, main_bucket[in_main])
    if stash:
        assert bool((~in_main).any()), "a full main bucket sends an id to the stash"
        stash_bucket = index_bucket(ids[~in_main], args.stash_keys.shape[0])
        assert torch.equal((slots[~in_main] - main_slots) // WAYS, stash_bucket)
        after = args.main_keys.clone()  # the main part with every placement, before ids leave
        after.view(-1)[slots[in_main]] = ids[in_main]
        full = after[main_bucket[~in_main]] >= 0
        assert bool(full.all()), "only an id whose main bucket was full went to the stash"
    else:
        assert bool(in_main.all())


def test_an_id_without_room_is_refused_and_nothing_is_written() -> None:
    """A down id whose main bucket and stash bucket are full: ``NoRoomError`` from the
    native op and the torch path alike, and every array as it was (the ids the call
    placed before it are taken out again)."""
    gen = torch.Generator().manual_seed(77)
    args = unplaced(make_case(gen, 3, 1, True, 5, 2), 1)
    last = args.down_ids[-1:]
    main_bucket = int(index_bucket(last, args.main_keys.shape[0]))
    stash_bucket = int(index_bucket(last, args.stash_keys.shape[0]))
    for keys, bucket in ((args.main_keys, main_bucket), (args.stash_keys, stash_bucket)):
        empty = keys[bucket] < 0
        keys[bucket][empty] = torch.arange(int(empty.sum())) + 900_001  # ids nobody moves
    for run in (
        lambda a: native.host_exchange(*a, num_threads=2),
        lambda a: host_exchange_torch(*a),
    ):
        got = clone(args)
        with pytest.raises(native_lib.NoRoomError, match="no empty way"):
            run(got)
        assert_same(got, args, "refused")
