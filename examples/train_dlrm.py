"""Train TorchRec's DLRM with KV (zero-collision) embedding tables, then reload it at world size 1.

What it does
------------
1. **Data.** A built-in synthetic stream shaped like Criteo: 13 dense count
   features, 26 categorical features whose vocabulary sizes follow the Criteo
   1TB cardinalities (those of TorchRec's DLRM example), ids drawn from a Zipf
   law and hashed into an ``--id-space`` of raw ids (2**40 by default). On the
   six features with more than a million values new ids keep arriving:
   ``--drift`` new ids per step enter at the head of the popularity ranking and
   age towards the tail. Labels have a learnable signal: the probability is a
   sigmoid of a fixed random linear function of the dense features plus a
   hidden per-id effect of four categorical features. ``--data`` reads Criteo
   TSV files instead (``examples/common/criteo.py``).
2. **Model.** ``torchrec.models.dlrm.DLRM`` over one ``EmbeddingBagCollection``
   built on the meta device (docs/sharding.md). The ``--num-kv-tables``
   features with the largest vocabularies get KV tables through
   ``KVEmbeddingBagCollectionSharder``: raw ids, no modulo, LRU or LFU
   eviction, one table with admission after 2 sightings and, with ``--ssd``,
   one table with an SSD tier under ``WORKDIR/ssd``. The other features get
   stock tables of at most ``--stock-rows`` rows (raw id modulo the table size,
   as TorchRec's Criteo pipeline does).
3. **Training.** ``DistributedModelParallel`` with the stock planner and
   ``TrainPipelineSparseDist`` (gloo on CPU, nccl on CUDA), as TorchRec's DLRM
   example does: fused row-wise Adagrad for every embedding table, torch
   Adagrad for the dense parameters (``in_backward_optimizer_filter``). Rank 0
   shows a progress bar with steps/s, the training loss and the KV tables'
   metrics summed over ranks (stored rows, load factor, hit rate, evictions,
   admission rejects, SSD rows / reads / writes).
4. **Held-out evaluation** of ``--eval-batches`` fixed batches per rank (drawn
   after the last training step, never trained on; with ``--data`` the first
   blocks of the file, skipped by training): AUC, log loss and every
   prediction, written to ``WORKDIR/eval_sharded.pt``.
5. **Checkpoint.** ``torchrec_kvemb.checkpoint.save(model, WORKDIR/ckpt,
   optimizer=dense_optimizer)``, collective.
6. **Reload at world size 1.** After the process group is destroyed, rank 0
   builds the unsharded model (a ``KVEmbeddingBagCollection`` for the KV tables
   and a stock ``EmbeddingBagCollection`` for the others, same configs, under
   one collection), ``checkpoint.load``s it, evaluates the same batches and
   prints both evaluations and the largest prediction difference. Exit status
   1 if they differ by more than 1e-5 (1e-3 when trained on CUDA).

This file is the job (its phases and flags); the data, the model, the metrics
and the torchrun relaunch live in ``examples/common/``, shared with
``reshard_checkpoint.py`` and ``export_for_inference.py``.

How to run
----------
::

    make demo                                                  # the default run, under a minute
    torchrun --standalone --nproc_per_node 2 examples/train_dlrm.py --workdir demo_out
    python examples/train_dlrm.py --world-size 4 --steps 2000  # starts torchrun itself
    torchrun --nproc_per_node 8 examples/train_dlrm.py --batch-size 8192 --steps 20000 \\
        --num-kv-tables 8 --kv-capacity 20000000 --id-space 2**62 --workdir /mnt/ssd/dlrm
    torchrun --nproc_per_node 2 examples/train_dlrm.py --data day_0.gz day_1.gz
    python examples/train_dlrm.py --reload-only --workdir demo_out   # only phase 6

Flags
-----
--steps N            training steps (default 600); with --data, at most N
--batch-size B       samples per rank and step (default 512)
--num-kv-tables K    KV tables: the K features with the largest vocabularies (0-26, default 4)
--world-size W       processes to start when run without torchrun (default 2); under
                     torchrun the launcher's world size counts and a different W is reported
--id-space N         raw ids of the synthetic stream lie in [0, N); also the KV tables'
                     num_embeddings (default 2**40; accepts 2**k, 1<<k or a number)
--zipf A             Zipf exponent of the id popularity (default 1.05)
--drift D            new ids per step entering at the head of each large feature (default 2)
--workdir DIR        output directory: ssd/, ckpt/, eval_sharded.pt (default demo_out)
--seed S             seed of the stream, the label function and the model (default 0)
--ssd / --no-ssd     put the largest KV table on an SSD tier under WORKDIR/ssd (default: on
                     when torchrec_kvemb.ssd is available)
--eval-batches E     held-out batches per rank (default 4)
--data PATH ...      train on Criteo TSV files (plain or .gz) instead of the synthetic stream
--kv-capacity R      in-memory rows of each KV table, over all ranks (default 32768; the
                     SSD table keeps half of it in memory, the rest goes to disk)
--stock-rows R       rows of a stock table at most (default 100000)
--embedding-dim D    embedding dimension of every table (default 16)
--lr LR              learning rate of the embeddings and the dense part (default 0.05)
--log-every N        steps between metric updates of the progress bar (default 10)
--reload-only        run only the world-size-1 reload of WORKDIR (phase 6), no training
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import time
import warnings

import torch
import torch.distributed as dist
from torchrec.datasets.criteo import CAT_FEATURE_COUNT
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
from tqdm import tqdm

from common.data import Data
from common.evaluation import (
    evaluation,
    format_eval,
    prediction_diff,
    predictions,
    sharded_predictions,
    tolerance,
)
from common.kv_metrics import describe_kv, reduce_metrics
from common.launch import quiet_logs, relaunched_under_torchrun, say, setup_process_group
from common.model import (
    dense_optimizer,
    dlrm_on_meta,
    fused_params,
    kv_options,
    plan_summary,
    table_sizes,
    unsharded_dlrm,
)
from common.workdir import CKPT, EVAL_FILE, directory_bytes, saved_run, shown
from torchrec_kvemb import KVEmbeddingBagCollectionSharder
from torchrec_kvemb import checkpoint as kv_checkpoint


# ------------------------------------------------------------------- phases
def train(args: argparse.Namespace) -> None:
    rank, world, device = setup_process_group()
    workdir = os.path.abspath(args.workdir)
    ssd_dir = os.path.join(workdir, "ssd") if args.ssd else None
    if rank == 0:
        os.makedirs(workdir, exist_ok=True)
        for name in ("ssd", "ssd_reload", EVAL_FILE):
            path = os.path.join(workdir, name)
            if os.path.isdir(path):
                shutil.rmtree(path)
            elif os.path.exists(path):
                os.remove(path)
    dist.barrier()
    if args.world_size is not None and args.world_size != world:
        say(rank, f"note: --world-size {args.world_size} given, torchrun started {world}")
    say(rank, f"train_dlrm: {world} ranks ({dist.get_backend()}), device {device.type}")

    # Model: every table on meta; the sharder makes the KV ones KV tables.
    options = kv_options(args, ssd_dir)
    model = dlrm_on_meta(args, device)
    sharder = KVEmbeddingBagCollectionSharder(options, fused_params=fused_params(args))
    started = time.perf_counter()
    model = DistributedModelParallel(model, device=device, sharders=[sharder])
    optimizer = dense_optimizer(model, args.lr)
    say(rank, plan_summary(model, options, time.perf_counter() - started))

    data = Data(args, table_sizes(args))
    pipeline = TrainPipelineSparseDist(model, optimizer, device)
    batches = data.train(rank, world)
    bar = tqdm(total=args.steps, unit="step", disable=rank != 0, dynamic_ncols=True)
    loss_sum, loss_count, previous = 0.0, 0, None
    recent_loss, recent_steps = float("nan"), 0
    steps = 0
    started = time.perf_counter()
    while steps < args.steps:
        try:
            loss = pipeline.progress(batches)[0]
        except StopIteration:
            break
        steps += 1
        loss_sum += float(loss)
        loss_count += 1
        bar.update(1)
        if steps % args.log_every == 0 or steps == args.steps:
            counters, recent_loss = reduce_metrics(model, loss_sum, loss_count, device)
            recent_steps = loss_count
            window = None if previous is None else {k: counters[k] - previous[k] for k in counters}
            bar.set_postfix_str(f"loss={recent_loss:.4f} {describe_kv(counters, window)}")
            previous, loss_sum, loss_count = counters, 0.0, 0
    bar.close()
    elapsed = time.perf_counter() - started
    counters, _ = reduce_metrics(model, 0.0, 0, device)
    say(
        rank,
        f"trained {steps} steps x {world} ranks x {args.batch_size} samples in {elapsed:.1f} s "
        f"({steps / elapsed:.2f} steps/s, {steps * world * args.batch_size / elapsed:,.0f} "
        f"samples/s); train loss (last {recent_steps} steps) {recent_loss:.4f}",
    )
    say(rank, f"KV tables (summed over ranks): {describe_kv(counters)}")
    pipeline.detach()

    # Held-out evaluation, before the checkpoint.
    logits, labels = sharded_predictions(model, data.held_out(rank, world), device)
    result = {"logits": logits, "labels": labels, **evaluation(logits, labels)}
    if rank == 0:
        say(rank, f"held-out eval, sharded ({world} ranks):   {format_eval(result)}")
        torch.save(
            {"world_size": world, "args": vars(args), "device": device.type, **result},
            os.path.join(workdir, EVAL_FILE),
        )

    started = time.perf_counter()
    path = os.path.join(workdir, CKPT)
    kv_checkpoint.save(model, path, optimizer=optimizer)
    say(
        rank,
        f"checkpoint saved: {shown(path)} ({directory_bytes(path) / 2**20:.1f} MiB, "
        f"{time.perf_counter() - started:.1f} s)",
    )
    dist.barrier()
    del pipeline, model, optimizer
    gc.collect()
    dist.destroy_process_group()
    if rank == 0:
        reload(args)


def reload(args: argparse.Namespace) -> None:
    """World size 1: the unsharded model loads the checkpoint and evaluates the same
    held-out batches as the sharded model did."""
    workdir = os.path.abspath(args.workdir)
    run, saved = saved_run(workdir)
    world = saved["world_size"]
    print(f"--- reload at world size 1 (the sharded run had {world} ranks) ---", flush=True)
    if not os.path.isdir(os.path.join(workdir, CKPT)):
        raise SystemExit(f"{workdir}: no checkpoint {CKPT}; run the training first")
    torch.set_num_threads(os.cpu_count() or 1)
    started = time.perf_counter()
    model = unsharded_dlrm(run, os.path.join(workdir, "ssd_reload") if run.ssd else None)
    kv_checkpoint.load(model, os.path.join(workdir, CKPT))
    print(
        f"loaded {shown(os.path.join(workdir, CKPT))} into an unsharded DLRM "
        f"(KVEmbeddingBagCollection + EmbeddingBagCollection) in "
        f"{time.perf_counter() - started:.1f} s",
        flush=True,
    )
    model.eval()
    batches = Data(run, table_sizes(run)).held_out_global(world)
    logits_t = predictions(model, batches)
    labels_t = torch.cat([b.labels for b in batches])
    result = evaluation(logits_t, labels_t)
    same_labels = torch.equal(labels_t, saved["labels"].to(labels_t.dtype))
    diff, tol = prediction_diff(logits_t, saved), tolerance(saved)
    print(f"held-out eval, sharded ({world} ranks):   {format_eval(saved)}")
    print(f"held-out eval, reloaded (world size 1): {format_eval(result)}")
    if same_labels and diff <= tol:
        print(
            f"MATCH: the reloaded model's evaluation matches the sharded model's "
            f"(max abs prediction diff {diff:.2e} <= {tol:g} over {labels_t.numel()} samples)",
            flush=True,
        )
        return
    print(
        f"MISMATCH: max abs prediction diff {diff:.2e} > {tol:g}"
        + ("" if same_labels else " (and the held-out labels differ)"),
        flush=True,
    )
    raise SystemExit(1)


# ---------------------------------------------------------------------- CLI
def id_space(text: str) -> int:
    """``2**40``, ``1<<40`` or a number."""
    text = text.replace(" ", "")
    if "**" in text:
        base, exp = text.split("**")
        value = int(base) ** int(exp)
    elif "<<" in text:
        base, shift = text.split("<<")
        value = int(base) << int(shift)
    else:
        value = int(float(text)) if "e" in text.lower() else int(text)
    if not 2 <= value <= 2**63 - 1:
        raise argparse.ArgumentTypeError(f"id space must be in [2, 2**63 - 1], got {value}")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Train DLRM with KV embedding tables (see the module docstring).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--steps", type=int, default=600, help="training steps")
    p.add_argument("--batch-size", type=int, default=512, help="samples per rank and step")
    p.add_argument("--num-kv-tables", type=int, default=4, help="KV tables (largest features)")
    p.add_argument(
        "--world-size",
        type=int,
        default=None,
        help="processes to start without torchrun (2 if not given)",
    )
    p.add_argument("--id-space", type=id_space, default=2**40, help="raw ids lie in [0, N)")
    p.add_argument("--zipf", type=float, default=1.05, help="Zipf exponent of id popularity")
    p.add_argument("--drift", type=float, default=2.0, help="new head ids per step")
    p.add_argument("--workdir", default="demo_out", help="output directory")
    p.add_argument("--seed", type=int, default=0, help="seed of data, labels and model")
    p.add_argument(
        "--ssd",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="largest KV table on an SSD tier under WORKDIR/ssd",
    )
    p.add_argument("--eval-batches", type=int, default=4, help="held-out batches per rank")
    p.add_argument("--data", nargs="+", default=None, help="Criteo TSV files instead")
    p.add_argument("--kv-capacity", type=int, default=32768, help="rows per KV table")
    p.add_argument("--stock-rows", type=int, default=100_000, help="rows of a stock table")
    p.add_argument("--embedding-dim", type=int, default=16, help="embedding dimension")
    p.add_argument("--lr", type=float, default=0.05, help="learning rate")
    p.add_argument("--log-every", type=int, default=10, help="steps between metric updates")
    p.add_argument("--reload-only", action="store_true", help="only the world-size-1 reload")
    args = p.parse_args(argv)
    if not 0 <= args.num_kv_tables <= CAT_FEATURE_COUNT:
        p.error(f"--num-kv-tables must be in [0, {CAT_FEATURE_COUNT}]")
    if args.num_kv_tables == 0:
        p.error("--num-kv-tables 0 leaves no KV table; the sharder needs at least one")
    if args.id_space * args.embedding_dim >= 2**63:
        p.error("--id-space x --embedding-dim must stay below 2**63 (the meta EBC's size)")
    for name in ("steps", "batch_size", "eval_batches", "kv_capacity", "log_every"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def main() -> None:
    quiet_logs()
    warnings.filterwarnings("always", module="torchrec_kvemb")
    args = parse_args()
    if args.reload_only:
        reload(args)
        return
    if relaunched_under_torchrun(__file__, args.world_size or 2):
        return
    train(args)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
