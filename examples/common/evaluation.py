"""Held-out evaluation: predictions sharded or not, AUC and log loss, and the check
that another model (reloaded, resharded, exported) predicts what the trained one did.

A DLRM here is TorchRec's ``DLRMTrain``: ``model(batch)`` returns
``(loss, (loss, logits, labels))``. The training run saves its held-out
evaluation (``logits``, ``labels``, ``device``, ...; :mod:`common.workdir`);
predictions of another model match it within :func:`tolerance`.

Example::

    logits, labels = sharded_predictions(model, data.held_out(rank, world), device)
    print(format_eval(evaluation(logits, labels)))
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torchrec.datasets.utils import Batch


def auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """ROC AUC by the rank-sum statistic (ties get their average rank)."""
    scores = scores.double().reshape(-1)
    labels = labels.reshape(-1) > 0.5
    pos = int(labels.sum())
    neg = labels.numel() - pos
    if pos == 0 or neg == 0:
        return float("nan")
    uniq, inverse, counts = torch.unique(scores, return_inverse=True, return_counts=True)
    ends = counts.cumsum(0).double()
    average_rank = ends - (counts.double() - 1) / 2
    ranks = average_rank[inverse]
    return float((ranks[labels].sum() - pos * (pos + 1) / 2) / (pos * neg))


def evaluation(logits: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    """AUC, log loss and the number of samples."""
    loss = nn.functional.binary_cross_entropy_with_logits(logits.double(), labels.double())
    return {"auc": auc(logits, labels), "logloss": float(loss), "samples": labels.numel()}


def format_eval(result: dict[str, Any]) -> str:
    return (
        f"AUC {result['auc']:.4f}  logloss {result['logloss']:.4f}  ({result['samples']} samples)"
    )


def sharded_predictions(
    model: nn.Module, batches: list[Batch], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits and labels of a sharded model over this rank's ``batches``, every
    rank's gathered in rank order batch by batch (a collective); eval mode."""
    world = dist.get_world_size()
    model.eval()
    logits, labels = [], []
    with torch.no_grad():
        for batch in batches:
            _, (_, local_logits, local_labels) = model(batch.to(device))
            for mine, out in ((local_logits, logits), (local_labels, labels)):
                parts = [torch.empty_like(mine) for _ in range(world)]
                dist.all_gather(parts, mine.contiguous())
                out.append(torch.cat(parts).cpu())
    return torch.cat(logits), torch.cat(labels)


def predictions(model: nn.Module, batches: list[Batch]) -> torch.Tensor:
    """Logits of an unsharded model over ``batches``, in order."""
    with torch.no_grad():
        return torch.cat([model(batch)[1][1] for batch in batches])


def tolerance(saved: dict[str, Any]) -> float:
    """Largest prediction difference from the training run's that passes: float32
    sums in another order (1e-5), looser when it trained on CUDA (1e-3)."""
    return 1e-3 if saved.get("device") == "cuda" else 1e-5


def prediction_diff(logits: torch.Tensor, saved: dict[str, Any]) -> float:
    """Largest absolute difference of the predicted probabilities from the training run's."""
    return float((torch.sigmoid(logits) - torch.sigmoid(saved["logits"])).abs().max())


def check_predictions(logits: torch.Tensor, saved: dict[str, Any]) -> tuple[bool, str]:
    """Whether ``logits`` match the training run's held-out predictions, and a line
    that says so."""
    diff, tol = prediction_diff(logits, saved), tolerance(saved)
    ok = diff <= tol
    return ok, (
        f"held-out predictions {'MATCH' if ok else 'MISMATCH'} the training run's "
        f"(max abs diff {diff:.2e}, tolerance {tol:g}, {logits.numel()} samples)"
    )
