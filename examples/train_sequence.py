"""Train a sequence model with KV sequence embeddings, then reload it at world size 1.

What it does
------------
1. **Data.** Built-in synthetic sessions: each sample is a user's history of
   ``--history`` item ids (up to that many; lengths vary) and one candidate
   item. Items live in a ``--id-space`` of raw ids (2**40 by default): each
   belongs to one of ``--clusters`` tastes, and within a taste their
   popularity follows a Zipf law. A user's history is drawn from their taste;
   the candidate is from the same taste (label 1) or another one (label 0), so
   the label is learnable from the items' embeddings alone.
2. **Model.** TorchRec's ``EmbeddingCollection`` (sequence embeddings: one row
   per id, unpooled) with one table ``item`` read by two features, ``history``
   and ``candidate``, built on the meta device. ``KVEmbeddingCollectionSharder``
   makes it a KV table (raw ids, no modulo, LRU eviction; ``--weights-dtype``
   float16 / bfloat16 stores its rows in half precision). The user vector is
   the mean of the history's rows through a linear layer; the logit is its dot
   product with the candidate's row.
3. **Training.** ``DistributedModelParallel`` with the stock planner (gloo on
   CPU, nccl on CUDA): fused row-wise Adagrad for the table, torch Adagrad for
   the dense part. Rank 0 shows a progress bar with the loss and the KV
   table's metrics summed over ranks.
4. **Held-out evaluation** of ``--eval-batches`` batches per rank: AUC and log
   loss; then ``torchrec_kvemb.checkpoint.save``.
5. **Reload at world size 1.** Rank 0 alone builds the unsharded model (a
   ``KVEmbeddingCollection``), loads the checkpoint, evaluates the same batches
   and prints ``MATCH`` (exit 0) or ``MISMATCH`` (exit 1).

How to run
----------
::

    make demo-seq                                           # the default run, about a minute
    python examples/train_sequence.py --weights-dtype float16 --steps 1000
    torchrun --standalone --nproc_per_node 2 examples/train_sequence.py --workdir demo_seq_out
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
import warnings

import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torch import nn
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.modules.embedding_configs import EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common.evaluation import evaluation, format_eval  # noqa: E402
from common.kv_metrics import describe_kv, reduce_metrics  # noqa: E402
from common.launch import quiet_logs, relaunched_under_torchrun, say, setup_process_group  # noqa: E402
from common.model import RELOAD_HEADROOM  # noqa: E402
from common.synthetic import mix64, zipf_ranks  # noqa: E402
from torchrec_kvemb import (  # noqa: E402
    KVEmbeddingCollection,
    KVEmbeddingCollectionSharder,
    KVTableOptions,
    checkpoint,
)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
CKPT = "ckpt"
EVAL_FILE = "eval_sharded.pt"
TOLERANCE = 1e-5


# --------------------------------------------------------------------- data
class Sessions:
    """Synthetic sessions: batch ``(rank, index)`` is the same on every run and rank.

    Example::

        kjt, labels = Sessions(args).batch(rank=0, index=3)
    """

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args

    def items(self, taste: torch.Tensor, rank: torch.Tensor) -> torch.Tensor:
        """Raw item ids of a taste's ``rank``-th most popular items."""
        key = taste * 1_000_003 + rank + self.args.seed * 7_919
        return mix64(key).abs() % self.args.id_space

    def batch(self, rank: int, index: int) -> tuple[KeyedJaggedTensor, torch.Tensor]:
        a = self.args
        g = torch.Generator().manual_seed(((a.seed * 1009 + rank) << 32) + index)
        b = a.batch_size
        taste = torch.randint(0, a.clusters, (b,), generator=g)
        lengths = torch.randint(1, a.history + 1, (b,), generator=g)
        n = int(lengths.sum())
        history = self.items(
            taste.repeat_interleave(lengths), zipf_ranks(a.items_per_cluster, a.zipf, n, g)
        )
        labels = torch.randint(0, 2, (b,), generator=g).float()
        other = (taste + torch.randint(1, a.clusters, (b,), generator=g)) % a.clusters
        candidate = self.items(
            torch.where(labels > 0, taste, other), zipf_ranks(a.items_per_cluster, a.zipf, b, g)
        )
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=["history", "candidate"],
            values=torch.cat([history, candidate]),
            lengths=torch.cat([lengths, torch.ones(b, dtype=torch.int64)]),
        )
        return kjt, labels


