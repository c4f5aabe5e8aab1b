"""Side-by-side benchmarks of torchrec_kvemb against stock TorchRec / FBGEMM paths.

Run one with ``python -m benchmarks.<name>`` from the repository root; results
are kept in ``docs/``.
"""
