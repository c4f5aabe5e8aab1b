"""The kernel tests' comparisons: bit for bit, with where and by how much they differ."""

from __future__ import annotations

import torch


def assert_same(
    name: str, got: torch.Tensor, want: torch.Tensor, labels: tuple[str, str] = ("triton", "torch")
) -> None:
    """``got`` equals ``want`` bit for bit (``got`` moved to ``want``'s device first);
    ``labels`` name the two sides in the message."""
    got = got.to(want.device)
    assert got.dtype == want.dtype, f"{name}: dtype {got.dtype} != {want.dtype}"
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    if not torch.equal(got, want):
        bad = (got != want).nonzero()[:8]
        at = [tuple(i) for i in bad.tolist()]
        raise AssertionError(
            f"{name}: {int((got != want).sum())} of {got.numel()} differ; first at {at}: "
            f"{labels[0]} {[got[tuple(i)].item() for i in bad]} vs "
            f"{labels[1]} {[want[tuple(i)].item() for i in bad]}"
        )