# -------------------------------------------------------------------- model
class SequenceModel(nn.Module):
    """Mean of the history's rows -> linear -> dot with the candidate's row."""

    def __init__(self, ec: nn.Module, dim: int, device: torch.device | None = None) -> None:
        super().__init__()
        self.ec = ec
        self.user = nn.Linear(dim, dim, device=device)
        self.bias = nn.Parameter(torch.zeros(1, device=device))

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        rows = self.ec(kjt)
        history, candidate = rows["history"], rows["candidate"]
        lengths = history.lengths()
        bag = torch.repeat_interleave(torch.arange(lengths.numel(), device=lengths.device), lengths)
        pooled = torch.zeros(lengths.numel(), history.values().shape[1], device=lengths.device)
        pooled = pooled.index_add(0, bag, history.values()) / lengths.clamp(min=1).unsqueeze(1)
        return (self.user(pooled) * candidate.values()).sum(1) + self.bias


def table_config(args: argparse.Namespace) -> list[EmbeddingConfig]:
    return [
        EmbeddingConfig(
            name="item",
            embedding_dim=args.embedding_dim,
            num_embeddings=args.id_space,
            feature_names=["history", "candidate"],
            # TorchRec's default, +/-sqrt(1 / num_embeddings), is ~1e-6 over 2**40 ids.
            weight_init_min=-0.01,
            weight_init_max=0.01,
        )
    ]


def kv_options(args: argparse.Namespace, headroom: int = 1) -> KVTableOptions:
    """The item table's options; ``headroom`` multiplies the capacity (the reload's
    one table holds what the shards held, in buckets that fill differently)."""
    return KVTableOptions(
        capacity=args.kv_capacity * headroom,
        seed=args.seed,
        weights_dtype=DTYPES[args.weights_dtype],
    )


