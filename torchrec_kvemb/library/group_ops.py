"""Ops of a group of KV tables (``torchrec_kvemb/group.py``): ``torch.ops.kvemb.
{lookup_train_group, lookup_eval_group, pooled_eval_group, pooled_forward, rows_forward,
fused_backward}``.

Each op's arguments are the fields of one ``NamedTuple`` below (its schema: a
group's arrays, ``TableStorage``, updated in place; its layout as
``GroupLayout.tensors()`` and two flags; the batch). Kernels:

==================  =========================================  ===========================
op                  CPU                                        CUDA
==================  =========================================  ===========================
lookup_train_group  native (``csrc/lookup_train.cpp``)         Triton (``group_lookup``)
lookup_eval_group   native (``csrc/lookup_eval.cpp``)          Triton (``group_lookup``)
pooled_eval_group   native (``csrc/pooled_forward.cpp``)       Triton: the probe, then pooled
pooled_forward      native (``csrc/pooled_forward.cpp``)       Triton (``group_pooled``)
rows_forward        native (``csrc/pooled_forward.cpp``)       Triton (``group_pooled``)
fused_backward      native (``csrc/fused_backward.cpp``)       Triton (``group_pooled``)
==================  =========================================  ===========================

Every kernel gives, table by table, what the per-table torch path gives (the
reference; tests hold them to it): ids, slots, scores and counters bit for bit,
rows to float tolerance. The lookup advances each table's clock (``step``) and
the backward each table's optimizer step (``optim_steps``), in place.

Example::

    out = torch.ops.kvemb.lookup_eval_group(keys, layout.bucket_offset,
                                            layout.num_buckets, ids, table_idx, metrics)
"""

import threading
from typing import NamedTuple

import torch

from torchrec_kvemb.contracts import KERNEL_METRICS, Bags, GroupLayout
from torchrec_kvemb.library.registry import define, schema
from torchrec_kvemb.native_lib import Workspace
from torchrec_kvemb.ops import native
from torchrec_kvemb.ops.pooled_lookup import add_initial_rows, copy_initial_rows
from torchrec_kvemb.optimizer import FusedOptimConfig, OptimKind, WeightDecay

Tensor = torch.Tensor

_WORKSPACES = threading.local()


def workspace() -> Workspace:
    """This thread's scratch memory for the native group ops (made on first use;
    why reused: fresh scratch pages cost ~15% of a training lookup of 327k ids)."""
    ws = getattr(_WORKSPACES, "value", None)
    if ws is None:
        ws = _WORKSPACES.value = Workspace()
    return ws


class InitArgs(NamedTuple):
    """The layout's initial-row settings (``GroupLayout``'s tensors of those names)."""

    seed: Tensor
    seed_mix: Tensor
    init_normal: Tensor
    init_a: Tensor
    init_b: Tensor
    init_col: Tensor

    def layout(self) -> GroupLayout:
        """A layout that carries only these (what a pooled forward reads of it)."""
        zeros = (torch.zeros_like(self.seed),) * 6
        return GroupLayout.from_tensors((*zeros, *self), has_admission=False, has_normal=False)


# ------------------------------------------------------------ lookup_train_group
class TrainArgs(NamedTuple):
    """``lookup_train_group``'s arguments; ``step``: each table's clock, advanced by
    one here; counters add to ``metrics``."""

    keys: Tensor
    scores: Tensor
    weights: Tensor
    state: Tensor
    counter_keys: Tensor
    counter_scores: Tensor
    counts: Tensor
    bucket_offset: Tensor
    num_buckets: Tensor
    policy: Tensor
    admission_threshold: Tensor
    counter_bucket_offset: Tensor
    counter_num_buckets: Tensor
    seed: Tensor
    seed_mix: Tensor
    init_normal: Tensor
    init_a: Tensor
    init_b: Tensor
    init_col: Tensor
    has_admission: bool
    has_normal: bool
    ids: Tensor
    table_idx: Tensor
    step: Tensor
    metrics: Tensor
    custom_scores: Tensor | None
    use_custom: Tensor | None

    def layout(self) -> GroupLayout:
        return GroupLayout.from_tensors(self[7:19], self.has_admission, self.has_normal)


