"""Output memory of an evaluation, reused from batch to batch once nothing holds it.

A sequence evaluation writes every id's row: 42 MB for 163,840 ids of dim 64.
Fresh memory of that size comes from the kernel page by page (glibc maps it
afresh or has trimmed its heap back), and each page is zeroed and faulted in as
the kernel writes it: a third of a one-thread evaluation step went to
``clear_page`` and the faults. ``ReusedOutputs`` keeps the last buffer handed
out at each position of a batch and hands it out again once no tensor (no view,
no NumPy array) shares its memory any more, so a running evaluation writes into
pages it already has. It holds at most one batch's outputs; where its storage
use count cannot be read (another torch), every buffer is new.

Example::

    outputs = ReusedOutputs()
    rows = outputs.take(0, (n, dim))   # float32 [n, dim], contents undefined
"""

from __future__ import annotations

import threading

import torch

from torchrec_kvemb import huge_pages

_use_count = getattr(torch._C, "_storage_Use_Count", None)


def _unshared(buffer: torch.Tensor) -> bool:
    """Whether ``buffer`` is the only tensor on its memory (the count also holds the
    storage object made to ask)."""
    return _use_count is not None and _use_count(buffer.untyped_storage()._cdata) == 2


class ReusedOutputs:
    """Float32 CPU output buffers by position in a batch, reused once unshared (see
    the module docstring); safe to call from several threads."""

    def __init__(self) -> None:
        self._buffers: dict[int, torch.Tensor] = {}
        self._lock = threading.Lock()

    def take(self, position: int, shape: tuple[int, int]) -> torch.Tensor:
        """A contiguous float32 CPU tensor of ``shape`` whose memory no other tensor
        holds; its contents are undefined (the caller writes every element)."""
        numel = shape[0] * shape[1]
        with self._lock:
            buffer = self._buffers.get(position)
            if buffer is None or buffer.numel() < numel or not _unshared(buffer):
                buffer = torch.empty(numel)
                huge_pages.advise(buffer)
                self._buffers[position] = buffer
            return buffer[:numel].view(shape)

    def clear(self) -> None:
        """Drop every buffer (their memory goes back once no output holds it)."""
        with self._lock:
            self._buffers.clear()

    def nbytes(self) -> int:
        """Bytes of the buffers held."""
        with self._lock:
            return sum(b.numel() * 4 for b in self._buffers.values())