def fused_params(args: argparse.Namespace) -> dict:
    return {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": args.lr}


def unsharded_model(args: argparse.Namespace) -> SequenceModel:
    ec = KVEmbeddingCollection(
        table_config(args), kv_options(args, RELOAD_HEADROOM), fused_params=fused_params(args)
    )
    return SequenceModel(ec, args.embedding_dim)


# -------------------------------------------------------------------- train
def train(args: argparse.Namespace) -> None:
    rank, world, device = setup_process_group()
    workdir = os.path.abspath(args.workdir)
    os.makedirs(workdir, exist_ok=True)
    torch.manual_seed(args.seed)
    ec = EmbeddingCollection(table_config(args), device=torch.device("meta"))
    sharder = KVEmbeddingCollectionSharder({"item": kv_options(args)}, fused_params(args))
    model = DistributedModelParallel(
        SequenceModel(ec, args.embedding_dim, device), device=device, sharders=[sharder]
    )
    plan = model.plan.plan["ec"]["item"]
    say(rank, f"item table: {plan.sharding_type} / {plan.compute_kernel} on ranks {plan.ranks}, "
              f"{args.weights_dtype} rows")  # fmt: skip
    dense = [p for n, p in model.named_parameters() if "ec." not in n]
    optimizer = torch.optim.Adagrad(dense, lr=args.lr)
    sessions = Sessions(args)
    bar = tqdm(total=args.steps, unit="step", disable=rank != 0, dynamic_ncols=True)
    loss_sum, loss_count, recent = 0.0, 0, float("nan")
    started = time.perf_counter()
    for step in range(args.steps):
        kjt, labels = sessions.batch(rank, step)
        loss = nn.functional.binary_cross_entropy_with_logits(
            model(kjt.to(device)), labels.to(device)
        )
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        loss_sum, loss_count = loss_sum + float(loss), loss_count + 1
        bar.update(1)
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            counters, recent = reduce_metrics(model, loss_sum, loss_count, device)
            bar.set_postfix_str(f"loss={recent:.4f} {describe_kv(counters)}")
            loss_sum, loss_count = 0.0, 0
    bar.close()
    elapsed = time.perf_counter() - started
    say(
        rank,
        f"trained {args.steps} steps x {world} ranks x {args.batch_size} sessions "
        f"in {elapsed:.1f} s; train loss (last {args.log_every} steps) {recent:.4f}",
    )

    logits, labels = held_out(model, sessions, rank, world, device)
    result = {"logits": logits, "labels": labels, **evaluation(logits, labels)}
    if rank == 0:
        say(rank, f"held-out eval, sharded ({world} ranks):   {format_eval(result)}")
        torch.save({"world_size": world, "args": vars(args), **result},
                   os.path.join(workdir, EVAL_FILE))  # fmt: skip
    path = os.path.join(workdir, CKPT)
    checkpoint.save(model, path, optimizer=optimizer)
    say(rank, f"checkpoint saved: {path}")
    dist.barrier()
    del model, optimizer
    gc.collect()
    dist.destroy_process_group()
    if rank == 0:
        reload(args)


def held_out(model, sessions: Sessions, rank: int, world: int, device: torch.device):
    """Logits and labels of every rank's held-out batches, in rank order (a collective)."""
    model.eval()
    first = sessions.args.steps
    logits, labels = [], []
    with torch.no_grad():
        for i in range(sessions.args.eval_batches):
            kjt, y = sessions.batch(rank, first + i)
            out = model(kjt.to(device)).cpu()
            parts = [torch.empty_like(out) for _ in range(world)]
            dist.all_gather(parts, out) if device.type == "cpu" else _gather_cuda(parts, out)
            logits += [(r, i, p) for r, p in enumerate(parts)]
            labels += [(r, i, sessions.batch(r, first + i)[1]) for r in range(world)]
    order = sorted(range(len(logits)), key=lambda k: logits[k][:2])
    return (torch.cat([logits[k][2] for k in order]), torch.cat([labels[k][2] for k in order]))


def _gather_cuda(parts: list[torch.Tensor], out: torch.Tensor) -> None:
    gathered = [p.cuda() for p in parts]
    dist.all_gather(gathered, out.cuda())
    for p, g in zip(parts, gathered, strict=True):
        p.copy_(g.cpu())


# ------------------------------------------------------------------- reload
def reload(args: argparse.Namespace) -> None:
    workdir = os.path.abspath(args.workdir)
    saved = torch.load(os.path.join(workdir, EVAL_FILE))
    world = saved["world_size"]
    print(f"--- reload at world size 1 (the sharded run had {world} ranks) ---", flush=True)
    model = unsharded_model(args)
    checkpoint.load(model, os.path.join(workdir, CKPT))
    model.eval()
    sessions = Sessions(args)
    logits = []
    with torch.no_grad():
        for r in range(world):  # rank-major, as held_out() gathers them
            for i in range(args.eval_batches):
                logits.append(model(sessions.batch(r, args.steps + i)[0]))
    logits = torch.cat(logits)
    result = evaluation(logits, saved["labels"])
    diff = float((logits - saved["logits"]).abs().max())
    print(f"held-out eval, sharded ({world} ranks):   {format_eval(saved)}")
    print(f"held-out eval, reloaded (world size 1): {format_eval(result)}")
    if diff <= TOLERANCE:
        print(f"MATCH: the reloaded model's evaluation matches the sharded model's "
              f"(max abs prediction diff {diff:.2e} <= {TOLERANCE:g} over {logits.numel()} "
              f"samples)", flush=True)  # fmt: skip
        return
    print(f"MISMATCH: max abs prediction diff {diff:.2e} > {TOLERANCE:g}", flush=True)
    raise SystemExit(1)


# ---------------------------------------------------------------------- CLI
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Train a sequence model with KV sequence embeddings (see the docstring).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--steps", type=int, default=800, help="training steps")
    p.add_argument("--batch-size", type=int, default=256, help="sessions per rank and step")
    p.add_argument("--history", type=int, default=20, help="longest history")
    p.add_argument("--clusters", type=int, default=64, help="tastes")
    p.add_argument("--items-per-cluster", type=int, default=5000, help="items of one taste")
    p.add_argument("--zipf", type=float, default=1.05, help="Zipf exponent within a taste")
    p.add_argument("--id-space", type=int, default=2**40, help="raw item ids lie in [0, N)")
    p.add_argument("--kv-capacity", type=int, default=65536, help="rows of the KV table")
    p.add_argument("--weights-dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--embedding-dim", type=int, default=32, help="embedding dimension")
    p.add_argument("--lr", type=float, default=0.05, help="learning rate")
    p.add_argument("--eval-batches", type=int, default=4, help="held-out batches per rank")
    p.add_argument("--log-every", type=int, default=10, help="steps between metric updates")
    p.add_argument("--world-size", type=int, default=2, help="processes without torchrun")
    p.add_argument("--workdir", default="demo_seq_out", help="output directory")
    p.add_argument("--seed", type=int, default=0, help="seed of data and model")
    args = p.parse_args(argv)
    for name in ("steps", "batch_size", "history", "eval_batches", "kv_capacity", "log_every"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.clusters < 2:
        p.error("--clusters must be >= 2 (a negative candidate comes from another taste)")
    if args.id_space * args.embedding_dim * 4 >= 2**63:
        p.error("--id-space x --embedding-dim x 4 must stay below 2**63 (the meta table's bytes)")
    return args


def main() -> None:
    quiet_logs()
    warnings.filterwarnings("always", module="torchrec_kvemb")
    args = parse_args()
    if relaunched_under_torchrun(__file__, args.world_size):
        return
    train(args)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
