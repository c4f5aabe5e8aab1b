"""What the unsharded KV collections (bags and sequences) share: their tables by
name, as layouts for state_dict and checkpoints, their counters, and the optimizer
``apply_optimizer_in_backward`` marks their weights with.

Example::

    class KVEmbeddingCollection(KVTablesMixin, nn.Module):
        ...   # sets self._tables (name -> KVTable), self._device, self._fused_params,
              # self._optims (name -> FusedOptimConfig), and builds its lookup in
              # _build_lookup(optims)
"""

import contextlib
import sys
from collections.abc import Iterator

import torch
from torch import nn
from torch.fx._symbolic_trace import is_fx_symbolic_tracing

# why: DistributedDataParallel reads ``torch.distributed.optim`` for parameters marked
# as optimized in backward (the tables' placeholder weights) before the first forward,
# and fails with an AttributeError where nothing imported it; imported, the forward
# runs and refuses DDP with the error that says what to do (refuse_data_parallel).
with contextlib.suppress(ImportError):
    import torch.distributed.optim  # noqa: F401

from torchrec_kvemb.optimizer import FusedOptimConfig, FusedParamsError, marked_fused_params
from torchrec_kvemb.state_dict.layout import TableLayout
from torchrec_kvemb.table import KVTable


class KVTablesMixin:
    """``table``, ``kv_tables``, ``kv_layouts``, ``metrics`` and ``device`` of a module
    that sets ``_tables`` (its ``KVTable`` s by name) and ``_device``, and its
    ``named_modules`` as a stock collection's.

    **apply_optimizer_in_backward.** Each table's placeholder weight
    (``<entries_attribute>.<table>.weight``) takes torch's
    ``apply_optimizer_in_backward`` as a stock table's weight does. A mark is read at
    once (:meth:`optimizer_marked`): the class and kwargs translate as TorchRec's
    sharders translate them, merged over the collection's ``fused_params``, or are
    refused naming the table. The tables take the new optimizers before their next
    use (forward, ``table``, ``kv_tables``, ``state_dict``, a sharder): the
    collection's lookup is built again then, once for any number of marks. A KV
    table keeps its optimizer's state in its rows, so a mark that changes a table's
    optimizer after the collection trained or was given rows is refused, and so is
    one that changes the state layout of a table with an SSD tier (its files are
    laid out when it is built): build the collection with
    ``fused_params=fused_params_of_torch_optimizer(cls, kwargs)`` instead.

    No attribute annotations on the class and no postponed annotations in this
    module: ``torch.jit.script`` of a collection reads the class's attribute
    annotations (``KVTable`` is no TorchScript type) and compiles the ``device``
    property, whose return type it must resolve."""

    @property
    def device(self) -> torch.device:
        return self._device

    def table(self, name: str) -> KVTable:
        """The KVTable named ``name``."""
        self.apply_marked_optimizers()
        return self._tables[name]

    def kv_tables(self) -> dict[str, KVTable]:
        """Every KVTable by name."""
        self.apply_marked_optimizers()
        return dict(self._tables)

    def kv_layouts(self) -> list[TableLayout]:
        """Every table as its state_dict and checkpoints see it (whole, in this process)."""
        self.apply_marked_optimizers()
        return [TableLayout.unsharded(table) for table in self._tables.values()]

    def metrics(self) -> dict[str, dict[str, float]]:
        """``KVTable.metrics()`` of every table, by name."""
        self.apply_marked_optimizers()
        return {name: t.metrics() for name, t in self._tables.items()}

    # ------------------------------------------------ apply_optimizer_in_backward
    def table_weight(self, name: str) -> nn.Parameter | None:
        """The placeholder weight of table ``name`` (``[0, dim]``): the parameter
        ``apply_optimizer_in_backward`` marks (None for a table named as an
        ``nn.ModuleDict`` attribute, ``items``, ``keys``..., which has none)."""
        entries = getattr(self, self._entries_attribute)._modules.get(name)
        return None if entries is None else entries.weight

    def marked_optims(self) -> dict[str, FusedOptimConfig]:
        """Each table's optimizer: the collection's ``fused_params`` with what
        ``apply_optimizer_in_backward`` marked the table's weight with merged over them
        (TorchRec's ``merge_fused_params``), read by ``FusedOptimConfig.from_fused_params``;
        a ``FusedParamsError`` names the table whose mark a KV table cannot run."""
        optims = {}
        for name, built in self._optims.items():
            merged = marked_fused_params(self.table_weight(name), self._fused_params, name)
            optims[name] = (
                built if merged is None else FusedOptimConfig.from_fused_params(merged, name)
            )
        return optims

    def optimizer_marked(self, table: str) -> None:
        """``apply_optimizer_in_backward`` marked ``table``'s weight: read the marks now
        (refusing what the tables cannot run); the tables take them before their next
        use (:meth:`apply_marked_optimizers`)."""
        optims = self.marked_optims()
        changed = [n for n, config in optims.items() if config != self._optims[n]]
        if not changed:
            return
        first = table if table in changed else changed[0]
        for name, current in self._tables.items():
            held, trained = current.total_size, current.step
            if held or trained:
                raise FusedParamsError(
                    f"table {first!r}: apply_optimizer_in_backward changes its optimizer "
                    f"({self._optims[first]} -> {optims[first]}), but the collection has "
                    f"trained or holds rows (table {name!r}: {trained} training steps, "
                    f"{held} ids) and a KV table keeps its optimizer's state in its rows: "
                    "mark the weights before the first training step and before loading rows"
                )
        for name in changed:
            current = self._tables[name]
            if current.ssd is not None and (
                optims[name].state_dim(current.dim) != self._optims[name].state_dim(current.dim)
            ):
                raise FusedParamsError(
                    f"table {name!r}: apply_optimizer_in_backward gives it {optims[name]}, "
                    "whose state its SSD tier's files, laid out for "
                    f"{self._optims[name]} when the collection was built, cannot hold; build "
                    "the collection with fused_params=fused_params_of_torch_optimizer(cls, "
                    "kwargs) (torchrec_kvemb.optimizer)"
                )
        self._marks_pending = True

    @torch.compiler.disable
    def refuse_data_parallel(self) -> None:
        """Raise when this forward runs inside ``DistributedDataParallel`` (or FSDP's
        wrapper): they keep replicas equal by all-reducing parameters' gradients,
        and a KV table's rows are no parameter, so every process would train rows of
        its own, silently unlike a replicated stock table. Checked at the first
        eager forward (the forward calls it while ``_data_parallel_checked`` is
        False); a collection used alone, or sharded by DMP, passes."""
        self._data_parallel_checked = True
        frame = sys._getframe(1)
        for _ in range(64):  # the wrapper's forward is a few calls up
            if frame is None:
                return
            owner = frame.f_locals.get("self")
            wrapper = type(owner).__name__
            if isinstance(owner, nn.parallel.DistributedDataParallel) or (
                wrapper == "FullyShardedDataParallel"
            ):
                kind = type(self).__name__
                raise RuntimeError(
                    f"{kind} (tables {sorted(self._tables)}) runs inside {wrapper}, which "
                    "replicates a model by all-reducing its parameters' gradients; KV "
                    "tables keep their rows outside any parameter, so each process would "
                    "train rows of its own. Shard the collection instead: "
                    f"DistributedModelParallel(model, sharders=[{kind}Sharder(module_type="
                    f"{kind})]) (docs/sharding.md), or run it in one process without "
                    f"{wrapper}"
                )
            frame = frame.f_back

    @torch.compiler.disable
    def apply_marked_optimizers(self) -> None:
        """Give the tables the optimizers ``apply_optimizer_in_backward`` marked their
        weights with since they were built (a no-op without new marks): the lookup is
        built again with them, its tables empty as they were. A compiled forward
        (``torch.compile``) cannot build it: call this (or any eager use of the
        collection) between the marks and compiling."""
        # why at first use, not at each mark: a build costs what the collection's
        # construction does (8 tables of 1M rows x 64 on CPU: 7.5 s), and
        # apply_optimizer_in_backward marks one table at a time.
        if not self._marks_pending:
            return
        self._marks_pending = False
        optims = self.marked_optims()
        if optims == self._optims:
            return
        for current in self._tables.values():
            current.close()  # an SSD tier's files: the new table opens them again
        self._build_lookup(optims)

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
