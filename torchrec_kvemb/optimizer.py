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

``FusedOptimConfig.from_fused_params`` reads ``fused_params`` as FBGEMM's TBE
(where the stock sharder sends them) reads them, defaults included
(``EXACT_SGD``, learning rate 0.01, eps 1e-8, no weight decay mode), and the
kwargs of a torch optimizer TorchRec hands over with them; what a KV table
cannot run as FBGEMM would is refused by name (``FusedParamsError``).
docs/kv-table.md lists every key.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Mapping
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

#: The keys that set the update, read as FBGEMM's TBE reads them, with the names
#: torch's optimizers give two of them (``lr``, ``betas``: TorchRec hands an
#: ``apply_optimizer_in_backward`` optimizer's kwargs over as they are).
OPTIMIZER_KEYS = frozenset(
    {
        "optimizer",
        "learning_rate",
        "lr",
        "eps",
        "beta1",
        "beta2",
        "betas",
        "weight_decay",
        "weight_decay_mode",
        "gradient_clipping",
        "max_gradient",
    }
)
#: Keys that place, cache, prefetch, check or report a table and never change its
#: numbers: accepted whatever their value.
NO_EFFECT_KEYS = frozenset(
    {
        "cache_algorithm",
        "cache_load_factor",
        "cache_sets",
        "cache_reserved_memory",
        "cache_precision",
        "enforce_hbm",
        "record_cache_metrics",
        "gather_uvm_cache_stats",
        "stochastic_rounding",
        "bounds_check_mode",
        "prefetch_pipeline",
        "multipass_prefetch_config",
        "uvm_non_rowwise_momentum",
        "uvm_host_mapped",
        "use_experimental_tbe",
        "stats_reporter_config",
        "table_names",
        "embedding_table_index_type",
        "embedding_table_offset_type",
        "embedding_shard_info",
        "tbe_input_multiplexer_config",
        "enable_raw_embedding_streaming",
        "res_params",
        "preallocated_host_buffers",
        # torch optimizers' implementation switches
        "foreach",
        "capturable",
        "differentiable",
        "fused",
    }
)
#: TorchRec's own bookkeeping keys (``torchrec.distributed.fused_params``) start so.
_TORCHREC_BOOKKEEPING = "__register_"


def _is_fp32(value: Any) -> bool:
    return str(getattr(value, "value", value)).lower() in ("fp32", "float32", "torch.float32", "0")


#: Keys accepted only at the value that changes nothing: key -> (that check, why
#: any other value is refused).
_DEFAULT_ONLY: dict[str, tuple[Any, str]] = {
    "output_dtype": (_is_fp32, "KV tables output float32"),
    "weights_precision": (
        _is_fp32,
        "a KV table's row precision is KVTableOptions(weights_dtype=...)",
    ),
    "max_norm": (lambda v: float(v) == 0.0, "KV tables do not renormalize rows"),
    "momentum": (lambda v: float(v) == 0.0, "no KV optimizer keeps a momentum buffer"),
    "dampening": (lambda v: float(v) == 0.0, "no KV optimizer keeps a momentum buffer"),
    "nesterov": (lambda v: not v, "no KV optimizer keeps a momentum buffer"),
    "amsgrad": (lambda v: not v, "KV Adam keeps no maximum of its second moment"),
    "maximize": (lambda v: not v, "KV optimizers minimize"),
    "lr_decay": (lambda v: float(v) == 0.0, "KV learning rates decay only through the lr"),
    "initial_accumulator_value": (
        lambda v: float(v) == 0.0,
        "row-wise Adagrad's sum starts at 0 in a new row",
    ),
    "ensemble_mode": (lambda v: v is None, "ensemble optimizers are not supported"),
    "emainplace_mode": (lambda v: v is None, "EMA in-place optimizers are not supported"),
    "counter_based_regularization": (
        lambda v: v is None,
        "counter-based regularization is not supported",
    ),
    "cowclip_regularization": (lambda v: v is None, "cowclip is not supported"),
    "global_weight_decay": (lambda v: v is None, "global weight decay is not supported"),
    "extra_optimizer_config": (lambda v: v is None, "extra optimizer configs are not supported"),
    "optimizer_state_dtypes": (lambda v: not v, "optimizer state is float32"),
    "is_qr_tbe": (lambda v: not v, "quotient-remainder tables are not supported"),
}

#: The torch optimizer classes a KV table runs (TorchRec's own mapping decides the
#: ``EmbOptimType``, as the stock sharded tables use it).
TORCH_OPTIMIZERS = ("torch.optim.SGD", "torch.optim.Adam", "torchrec.optim.SGD",
                    "torchrec.optim.Adam", "torchrec.optim.RowWiseAdagrad")  # fmt: skip


class FusedParamsError(ValueError):
    """A ``fused_params`` key (or optimizer class) a KV table cannot honour as FBGEMM
    does; the message names the key and, where known, the table."""