TRAIN_MUTATES = ("keys", "scores", "weights", "state", "counter_keys", "counter_scores",
                 "counts", "step", "metrics")  # fmt: skip


def _lookup_train_cpu(*args: object) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    a = TrainArgs(*args)
    counter = None
    if a.has_admission:
        counter = native.CounterIndex(a.counter_keys, a.counter_scores, a.counts)
    a.step.add_(1)
    out = native.lookup_train_group(
        a.layout(), a.keys, a.scores, a.weights, a.state, a.ids, a.table_idx, a.step,
        a.custom_scores, a.use_custom, counter, num_threads=torch.get_num_threads(),
        workspace=workspace(), pad_uniques=True,
    )  # fmt: skip
    a.metrics[:, :KERNEL_METRICS] += out.metrics
    # One unique per id, as the Triton kernel gives (static shapes for torch.compile):
    # the entries past the batch's uniques have no row (slot -1) and no occurrence.
    return out.slots, out.unique_index, out.unique_slots, out.unique_table


def _lookup_train_cuda(*args: object) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    from torchrec_kvemb.kernels.group_lookup import group_lookup_train_triton

    a = TrainArgs(*args)
    a.step.add_(1)
    out = group_lookup_train_triton(
        a.layout(), a.keys, a.scores, a.weights, a.state, a.counter_keys, a.counter_scores,
        a.counts, a.ids, a.table_idx, a.step, a.metrics, a.custom_scores, a.use_custom,
    )  # fmt: skip
    return out.slots, out.unique_index, out.unique_slots, out.unique_table


def _lookup_train_fake(*args: object) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    # One unique per id: those past the batch's uniques have slot -1.
    ids = TrainArgs(*args).ids
    return tuple(torch.empty_like(ids) for _ in range(4))


lookup_train_group = define(
    "lookup_train_group",
    _lookup_train_cpu,
    _lookup_train_cuda,
    _lookup_train_fake,
    mutates=TRAIN_MUTATES,
    op_schema=schema(TrainArgs, "(Tensor, Tensor, Tensor, Tensor)", TRAIN_MUTATES),
)


# ------------------------------------------------------------- lookup_eval_group
def _lookup_eval_cpu(
    keys: Tensor,
    bucket_offset: Tensor,
    num_buckets: Tensor,
    ids: Tensor,
    table_idx: Tensor,
    metrics: Tensor,
) -> Tensor:
    slots, hits = native.lookup_eval_group(
        keys, bucket_offset, num_buckets, ids, table_idx, num_threads=torch.get_num_threads()
    )
    T = bucket_offset.numel()
    seen = torch.zeros(T + 1, dtype=torch.int64)
    seen.index_add_(0, torch.where(table_idx >= 0, table_idx, T), torch.ones_like(ids))
    metrics[:, 0] += hits
    metrics[:, 1] += seen[:T] - hits
    return slots


class _BucketRanges(NamedTuple):
    """What a probe reads of a ``GroupLayout``: each table's bucket range."""

    bucket_offset: Tensor
    num_buckets: Tensor


def _lookup_eval_cuda(
    keys: Tensor,
    bucket_offset: Tensor,
    num_buckets: Tensor,
    ids: Tensor,
    table_idx: Tensor,
    metrics: Tensor,
) -> Tensor:
    from torchrec_kvemb.kernels.group_lookup import group_lookup_eval_triton

    layout = _BucketRanges(bucket_offset, num_buckets)
    return group_lookup_eval_triton(layout, keys, ids, table_idx, metrics)


def _lookup_eval_fake(
    keys: Tensor,
    bucket_offset: Tensor,
    num_buckets: Tensor,
    ids: Tensor,
    table_idx: Tensor,
    metrics: Tensor,
) -> Tensor:
    return torch.empty_like(ids)


lookup_eval_group = define(
    "lookup_eval_group",
    _lookup_eval_cpu,
    _lookup_eval_cuda,
    _lookup_eval_fake,
    mutates=("metrics",),
)


