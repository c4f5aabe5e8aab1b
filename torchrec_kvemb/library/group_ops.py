"""Ops of a group of KV tables (``torchrec_kvemb/group.py``): ``torch.ops.kvemb.
{lookup_train_group, lookup_eval_group, pooled_forward, rows_forward, fused_backward}``.

A group's layout travels as its tensors (``GroupLayout.tensors()``, then the
``has_admission`` and ``has_normal`` flags); its arrays (``TableStorage``) as
seven tensors, updated in place. Kernels:

==================  =========================================  ===========================
op                  CPU                                        CUDA
==================  =========================================  ===========================
lookup_train_group  native (``csrc/lookup_train.cpp``)         Triton (``group_lookup``)
lookup_eval_group   native (``csrc/lookup_eval.cpp``)          Triton (``group_lookup``)
pooled_forward      torch path (``embedding_bag`` by slot)     Triton (``group_pooled``)
rows_forward        torch path (``index_select`` by slot)      Triton (``group_pooled``)
fused_backward      native (``csrc/fused_backward.cpp``)       Triton (``group_pooled``)
==================  =========================================  ===========================

Every kernel gives, table by table, what the per-table torch path gives (the
reference; tests hold them to it): ids, slots, scores and counters bit for bit,
rows to float tolerance.

Example::

    out = torch.ops.kvemb.lookup_eval_group(keys, layout.bucket_offset,
                                            layout.num_buckets, ids, table_idx, metrics)
"""

import threading

import torch

from torchrec_kvemb.contracts import KERNEL_METRICS, Bags, GroupLayout
from torchrec_kvemb.library.registry import define
from torchrec_kvemb.native_lib import Workspace
from torchrec_kvemb.ops import native
from torchrec_kvemb.ops.pooled_lookup import group_pooled_forward_torch, group_rows_forward_torch
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


def _layout(
    bucket_offset: Tensor,
    num_buckets: Tensor,
    policy: Tensor,
    admission_threshold: Tensor,
    counter_bucket_offset: Tensor,
    counter_num_buckets: Tensor,
    seed: Tensor,
    seed_mix: Tensor,
    init_normal: Tensor,
    init_a: Tensor,
    init_b: Tensor,
    has_admission: bool,
    has_normal: bool,
) -> GroupLayout:
    tensors = (bucket_offset, num_buckets, policy, admission_threshold, counter_bucket_offset,
               counter_num_buckets, seed, seed_mix, init_normal, init_a, init_b)  # fmt: skip
    return GroupLayout.from_tensors(tensors, has_admission, has_normal)