@dataclass(frozen=True)
class FusedOptimConfig:
    """A fused optimizer's kind and hyper-parameters.

    ``from_fused_params`` is the one translation from TorchRec's ``fused_params``
    (those of a sharder, of a table's plan, or the kwargs an
    ``apply_optimizer_in_backward`` optimizer carries) and ``from_torch_optimizer``
    from a torch optimizer class and its kwargs; both give the update FBGEMM's TBE
    would run for them, or refuse by name what a KV table cannot run so
    (docs/kv-table.md lists every key).

    Example::

        FusedOptimConfig.from_fused_params(
            {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.05}
        )
        FusedOptimConfig.from_torch_optimizer(torch.optim.Adam, {"lr": 0.01, "betas": (0.8, 0.95)})
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
    def from_fused_params(
        cls, fused_params: Mapping[str, Any] | None, table: str | None = None
    ) -> FusedOptimConfig:
        """The update FBGEMM's TBE runs for ``fused_params``; a key it would read
        otherwise than a KV table can is a ``FusedParamsError`` naming the key (and
        ``table``). Keys left out take FBGEMM's defaults."""
        where = f"table {table!r}: fused_params" if table else "fused_params"
        params = dict(fused_params or {})

        def refuse(key: str, why: str) -> FusedParamsError:
            return FusedParamsError(f"{where}[{key!r}] = {params[key]!r}: {why}")

        for key in params:
            if key in OPTIMIZER_KEYS or key in NO_EFFECT_KEYS:
                continue
            if key.startswith(_TORCHREC_BOOKKEEPING):
                continue
            if key not in _DEFAULT_ONLY:
                raise refuse(key, "not a key KV tables read (docs/kv-table.md lists them)")
            accepts, why = _DEFAULT_ONLY[key]
            if not accepts(params[key]):
                raise refuse(key, why)
        kind = _kind(params, refuse)
        learning_rate = _one_of(params, "learning_rate", "lr", cls.learning_rate, refuse)
        beta1, beta2 = cls.beta1, cls.beta2
        if "betas" in params:
            betas = params["betas"]
            if len(betas) != 2:
                raise refuse("betas", "expected (beta1, beta2)")
            beta1, beta2 = (float(b) for b in betas)
            for key, value in (("beta1", beta1), ("beta2", beta2)):
                if key in params and float(params[key]) != value:
                    raise refuse(key, f"differs from betas {tuple(betas)}")
        beta1 = float(params.get("beta1", beta1))
        beta2 = float(params.get("beta2", beta2))
        decay, mode = _weight_decay(kind, params, refuse)
        config = cls(
            kind=kind,
            learning_rate=learning_rate,
            eps=float(params.get("eps", cls.eps)),
            beta1=beta1,
            beta2=beta2,
            weight_decay=decay,
            weight_decay_mode=mode,
            gradient_clipping=bool(params.get("gradient_clipping", False)),
            max_gradient=float(params.get("max_gradient", cls.max_gradient)),
        )
        for key in ("learning_rate", "lr", "eps", "max_gradient"):
            if key in params and float(params[key]) < 0:
                raise refuse(key, "must be >= 0")
        for key in ("beta1", "beta2", "betas"):
            if key in params and not (0.0 <= beta1 < 1.0 and 0.0 <= beta2 < 1.0):
                raise refuse(key, "betas must lie in [0, 1)")
        return config

    @classmethod
    def from_torch_optimizer(
        cls,
        optimizer_class: type,
        kwargs: Mapping[str, Any] | None = None,
        table: str | None = None,
    ) -> FusedOptimConfig:
        """The update a KV table runs for ``apply_optimizer_in_backward(optimizer_class,
        ..., kwargs)``: TorchRec's ``EmbOptimType`` for the class, then ``kwargs`` read
        as the stock sharded tables read them (``from_fused_params``)."""
        return cls.from_fused_params(
            fused_params_of_torch_optimizer(optimizer_class, kwargs, table), table
        )

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


def _kind(params: dict[str, Any], refuse: Callable[[str, str], FusedParamsError]) -> OptimKind:
    if "optimizer" not in params:
        return OptimKind.SGD
    opt = params["optimizer"]
    if isinstance(opt, str):
        opt = EmbOptimType._value2member_map_.get(opt) or EmbOptimType.__members__.get(
            opt.upper(), opt
        )
    if opt not in _KINDS:
        supported = ", ".join(o.name for o in _KINDS)
        raise refuse("optimizer", f"KV tables run {supported}")
    return _KINDS[opt]


def _one_of(
    params: dict[str, Any],
    key: str,
    alias: str,
    default: float,
    refuse: Callable[[str, str], FusedParamsError],
) -> float:
    """``params[key]`` or its torch name ``params[alias]`` (both given: equal)."""
    if key in params and alias in params and float(params[key]) != float(params[alias]):
        raise refuse(alias, f"differs from {key} {params[key]!r}")
    return float(params.get(key, params.get(alias, default)))


