"""Optimizer state in checkpoints: fused (stock tables), KV learning rates, dense.

* ``fused_optim.state.*``: ``model.fused_optimizer``'s state of **stock** tables.
  KV tables' optimizer state is in the model's state_dict (by id, beside the
  rows), so their entries of ``fused_optimizer`` are left out here.
* ``fused_optim.param_groups.<param key>.lr``: each KV table's learning rate.
* ``optim.*``: a dense ``torch.optim`` optimizer's state_dict keyed by parameter
  name, so that it loads at any world size.

Example::

    state = {"fused_optim": fused_state(model, slots)}
    state["optim"] = optimizer_state(model, dense_optimizer)
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint._nested_dict import unflatten_state_dict
from torch.distributed.checkpoint.metadata import Metadata

from torchrec_kvemb.state_dict.checks import CheckpointError
from torchrec_kvemb.state_dict.layout import KVTableSlot

FUSED, OPTIM = "fused_optim", "optim"


# ------------------------------------------------------- fused, stock tables
def fused_state(model: nn.Module, slots: Mapping[str, KVTableSlot]) -> dict[str, Any]:
    """``model.fused_optimizer``'s state of stock tables, as its ``state_dict()``
    gives it (KV tables keep theirs in the model's state_dict; their entries are
    not even exported here)."""
    fused = getattr(model, "fused_optimizer", None)
    if fused is None:
        return {}
    kv_rows = {id(s.layout.table.weights) for s in slots.values() if s.layout.table is not None}
    state = fused.state
    out = {}
    for key, param in fused.params.items():
        if id(param) in kv_rows or param not in state:
            continue
        content = stateful_content(state[param])
        if content:
            out[key] = content
    return {"state": out}


def stateful_content(value: Any) -> Any:
    """A keyed optimizer's per-parameter state as its ``state_dict()`` gives it:
    nested dicts, with objects that have a ``state_dict()`` replaced by it."""
    if isinstance(value, dict):
        return {k: stateful_content(v) for k, v in value.items()}
    if callable(getattr(value, "state_dict", None)):
        return value.state_dict()
    return value


# ------------------------------------------------------ KV learning rates
def lr_key(prefix: str) -> str:
    """The DCP key of a KV table's learning rate: its fused optimizer param key (the
    state_dict key of its rows) under ``fused_optim.param_groups``."""
    return f"{FUSED}.param_groups.{prefix}weight.lr"


def learning_rates(slots: Mapping[str, KVTableSlot]) -> dict[str, dict[str, float]]:
    """``{param key: {"lr": lr}}`` of the KV tables this rank holds (saved under
    ``fused_optim.param_groups``; every rank holding a shard writes the same value)."""
    out = {}
    for prefix, slot in slots.items():
        lr = slot.layout.learning_rate()
        if lr is not None:
            out[f"{prefix}weight"] = {"lr": lr}
    return out


def saved_learning_rates(
    slots: Mapping[str, KVTableSlot], values: Mapping[str, Any]
) -> dict[str, float]:
    """The learning rates read for this rank's KV tables, by prefix, checked."""
    out = {}
    for prefix, value in values.items():
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            lr = math.nan
        else:
            lr = float(value)
        if not (math.isfinite(lr) and lr >= 0):
            raise CheckpointError(
                f"table {slots[prefix].layout.name!r} ({prefix.rstrip('.')}): the saved "
                f"learning rate {value!r} is not a number >= 0"
            )
        out[prefix] = lr
    return out


def restore_learning_rates(slots: Mapping[str, KVTableSlot], saved: Mapping[str, float]) -> None:
    """Give each KV table its saved learning rate. Sharded tables of one grouped
    config share one fused optimizer, hence one ``lr``: where theirs were saved
    different (e.g. set per table unsharded), the rate of the table whose state_dict
    key sorts first applies to all of them (the same choice on every rank), with a
    warning."""
    shared: dict[int, list[str]] = {}
    for prefix in sorted(saved):
        layout = slots[prefix].layout
        owner = layout.fused_optimizer if layout.fused_optimizer is not None else layout.table
        shared.setdefault(id(owner), []).append(prefix)
    for prefixes in shared.values():
        lr = saved[prefixes[0]]
        if len({saved[p] for p in prefixes}) > 1:
            names = [slots[p].layout.name for p in prefixes]
            warnings.warn(
                f"KV tables {names} share one fused optimizer param group in this model but "
                f"were saved with learning rates {[saved[p] for p in prefixes]}; all of them "
                f"now use {lr} (that of {names[0]!r})",
                stacklevel=3,
            )
        for prefix in prefixes:
            slots[prefix].layout.set_learning_rate(lr)


# ------------------------------------------------------ a dense optimizer
def _param_names(model: nn.Module) -> dict[int, str]:
    return {id(p): name for name, p in model.named_parameters()}


def optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """A torch optimizer's state_dict keyed by parameter name (so that it loads into
    another process's optimizer over the same named parameters)."""
    if isinstance(getattr(optimizer, "params", None), Mapping):
        raise TypeError(
            "checkpoint.save: optimizer must be a torch.optim optimizer of dense parameters; "
            "TorchRec's keyed optimizers are not supported (model.fused_optimizer's state "
            "is saved with the model)"
        )
    names = _param_names(model)
    order = [names.get(id(p)) for g in optimizer.param_groups for p in g["params"]]
    if None in order:
        raise CheckpointError("the optimizer holds parameters that are not the model's")
    raw = optimizer.state_dict()
    groups = []
    for group, raw_group in zip(optimizer.param_groups, raw["param_groups"], strict=True):
        named = {k: v for k, v in raw_group.items() if k != "params"}
        named["params"] = [names[id(p)] for p in group["params"]]
        groups.append(named)
    return {
        "state": {order[i]: s for i, s in raw["state"].items()},
        "param_groups": groups,
    }


def optimizer_to_load(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    flat: dict[str, Any],
    metadata: Metadata,
) -> dict[str, Any]:
    """The saved optimizer state as ``optimizer.load_state_dict`` takes it."""
    nested = unflatten_state_dict(flat, metadata.planner_data)[OPTIM]
    names = _param_names(model)
    saved_groups = nested.get("param_groups", [])
    if len(saved_groups) != len(optimizer.param_groups):
        raise CheckpointError(
            f"the optimizer has {len(optimizer.param_groups)} param groups, the "
            f"checkpoint's {len(saved_groups)}"
        )
    state, groups, index = {}, [], 0
    for group, saved_group in zip(optimizer.param_groups, saved_groups, strict=True):
        fqns = [names.get(id(p)) for p in group["params"]]
        if sorted(map(str, fqns)) != sorted(saved_group["params"]):
            raise CheckpointError(
                f"the optimizer's parameters {fqns} differ from the checkpoint's "
                f"{saved_group['params']}"
            )
        loaded = {k: v for k, v in saved_group.items() if k != "params"}
        loaded["params"] = list(range(index, index + len(fqns)))
        for fqn in fqns:
            if fqn in nested.get("state", {}):
                state[index] = nested["state"][fqn]
            index += 1
        groups.append(loaded)
    return {"state": state, "param_groups": groups}
