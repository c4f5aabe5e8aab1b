"""Fused optimizer row update (torch path), and fbgemm's CPU fused backward.

``optimizer_update_torch`` is the reference: the update of the Triton fused
backward (``kernels/group_pooled.py``), of the native one (``csrc/``) and of
fbgemm's CPU TBE backward (used as a fast path where it computes the same
update) are tested against it.
"""

from __future__ import annotations

import torch

from torchrec_kvemb.optimizer import FusedOptimConfig, OptimKind, WeightDecay


def optimizer_update_torch(
    weights: torch.Tensor,
    state: torch.Tensor,
    slots: torch.Tensor,
    grads: torch.Tensor,
    config: FusedOptimConfig,
    step: int,
) -> None:
    """Apply one optimizer step to rows ``slots`` (unique) given their ``grads``, in place.

    ``step`` counts this table's optimizer steps from 1 (Adam's bias correction).
    """
    if slots.numel() == 0:
        return
    # Half-precision rows: the update computes in float32 and rounds to nearest on store.
    w = weights.index_select(0, slots).to(torch.float32)
    g = grads.to(torch.float32)
    if config.gradient_clipping:
        g = g.clamp(-config.max_gradient, config.max_gradient)
    decay = config.weight_decay
    if decay and config.weight_decay_mode == WeightDecay.L2:
        g = g + decay * w
    lr = config.learning_rate
    if config.kind == OptimKind.SGD:
        new_w = w - lr * g
    elif config.kind == OptimKind.ROWWISE_ADAGRAD:
        s = state.index_select(0, slots)[:, 0] + (g * g).mean(dim=1)
        state.index_copy_(0, slots, s.unsqueeze(1))
        new_w = w - (lr / (torch.sqrt(s) + config.eps)).unsqueeze(1) * g
    else:
        dim = weights.shape[1]
        st = state.index_select(0, slots)
        m = config.beta1 * st[:, :dim] + (1.0 - config.beta1) * g
        v = config.beta2 * st[:, dim:] + (1.0 - config.beta2) * g * g
        state.index_copy_(0, slots, torch.cat([m, v], dim=1))
        m_hat = m / (1.0 - config.beta1**step)
        v_hat = v / (1.0 - config.beta2**step)
        new_w = w - lr * m_hat / (torch.sqrt(v_hat) + config.eps)
    if decay and config.weight_decay_mode == WeightDecay.DECOUPLE:
        new_w = new_w - (lr * decay) * w
    weights.index_copy_(0, slots, new_w.to(weights.dtype))


def fbgemm_supports(config: FusedOptimConfig, weights: torch.Tensor) -> bool:
    """Whether fbgemm's CPU fused backward computes exactly this update."""
    # why: fbgemm's CPU kernels ignore weight decay and clipping, and have no Adam.
    return (
        weights.device.type == "cpu"
        # fbgemm's CPU kernels also update float16 rows (float32 math, rounded to nearest)
        and weights.dtype in (torch.float32, torch.float16)
        and config.kind in (OptimKind.SGD, OptimKind.ROWWISE_ADAGRAD)
        and not (config.weight_decay and config.weight_decay_mode != WeightDecay.NONE)
        and not config.gradient_clipping
        and _fbgemm_loaded()
    )


def _fbgemm_loaded() -> bool:
    try:
        import fbgemm_gpu  # noqa: F401
        import fbgemm_gpu.split_table_batched_embeddings_ops_training  # noqa: F401
    except Exception:
        return False
    return hasattr(torch.ops.fbgemm, "split_embedding_backward_codegen_rowwise_adagrad_cpu")


def fused_backward_fbgemm(
    grad_out: torch.Tensor,
    weights: torch.Tensor,
    state: torch.Tensor,
    slots: torch.Tensor,
    offsets: torch.Tensor,
    scale: torch.Tensor | None,
    config: FusedOptimConfig,
    mean: bool = False,
) -> None:
    """Gradient reduction and optimizer update by fbgemm's CPU TBE backward, in place.

    ``slots`` holds only stored rows (no -1); ``offsets`` its bags; ``scale`` the
    per-id multiplier (sample weight, / length for mean pooling), or ``None``
    for unweighted bags pooled by sum, or by mean when ``mean``.
    """
    capacity, dim = weights.shape
    i32 = dict(dtype=torch.int32)
    i64 = dict(dtype=torch.int64)
    common = dict(
        grad_output=grad_out.contiguous(),
        host_weights=weights.view(-1),
        weights_placements=torch.zeros(1, **i32),
        weights_offsets=torch.zeros(1, **i64),
        D_offsets=torch.tensor([0, dim], **i32),
        max_D=dim,
        hash_size_cumsum=torch.tensor([0, capacity], **i64),
        total_hash_size_bits=max(1, int(capacity).bit_length()),
        indices=slots,
        offsets=offsets,
        # With a scale, SUM: a mean's 1/length is in the scale.
        pooling_mode=1 if (mean and scale is None) else 0,
        indice_weights=torch.empty(0) if scale is None else scale.to(torch.float32),
        stochastic_rounding=False,
        learning_rate_tensor=torch.tensor(config.learning_rate, dtype=torch.float32),
    )
    if config.kind == OptimKind.SGD:
        torch.ops.fbgemm.split_embedding_backward_codegen_sgd_cpu(**common)
    else:
        torch.ops.fbgemm.split_embedding_backward_codegen_rowwise_adagrad_cpu(
            **common,
            momentum1_host=state.view(-1),
            momentum1_placements=torch.zeros(1, **i32),
            momentum1_offsets=torch.zeros(1, **i64),
            eps=config.eps,
        )
