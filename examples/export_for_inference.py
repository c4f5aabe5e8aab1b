"""Export a checkpoint of ``examples/train_dlrm.py`` for inference, in one process.

What it does
------------
1. Reads the run's flags from ``WORKDIR/eval_sharded.pt`` and builds the
   unsharded DLRM of ``train_dlrm.py`` (imported, not copied): KV tables in a
   ``KVEmbeddingBagCollection``, the others in a stock ``EmbeddingBagCollection``.
2. ``checkpoint.load``s ``--ckpt`` (any world size or KV sharding, e.g. the output
   of ``examples/reshard_checkpoint.py``) and makes the model read-only: eval
   mode (a KV table neither inserts nor evicts; ids without a row pool as
   zeros) and no gradients.
3. Checks the held-out predictions against those of the sharded training run.
4. With ``--dense-rows N``: exports every KV table's rows of ids ``0 .. N-1`` as
   a dense ``[N, dim]`` weight (``torchrec_kvemb.checkpoint.migrate.export_dense``,
   missing ids as zeros, as the eval-mode KV table pools them).
5. Writes a ``torch.save`` bundle (no TorchScript) to ``--out``: the run's
   flags, the table configs, the KV table names, the model's ``state_dict``
   (plain tensors; KV tables as ``weight`` / ``weight_id`` / ... rows) and the
   dense exports. ``torch.load(path, weights_only=False)`` reads it back.
6. Prints the predictions of ``--batches`` synthetic batches.

How to run
----------
::

    python examples/train_dlrm.py --workdir demo_out
    python examples/export_for_inference.py --workdir demo_out --dense-rows 1000
    python examples/export_for_inference.py --workdir demo_out \\
        --ckpt demo_out/ckpt_resharded --out demo_out/inference.pt

Flags
-----
--workdir DIR      the training run's directory (eval_sharded.pt, ckpt/); default demo_out
--ckpt PATH        the checkpoint (default WORKDIR/ckpt)
--out PATH         the bundle (default WORKDIR/inference.pt)
--dense-rows N     export KV tables as dense [N, dim] weights (default 0: no export)
--batches B        synthetic batches to predict (default 3)
--batch-size S     samples per synthetic batch (default 8)
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_dlrm as td  # noqa: E402
from criteo_tsv import to_batch  # noqa: E402

from torchrec_kvemb.checkpoint.migrate import export_dense  # noqa: E402

#: Bundle format tag.
BUNDLE_FORMAT = "torchrec_kvemb.examples.inference_bundle/1"


def build_model(run: argparse.Namespace, workdir: str) -> tuple[torch.nn.Module, list[str]]:
    """The unsharded DLRM of the run, and its KV table names."""
    ssd_dir = os.path.join(workdir, "ssd_export") if run.ssd else None
    options = td.kv_options(run, ssd_dir, headroom=td.RELOAD_HEADROOM)
    device = torch.device("cpu")
    ebc = td.MixedEmbeddingBagCollection(
        td.table_configs(run), options, td.fused_params(run), device
    )
    return td.build_dlrm(ebc, run, device), sorted(options)


def check_held_out(model: torch.nn.Module, run: argparse.Namespace, saved: dict) -> bool:
    data = td.Data(run, td.table_sizes(run))
    batches = data.held_out_global(saved["world_size"])
    with torch.no_grad():
        logits = torch.cat([model(b)[1][1] for b in batches])
    diff = float((torch.sigmoid(logits) - torch.sigmoid(saved["logits"])).abs().max())
    tol = 1e-3 if saved.get("device") == "cuda" else 1e-5
    ok = diff <= tol
    print(
        f"held-out predictions {'MATCH' if ok else 'MISMATCH'} the training run's "
        f"(max abs diff {diff:.2e}, tolerance {tol:g}, {logits.numel()} samples)",
        flush=True,
    )
    return ok


def export(args: argparse.Namespace) -> None:
    torch.set_num_threads(os.cpu_count() or 1)
    workdir = os.path.abspath(args.workdir)
    ckpt = os.path.abspath(args.ckpt or os.path.join(workdir, td.CKPT))
    out = os.path.abspath(args.out or os.path.join(workdir, "inference.pt"))
    path = os.path.join(workdir, td.EVAL_FILE)
    if not os.path.exists(path):
        raise SystemExit(f"{workdir}: no {td.EVAL_FILE}; run examples/train_dlrm.py first")
    saved = torch.load(path, weights_only=False)
    run = argparse.Namespace(**saved["args"])

    started = time.perf_counter()
    model, kv_tables = build_model(run, workdir)
    td.kv_checkpoint.load(model, ckpt)
    model.eval()
    model.requires_grad_(False)
    print(
        f"loaded {td.shown(ckpt)} (saved by {td.kv_checkpoint.read_marker(ckpt)['world_size']} "
        f"ranks) into a read-only unsharded DLRM in {time.perf_counter() - started:.1f} s",
        flush=True,
    )
    for name, metrics in model.model.sparse_arch.embedding_bag_collection.kv.metrics().items():
        rows = int(metrics.get("size", 0) + metrics.get("ssd_size", 0))
        print(f"KV table {name}: {rows} rows", flush=True)
    ok = check_held_out(model, run, saved)

    dense: dict[str, torch.Tensor] = {}
    if args.dense_rows:
        for name in kv_tables:
            weight = export_dense(model, name, args.dense_rows, missing_as_zeros=True)
            dense[name] = weight
            held = int((weight != 0).any(dim=1).sum())
            print(
                f"dense export {name}: {list(weight.shape)} ({held} of the ids below "
                f"{args.dense_rows} have a row)",
                flush=True,
            )

    bundle = {
        "format": BUNDLE_FORMAT,
        "run_args": vars(run),
        "checkpoint": ckpt,
        "table_configs": [
            {
                "name": c.name,
                "embedding_dim": c.embedding_dim,
                "num_embeddings": c.num_embeddings,
                "feature_names": list(c.feature_names),
            }
            for c in td.table_configs(run)
        ],
        "kv_tables": kv_tables,
        "state_dict": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "dense_kv_weights": dense,
    }
    os.makedirs(os.path.dirname(out), exist_ok=True)
    torch.save(bundle, out)
    print(
        f"inference bundle saved: {td.shown(out)} ({os.path.getsize(out) / 2**20:.1f} MiB, "
        f"{len(bundle['state_dict'])} state_dict entries, {len(dense)} dense KV exports)",
        flush=True,
    )

    stream = td.SyntheticCriteo(run.id_space, run.zipf, run.drift, run.seed + 1)
    sizes = td.table_sizes(run)
    with torch.no_grad():
        for j in range(args.batches):
            batch = to_batch(stream.batch(j, 0, args.batch_size, td.EVAL_STREAM), sizes)
            probs = torch.sigmoid(model(batch)[1][1])
            shown = " ".join(f"{p:.3f}" for p in probs.tolist())
            print(f"batch {j}: predictions {shown}", flush=True)
    if not ok:
        raise SystemExit(1)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Export a train_dlrm.py checkpoint for inference (see the docstring).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--workdir", default="demo_out", help="the training run's directory")
    p.add_argument("--ckpt", default=None, help="checkpoint (default WORKDIR/ckpt)")
    p.add_argument("--out", default=None, help="bundle (default WORKDIR/inference.pt)")
    p.add_argument("--dense-rows", type=int, default=0, help="dense [N, dim] export of KV")
    p.add_argument("--batches", type=int, default=3, help="synthetic batches to predict")
    p.add_argument("--batch-size", type=int, default=8, help="samples per synthetic batch")
    args = p.parse_args(argv)
    for name in ("dense_rows", "batches", "batch_size"):
        if getattr(args, name) < (0 if name == "dense_rows" else 1):
            p.error(f"--{name.replace('_', '-')} is out of range")
    return args


def main() -> None:
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    export(parse_args())


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
