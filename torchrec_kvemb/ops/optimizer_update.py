"""Fused optimizer row update (torch path).

``optimizer_update_torch`` is the reference (after ``clip_output_gradient`` on
the lookup's output gradient, where clipping is on): the update of the Triton fused
backward (``kernels/group_pooled.py``) and of the native one (``csrc/``) are
tested against it, and it is tested against FBGEMM's CPU TBE backward and
torch's own optimizers (tests/ops/test_pooled_lookup.py,
tests/test_optimizer_reference.py).
"""

from __future__ import annotations

import torch

from torchrec_kvemb.optimizer import FusedOptimConfig, OptimKind, WeightDecay


def clip_output_gradient(grad_out: torch.Tensor, config: FusedOptimConfig) -> torch.Tensor:
    """The gradient of a lookup's output as the optimizer ``config`` takes it: with
    ``gradient_clipping``, each element clamped to ``[-max_gradient, max_gradient]``,
    bag by bag before the bags' gradients are reduced into rows, as FBGEMM's TBE
    clamps its output's gradient (a row read by several bags sums their clamped
    gradients; MEAN and per-sample weights scale the clamped gradient)."""
    if not config.gradient_clipping:
        return grad_out
    return grad_out.clamp(-config.max_gradient, config.max_gradient)


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
    Gradient clipping is not here: it clamps the gradient of the lookup's output,
    before ``grads`` are summed from it (``clip_output_gradient``).
    """
    if slots.numel() == 0:
        return
    # Half-precision rows: the update computes in float32 and rounds to nearest on store.
    w = weights.index_select(0, slots).to(torch.float32)
    g = grads.to(torch.float32)
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
