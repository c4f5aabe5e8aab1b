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
   TSV files instead (``examples/criteo_tsv.py``).
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
import logging
import math
import os
import shutil
import sys
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.datasets.criteo import CAT_FEATURE_COUNT, DEFAULT_CAT_NAMES, INT_FEATURE_COUNT
from torchrec.datasets.utils import Batch
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
from torchrec.models.dlrm import DLRM, DLRMTrain
from torchrec.optim.optimizers import in_backward_optimizer_filter
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from criteo_tsv import RawBatch, read_criteo_tsv, to_batch  # noqa: E402

from torchrec_kvemb import (  # noqa: E402
    EvictionPolicy,
    KVEmbeddingBagCollection,
    KVEmbeddingBagCollectionSharder,
    KVTableOptions,
    SSDOptions,
)
from torchrec_kvemb import checkpoint as kv_checkpoint  # noqa: E402
from torchrec_kvemb.sharding import ShardedKVEmbeddingBagCollection  # noqa: E402

#: Vocabulary sizes of the 26 categorical features: Criteo 1TB's, as in TorchRec's
#: DLRM example (``--num_embeddings_per_feature``).
CARDINALITIES = [
    45833188, 36746, 17245, 7413, 20243, 3, 7114, 1441, 62, 29275261, 1572176, 345138, 10,
    2209, 11267, 128, 4, 974, 14, 48937457, 11316796, 40094537, 452104, 12606, 104, 35,
]  # fmt: skip
#: Features whose vocabulary keeps growing in the synthetic stream (over a million values).
DRIFTING = frozenset(f for f, n in enumerate(CARDINALITIES) if n > 1_000_000)
#: Features with a hidden per-id effect on the label: two large, two small.
SIGNAL = (19, 0, 7, 15)
EVAL_STREAM, TRAIN_STREAM = 1, 0
CKPT, EVAL_FILE = "ckpt", "eval_sharded.pt"
#: KV capacity of the world-size-1 model, in multiples of the trained one (see ``reload``).
RELOAD_HEADROOM = 4
DENSE_ARCH = [64]  # then the embedding dim
OVER_ARCH = [64, 32, 1]


# ---------------------------------------------------------------------- data
def _signed(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


_MIX1, _MIX2 = _signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB)


