"""Print the first batch of Criteo TSV files, as ``examples/train_dlrm.py --data`` reads them.

The reader, the format and what a sample becomes (dense ``log(1 + x)``, raw
63-bit categorical ids) are in ``examples/common/criteo.py``.

How to run
----------
::

    python examples/criteo_tsv.py day_0.gz --batch-size 4

Train on the files (see the docstring of ``train_dlrm.py``)::

    torchrun --standalone --nproc_per_node 2 examples/train_dlrm.py --data day_0.gz

Flags
-----
PATH ...           Criteo TSV files (plain or .gz), read in order
--batch-size B     samples in the batch (default 4)
"""

from __future__ import annotations

import argparse

from torchrec.datasets.criteo import CAT_FEATURE_COUNT

from common.criteo import read_criteo_tsv, to_batch


def main() -> None:
    parser = argparse.ArgumentParser(description="Print the first batch of Criteo TSV files.")
    parser.add_argument("paths", nargs="+", help="Criteo TSV files (plain or .gz)")
    parser.add_argument("--batch-size", type=int, default=4, help="samples in the batch (4)")
    args = parser.parse_args()
    for raw in read_criteo_tsv(args.paths, args.batch_size, max_batches=1):
        batch = to_batch(raw, [None] * CAT_FEATURE_COUNT)
        print("labels", batch.labels.tolist())
        print("dense_features", batch.dense_features)
        print("sparse_features", batch.sparse_features)
        return
    print(f"fewer than {args.batch_size} samples in {args.paths}")


if __name__ == "__main__":
    main()
