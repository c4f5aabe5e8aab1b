"""Reading DCP checkpoints of KV tables: a load planner and a parallel file reader.

* :class:`RowRangePlanner` (``checkpoint.load``): tensors named in its
  ``row_offsets`` receive a range of rows of the saved tensor (the routing
  buckets a rank owns), the others the whole saved tensor.
* :class:`ParallelFileSystemReader`: reads a rank's files on one thread each.

Example::

    targets = {"model.t.weight": torch.empty(100, 8)}
    dcp.load(targets, storage_reader=ParallelFileSystemReader(path),
             planner=RowRangePlanner({"model.t.weight": 400}))
"""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    create_default_local_load_plan,
)
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.futures import Future


class RowRangePlanner(DefaultLoadPlanner):
    """DCP's load planner over a flat state_dict, where the tensors named in
    ``row_offsets`` receive rows ``[offset, offset + len)`` of the saved tensor.

    Example::

        targets = {"model.t.weight": torch.empty(100, 8)}
        dcp.load(targets, storage_reader=reader, planner=RowRangePlanner({"model.t.weight": 400}))
    """

    def __init__(self, row_offsets: Mapping[str, int]) -> None:
        super().__init__(flatten_state_dict=False)
        self._row_offsets = dict(row_offsets)

    def create_local_plan(self) -> LoadPlan:
        whole = {k: v for k, v in self.state_dict.items() if k not in self._row_offsets}
        items = list(create_default_local_load_plan(whole, self.metadata, True).items)
        for key, start in self._row_offsets.items():
            tensor = self.state_dict[key]
            if tensor.shape[0] == 0:
                continue
            chunk = ChunkStorageMetadata(
                offsets=torch.Size([start] + [0] * (tensor.dim() - 1)), sizes=tensor.size()
            )
            items += create_read_items_for_chunk_list(
                key, self.metadata.state_dict_metadata[key], [chunk]
            )
        return LoadPlan(items)

    def load_bytes(self, read_item, value) -> None:
        # why: the base class sets them into a copy of the dict it was given.
        key = read_item.dest_index.fqn
        self.original_state_dict[key] = torch.load(value, weights_only=False)

    def lookup_tensor(self, index):
        if index.fqn in self._row_offsets:
            return self.state_dict[index.fqn]
        return super().lookup_tensor(index)


class ParallelFileSystemReader(dcp.FileSystemReader):
    """DCP's file system reader, reading a rank's files on one thread each.

    why: a checkpoint written with ``thread_count=4`` holds 4 files per rank; reading
    them at once took 0.69 s instead of 1.13 s for 1.1 GB here (file reads and
    copies release the GIL).

    Example::

        dcp.load(targets, storage_reader=ParallelFileSystemReader("/ckpt/step_1000"))
    """

    def read_data(self, plan: LoadPlan, planner) -> Future:
        per_file: dict[str, list] = {}
        for item in plan.items:
            path = self.storage_data[item.storage_index].relative_path
            per_file.setdefault(path, []).append(item)
        read = super().read_data
        if len(per_file) > 1:
            with ThreadPoolExecutor(len(per_file)) as pool:
                futures = [
                    pool.submit(read, LoadPlan(items), planner) for items in per_file.values()
                ]
                for future in futures:
                    future.result().wait()
        elif per_file:
            read(plan, planner).wait()
        done: Future = Future()
        done.set_result(None)
        return done