def mix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer on int64 (wrapping arithmetic, logical shifts)."""

    def shr(v: torch.Tensor, k: int) -> torch.Tensor:
        return (v >> k) & ((1 << (64 - k)) - 1)

    x = x ^ shr(x, 30)
    x = x * _MIX1
    x = x ^ shr(x, 27)
    x = x * _MIX2
    return x ^ shr(x, 31)


def zipf_ranks(n: int, alpha: float, size: int, g: torch.Generator) -> torch.Tensor:
    """``size`` ranks in ``[1, n]``, P(rank) ~ rank**-alpha (inverse CDF of the
    continuous power law, floored)."""
    u = torch.rand(size, generator=g, dtype=torch.float64)
    if abs(alpha - 1.0) < 1e-9:
        r = torch.exp(u * math.log(n + 1))
    else:
        a = 1.0 - alpha
        r = (1.0 + u * ((n + 1) ** a - 1.0)) ** (1.0 / a)
    return r.floor().to(torch.int64).clamp_(1, n)


class SyntheticCriteo:
    """The synthetic stream: ``batch(step, rank, size)`` is the same for a given seed
    on any machine and world size (rank ``r``'s samples are its own draw)."""

    def __init__(self, id_space: int, zipf: float, drift: float, seed: int) -> None:
        self.id_space = id_space
        self.zipf = zipf
        self.drift = drift
        self.seed = seed
        g = torch.Generator().manual_seed(seed)
        self.dense_weight = torch.randn(INT_FEATURE_COUNT, generator=g) / INT_FEATURE_COUNT**0.5
        self.dense_mean = torch.rand(INT_FEATURE_COUNT, generator=g) * 3.0
        self.bias = -1.0

    def _generator(self, stream: int, step: int, rank: int) -> torch.Generator:
        state = np.random.SeedSequence([self.seed, stream, step, rank]).generate_state(1)
        return torch.Generator().manual_seed(int(state[0]))

    def items(self, feature: int, ranks: torch.Tensor, step: int) -> torch.Tensor:
        """The item behind each popularity rank at ``step``: on drifting features the
        head moves on by ``drift`` new items per step."""
        if feature in DRIFTING:
            return ranks - int(self.drift * step)
        return ranks

    def raw_ids(self, feature: int, items: torch.Tensor) -> torch.Tensor:
        """Raw ids in ``[0, id_space)``: a hash of (feature, item)."""
        h = mix64(items * CAT_FEATURE_COUNT + feature + (self.seed << 48))
        return (h & (2**63 - 1)) % self.id_space

    def effect(self, feature: int, items: torch.Tensor) -> torch.Tensor:
        """The hidden per-item effect on the label logit, mean 0, std 1."""
        h = mix64(items * 7919 + feature * 104729 + self.seed * 15485863 + 1)
        u = ((h >> 11) & ((1 << 53) - 1)).to(torch.float64) / float(1 << 53)
        return ((u - 0.5) * 12**0.5).to(torch.float32)

    def batch(self, step: int, rank: int, size: int, stream: int = TRAIN_STREAM) -> RawBatch:
        g = self._generator(stream, step, rank)
        z = torch.randn(size, INT_FEATURE_COUNT, generator=g)
        dense = torch.exp(self.dense_mean + 1.2 * z).floor().to(torch.int64) - 1
        logit = self.bias + 0.9 * (z @ self.dense_weight)
        sparse = torch.empty(size, CAT_FEATURE_COUNT, dtype=torch.int64)
        for f, n in enumerate(CARDINALITIES):
            items = self.items(f, zipf_ranks(n, self.zipf, size, g), step)
            sparse[:, f] = self.raw_ids(f, items)
            if f in SIGNAL:
                logit = logit + 0.8 * self.effect(f, items)
        labels = torch.bernoulli(torch.sigmoid(logit), generator=g).to(torch.int64)
        return RawBatch(dense=dense, sparse=sparse, labels=labels)


@dataclass
class Data:
    """Where batches come from: the synthetic stream or Criteo TSV files."""

    args: argparse.Namespace
    table_sizes: list[int | None]

    def _stream(self) -> SyntheticCriteo:
        a = self.args
        return SyntheticCriteo(a.id_space, a.zipf, a.drift, a.seed)

    def train(self, rank: int, world: int) -> Iterator[Batch]:
        a = self.args
        if a.data:
            raws = read_criteo_tsv(
                a.data, a.batch_size, rank, world, skip_batches=a.eval_batches, max_batches=a.steps
            )
            return (to_batch(raw, self.table_sizes) for raw in raws)
        stream = self._stream()
        return (
            to_batch(stream.batch(step, rank, a.batch_size), self.table_sizes)
            for step in range(a.steps)
        )

    def held_out(self, rank: int, world: int) -> list[Batch]:
        """This rank's held-out batches."""
        a = self.args
        if a.data:
            raws = list(read_criteo_tsv(a.data, a.batch_size, rank, world, 0, a.eval_batches))
            if len(raws) < a.eval_batches:
                raise SystemExit(
                    f"--data holds fewer than {a.eval_batches} blocks of "
                    f"{a.batch_size * world} lines for the held-out set"
                )
        else:
            stream = self._stream()
            raws = [
                stream.batch(a.steps + j, rank, a.batch_size, EVAL_STREAM)
                for j in range(a.eval_batches)
            ]
        return [to_batch(raw, self.table_sizes) for raw in raws]

    def held_out_global(self, world: int) -> list[Batch]:
        """Every rank's held-out batches, batch ``j`` of all ranks as one (rank-major)."""
        parts = [self.held_out(r, world) for r in range(world)]
        out = []
        for j in range(self.args.eval_batches):
            batches = [p[j] for p in parts]
            out.append(
                Batch(
                    dense_features=torch.cat([b.dense_features for b in batches]),
                    sparse_features=_cat_kjts([b.sparse_features for b in batches]),
                    labels=torch.cat([b.labels for b in batches]),
                )
            )
        return out


def _cat_kjts(kjts: list[KeyedJaggedTensor]) -> KeyedJaggedTensor:
    """Bags of several KJTs (same keys) as one batch, in order."""
    keys = kjts[0].keys()
    dicts = [k.to_dict() for k in kjts]
    values, lengths = [], []
    for key in keys:
        for d in dicts:
            values.append(d[key].values())
            lengths.append(d[key].lengths())
    return KeyedJaggedTensor.from_lengths_sync(
        keys=keys, values=torch.cat(values), lengths=torch.cat(lengths)
    )


# --------------------------------------------------------------------- model
def kv_features(num_kv_tables: int) -> list[int]:
    """The features with the largest vocabularies, largest first."""
    order = sorted(range(CAT_FEATURE_COUNT), key=lambda f: -CARDINALITIES[f])
    return order[:num_kv_tables]


def table_name(feature: int) -> str:
    return f"t_{DEFAULT_CAT_NAMES[feature]}"


def table_configs(args: argparse.Namespace) -> list[EmbeddingBagConfig]:
    kv = set(kv_features(args.num_kv_tables))
    return [
        EmbeddingBagConfig(
            name=table_name(f),
            embedding_dim=args.embedding_dim,
            num_embeddings=args.id_space if f in kv else min(n, args.stock_rows),
            feature_names=[DEFAULT_CAT_NAMES[f]],
        )
        for f, n in enumerate(CARDINALITIES)
    ]


def table_sizes(args: argparse.Namespace) -> list[int | None]:
    """Per feature: the stock table's size (ids are taken modulo it), None for KV."""
    kv = set(kv_features(args.num_kv_tables))
    return [None if f in kv else min(n, args.stock_rows) for f, n in enumerate(CARDINALITIES)]


def kv_options(
    args: argparse.Namespace, ssd_dir: str | None, headroom: int = 1
) -> dict[str, KVTableOptions]:
    """Per KV table. The largest goes on the SSD tier (``ssd_dir``) and keeps half
    its rows in memory; the second admits an id after 2 sightings and evicts LFU;
    the others evict LRU. ``headroom`` multiplies the capacities (see ``reload``)."""
    out = {}
    for i, f in enumerate(kv_features(args.num_kv_tables)):
        ssd = SSDOptions(path=ssd_dir, resume=False) if (i == 0 and ssd_dir) else None
        capacity = args.kv_capacity // 2 if ssd else args.kv_capacity
        out[table_name(f)] = KVTableOptions(
            capacity=capacity * headroom,
            eviction=EvictionPolicy.LFU if i == 1 else EvictionPolicy.LRU,
            admission_threshold=2 if i == 1 else 1,
            seed=args.seed + f,
            ssd=ssd,
        )
    return out


def fused_params(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
        "learning_rate": args.lr,
        "eps": 1e-8,
    }


def build_dlrm(ebc: nn.Module, args: argparse.Namespace, device: torch.device) -> DLRMTrain:
    torch.manual_seed(args.seed)
    return DLRMTrain(
        DLRM(
            embedding_bag_collection=ebc,
            dense_in_features=INT_FEATURE_COUNT,
            dense_arch_layer_sizes=[*DENSE_ARCH, args.embedding_dim],
            over_arch_layer_sizes=OVER_ARCH,
            dense_device=device,
        )
    )


class MixedEmbeddingBagCollection(nn.Module):
    """KV tables in a ``KVEmbeddingBagCollection``, the others in a stock
    ``EmbeddingBagCollection``, seen from outside as one collection of every
    table: ``forward`` returns one ``KeyedTensor`` of all features and the
    ``state_dict`` keys are those of one ``EmbeddingBagCollection``
    (``embedding_bags.<table>...``), so a checkpoint of the sharded model loads
    into it."""

    def __init__(
        self,
        tables: list[EmbeddingBagConfig],
        options: dict[str, KVTableOptions],
        fused: dict[str, Any],
        device: torch.device,
    ) -> None:
        super().__init__()
        self._configs = list(tables)
        self._kv_names = set(options)
        kv = [c for c in tables if c.name in options]
        stock = [c for c in tables if c.name not in options]
        self.kv = KVEmbeddingBagCollection(kv, options, device=device, fused_params=fused)
        self.stock = EmbeddingBagCollection(stock, device=device) if stock else None
        self._kv_features = [f for c in kv for f in c.feature_names]
        self._stock_features = [f for c in stock for f in c.feature_names]
        self._features = [f for c in tables for f in c.feature_names]
        self.register_state_dict_post_hook(self._flatten_keys)
        self.register_load_state_dict_pre_hook(self._nest_keys)

    def embedding_bag_configs(self) -> list[EmbeddingBagConfig]:
        return self._configs

    def is_weighted(self) -> bool:
        return False

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        jts = features.to_dict()
        pooled: dict[str, torch.Tensor] = {}
        for module, names in ((self.kv, self._kv_features), (self.stock, self._stock_features)):
            if names:
                sub = KeyedJaggedTensor.from_jt_dict({n: jts[n] for n in names})
                pooled.update(module(sub).to_dict())
        return KeyedTensor(
            keys=self._features,
            length_per_key=[pooled[f].shape[1] for f in self._features],
            values=torch.cat([pooled[f] for f in self._features], dim=1),
        )

    @staticmethod
    def _flatten_keys(module: nn.Module, state: dict, prefix: str, _metadata: Any) -> None:
        for sub in ("kv.", "stock."):
            for key in [k for k in state if k.startswith(prefix + sub)]:
                state[prefix + key[len(prefix + sub) :]] = state.pop(key)

    def _nest_keys(self, _module: nn.Module, state: dict, prefix: str, *_: Any) -> None:
        head = prefix + "embedding_bags."
        for key in [k for k in state if k.startswith(head)]:
            table = key[len(head) :].split(".", 1)[0]
            sub = "kv." if table in self._kv_names else "stock."
            state[prefix + sub + key[len(prefix) :]] = state.pop(key)


# ------------------------------------------------------------------- metrics
#: KV counters summed over tables and ranks for the progress bar.
KV_COUNTERS = (
    "size",
    "capacity",
    "hits",
    "misses",
    "evictions",
    "admission_rejects",
    "ssd_size",
    "ssd_reads",
    "ssd_writes",
)


def kv_modules(model: nn.Module) -> list[ShardedKVEmbeddingBagCollection]:
    return [m for m in model.modules() if isinstance(m, ShardedKVEmbeddingBagCollection)]


def kv_counters(model: nn.Module) -> torch.Tensor:
    """This rank's KV counters (``KV_COUNTERS``), summed over its table shards."""
    total = torch.zeros(len(KV_COUNTERS), dtype=torch.float64)
    for module in kv_modules(model):
        for metrics in module.metrics().values():
            total += torch.tensor([float(metrics.get(k, 0)) for k in KV_COUNTERS])
    return total


def describe_kv(c: dict[str, float], window: dict[str, float] | None = None) -> str:
    """Progress-bar text of summed counters; hit rate over ``window`` (deltas) if given."""
    w = window or c
    lookups = w["hits"] + w["misses"]
    text = (
        f"rows={_short(c['size'])} load={c['size'] / max(c['capacity'], 1):.2f} "
        f"hit={100 * w['hits'] / lookups if lookups else 0:.1f}% "
        f"evict={_short(c['evictions'])} rejects={_short(c['admission_rejects'])}"
    )
    if c["ssd_size"] or c["ssd_writes"]:
        text += (
            f" ssd_rows={_short(c['ssd_size'])} ssd_r/w="
            f"{_short(c['ssd_reads'])}/{_short(c['ssd_writes'])}"
        )
    return text


def _short(x: float) -> str:
    for unit, size in (("M", 1e6), ("k", 1e3)):
        if abs(x) >= size:
            return f"{x / size:.1f}{unit}"
    return f"{x:.0f}"


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
    loss = nn.functional.binary_cross_entropy_with_logits(logits.double(), labels.double())
    return {"auc": auc(logits, labels), "logloss": float(loss), "samples": labels.numel()}


# ------------------------------------------------------------------- phases
def setup_process_group() -> tuple[int, int, torch.device]:
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local_rank)
        device, backend = torch.device(f"cuda:{local_rank}"), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    dist.init_process_group(backend)
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    return dist.get_rank(), dist.get_world_size(), device


