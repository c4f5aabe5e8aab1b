"""Run as a script: compile every Triton kernel, as the package launches it, for a GPU.

``record``: drive the kernels through the public API (a KV EBC training and
evaluating with each optimizer, pooling, weighting and eviction policy, and
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
def drive_ebc() -> None:
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from torchrec_kvemb import EvictionPolicy, Initializer, KVEmbeddingBagCollection, KVTableOptions
    from torchrec_kvemb.optimizer import WeightDecay

    optimizers = [
        ({"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD}, PoolingType.SUM, False),
        ({"optimizer": EmbOptimType.ADAM, "weight_decay": 0.01}, PoolingType.MEAN, True),
        (
            {
                "optimizer": EmbOptimType.EXACT_SGD,
                "weight_decay": 0.01,
                "weight_decay_mode": WeightDecay.DECOUPLE,
                "gradient_clipping": True,
                "max_gradient": 0.5,
            },
            PoolingType.SUM,
            True,
        ),
    ]
    policies = [EvictionPolicy.LRU, EvictionPolicy.LFU, EvictionPolicy.NONE]
    gen = torch.Generator().manual_seed(5)
    for (fused, pooling, weighted), policy in zip(optimizers, policies, strict=True):
        configs = [
            EmbeddingBagConfig(
                name=name,
                embedding_dim=dim,
                num_embeddings=2**63 - 1,
                feature_names=[name],
                pooling=pooling,
            )
            for name, dim in (("a", 5), ("b", 36))
        ]
        options = {
            "a": KVTableOptions(capacity=32, eviction=policy, admission_threshold=2),
            "b": KVTableOptions(capacity=48, eviction=policy, initializer=Initializer.NORMAL),
        }
        ebc = KVEmbeddingBagCollection(
            configs, options, is_weighted=weighted, fused_params={**fused, "learning_rate": 0.1}
        )
        for step in range(4):
            lengths = torch.randint(0, 5, (2 * 7,), generator=gen)
            values = torch.randint(0, 90, (int(lengths.sum()),), generator=gen) * 1_000_003
            weights = torch.rand(values.numel(), generator=gen) if weighted else None
            kjt = KeyedJaggedTensor.from_lengths_sync(
                keys=["a", "b"], values=values, lengths=lengths, weights=weights
            )
            if step == 3:
                ebc.eval()
                with torch.no_grad():
                    ebc(kjt)
            else:
                ebc(kjt).values().sum().backward()


def drive_bucketize() -> None:
    from torchrec_kvemb.ops.dispatch import block_bucketize_2d

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
