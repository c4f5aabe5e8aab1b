"""``KVPooledModule`` and ``KVSequenceModule``: a collection's KV lookup (pooled, or
one row per id) as one opaque call, for inference graphs (``torch.fx`` tracing and
``torch.jit.script``).

TorchRec's inference flow traces the unsharded model (``torchrec.fx.symbolic_trace``
or ``torch.fx.symbolic_trace``) and may script the result. A KV lookup is
data-dependent Python (hash probes, native ops, per-batch plans), so it cannot be
traced through; instead this module puts itself in the graph as one
``call_module`` node, which calls back into the lookup when the graph runs: the
traced module shares the collection's tables.

Scripting keeps the lookup a Python call (``torch.jit.ignore``): a scripted
module runs in Python processes that hold the collection, and
``torch.jit.save`` refuses it (its KV tables live in Python and the native
extension, not in TorchScript). The scripted module finds the lookup through a
handle, so the collection must stay alive while the scripted module is used.

Example::

    ebc.eval()
    graph = torch.fx.symbolic_trace(ebc)   # or torchrec.fx.symbolic_trace(ebc)
    torch.testing.assert_close(graph(kjt).values(), ebc(kjt).values())
    ec.eval()
    graph = torch.fx.symbolic_trace(ec)
    torch.testing.assert_close(graph(kjt)["history"].values(), ec(kjt)["history"].values())
"""

import itertools
import weakref

import torch
from torch import nn
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_kvemb.bag_lookup import KVBagLookup
from torchrec_kvemb.sequence_lookup import KVSequenceLookup

#: Lookups by handle: what a scripted module calls back into (it cannot hold them).
_LOOKUPS: weakref.WeakValueDictionary[int, KVBagLookup] = weakref.WeakValueDictionary()
_HANDLES = itertools.count(1)


def _register(lookup: KVBagLookup | KVSequenceLookup) -> int:
    """A new handle for ``lookup``, kept in the registry the modules' forwards read."""
    handle = next(_HANDLES)
    _LOOKUPS[handle] = lookup
    return handle


def _call_node(
    module: nn.Module,
    features: torch.fx.Proxy,
    eviction_scores: dict[str, torch.Tensor] | None,
) -> torch.fx.Proxy:
    """Being traced: one node calling ``module`` when the graph runs."""
    tracer = features.tracer
    return tracer.create_proxy(
        "call_module", tracer.path_of_module(module), (features, eviction_scores), {}
    )


class KVPooledModule(nn.Module):
    """The pooled lookup of a ``KVBagLookup`` as a module: ``forward(features,
    eviction_scores) -> [stride, sum of feature dims]``; training mode stores new
    ids and ties the output into the fused backward, eval mode is read-only.

    Traced by ``torch.fx`` (any tracer) as one ``call_module`` node; scripted as a
    Python call (see the module docstring). No parameters or buffers."""

    def __init__(self, lookup: KVBagLookup) -> None:
        super().__init__()
        self.lookup = lookup
        self.handle: int = _register(lookup)

    @torch.jit.ignore
    def forward(
        self,
        features: KeyedJaggedTensor,
        eviction_scores: dict[str, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        if isinstance(features, torch.fx.Proxy):
            return _call_node(self, features, eviction_scores)
        return _lookup_of(self).pooled(features, self.training, eviction_scores)


class KVSequenceModule(nn.Module):
    """The sequence lookup of a ``KVSequenceLookup`` as a module: ``forward(features,
    eviction_scores) -> [rows of each (table, feature)]``, one ``[ids, dim]`` tensor per
    output of the collection, in its order; training mode stores new ids and ties the
    rows into the fused backward, eval mode is read-only.

    Traced and scripted as :class:`KVPooledModule` is (see the module docstring)."""

    def __init__(self, lookup: KVSequenceLookup) -> None:
        super().__init__()
        self.lookup = lookup
        self.handle: int = _register(lookup)

    @torch.jit.ignore
    def forward(
        self,
        features: KeyedJaggedTensor,
        eviction_scores: dict[str, torch.Tensor] | None = None,
    ) -> list[torch.Tensor]:
        if isinstance(features, torch.fx.Proxy):
            return _call_node(self, features, eviction_scores)
        return _lookup_of(self).sequences(features, self.training, eviction_scores)


def _lookup_of(module: KVPooledModule | KVSequenceModule) -> KVBagLookup:
    """The lookup of ``module``, or of the module a scripted copy was made from."""
    lookup = module.__dict__.get("lookup") or _LOOKUPS.get(module.handle)
    if lookup is None:
        raise RuntimeError(
            f"{type(module).__name__}: the KV collection this scripted module was made "
            "from no longer exists; keep it alive while the scripted module runs (its KV "
            "tables live in it)"
        )
    return lookup