# ------------------------------------------------------------- pooled_eval_group
class EvalArgs(NamedTuple):
    """``pooled_eval_group``'s arguments: the group's index (``keys``, each table's
    bucket range) and rows, the batch (``ids``, bags cut by ``offsets``, None: every id
    a bag of its own; ``table_of_bag``: the table of each bag's ids, -1: not the
    group's; per-sample weights; ``mean_of_bag``: bags pooled by MEAN; ``bag_list``:
    the group's bags, in the output's row order where ``out_offset`` is given; unread
    without ``offsets``), where each bag's row goes (``out_offset [B]``: its flat
    offset in the output ``[out_rows, out_width]``, viewed as rows of ``dim`` the
    ``bag_list`` in order; -1: none; None: ``[B, dim]``), the layout's initial-row
    settings (which the Triton forward takes; missing ids pool zeros here), the
    ``[T, 6]`` metrics, to which hits and misses add, and ``unpooled``: no pooling,
    every id's row ``[n, dim]`` (the bags give each id's table only)."""

    keys: Tensor
    bucket_offset: Tensor
    num_buckets: Tensor
    weights: Tensor
    ids: Tensor
    offsets: Tensor | None
    table_of_bag: Tensor
    per_sample_weights: Tensor | None
    mean_of_bag: Tensor | None
    bag_list: Tensor
    out_offset: Tensor | None
    out_rows: int
    out_width: int
    seed: Tensor
    seed_mix: Tensor
    init_normal: Tensor
    init_a: Tensor
    init_b: Tensor
    init_col: Tensor
    metrics: Tensor
    unpooled: bool

    def out_shape(self) -> tuple[int, int]:
        if self.out_offset is not None:
            return self.out_rows, self.out_width
        if self.unpooled or self.offsets is None:
            return self.ids.shape[0], self.weights.shape[1]
        return self.offsets.shape[0] - 1, self.weights.shape[1]


EVAL_MUTATES = ("metrics",)


def _opt(t: Tensor | None) -> Tensor | None:
    return None if t is None else t.contiguous()


def _pooled_eval_cpu(*args: object, into: Tensor | None = None) -> Tensor:
    """The CPU kernel; ``into`` (never passed by the dispatcher, see
    ``dispatch.group_pooled_eval``): memory to write the output into."""
    a = EvalArgs(*args)
    out, hits, seen = native.pooled_eval(
        a.keys, a.bucket_offset, a.num_buckets, a.weights, a.ids.contiguous(), _opt(a.offsets),
        a.table_of_bag.contiguous(), _opt(a.per_sample_weights), _opt(a.mean_of_bag),
        _opt(a.out_offset), a.out_shape() if a.out_offset is not None else None,
        num_threads=torch.get_num_threads(), unpooled=a.unpooled, into=into,
    )  # fmt: skip
    a.metrics[:, 0] += hits
    a.metrics[:, 1] += seen - hits
    return out


def _pooled_eval_cuda(*args: object) -> Tensor:
    from torchrec_kvemb.kernels.group_pooled import group_pooled_forward_triton

    a = EvalArgs(*args)
    n = a.ids.shape[0]
    if a.offsets is None or a.unpooled:  # every id a bag of its own
        each = torch.arange(n + 1, device=a.ids.device)
        bags = Bags(each, each[:n], None)
        table_idx = a.table_of_bag
        if a.offsets is not None:  # of its bag's table
            lengths = a.offsets[1:] - a.offsets[:-1]
            table_idx = a.table_of_bag.repeat_interleave(lengths, output_size=n)
    else:
        mean = a.mean_of_bag if a.mean_of_bag is not None else False
        bags = Bags.build(a.offsets, n, a.per_sample_weights, mean)
        table_idx = a.table_of_bag.index_select(0, bags.bag_of)
    slots = _lookup_eval_cuda(a.keys, a.bucket_offset, a.num_buckets, a.ids, table_idx, a.metrics)
    init = InitArgs(a.seed, a.seed_mix, a.init_normal, a.init_a, a.init_b, a.init_col)
    bag_list = bags.bag_of if a.offsets is None or a.unpooled else a.bag_list  # rows: all
    pooled = group_pooled_forward_triton(
        init.layout(), a.weights, slots, a.ids, table_idx, bags, bag_list, True
    )
    if a.out_offset is None:
        return pooled
    return pooled.index_select(0, a.bag_list).view(a.out_shape())


def _pooled_eval_fake(*args: object) -> Tensor:
    a = EvalArgs(*args)
    return a.weights.new_empty(a.out_shape(), dtype=torch.float32)


