"""Export a checkpoint of ``examples/train_dlrm.py`` for inference, in one process.

What it does
------------
1. Reads the run's flags from ``WORKDIR/eval_sharded.pt`` and builds the
   unsharded DLRM of ``train_dlrm.py`` (``examples/common/model.py``): KV tables
   in a ``KVEmbeddingBagCollection``, the others in a stock ``EmbeddingBagCollection``.
2. ``checkpoint.load``s ``--ckpt`` (any world size or KV sharding, e.g. the output
   of ``examples/reshard_checkpoint.py``) and makes the model read-only: eval
   mode (a KV table neither inserts nor evicts; ids without a row pool as
   zeros) and no gradients.
3. Checks the held-out predictions against those of the sharded training run,
   and that the read-only DLRM traced by ``torchrec.fx.symbolic_trace`` (TorchRec's
   inference flow; the graph shares the KV tables) predicts the same.
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
import os
import time

import torch
import torchrec.fx

from common.criteo import to_batch
from common.data import Data
from common.evaluation import check_predictions, predictions
from common.launch import quiet_logs
from common.model import kv_table_names, table_configs, table_sizes, unsharded_dlrm
from common.synthetic import EVAL_STREAM, SyntheticCriteo
from common.workdir import CKPT, saved_run, shown
from torchrec_kvemb import checkpoint as kv_checkpoint
from torchrec_kvemb.checkpoint.migrate import export_dense

#: Bundle format tag.
BUNDLE_FORMAT = "torchrec_kvemb.examples.inference_bundle/1"


def export(args: argparse.Namespace) -> None:
    torch.set_num_threads(os.cpu_count() or 1)
    workdir = os.path.abspath(args.workdir)
    ckpt = os.path.abspath(args.ckpt or os.path.join(workdir, CKPT))
    out = os.path.abspath(args.out or os.path.join(workdir, "inference.pt"))
    run, saved = saved_run(workdir)

    started = time.perf_counter()
    model = unsharded_dlrm(run, os.path.join(workdir, "ssd_export") if run.ssd else None)
    kv_tables = kv_table_names(run)
    kv_checkpoint.load(model, ckpt)
    model.eval()
    model.requires_grad_(False)
    print(
        f"loaded {shown(ckpt)} (saved by {kv_checkpoint.read_marker(ckpt)['world_size']} "
        f"ranks) into a read-only unsharded DLRM in {time.perf_counter() - started:.1f} s",
        flush=True,
    )
    for name, metrics in model.model.sparse_arch.embedding_bag_collection.kv.metrics().items():
        rows = int(metrics.get("size", 0) + metrics.get("ssd_size", 0))
        print(f"KV table {name}: {rows} rows", flush=True)
    batches = Data(run, table_sizes(run)).held_out_global(saved["world_size"])
    logits = predictions(model, batches)
    ok, line = check_predictions(logits, saved)
    print(line, flush=True)
    traced = torchrec.fx.symbolic_trace(model.model)
    with torch.no_grad():
        traced_logits = torch.cat(
            [traced(b.dense_features, b.sparse_features).squeeze(-1) for b in batches]
        )
    same = torch.equal(traced_logits, logits)
    ok = ok and same
    print(
        f"traced DLRM (torchrec.fx.symbolic_trace): held-out predictions "
        f"{'EQUAL' if same else 'DIFFER FROM'} the eager model's",
        flush=True,
    )

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
            for c in table_configs(run)
        ],
        "kv_tables": kv_tables,
        "state_dict": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "dense_kv_weights": dense,
    }
    os.makedirs(os.path.dirname(out), exist_ok=True)
    torch.save(bundle, out)
    print(
        f"inference bundle saved: {shown(out)} ({os.path.getsize(out) / 2**20:.1f} MiB, "
        f"{len(bundle['state_dict'])} state_dict entries, {len(dense)} dense KV exports)",
        flush=True,
    )

    stream = SyntheticCriteo(run.id_space, run.zipf, run.drift, run.seed + 1)
    sizes = table_sizes(run)
    with torch.no_grad():
        for j in range(args.batches):
            batch = to_batch(stream.batch(j, 0, args.batch_size, EVAL_STREAM), sizes)
            probs = torch.sigmoid(model(batch)[1][1])
            text = " ".join(f"{p:.3f}" for p in probs.tolist())
            print(f"batch {j}: predictions {text}", flush=True)
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
    quiet_logs()
    export(parse_args())


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