def say(rank: int, *parts: Any) -> None:
    if rank == 0:
        print(*parts, flush=True)


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
    configs = table_configs(args)
    options = kv_options(args, ssd_dir)
    model = build_dlrm(EmbeddingBagCollection(configs, device=torch.device("meta")), args, device)
    sharder = KVEmbeddingBagCollectionSharder(options, fused_params=fused_params(args))
    started = time.perf_counter()
    model = DistributedModelParallel(model, device=device, sharders=[sharder])
    dense_params = [p for _, p in in_backward_optimizer_filter(model.named_parameters())]
    optimizer = torch.optim.Adagrad(dense_params, lr=args.lr, eps=1e-8)
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
    result = evaluate_sharded(model, data, rank, world, device)
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


def reduce_metrics(
    model: nn.Module, loss_sum: float, loss_count: int, device: torch.device
) -> tuple[dict, float]:
    """KV counters and the mean loss, summed over ranks."""
    local = torch.cat([kv_counters(model), torch.tensor([loss_sum, float(loss_count)])])
    local = local.to(device)  # nccl reduces CUDA tensors only
    dist.all_reduce(local)
    local = local.cpu()
    counters = dict(zip(KV_COUNTERS, local[:-2].tolist()))
    loss = float(local[-2] / local[-1]) if local[-1] > 0 else float("nan")
    return counters, loss