# ------------------------------------------------------------ lookup_train_group
def _lookup_train_cpu(
    keys: Tensor,
    scores: Tensor,
    weights: Tensor,
    state: Tensor,
    counter_keys: Tensor,
    counter_scores: Tensor,
    counts: Tensor,
    bucket_offset: Tensor,
    num_buckets: Tensor,
    policy: Tensor,
    admission_threshold: Tensor,
    counter_bucket_offset: Tensor,
    counter_num_buckets: Tensor,
    seed: Tensor,
    seed_mix: Tensor,
    init_normal: Tensor,
    init_a: Tensor,
    init_b: Tensor,
    has_admission: bool,
    has_normal: bool,
    ids: Tensor,
    table_idx: Tensor,
    step: Tensor,
    metrics: Tensor,
    custom_scores: Tensor | None,
    use_custom: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    layout = _layout(bucket_offset, num_buckets, policy, admission_threshold,
                     counter_bucket_offset, counter_num_buckets, seed, seed_mix, init_normal,
                     init_a, init_b, has_admission, has_normal)  # fmt: skip
    counter = native.CounterIndex(counter_keys, counter_scores, counts) if has_admission else None
    step.add_(1)
    out = native.lookup_train_group(
        layout, keys, scores, weights, state, ids, table_idx, step, custom_scores, use_custom,
        counter, num_threads=torch.get_num_threads(), workspace=workspace(),
    )  # fmt: skip
    metrics[:, :KERNEL_METRICS] += out.metrics
    # One unique per id, as the Triton kernel gives (static shapes for torch.compile):
    # the entries past the batch's uniques have no row (slot -1) and no occurrence.
    u = out.unique_slots.numel()
    unique_slots = torch.full_like(ids, -1)
    unique_slots[:u] = out.unique_slots
    unique_table = torch.zeros_like(ids)
    unique_table[:u] = out.unique_table
    return out.slots, out.unique_index, unique_slots, unique_table


def _lookup_train_cuda(
    keys: Tensor,
    scores: Tensor,
    weights: Tensor,
    state: Tensor,
    counter_keys: Tensor,
    counter_scores: Tensor,
    counts: Tensor,
    bucket_offset: Tensor,
    num_buckets: Tensor,
    policy: Tensor,
    admission_threshold: Tensor,
    counter_bucket_offset: Tensor,
    counter_num_buckets: Tensor,
    seed: Tensor,
    seed_mix: Tensor,
    init_normal: Tensor,
    init_a: Tensor,
    init_b: Tensor,
    has_admission: bool,
    has_normal: bool,
    ids: Tensor,
    table_idx: Tensor,
    step: Tensor,
    metrics: Tensor,
    custom_scores: Tensor | None,
    use_custom: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    from torchrec_kvemb.kernels.group_lookup import group_lookup_train_triton

    layout = _layout(bucket_offset, num_buckets, policy, admission_threshold,
                     counter_bucket_offset, counter_num_buckets, seed, seed_mix, init_normal,
                     init_a, init_b, has_admission, has_normal)  # fmt: skip
    step.add_(1)
    out = group_lookup_train_triton(
        layout, keys, scores, weights, state, counter_keys, counter_scores, counts, ids,
        table_idx, step, metrics, custom_scores, use_custom,
    )  # fmt: skip
    return out.slots, out.unique_index, out.unique_slots, out.unique_table


def _lookup_train_fake(
    keys: Tensor,
    scores: Tensor,
    weights: Tensor,
    state: Tensor,
    counter_keys: Tensor,
    counter_scores: Tensor,
    counts: Tensor,
    bucket_offset: Tensor,
    num_buckets: Tensor,
    policy: Tensor,
    admission_threshold: Tensor,
    counter_bucket_offset: Tensor,
    counter_num_buckets: Tensor,
    seed: Tensor,
    seed_mix: Tensor,
    init_normal: Tensor,
    init_a: Tensor,
    init_b: Tensor,
    has_admission: bool,
    has_normal: bool,
    ids: Tensor,
    table_idx: Tensor,
    step: Tensor,
    metrics: Tensor,
    custom_scores: Tensor | None,
    use_custom: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    # One unique per id: those past the batch's uniques have slot -1.
    return tuple(torch.empty_like(ids) for _ in range(4))


lookup_train_group = define(
    "lookup_train_group",
    _lookup_train_cpu,
    _lookup_train_cuda,
    _lookup_train_fake,
    mutates=(
        "keys",
        "scores",
        "weights",
        "state",
        "counter_keys",
        "counter_scores",
        "counts",
        "step",
        "metrics",
    ),
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


def _lookup_eval_cuda(
    keys: Tensor,
    bucket_offset: Tensor,
    num_buckets: Tensor,
    ids: Tensor,
    table_idx: Tensor,
    metrics: Tensor,
) -> Tensor:
    from torchrec_kvemb.kernels.group_lookup import group_lookup_eval_triton

    # The probe reads only the bucket ranges of the layout.
    layout = _BucketRanges(bucket_offset, num_buckets)
    return group_lookup_eval_triton(layout, keys, ids, table_idx, metrics)


class _BucketRanges:
    """What a probe reads of a ``GroupLayout``: each table's bucket range."""

    def __init__(self, bucket_offset: Tensor, num_buckets: Tensor) -> None:
        self.bucket_offset, self.num_buckets = bucket_offset, num_buckets


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


# ---------------------------------------------------------------- pooled_forward
def _init_layout(seed: Tensor, seed_mix: Tensor, init_normal: Tensor, init_a: Tensor,
                 init_b: Tensor) -> GroupLayout:  # fmt: skip
    """A layout that carries only the tables' initial-row settings (what a pooled
    forward reads of it)."""
    zeros = torch.zeros_like(seed)
    return GroupLayout.from_tensors(
        (zeros, zeros, zeros, zeros, zeros, zeros, seed, seed_mix, init_normal, init_a, init_b),
        has_admission=False,
        has_normal=False,
    )


def _pooled_forward_cpu(
    weights: Tensor,
    slots: Tensor,
    ids: Tensor,
    table_idx: Tensor,
    offsets: Tensor,
    bag_of: Tensor,
    scale: Tensor | None,
    bag_list: Tensor,
    seed: Tensor,
    seed_mix: Tensor,
    init_normal: Tensor,
    init_a: Tensor,
    init_b: Tensor,
    missing_as_zero: bool,
) -> Tensor:
    specs = (
        ()
        if missing_as_zero
        else _init_layout(seed, seed_mix, init_normal, init_a, init_b).init_specs
    )
    bags = Bags(offsets, bag_of, scale)
    return group_pooled_forward_torch(weights, slots, ids, table_idx, bags, specs, missing_as_zero)


def _pooled_forward_cuda(
    weights: Tensor,
    slots: Tensor,
    ids: Tensor,
    table_idx: Tensor,
    offsets: Tensor,
    bag_of: Tensor,
    scale: Tensor | None,
    bag_list: Tensor,
    seed: Tensor,
    seed_mix: Tensor,
    init_normal: Tensor,
    init_a: Tensor,
    init_b: Tensor,
    missing_as_zero: bool,
) -> Tensor:
    from torchrec_kvemb.kernels.group_pooled import group_pooled_forward_triton

    layout = _init_layout(seed, seed_mix, init_normal, init_a, init_b)
    bags = Bags(offsets, bag_of, scale)
    return group_pooled_forward_triton(
        layout, weights, slots, ids, table_idx, bags, bag_list, missing_as_zero
    )


def _pooled_forward_fake(
    weights: Tensor,
    slots: Tensor,
    ids: Tensor,
    table_idx: Tensor,
    offsets: Tensor,
    bag_of: Tensor,
    scale: Tensor | None,
    bag_list: Tensor,
    seed: Tensor,
    seed_mix: Tensor,
    init_normal: Tensor,
    init_a: Tensor,
    init_b: Tensor,
    missing_as_zero: bool,
) -> Tensor:
    return weights.new_empty((offsets.shape[0] - 1, weights.shape[1]), dtype=torch.float32)


pooled_forward = define(
    "pooled_forward",
    _pooled_forward_cpu,
    _pooled_forward_cuda,
    _pooled_forward_fake,
    cpu_name="torch (embedding_bag by slot)",
)


# ------------------------------------------------------------------ rows_forward
def _rows_forward_cpu(
    weights: Tensor,
    slots: Tensor,
    ids: Tensor,
    table_idx: Tensor,
    seed: Tensor,
    seed_mix: Tensor,
    init_normal: Tensor,
    init_a: Tensor,
    init_b: Tensor,
    missing_as_zero: bool,
) -> Tensor:
    specs = (
        ()
        if missing_as_zero
        else _init_layout(seed, seed_mix, init_normal, init_a, init_b).init_specs
    )
    return group_rows_forward_torch(weights, slots, ids, table_idx, specs, missing_as_zero)


def _rows_forward_cuda(
    weights: Tensor,
    slots: Tensor,
    ids: Tensor,
    table_idx: Tensor,
    seed: Tensor,
    seed_mix: Tensor,
    init_normal: Tensor,
    init_a: Tensor,
    init_b: Tensor,
    missing_as_zero: bool,
) -> Tensor:
    from torchrec_kvemb.kernels.group_pooled import group_pooled_forward_triton

    layout = _init_layout(seed, seed_mix, init_normal, init_a, init_b)
    n = ids.numel()
    each = torch.arange(n + 1, device=ids.device)  # every id a bag of its own
    bags = Bags(each, each[:n], None)
    return group_pooled_forward_triton(
        layout, weights, slots, ids, table_idx, bags, bags.bag_of, missing_as_zero
    )


def _rows_forward_fake(
    weights: Tensor,
    slots: Tensor,
    ids: Tensor,
    table_idx: Tensor,
    seed: Tensor,
    seed_mix: Tensor,
    init_normal: Tensor,
    init_a: Tensor,
    init_b: Tensor,
    missing_as_zero: bool,
) -> Tensor:
    return weights.new_empty((ids.shape[0], weights.shape[1]), dtype=torch.float32)


rows_forward = define(
    "rows_forward",
    _rows_forward_cpu,
    _rows_forward_cuda,
    _rows_forward_fake,
    cpu_name="torch (index_select by slot)",
)


# ---------------------------------------------------------------- fused_backward
def optim_config(
    kind: int,
    eps: float,
    beta1: float,
    beta2: float,
    weight_decay: float,
    weight_decay_mode: int,
    gradient_clipping: bool,
    max_gradient: float,
    learning_rate: float,
) -> FusedOptimConfig:
    """The ``FusedOptimConfig`` of a fused backward's scalar arguments."""
    (kind_of,) = [k for k in OptimKind if k.code == kind]
    mode = WeightDecay(weight_decay_mode)
    return FusedOptimConfig(kind_of, learning_rate, eps, beta1, beta2, weight_decay, mode,
                            gradient_clipping, max_gradient)  # fmt: skip


def _fused_backward_cpu(
    weights: Tensor,
    state: Tensor,
    grad: Tensor,
    offsets: Tensor,
    bag_of: Tensor,
    scale: Tensor | None,
    slots: Tensor,
    unique_index: Tensor,
    unique_slots: Tensor,
    unique_table: Tensor,
    learning_rates: Tensor,
    optim_steps: Tensor,
    kind: int,
    eps: float,
    beta1: float,
    beta2: float,
    weight_decay: float,
    weight_decay_mode: int,
    gradient_clipping: bool,
    max_gradient: float,
) -> None:
    optim_steps.add_(1)
    rates = learning_rates.tolist()
    config = optim_config(kind, eps, beta1, beta2, weight_decay, weight_decay_mode,
                          gradient_clipping, max_gradient, rates[0])  # fmt: skip
    # Every row dtype: half-precision rows take the float32 update and are stored
    # rounded to nearest even, as optimizer_update_torch stores them.
    native.fused_backward_group(
        weights, state, grad, offsets, unique_index, unique_slots, unique_table, config,
        learning_rate=rates, optim_step=optim_steps, per_sample_weights=scale,
        num_threads=torch.get_num_threads(), workspace=workspace(),
    )  # fmt: skip


def _fused_backward_cuda(
    weights: Tensor,
    state: Tensor,
    grad: Tensor,
    offsets: Tensor,
    bag_of: Tensor,
    scale: Tensor | None,
    slots: Tensor,
    unique_index: Tensor,
    unique_slots: Tensor,
    unique_table: Tensor,
    learning_rates: Tensor,
    optim_steps: Tensor,
    kind: int,
    eps: float,
    beta1: float,
    beta2: float,
    weight_decay: float,
    weight_decay_mode: int,
    gradient_clipping: bool,
    max_gradient: float,
) -> None:
    from torchrec_kvemb.kernels.group_pooled import group_fused_backward_triton

    optim_steps.add_(1)
    rates = learning_rates.to(torch.float32)
    bias1 = bias2 = rates  # read by Adam only: 1 - beta ** step per table
    if kind == OptimKind.ADAM.code:
        steps = optim_steps.to(torch.float64)
        bias1 = (1.0 - beta1**steps).to(torch.float32)
        bias2 = (1.0 - beta2**steps).to(torch.float32)
    slot_table = unique_table.index_select(0, unique_index.clamp(min=0))
    group_fused_backward_triton(
        weights, state, grad, slots, slot_table, Bags(offsets, bag_of, scale), kind, rates,
        bias1, bias2, eps, beta1, beta2, weight_decay,
        bool(weight_decay) and weight_decay_mode == WeightDecay.L2,
        bool(weight_decay) and weight_decay_mode == WeightDecay.DECOUPLE,
        gradient_clipping, max_gradient,
    )  # fmt: skip


def _fused_backward_fake(
    weights: Tensor,
    state: Tensor,
    grad: Tensor,
    offsets: Tensor,
    bag_of: Tensor,
    scale: Tensor | None,
    slots: Tensor,
    unique_index: Tensor,
    unique_slots: Tensor,
    unique_table: Tensor,
    learning_rates: Tensor,
    optim_steps: Tensor,
    kind: int,
    eps: float,
    beta1: float,
    beta2: float,
    weight_decay: float,
    weight_decay_mode: int,
    gradient_clipping: bool,
    max_gradient: float,
) -> None:
    return None


fused_backward = define(
    "fused_backward",
    _fused_backward_cpu,
    _fused_backward_cuda,
    _fused_backward_fake,
    mutates=("weights", "state", "optim_steps"),
    cpu_name="native",
)