def _weight_decay(
    kind: OptimKind, params: dict[str, Any], refuse: Callable[[str, str], FusedParamsError]
) -> tuple[float, WeightDecay]:
    """``weight_decay`` and its mode as FBGEMM's kernel of ``kind`` applies them.

    * SGD: FBGEMM's kernel takes no weight decay. Without a mode it does nothing,
      as there; with L2 or DECOUPLE, which it would ignore, it is refused.
    * Row-wise Adagrad: L2 and DECOUPLE as given; without a mode, nothing.
    * Adam: FBGEMM's kernel takes no mode and always decays decoupled
      (``w -= lr * (update + weight_decay * w)``): NONE and DECOUPLE run that; L2,
      which it would not run, is refused.
    """
    decay = float(params.get("weight_decay", 0.0))
    if decay < 0:
        raise refuse("weight_decay", "must be >= 0")
    raw = params.get("weight_decay_mode", WeightDecay.NONE)
    value = getattr(raw, "value", raw)
    if not isinstance(value, int) or value not in {int(m) for m in WeightDecay}:
        raise refuse(
            "weight_decay_mode",
            "KV tables apply WeightDecayMode NONE, L2 or DECOUPLE only",
        )
    mode = WeightDecay(value)
    if not decay:
        return decay, mode
    if kind == OptimKind.SGD and mode != WeightDecay.NONE:
        raise refuse(
            "weight_decay_mode",
            f"FBGEMM's SGD applies no weight decay (weight_decay {decay} would be ignored); "
            "drop weight_decay, or use EXACT_ROWWISE_ADAGRAD or ADAM",
        )
    if kind == OptimKind.ADAM:
        if mode == WeightDecay.L2:
            raise refuse(
                "weight_decay_mode",
                "FBGEMM's Adam decays decoupled whatever the mode; set DECOUPLE (or no mode)",
            )
        mode = WeightDecay.DECOUPLE
    return decay, mode


def fused_params_of_torch_optimizer(
    optimizer_class: type, kwargs: Mapping[str, Any] | None = None, table: str | None = None
) -> dict[str, Any]:
    """The ``fused_params`` TorchRec's sharders build for a table whose weight
    ``apply_optimizer_in_backward(optimizer_class, ..., kwargs)`` marked: the
    ``EmbOptimType`` TorchRec maps the class to, and ``kwargs`` as they are. A KV
    collection takes them as its ``fused_params``.

    Example::

        fused = fused_params_of_torch_optimizer(torch.optim.Adam, {"lr": 0.01})
        KVEmbeddingBagCollection(tables, options, fused_params=fused)
    """
    from torchrec.distributed.utils import optimizer_type_to_emb_opt_type

    params = dict(kwargs or {})
    if "optimizer" in params:
        return params
    where = f"table {table!r}: " if table else ""
    name = f"{optimizer_class.__module__}.{optimizer_class.__qualname__}"
    try:
        emb = optimizer_type_to_emb_opt_type(optimizer_class)
    except ValueError:
        emb = None
    if emb not in _KINDS:
        raise FusedParamsError(
            f"{where}optimizer class {name} (FBGEMM's {getattr(emb, 'name', None)}): KV "
            f"tables run {', '.join(TORCH_OPTIMIZERS)}"
        )
    params["optimizer"] = emb
    return params


def marked_fused_params(
    weight: torch.Tensor | None, fused_params: Mapping[str, Any] | None, table: str
) -> dict[str, Any] | None:
    """``fused_params`` with the optimizer ``apply_optimizer_in_backward`` marked
    ``weight`` with merged over them, as TorchRec's sharders merge them for a stock
    fused table (``merge_fused_params``: the optimizer's ``EmbOptimType`` and its kwargs
    win, over a key's torch name and FBGEMM's alike: a marked ``lr`` replaces
    ``learning_rate``, ``betas`` replaces ``beta1`` / ``beta2``); None when ``weight``
    carries no mark. More than one optimizer on one weight
    is refused naming ``table`` (TorchRec's sharders take one).

    Example::

        apply_optimizer_in_backward(RowWiseAdagrad, [weight], {"lr": 0.02})
        marked_fused_params(weight, {"eps": 1e-6}, "user")
        # {"eps": 1e-6, "learning_rate": 0.02, "optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD}
    """
    from torchrec.distributed.utils import merge_fused_params

    classes = getattr(weight, "_optimizer_classes", None)
    if not classes or classes[0] is None:
        return None
    if len(classes) > 1:
        names = ", ".join(f"{c.__module__}.{c.__qualname__}" for c in classes)
        raise FusedParamsError(
            f"table {table!r}: apply_optimizer_in_backward gave its weight {len(classes)} "
            f"optimizers ({names}); a table runs one, as TorchRec's fused tables do"
        )
    marked = dict(fused_params_of_torch_optimizer(classes[0], weight._optimizer_kwargs[0], table))
    base = dict(fused_params or {})
    # A torch name and FBGEMM's name of one setting are one key: the marked one wins.
    if {"lr", "learning_rate"} & marked.keys():
        base.pop("lr", None)
        base.pop("learning_rate", None)
    if "betas" in marked:
        base.pop("beta1", None)
        base.pop("beta2", None)
    elif {"beta1", "beta2"} & marked.keys() and "betas" in base:
        beta1, beta2 = base.pop("betas")
        base.setdefault("beta1", beta1)
        base.setdefault("beta2", beta2)
    return merge_fused_params(base, marked)  # renames the marked "lr" (its own copy)