def plan_summary(model: DistributedModelParallel, options: dict, seconds: float) -> str:
    by_kind: dict[str, list[str]] = {}
    for module_plan in model.plan.plan.values():
        for table, ps in module_plan.items():
            kind = "KV" if table in options else "stock"
            by_kind.setdefault(f"{kind} {ps.sharding_type}", []).append(table)
    parts = [
        f"{len(t)} {k}" + (f" ({', '.join(sorted(t))})" if k.startswith("KV") else "")
        for k, t in sorted(by_kind.items())
    ]
    ssd = [n for n, o in options.items() if o.ssd is not None]
    text = f"plan ({seconds:.1f} s): " + "; ".join(parts)
    if ssd:
        text += f"; SSD tier: {', '.join(ssd)} under {shown(options[ssd[0]].ssd.path)}"
    return text


def evaluate_sharded(
    model: DistributedModelParallel, data: Data, rank: int, world: int, device: torch.device
) -> dict[str, Any]:
    """Every rank evaluates its held-out batches; predictions gathered in rank order."""
    model.eval()
    logits, labels = [], []
    with torch.no_grad():
        for batch in data.held_out(rank, world):
            _, (_, local_logits, local_labels) = model(batch.to(device))
            for mine, out in ((local_logits, logits), (local_labels, labels)):
                parts = [torch.empty_like(mine) for _ in range(world)]
                dist.all_gather(parts, mine.contiguous())
                out.append(torch.cat(parts).cpu())
    logits_t, labels_t = torch.cat(logits), torch.cat(labels)
    return {"logits": logits_t, "labels": labels_t, **evaluation(logits_t, labels_t)}


