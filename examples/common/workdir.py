"""A training run's directory, as the other jobs read it back.

``train_dlrm.py --workdir DIR`` writes ``DIR/ckpt`` (the checkpoint),
``DIR/eval_sharded.pt`` (the run's flags, world size, device and held-out
evaluation: ``logits``, ``labels``, ``auc``, ...) and ``DIR/ssd`` (the SSD
tier). The reload, reshard and export jobs rebuild the model from the saved
flags and compare their predictions with the saved ones.

Example::

    run, saved = saved_run("demo_out")
    model = unsharded_dlrm(run, ssd_dir=None)
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import torch

CKPT, EVAL_FILE = "ckpt", "eval_sharded.pt"


def saved_run(workdir: str) -> tuple[argparse.Namespace, dict[str, Any]]:
    """The training run's flags and its sharded evaluation."""
    path = os.path.join(workdir, EVAL_FILE)
    if not os.path.exists(path):
        raise SystemExit(f"{workdir}: no {EVAL_FILE}; run examples/train_dlrm.py first")
    saved = torch.load(path, weights_only=False)
    return argparse.Namespace(**saved["args"]), saved


def shown(path: str) -> str:
    """``path`` relative to the current directory when it lies below it."""
    relative = os.path.relpath(path)
    return path if relative.startswith("..") else relative


def directory_bytes(path: str) -> int:
    """Bytes of the files under ``path``."""
    return sum(
        os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files
    )
