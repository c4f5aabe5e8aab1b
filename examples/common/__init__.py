"""What the example jobs share: data, the DLRM, metrics, evaluation, launching.

One concept per module:

- ``criteo``: the Criteo TSV format, its batches, the 1TB vocabulary sizes.
- ``synthetic``: the synthetic Criteo-like stream (Zipf ids, drift, a learnable label).
- ``data``: a run's training and held-out batches, from either source.
- ``model``: the DLRM's tables, KV options, optimizers, sharded or unsharded model.
- ``mixed_ebc``: KV and stock tables as one collection at world size 1.
- ``kv_metrics``: the KV tables' counters, summed over ranks, as progress text.
- ``evaluation``: predictions, AUC / log loss, the check against the training run.
- ``workdir``: a training run's directory, read back by the other jobs.
- ``launch``: torchrun self-relaunch, the process group, rank-0 printing.

The scripts in ``examples/`` import it as ``common`` (their own directory is
first on ``sys.path`` when they run).
"""
