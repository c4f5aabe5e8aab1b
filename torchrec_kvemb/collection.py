"""What the unsharded KV collections (bags and sequences) share: their tables by
name, as layouts for state_dict and checkpoints, and their counters.

Example::

    class KVEmbeddingCollection(KVTablesMixin, nn.Module):
        ...   # sets self._tables (name -> KVTable) and self._device
"""

from collections.abc import Iterator

import torch
from torch import nn
from torch.fx._symbolic_trace import is_fx_symbolic_tracing

from torchrec_kvemb.state_dict.layout import TableLayout
from torchrec_kvemb.table import KVTable


class KVTablesMixin:
    """``table``, ``kv_tables``, ``kv_layouts``, ``metrics`` and ``device`` of a module
    that sets ``_tables`` (its ``KVTable`` s by name) and ``_device``, and its
    ``named_modules`` as a stock collection's.

    No attribute annotations on the class and no postponed annotations in this
    module: ``torch.jit.script`` of a collection reads the class's attribute
    annotations (``KVTable`` is no TorchScript type) and compiles the ``device``
    property, whose return type it must resolve."""

    @property
    def device(self) -> torch.device:
        return self._device

    def table(self, name: str) -> KVTable:
        """The KVTable named ``name``."""
        return self._tables[name]

    def kv_tables(self) -> dict[str, KVTable]:
        """Every KVTable by name."""
        return dict(self._tables)

    def kv_layouts(self) -> list[TableLayout]:
        """Every table as its state_dict and checkpoints see it (whole, in this process)."""
        return [TableLayout.unsharded(table) for table in self._tables.values()]

    def metrics(self) -> dict[str, dict[str, float]]:
        """``KVTable.metrics()`` of every table, by name."""
        return {name: t.metrics() for name, t in self._tables.items()}

    def named_modules(
        self,
        memo: set[nn.Module] | None = None,
        prefix: str = "",
        remove_duplicate: bool = True,
    ) -> Iterator[tuple[str, nn.Module]]:
        """The modules a stock collection has: itself and ``embedding_bags.<table>``
        (``embeddings.<table>`` for sequences), the modules its sharded form has too
        (TorchRec's composable ``shard`` / ``shard_modules`` check that sharding keeps
        them). The lookup modules inside stay out, as a sharded collection keeps its
        own; ``torch.fx`` tracing and ``torch.compile`` see every module (a traced
        graph calls the lookup module by its path)."""
        modules = nn.Module.named_modules(self, memo, prefix, remove_duplicate)
        if is_fx_symbolic_tracing() or torch.compiler.is_compiling():
            yield from modules
            return
        dot = f"{prefix}." if prefix else ""
        for name, module in modules:
            child = name[len(dot) :].split(".", 1)[0] if name != prefix else ""
            if child in ("", "embedding_bags", "embeddings"):
                yield name, module
