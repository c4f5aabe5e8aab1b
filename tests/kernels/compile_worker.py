"""Run as a script: compile every Triton kernel, as the package launches it, for a GPU.

``record``: drive the kernels through the public API (KV EBCs training and
evaluating with each optimizer, decay mode, clipping, pooling, weighting and
eviction policy, admission and custom scores; ``KVTable`` on its own: find,
insert, checkpoint-style loads, a table with an SSD tier; a group of tables
over host tiers; and
``block_bucketize_2d`` with each option) in Triton's interpreter on CPU
tensors, recording each launch: the kernel, its argument types and its
constexpr values; print them as JSON.

``compile``: in a fresh process (the interpreter patches ``triton.language``
for good), read those launches from stdin, import the kernels as real
``@triton.jit`` functions and compile each variant with Triton's compiler down
to a cubin for the target (default ``cuda:90``, Hopper); no GPU is needed for
that. Prints, per variant, its cubin's size or the compiler's error.

    python tests/kernels/compile_worker.py record > launches.json
    python tests/kernels/compile_worker.py compile cuda:90 < launches.json
"""

from __future__ import annotations

import inspect
import json
import os
import sys
import tempfile
import traceback

if sys.argv[1:2] == ["record"]:
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ["TORCHREC_KVEMB_BACKEND"] = "triton"
else:
    os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402

_POINTER_TYPES = {
    torch.int64: "*i64",
    torch.int32: "*i32",
    torch.int8: "*i8",
    torch.uint8: "*u8",
    torch.bool: "*i1",
    torch.float32: "*fp32",
    torch.float64: "*fp64",
    torch.float16: "*fp16",
    torch.bfloat16: "*bf16",
}

#: (module, kernel name, signature items, constexpr items) -> launches seen.
LAUNCHES: dict[tuple, int] = {}


def _arg_type(value: object) -> str:
    """The Triton signature type the runtime gives a non-constexpr argument."""
    if isinstance(value, torch.Tensor):
        return _POINTER_TYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton type for {type(value).__name__}")


def _record(fn, args: tuple, kwargs: dict) -> None:
    params = inspect.signature(fn).parameters
    bound = dict(zip(params, args, strict=False))
    bound.update(kwargs)
    signature, constexprs = [], []
    for name, param in params.items():
        value = bound.get(name, param.default)
        if "constexpr" in str(param.annotation) or value is None:
            signature.append((name, "constexpr"))
            constexprs.append((name, value))
        else:
            signature.append((name, _arg_type(value)))
    key = (fn.__module__, fn.__name__, tuple(signature), tuple(constexprs))
    LAUNCHES[key] = LAUNCHES.get(key, 0) + 1


def _recording_run(self, *args, grid, warmup, **kwargs):
    _record(self.fn, args, kwargs)
    return _original_run(self, *args, grid=grid, warmup=warmup, **kwargs)


def install_recorder() -> None:
    from triton.runtime.interpreter import InterpretedFunction

    global _original_run
    _original_run = InterpretedFunction.run
    InterpretedFunction.run = _recording_run


_original_run = None


# ------------------------------------------------------------------ phase 1
def _kjt(keys: list[str], batch: int, weighted: bool, gen: torch.Generator):
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    lengths = torch.randint(0, 5, (len(keys) * batch,), generator=gen)
    values = torch.randint(0, 90, (int(lengths.sum()),), generator=gen) * 1_000_003
    weights = torch.rand(values.numel(), generator=gen) if weighted else None
    return KeyedJaggedTensor.from_lengths_sync(
        keys=keys, values=values, lengths=lengths, weights=weights
    )