pooled_eval_group = define(
    "pooled_eval_group",
    _pooled_eval_cpu,
    _pooled_eval_cuda,
    _pooled_eval_fake,
    mutates=EVAL_MUTATES,
    op_schema=schema(EvalArgs, "Tensor", EVAL_MUTATES),
)


# ---------------------------------------------------------------- pooled_forward
class PooledArgs(NamedTuple):
    """``pooled_forward``'s arguments: rows ``[B, dim]`` of the bags in ``bag_list``."""

    weights: Tensor
    slots: Tensor
    ids: Tensor
    table_idx: Tensor
    offsets: Tensor
    bag_of: Tensor
    scale: Tensor | None
    bag_list: Tensor
    seed: Tensor
    seed_mix: Tensor
    init_normal: Tensor
    init_a: Tensor
    init_b: Tensor
    init_col: Tensor
    missing_as_zero: bool

    def init(self) -> InitArgs:
        return InitArgs(*self[8:14])

    def bags(self) -> Bags:
        return Bags(self.offsets, self.bag_of, self.scale)


def _pooled_forward_cpu(*args: object) -> Tensor:
    a = PooledArgs(*args)
    # Every row dtype; training's ids without a row (admission, no room: rare) pool
    # their initial rows afterwards, as the torch path adds them.
    out, missing = native.pooled_forward(
        a.weights, a.slots.contiguous(), a.offsets.contiguous(), a.scale, a.table_idx.contiguous(),
        num_threads=torch.get_num_threads(),
    )  # fmt: skip
    if missing and not a.missing_as_zero:
        specs = a.init().layout().init_specs
        add_initial_rows(out, a.slots, a.ids, a.table_idx, a.bags(), specs)
    return out


def _pooled_forward_cuda(*args: object) -> Tensor:
    from torchrec_kvemb.kernels.group_pooled import group_pooled_forward_triton

    a = PooledArgs(*args)
    return group_pooled_forward_triton(
        a.init().layout(), a.weights, a.slots, a.ids, a.table_idx, a.bags(), a.bag_list,
        a.missing_as_zero,
    )  # fmt: skip


def _pooled_forward_fake(*args: object) -> Tensor:
    a = PooledArgs(*args)
    bags = a.offsets.shape[0] - 1
    return a.weights.new_empty((bags, a.weights.shape[1]), dtype=torch.float32)


pooled_forward = define(
    "pooled_forward",
    _pooled_forward_cpu,
    _pooled_forward_cuda,
    _pooled_forward_fake,
    op_schema=schema(PooledArgs, "Tensor"),
)


# ------------------------------------------------------------------ rows_forward
class RowsArgs(NamedTuple):
    """``rows_forward``'s arguments: one row per id ``[n, dim]``, unpooled."""

    weights: Tensor
    slots: Tensor
    ids: Tensor
    table_idx: Tensor
    seed: Tensor
    seed_mix: Tensor
    init_normal: Tensor
    init_a: Tensor
    init_b: Tensor
    init_col: Tensor
    missing_as_zero: bool

    def init(self) -> InitArgs:
        return InitArgs(*self[4:10])


def _rows_forward_cpu(*args: object) -> Tensor:
    a = RowsArgs(*args)
    rows, missing = native.pooled_forward(
        a.weights, a.slots.contiguous(), None, table_idx=a.table_idx.contiguous(),
        num_threads=torch.get_num_threads(),
    )  # fmt: skip
    if missing and not a.missing_as_zero:
        where = (a.slots < 0).nonzero().squeeze(1)
        copy_initial_rows(rows, where, a.ids, a.table_idx, a.init().layout().init_specs)
    return rows


def _rows_forward_cuda(*args: object) -> Tensor:
    from torchrec_kvemb.kernels.group_pooled import group_pooled_forward_triton

    a = RowsArgs(*args)
    n = a.ids.numel()
    each = torch.arange(n + 1, device=a.ids.device)  # every id a bag of its own
    bags = Bags(each, each[:n], None)
    return group_pooled_forward_triton(
        a.init().layout(), a.weights, a.slots, a.ids, a.table_idx, bags, bags.bag_of,
        a.missing_as_zero,
    )  # fmt: skip


