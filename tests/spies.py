"""Which implementation ran: spies on each implementation's entry points.

A test named for an implementation runs under ``run_on(monkeypatch, name)``, which
sets ``TORCHREC_KVEMB_BACKEND`` for it and counts the calls of every
implementation's training entry points; ``check()`` then asserts that the named
one ran and no other did. Replace the named implementation by another and the
test fails.

Example::

    ran = run_on(monkeypatch, "native")
    ebc(kjt).values().sum().backward()
    ran.check()
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

import pytest

from torchrec_kvemb import dispatch, native_lib
from torchrec_kvemb.backend import ENV_VAR
from torchrec_kvemb.ops import native
from torchrec_kvemb.table import KVTable

IMPLEMENTATIONS = ("native", "torch", "triton")


def _entry_points() -> dict[str, list[tuple[object, str]]]:
    from torchrec_kvemb.kernels import group_lookup, group_pooled

    return {
        "native": [(native, "lookup_train_group"), (native, "fused_backward_group")],
        "triton": [
            (group_lookup, "group_lookup_train_triton"),
            (group_pooled, "group_fused_backward_triton"),
        ],
        "torch": [(KVTable, "lookup_train"), (dispatch, "optimizer_update_torch")],
    }


@dataclass
class Ran:
    """Calls of each implementation's entry points since ``run_on``."""

    name: str
    calls: collections.Counter = field(default_factory=collections.Counter)

    def check(self) -> None:
        points = _entry_points()
        for impl, entries in points.items():
            for _, attr in entries:
                key = f"{impl}:{attr}"
                if impl == self.name:
                    assert self.calls[key] > 0, f"{self.name}: {attr} never ran"
                else:
                    assert self.calls[key] == 0, f"{self.name}: {impl}'s {attr} ran"


def run_on(monkeypatch: pytest.MonkeyPatch, name: str) -> Ran:
    """Select implementation ``name`` and spy on every implementation's entry points."""
    assert name in IMPLEMENTATIONS, name
    if name == "native":
        assert native_lib.available(), native_lib.unavailable_reason()  # make test builds it
    monkeypatch.setenv(ENV_VAR, "auto" if name == "native" else name)
    ran = Ran(name)
    for impl, entries in _entry_points().items():
        for owner, attr in entries:
            real = getattr(owner, attr)

            def spy(*args, _real=real, _key=f"{impl}:{attr}", **kwargs):
                ran.calls[_key] += 1
                return _real(*args, **kwargs)

            monkeypatch.setattr(owner, attr, spy)
    return ran
