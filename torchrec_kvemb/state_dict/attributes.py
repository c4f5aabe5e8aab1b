"""KV tables as attributes: every state_dict key of a KV module names an attribute path.

Tools that walk a state_dict key as a path of attributes (``torch.distributed.
checkpoint.state_dict``'s ``get_model_state_dict`` / ``set_model_state_dict``,
``get_state_dict`` / ``set_state_dict``, which resolve ``ebc.embedding_bags.user.weight``
as ``model.ebc.embedding_bags.user.weight``) and the composable APIs' FQN check
(``torchrec.distributed.shard.shard`` / ``shard_modules``, which compare a module's
``named_modules()`` and ``named_parameters()`` before and after sharding) see a KV
module as they see a stock one: an ``nn.ModuleDict`` under ``embedding_bags``
(``embeddings`` for a sequence collection) with one :class:`KVTableEntries` module
per KV table. Such a module has one parameter, ``weight``, with no rows (a KV
table's content lives in its ``KVTable``, and a table of ``2**63 - 1`` ids fits no
tensor); its other state_dict keys (``weight_id``, ``momentum1``, ...) resolve to a
:class:`KVStateKey` naming them. The values are in ``state_dict()``.

Example::

    ebc.embedding_bags["user"].weight       # a [0, dim] placeholder
    ebc.embedding_bags["user"].weight_id    # KVStateKey(table='user', key='weight_id')
    ebc.state_dict()["embedding_bags.user.weight"]   # the rows
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torchrec.optim.fused import EmptyFusedOptimizer

from torchrec_kvemb.state_dict.rows import KNOWN_KEYS


@dataclass(frozen=True)
class KVStateKey:
    """What a KV table's state_dict key names as an attribute: the table and the key
    (its value is the module's ``state_dict()[f"{prefix}{table}.{key}"]``).

    Example::

        KVStateKey("user", "weight_id")
    """

    table: str
    key: str


class MarkedOptimizerKwargs(list):
    """The ``_optimizer_kwargs`` list of a placeholder that takes
    ``apply_optimizer_in_backward``: torch appends an optimizer's kwargs to it last,
    after its instance (``_in_backward_optimizers``) and class (``_optimizer_classes``);
    the append then calls ``on_mark(table)`` (a bound method, held weakly), which reads
    the mark and raises what the table cannot run. A mark ``on_mark`` refuses is taken
    back from all three lists before the error leaves (torch registers its hook after
    the append, so none is left). Pickled or copied it is a plain list.

    Example::

        weight._optimizer_kwargs = MarkedOptimizerKwargs(weight, "user", ebc.optimizer_marked)
    """

    def __init__(self, weight: torch.Tensor, table: str, on_mark: Callable[[str], None]) -> None:
        super().__init__()
        # weak: the weight holds this list, and the collection holds the weight
        self._weight = weakref.ref(weight)
        self._table = table
        self._on_mark = weakref.WeakMethod(on_mark)

    def append(self, kwargs: Any) -> None:
        super().append(kwargs)
        on_mark = self._on_mark()
        if on_mark is None:
            return
        try:
            on_mark(self._table)
        except BaseException:
            super().pop()
            weight = self._weight()
            if weight is not None:
                weight._optimizer_classes.pop()
                weight._in_backward_optimizers.pop()
            raise

    def __reduce__(self) -> tuple:
        return list, (list(self),)


class KVTableEntries(nn.Module):
    """A KV table under ``<attribute>.<table>`` of its collection, as a stock table's
    module: a ``weight`` parameter with no rows (the name a stock table's weight
    has, so that sharding a stock module keeps its parameter names; a KV table's
    rows live in its ``KVTable``, and ``2**63 - 1`` ids fit no tensor), marked as
    updated in backward as a stock fused table's weight is, no buffers;
    its other state_dict keys resolve as attributes (:class:`KVStateKey`). It adds
    nothing to ``state_dict()`` and loads nothing itself: the collection's hooks
    write and read the table's entries.

    With ``on_mark`` (an unsharded collection's) the weight takes
    ``apply_optimizer_in_backward`` as a stock table's does: it requires grad (torch
    hooks the optimizer on its gradient accumulator; no gradient ever reaches it)
    and each mark calls ``on_mark(table)`` (:class:`MarkedOptimizerKwargs`), which
    gives the table that optimizer. Without it (a sharded collection's) the weight
    requires no grad.

    Example::

        entries = KVTableEntries("user", dim=8)
        entries.weight.shape    # torch.Size([0, 8])
        entries.exp_avg         # KVStateKey(table='user', key='exp_avg')
    """

    def __init__(
        self,
        table: str,
        dim: int,
        device: torch.device | None = None,
        on_mark: Callable[[str], None] | None = None,
    ) -> None:
        super().__init__()
        weight = nn.Parameter(torch.empty(0, dim, device=device), requires_grad=on_mark is not None)
        # Updated in backward by the table's fused optimizer, as a stock fused table's
        # weight: TorchRec's in_backward_optimizer_filter leaves it out of dense
        # optimizers (and a CombinedOptimizer beside the fused one).
        weight._in_backward_optimizers = [EmptyFusedOptimizer()]
        if on_mark is not None:
            # torch appends to these (it creates them only where the first is missing)
            weight._optimizer_classes = []
            weight._optimizer_kwargs = MarkedOptimizerKwargs(weight, table, on_mark)
        self.weight = weight
        self.table = table

    def __getattr__(self, name: str) -> object:
        table = self.__dict__.get("table")
        if table is not None and name in KNOWN_KEYS and name not in self.__dict__["_parameters"]:
            return KVStateKey(table, name)
        return super().__getattr__(name)

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        """Nothing: the collection's state_dict hook writes the table's entries."""

    def _load_from_state_dict(
        self,
        state_dict: dict,
        prefix: str,
        local_metadata: dict,
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        """Nothing to load (the collection's hook took the table's entries); keys left
        under the table's prefix are unexpected."""
        if strict:
            unexpected_keys.extend(k for k in state_dict if k.startswith(prefix))

    def extra_repr(self) -> str:
        return f"table={self.table!r}, dim={self.weight.shape[1]}"


def install_table_entries(
    module: nn.Module,
    attribute: str,
    tables: dict[str, int],
    device: torch.device | None = None,
    on_mark: Callable[[str], None] | None = None,
) -> None:
    """Give ``module`` a :class:`KVTableEntries` under ``<attribute>.<table>`` for each
    KV table in ``tables`` (name: dim), its placeholder on ``device`` (taking
    ``apply_optimizer_in_backward`` marks with ``on_mark``): in its
    ``nn.ModuleDict`` ``attribute`` where it has one (a sharded collection's, which
    holds the stock tables' modules too; a KV table's entry replaces the empty module
    there), else in a new one. A table named as an
    attribute of ``nn.ModuleDict`` (``items``, ``keys``, ...) gets none: a stock
    collection cannot hold it either, and the module's own ``state_dict`` is unchanged."""
    container = module._modules.get(attribute)
    if not isinstance(container, nn.ModuleDict):
        container = nn.ModuleDict()
        module.add_module(attribute, container)
    for name in tables:
        if hasattr(container, name) and name not in container._modules:
            continue
        current = container[name] if name in container else None
        if current is not None and (
            next(current.parameters(), None) is not None
            or next(current.buffers(), None) is not None
        ):
            raise ValueError(
                f"table {name!r}: {attribute}.{name} already holds parameters or buffers; a "
                "KV table's entries cannot take its place"
            )
        container[name] = KVTableEntries(name, tables[name], device, on_mark)
