"""Fused optimizer configuration, read from TorchRec's ``fused_params``.

The optimizer runs inside backward: a table's rows are updated in place and
no ``.grad`` is ever materialized for them. Its state lives beside each row,
``state_dim`` floats per slot:

* SGD (``EmbOptimType.EXACT_SGD`` / ``SGD``): no state.
* ``EXACT_ROWWISE_ADAGRAD`` (or ``ROWWISE_ADAGRAD``): one float, the running
  sum of the row's mean squared gradient.
* ``ADAM``: ``2 * dim`` floats, first and second moments.

The config owns that layout: ``state_shapes`` names the state tensors a table
exports (``momentum1 [n]``, ``exp_avg [n, dim]``...), ``split_state`` and
``join_state`` convert between them and the table's ``[n, state_dim]`` rows.
Its ``learning_rate`` is the rate a table starts with; a table's current rate
lives in its param group (``KVTable.learning_rate``).

Defaults are FBGEMM's fused tables' (where the stock sharder sends
``fused_params``): ``EXACT_SGD``, learning rate 0.01, eps 1e-8, no weight decay
mode (a ``weight_decay`` without ``weight_decay_mode`` does nothing).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, replace
from typing import Any

import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType


class OptimKind(enum.Enum):
    """A fused optimizer. ``code``: its number in every kernel (the Triton
    constexprs of ``kernels/group_pooled.py``, ``KvOptim`` in
    ``csrc/kvemb_native.h``, which a test checks against this class)."""

    SGD = "sgd"
    ROWWISE_ADAGRAD = "rowwise_adagrad"
    ADAM = "adam"

    @property
    def code(self) -> int:
        return _CODES[self]

    @property
    def state_names(self) -> tuple[str, ...]:
        """Its state blocks in row order (each one float, or ``dim`` floats)."""
        return _STATE_NAMES[self]


_CODES = {OptimKind.SGD: 0, OptimKind.ROWWISE_ADAGRAD: 1, OptimKind.ADAM: 2}
#: Each kind's state blocks, in the order they sit in a row's state columns.
_STATE_NAMES = {
    OptimKind.SGD: (),
    OptimKind.ROWWISE_ADAGRAD: ("momentum1",),
    OptimKind.ADAM: ("exp_avg", "exp_avg_sq"),
}
#: Floats per row of each named state block: one, or ``dim`` (``STATE_PER_COLUMN``).
STATE_PER_COLUMN = frozenset({"exp_avg", "exp_avg_sq"})
#: Every state name any optimizer keeps.
STATE_NAMES = tuple(dict.fromkeys(n for names in _STATE_NAMES.values() for n in names))


class WeightDecay(enum.IntEnum):
    """How ``weight_decay`` applies (values follow fbgemm's WeightDecayMode)."""

    NONE = 0
    L2 = 1  # gradient += weight_decay * weight, before the optimizer
    DECOUPLE = 2  # weight -= learning_rate * weight_decay * weight, after it


_KINDS = {
    EmbOptimType.SGD: OptimKind.SGD,
    EmbOptimType.EXACT_SGD: OptimKind.SGD,
    EmbOptimType.EXACT_ROWWISE_ADAGRAD: OptimKind.ROWWISE_ADAGRAD,
    EmbOptimType.ROWWISE_ADAGRAD: OptimKind.ROWWISE_ADAGRAD,
    EmbOptimType.ADAM: OptimKind.ADAM,
}

#: The ``fused_params`` keys that describe the update.
OPTIMIZER_KEYS = frozenset(
    {
        "optimizer",
        "learning_rate",
        "eps",
        "beta1",
        "beta2",
        "weight_decay",
        "weight_decay_mode",
        "gradient_clipping",
        "max_gradient",
    }
)
# Keys TorchRec sharders pass around that do not change the update.
_IGNORED_KEYS = {
    "output_dtype",
    "cache_load_factor",
    "cache_precision",
    "stochastic_rounding",
    "prefetch_pipeline",
}


@dataclass(frozen=True)
class FusedOptimConfig:
    """A fused optimizer's kind and hyper-parameters.

    Example::

        FusedOptimConfig.from_fused_params(
            {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.05}
        )
    """

    kind: OptimKind = OptimKind.SGD
    learning_rate: float = 0.01
    eps: float = 1e-8
    beta1: float = 0.9
    beta2: float = 0.999
    weight_decay: float = 0.0
    weight_decay_mode: WeightDecay = WeightDecay.NONE
    gradient_clipping: bool = False
    max_gradient: float = 1.0

    @classmethod
    def from_fused_params(cls, fused_params: dict[str, Any] | None) -> FusedOptimConfig:
        """Read TorchRec's ``fused_params`` conventions; unknown keys are an error."""
        params = dict(fused_params or {})
        unknown = set(params) - OPTIMIZER_KEYS - _IGNORED_KEYS
        if unknown:
            raise ValueError(f"fused_params: unsupported keys {sorted(unknown)}")
        kind = cls.kind
        if "optimizer" in params:
            opt = params["optimizer"]
            if isinstance(opt, str):
                opt = EmbOptimType(opt) if opt in EmbOptimType._value2member_map_ else opt
            if opt not in _KINDS:
                supported = ", ".join(o.name for o in _KINDS)
                raise ValueError(f"fused_params: optimizer {opt!r} is not supported ({supported})")
            kind = _KINDS[opt]
        mode = params.get("weight_decay_mode", WeightDecay.NONE)
        mode = WeightDecay(int(getattr(mode, "value", mode)))
        config = cls(
            kind=kind,
            learning_rate=float(params.get("learning_rate", cls.learning_rate)),
            eps=float(params.get("eps", cls.eps)),
            beta1=float(params.get("beta1", cls.beta1)),
            beta2=float(params.get("beta2", cls.beta2)),
            weight_decay=float(params.get("weight_decay", 0.0)),
            weight_decay_mode=mode,
            gradient_clipping=bool(params.get("gradient_clipping", False)),
            max_gradient=float(params.get("max_gradient", cls.max_gradient)),
        )
        if config.learning_rate < 0 or config.eps < 0:
            raise ValueError("fused_params: learning_rate and eps must be >= 0")
        return config

    def with_learning_rate(self, learning_rate: float) -> FusedOptimConfig:
        return replace(self, learning_rate=float(learning_rate))

    def state_dim(self, dim: int) -> int:
        """Floats of optimizer state stored per row."""
        return sum(math.prod(shape) for shape in self.state_shapes(dim).values())

    def state_names(self) -> list[str]:
        """Names of the state tensors in exports and state_dicts."""
        return list(self.kind.state_names)

    def state_shapes(self, dim: int) -> dict[str, tuple[int, ...]]:
        """Each named state tensor's shape per row: ``()`` (one float) or ``(dim,)``."""
        return {n: (dim,) if n in STATE_PER_COLUMN else () for n in self.kind.state_names}

    def state_columns(self, dim: int) -> dict[str, int]:
        """The first state column of each named state tensor in a row's state."""
        out, start = {}, 0
        for name, shape in self.state_shapes(dim).items():
            out[name] = start
            start += math.prod(shape)
        return out

    def split_state(self, state: torch.Tensor, dim: int) -> dict[str, torch.Tensor]:
        """The named state tensors (views) of state rows ``[n, state_dim]``."""
        out, start = {}, 0
        for name, shape in self.state_shapes(dim).items():
            width = math.prod(shape)
            part = state[:, start : start + width]
            out[name] = part[:, 0] if shape == () else part
            start += width
        return out

    def join_state(self, named: dict[str, torch.Tensor], dim: int) -> torch.Tensor | None:
        """State rows ``[n, state_dim]`` from the named tensors (None for SGD)."""
        shapes = self.state_shapes(dim)
        if not shapes:
            return None
        return torch.cat([named[n].reshape(-1, math.prod(s)) for n, s in shapes.items()], dim=1)
