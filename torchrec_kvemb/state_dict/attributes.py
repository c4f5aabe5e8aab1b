"""KV tables as attributes: every state_dict key of a KV module names an attribute path.

Tools that walk a state_dict key as a path of attributes (``torch.distributed.
checkpoint.state_dict``'s ``get_model_state_dict`` / ``set_model_state_dict``,
``get_state_dict`` / ``set_state_dict``, which resolve ``ebc.embedding_bags.user.weight``
as ``model.ebc.embedding_bags.user.weight``) and the composable APIs' FQN check
(``torchrec.distributed.shard.shard`` / ``shard_modules``, which compare a module's
``named_modules()`` before and after sharding) see a KV module as they see a stock
one: an ``nn.ModuleDict`` under ``embedding_bags`` (``embeddings`` for a sequence
collection) with one :class:`KVTableEntries` module per KV table. Such a module has
no parameters or buffers (a KV table's content lives in its ``KVTable``, and a table
of ``2**63 - 1`` ids fits no tensor); each of its state_dict keys (``weight``,
``weight_id``, ``momentum1``, ...) resolves to a :class:`KVStateKey` naming it. The
values are in ``state_dict()``.

Example::

    ebc.embedding_bags["user"].weight       # KVStateKey(table='user', key='weight')
    ebc.state_dict()["embedding_bags.user.weight"]   # the rows
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

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


class KVTableEntries(nn.Module):
    """A KV table under ``<attribute>.<table>`` of its collection: no parameters or
    buffers; its state_dict keys resolve as attributes (:class:`KVStateKey`).

    Example::

        entries = KVTableEntries("user")
        entries.exp_avg     # KVStateKey(table='user', key='exp_avg')
    """

    def __init__(self, table: str) -> None:
        super().__init__()
        self.table = table

    def __getattr__(self, name: str) -> object:
        if name in KNOWN_KEYS:
            return KVStateKey(self.__dict__["table"], name)
        return super().__getattr__(name)

    def extra_repr(self) -> str:
        return f"table={self.table!r}"


def install_table_entries(module: nn.Module, attribute: str, tables: list[str]) -> None:
    """Give ``module`` a :class:`KVTableEntries` under ``<attribute>.<table>`` for each
    KV table in ``tables``: in its ``nn.ModuleDict`` ``attribute`` where it has one (a
    sharded collection's, which holds the stock tables' modules too; a KV table's entry
    replaces the empty module there), else in a new one. A table named as an
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
        container[name] = KVTableEntries(name)