def format_eval(result: dict) -> str:
    return (
        f"AUC {result['auc']:.4f}  logloss {result['logloss']:.4f}  ({result['samples']} samples)"
    )


def shown(path: str) -> str:
    """``path`` relative to the current directory when it lies below it."""
    relative = os.path.relpath(path)
    return path if relative.startswith("..") else relative


def directory_bytes(path: str) -> int:
    return sum(
        os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files
    )


def reload(args: argparse.Namespace) -> None:
    """World size 1: the unsharded model loads the checkpoint and evaluates the same
    held-out batches as the sharded model did."""
    workdir = os.path.abspath(args.workdir)
    if not os.path.exists(os.path.join(workdir, EVAL_FILE)):
        raise SystemExit(f"{workdir}: no {EVAL_FILE}; run the training first")
    saved = torch.load(os.path.join(workdir, EVAL_FILE), weights_only=False)
    run = argparse.Namespace(**saved["args"])
    world = saved["world_size"]
    print(f"--- reload at world size 1 (the sharded run had {world} ranks) ---", flush=True)
    if not os.path.isdir(os.path.join(workdir, CKPT)):
        raise SystemExit(f"{workdir}: no checkpoint {CKPT}; run the training first")
    torch.set_num_threads(os.cpu_count() or 1)
    started = time.perf_counter()
    device = torch.device("cpu")
    ssd_dir = os.path.join(workdir, "ssd_reload") if run.ssd else None
    # Why the headroom: after training, a shard's 16-way index buckets are often
    # all full; the same ids rehashed into one table of the same total size
    # overflow some buckets (default run: 2317 of 32768 rows of t_cat_9 found no
    # room at 1x, 2 at 2x, none at 4x).
    options = kv_options(run, ssd_dir, headroom=RELOAD_HEADROOM)
    ebc = MixedEmbeddingBagCollection(table_configs(run), options, fused_params(run), device)
    model = build_dlrm(ebc, run, device)
    kv_checkpoint.load(model, os.path.join(workdir, CKPT))
    print(
        f"loaded {shown(os.path.join(workdir, CKPT))} into an unsharded DLRM "
        f"(KVEmbeddingBagCollection + EmbeddingBagCollection) in "
        f"{time.perf_counter() - started:.1f} s",
        flush=True,
    )
    model.eval()
    data = Data(run, table_sizes(run))
    logits = []
    with torch.no_grad():
        for batch in data.held_out_global(world):
            logits.append(model(batch)[1][1])
    logits_t = torch.cat(logits)
    labels_t = torch.cat([b.labels for b in data.held_out_global(world)])
    result = evaluation(logits_t, labels_t)
    same_labels = torch.equal(labels_t, saved["labels"].to(labels_t.dtype))
    diff = float((torch.sigmoid(logits_t) - torch.sigmoid(saved["logits"])).abs().max())
    tol = 1e-3 if saved.get("device") == "cuda" else 1e-5
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
    warnings.filterwarnings("ignore")  # TorchRec's and fbgemm's, many per rank
    warnings.filterwarnings("always", module="torchrec_kvemb")
    logging.disable(logging.WARNING)
    args = parse_args()
    if args.reload_only:
        reload(args)
        return
    if relaunched_under_torchrun(__file__, args.world_size or 2):
        return
    train(args)


def relaunched_under_torchrun(script: str, world: int) -> bool:
    """Outside torchrun (no ``RANK``): run ``script`` with this command line on
    ``world`` local processes through torchrun and return True once they end;
    under torchrun, return False (this process is one of the ranks)."""
    if "RANK" in os.environ:
        return False
    from torch.distributed.run import main as torchrun

    torchrun(["--standalone", f"--nproc_per_node={world}", os.path.abspath(script)] + sys.argv[1:])
    return True


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