def drive_ebc() -> None:
    """KV EBCs training and evaluating (the group kernels): every optimizer, L2 and
    decoupled weight decay, clipping, SUM / MEAN / weighted pooling, every eviction
    policy (custom scores given in some steps), admission, a group of two tables,
    a dim over one column block, and float16 / bfloat16 rows."""
    from dataclasses import replace

    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType

    from torchrec_kvemb import EvictionPolicy, Initializer, KVEmbeddingBagCollection, KVTableOptions
    from torchrec_kvemb.optimizer import WeightDecay

    setups = [
        (
            {
                "optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
                "weight_decay": 0.01,
                "weight_decay_mode": WeightDecay.L2,
            },
            PoolingType.MEAN,
            False,
        ),
        (
            {
                "optimizer": EmbOptimType.ADAM,
                "weight_decay": 0.01,
                "weight_decay_mode": WeightDecay.DECOUPLE,
            },
            PoolingType.SUM,
            False,
        ),
        (
            {"optimizer": EmbOptimType.EXACT_SGD, "gradient_clipping": True, "max_gradient": 0.5},
            PoolingType.SUM,
            True,
        ),
    ]
    setups = [(*setup, torch.float32) for setup in setups] + [
        ({"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD}, PoolingType.SUM, False, torch.float16),
        ({"optimizer": EmbOptimType.ADAM}, PoolingType.MEAN, True, torch.bfloat16),
    ]
    # name: dim, options; "a" and "b" make one group (same dim), with admission.
    tables = {
        "a": (5, KVTableOptions(capacity=32, eviction=EvictionPolicy.LRU, admission_threshold=2)),
        "b": (5, KVTableOptions(capacity=16, eviction=EvictionPolicy.LFU)),
        "c": (
            130,
            KVTableOptions(
                capacity=48, eviction=EvictionPolicy.CUSTOM_SCORE, initializer=Initializer.NORMAL
            ),
        ),
        "d": (36, KVTableOptions(capacity=16, eviction=EvictionPolicy.NONE)),
    }
    gen = torch.Generator().manual_seed(5)
    for fused, pooling, weighted, dtype in setups:
        configs = [
            EmbeddingBagConfig(
                name=name,
                embedding_dim=dim,
                num_embeddings=2**63 - 1,
                feature_names=[name],
                pooling=pooling,
            )
            for name, (dim, _) in tables.items()
        ]
        options = {name: replace(opts, weights_dtype=dtype) for name, (_, opts) in tables.items()}
        ebc = KVEmbeddingBagCollection(
            configs, options, is_weighted=weighted, fused_params={**fused, "learning_rate": 0.1}
        )
        for step in range(4):
            kjt = _kjt(list(tables), 7, weighted, gen)
            if step == 3:
                ebc.eval()
                with torch.no_grad():
                    ebc(kjt)
                continue
            scores = None
            if step != 1:  # step 1: the CUSTOM_SCORE table falls back to its clock
                count = kjt["c"].values().numel()
                scores = {"c": torch.randint(0, 4, (count,), generator=gen)}
            ebc(kjt, eviction_scores=scores).values().sum().backward()


def drive_tables() -> None:
    """The per-table kernels (probe, find-or-insert), as ``KVTable`` uses them: ``find``,
    ``insert`` under each policy, a checkpoint-style ``load_rows`` and
    ``load_admission``, and a KV EBC with an SSD tier (its table is looked up on
    its own, by the per-table path)."""
    from torchrec.modules.embedding_configs import EmbeddingBagConfig

    from torchrec_kvemb import EvictionPolicy, KVEmbeddingBagCollection, KVTable, KVTableOptions
    from torchrec_kvemb.options import SSDOptions

    gen = torch.Generator().manual_seed(9)
    ids = torch.randperm(200, generator=gen)[:70] * 7_919
    for policy in EvictionPolicy:
        table = KVTable("t", 7, KVTableOptions(capacity=48, eviction=policy, admission_threshold=2))
        table.insert(ids[:60], torch.randn(60, 7, generator=gen))
        table.find(ids)
        table.insert(ids[40:], torch.randn(30, 7, generator=gen))
        exported = table.export()
        waiting = table.admission_entries()
        table.lookup_train(ids[:45])
        table.clear()
        table.load_rows(exported["ids"], exported["weights"], None, exported["scores"])
        table.load_admission(*waiting)
        table.find(ids)

    with tempfile.TemporaryDirectory() as path:
        configs = [
            EmbeddingBagConfig(
                name=name, embedding_dim=4, num_embeddings=2**63 - 1, feature_names=[name]
            )
            for name in ("mem", "ssd")
        ]
        options = {
            "mem": KVTableOptions(capacity=16),
            "ssd": KVTableOptions(capacity=16, ssd=SSDOptions(path=path)),
        }
        ebc = KVEmbeddingBagCollection(configs, options)
        for _ in range(2):
            ebc(_kjt(["mem", "ssd"], 5, False, gen)).values().sum().backward()
        ebc.table("ssd").close()


def drive_tiered_group() -> None:
    """A group of two tables over host tiers (one with admission, one LFU): the
    group kernels' ``TIER`` variant (``tiered_lookup``), as CUDA runs it."""
    from torchrec.modules.embedding_configs import EmbeddingBagConfig

    from torchrec_kvemb import (
        EvictionPolicy,
        HostTierOptions,
        KVEmbeddingBagCollection,
        KVTableOptions,
    )

    gen = torch.Generator().manual_seed(11)
    configs = [
        EmbeddingBagConfig(
            name=name, embedding_dim=4, num_embeddings=2**63 - 1, feature_names=[name]
        )
        for name in ("p", "q")
    ]
    host = HostTierOptions()
    options = {
        "p": KVTableOptions(capacity=16, host_tier=host, admission_threshold=2),
        "q": KVTableOptions(capacity=16, host_tier=host, eviction=EvictionPolicy.LFU),
    }
    ebc = KVEmbeddingBagCollection(configs, options)
    for _ in range(3):
        ebc(_kjt(["p", "q"], 9, False, gen)).values().sum().backward()


def drive_bucketize() -> None:
    from torchrec_kvemb.dispatch import block_bucketize_2d

    gen = torch.Generator().manual_seed(3)
    lengths = torch.tensor([2, 0, 3, 1, 4, 1], dtype=torch.int64)
    for index_dtype in (torch.int64, torch.int32):
        indices = torch.randint(0, 97, (int(lengths.sum()),), generator=gen).to(index_dtype)
        for weights in (None, torch.rand(indices.numel(), generator=gen)):
            for pos, keep in ((False, False), (True, True)):
                block_bucketize_2d(
                    lengths.to(index_dtype),
                    indices,
                    block_sizes=[20, 25],
                    world_size=3,
                    weights=weights,
                    bucketize_pos=pos,
                    keep_orig_idx=keep,
                )
        block_bucketize_2d(
            lengths.to(index_dtype),
            indices,
            block_sizes=[20, 25],
            world_size=3,
            weights=torch.rand(indices.numel(), 3, generator=gen),
            total_num_blocks=[6, 9],
        )


# ------------------------------------------------------------------ phase 2
def compile_all(launches: list[dict], target_spec: str) -> dict:
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    backend, arch = target_spec.split(":")
    target = GPUTarget(backend, int(arch), 32)
    results = []
    for launch in launches:
        kernel = getattr(importlib.import_module(launch["module"]), launch["name"])
        entry = {**launch, "kernel": f"{launch['module'].rsplit('.', 1)[-1]}.{launch['name']}"}
        try:
            source = ASTSource(
                fn=kernel, signature=launch["signature"], constexprs=launch["constexprs"]
            )
            compiled = triton.compile(source, target=target)
            entry["cubin_bytes"] = len(compiled.asm["cubin"])
        except Exception:  # noqa: BLE001 - reported, and the test fails on it
            entry["error"] = traceback.format_exc(limit=3)[-2000:]
        results.append(entry)
    return {"target": target_spec, "variants": results}


def main() -> None:
    mode = sys.argv[1] if len(sys.argv) > 1 else ""
    if mode == "record":
        install_recorder()
        drive_ebc()
        drive_tables()
        drive_tiered_group()
        drive_bucketize()
        launches = [
            {
                "module": module,
                "name": name,
                "signature": dict(signature),
                "constexprs": dict(constexprs),
                "launches": count,
            }
            for (module, name, signature, constexprs), count in sorted(LAUNCHES.items())
        ]
        print(json.dumps(launches))
    elif mode == "compile":
        target = sys.argv[2] if len(sys.argv) > 2 else "cuda:90"
        print(json.dumps(compile_all(json.load(sys.stdin), target)))
    else:
        raise SystemExit("usage: compile_worker.py record | compile [cuda:90]")


if __name__ == "__main__":
    main()