def _rows_forward_fake(*args: object) -> Tensor:
    a = RowsArgs(*args)
    return a.weights.new_empty((a.ids.shape[0], a.weights.shape[1]), dtype=torch.float32)


rows_forward = define(
    "rows_forward",
    _rows_forward_cpu,
    _rows_forward_cuda,
    _rows_forward_fake,
    op_schema=schema(RowsArgs, "Tensor"),
)


# ---------------------------------------------------------------- fused_backward
class BackwardArgs(NamedTuple):
    """``fused_backward``'s arguments: the gradient ``grad [B, dim]`` of the pooled
    rows, the lookup's slots and unique rows, each table's learning rate and
    optimizer steps (``optim_steps``, advanced by one here), the optimizer."""

    weights: Tensor
    state: Tensor
    grad: Tensor
    offsets: Tensor
    bag_of: Tensor
    scale: Tensor | None
    slots: Tensor
    unique_index: Tensor
    unique_slots: Tensor
    unique_table: Tensor
    learning_rates: Tensor
    optim_steps: Tensor
    kind: int
    eps: float
    beta1: float
    beta2: float
    weight_decay: float
    weight_decay_mode: int
    gradient_clipping: bool
    max_gradient: float

    def config(self, learning_rate: float) -> FusedOptimConfig:
        """The ``FusedOptimConfig`` of the scalar arguments."""
        (kind,) = [k for k in OptimKind if k.code == self.kind]
        return FusedOptimConfig(kind, learning_rate, self.eps, self.beta1, self.beta2,
                                self.weight_decay, WeightDecay(self.weight_decay_mode),
                                self.gradient_clipping, self.max_gradient)  # fmt: skip


BACKWARD_MUTATES = ("weights", "state", "optim_steps")


def _fused_backward_cpu(*args: object) -> None:
    a = BackwardArgs(*args)
    a.optim_steps.add_(1)
    rates = a.learning_rates.tolist()
    # The uniques some id refers to: the lookup's own (its padding past them, one
    # entry per id, would only cost the kernel's passes over uniques time: 2.6 ms).
    uniques = int(a.unique_index.max()) + 1 if a.unique_index.numel() else 0
    # Every row dtype: half-precision rows take the float32 update and are stored
    # rounded to nearest even, as optimizer_update_torch stores them.
    native.fused_backward_group(
        a.weights, a.state, a.grad, a.offsets, a.unique_index, a.unique_slots[:uniques],
        a.unique_table[:uniques], a.config(rates[0]), learning_rate=rates,
        optim_step=a.optim_steps,
        per_sample_weights=a.scale, num_threads=torch.get_num_threads(),
        workspace=workspace(),
    )  # fmt: skip


def _fused_backward_cuda(*args: object) -> None:
    from torchrec_kvemb.kernels.group_pooled import group_fused_backward_triton

    a = BackwardArgs(*args)
    a.optim_steps.add_(1)
    rates = a.learning_rates.to(torch.float32)
    bias1 = bias2 = rates  # read by Adam only: 1 - beta ** step per table
    if a.kind == OptimKind.ADAM.code:
        steps = a.optim_steps.to(torch.float64)
        bias1 = (1.0 - a.beta1**steps).to(torch.float32)
        bias2 = (1.0 - a.beta2**steps).to(torch.float32)
    slot_table = a.unique_table.index_select(0, a.unique_index.clamp(min=0))
    decay = bool(a.weight_decay)
    group_fused_backward_triton(
        a.weights, a.state, a.grad, a.slots, slot_table, Bags(a.offsets, a.bag_of, a.scale),
        a.kind, rates, bias1, bias2, a.eps, a.beta1, a.beta2, a.weight_decay,
        decay and a.weight_decay_mode == WeightDecay.L2,
        decay and a.weight_decay_mode == WeightDecay.DECOUPLE,
        a.gradient_clipping, a.max_gradient,
    )  # fmt: skip


def _fused_backward_fake(*args: object) -> None:
    return None


fused_backward = define(
    "fused_backward",
    _fused_backward_cpu,
    _fused_backward_cuda,
    _fused_backward_fake,
    mutates=BACKWARD_MUTATES,
    op_schema=schema(BackwardArgs, "()", BACKWARD_MUTATES),
)
