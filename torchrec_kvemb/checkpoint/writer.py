"""The storage writer of ``checkpoint.save``: DCP's file layout, tensors written in blocks.

:class:`RowStreamWriter` is DCP's ``FileSystemWriter`` (same files, same
metadata: ``FileSystemReader`` and ``dcp.load`` read what it writes) with its own
``write_data``: each of ``thread_count`` threads writes one file, and each tensor
is written as a ``torch.save`` record by
:func:`~torchrec_kvemb.checkpoint.tensor_record.write_tensor` straight from its
memory, block by block. A deferred table entry (a placeholder of
:mod:`torchrec_kvemb.state_dict.deferred`) is filled block by block into one
reused buffer per thread as it is written, so a table's rows are never gathered
whole. A tensor ``write_tensor`` does not write (another dtype, a tensor
subclass) is written with ``torch.save`` as DCP writes it.

Example::

    with deferring() as deferred:
        state = {"model": model.state_dict()}
        dcp.save(state, storage_writer=RowStreamWriter(path, thread_count=4, deferred=deferred))
"""

from __future__ import annotations

import io
import math
import os
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from torchrec_kvemb.checkpoint.direct_file import open_for_writing
from torchrec_kvemb.checkpoint.priority import SavePriority
from torchrec_kvemb.checkpoint.saved_tensor import writable_bytes
from torchrec_kvemb.checkpoint.tensor_record import writable, write_all, write_tensor
from torchrec_kvemb.state_dict.deferred import DeferredEntries, DeferredEntry

#: Bytes of a deferred entry filled and written at a time (per writer thread).
BLOCK_BYTES = 4 << 20
SUFFIX = ".distcp"


class RowStreamWriter(FileSystemWriter):
    """``FileSystemWriter`` writing tensors in blocks and filling ``deferred``
    entries as it writes them (see the module's docstring).

    Example::

        writer = RowStreamWriter("/ckpt/step_10.tmp", thread_count=4, deferred=deferred)
    """

    def __init__(
        self,
        path: str | os.PathLike,
        thread_count: int = 1,
        deferred: DeferredEntries | None = None,
        block_bytes: int = BLOCK_BYTES,
        max_bytes_per_s: float | None = None,
        direct: bool = True,
        priority: SavePriority | None = None,
    ) -> None:
        super().__init__(
            path, single_file_per_rank=True, sync_files=True, thread_count=thread_count
        )
        self.deferred = deferred if deferred is not None else DeferredEntries()
        self.block_bytes = block_bytes
        self.pace = Pace(max_bytes_per_s) if max_bytes_per_s else None
        #: Write around the page cache where the file system allows (:mod:`.direct_file`).
        self.direct = direct
        #: The CPU priority of the writer threads (an asynchronous save's; None: the caller's).
        self.priority = priority

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        prefix = plan.storage_data.prefix
        bins = [b for b in split_items(plan.items, self.thread_count) if b]
        names = [f"{prefix}{i}{SUFFIX}" for i in range(len(bins))]
        with ThreadPoolExecutor(max(1, len(bins)), thread_name_prefix="kvemb-ckpt-write") as pool:
            parts = list(pool.map(lambda n, b: self._write_file(n, b, planner), names, bins))
        done: Future[list[WriteResult]] = Future()
        done.set_result([r for part in parts for r in part])
        return done

    def _write_file(
        self, name: str, items: list[WriteItem], planner: SavePlanner
    ) -> list[WriteResult]:
        if self.priority is None:
            return self._write_items(name, items, planner)
        with self.priority.lowered():
            return self._write_items(name, items, planner)

    def _write_items(
        self, name: str, items: list[WriteItem], planner: SavePlanner
    ) -> list[WriteResult]:
        results = []
        path = self.fs.concat_path(self.path, name)
        with open_for_writing(path, self.direct) as f:
            for item in items:
                offset = f.tell()
                data = planner.resolve_data(item)
                if item.type == WriteItemType.BYTE_IO:
                    write_all(f, data.getbuffer())
                else:
                    self._write_tensor(f, data)
                length = f.tell() - offset
                info = _StorageInfo(name, offset, length)
                results.append(
                    WriteResult(index=item.index, size_in_bytes=length, storage_data=info)
                )
            f.finish(sync=self.sync_files)
        return results

    def _write_tensor(self, f: io.RawIOBase, tensor: torch.Tensor) -> None:
        found = self.deferred.find(tensor)
        if found is not None:
            entry, first, rows = found
            blocks = _filled_blocks(entry, first, rows, self.block_bytes)
            write_tensor(f, tensor.dtype, tuple(tensor.shape), self._paced(blocks))
            return
        if (
            type(tensor) is not torch.Tensor
            or tensor.layout != torch.strided
            or not writable(tensor.dtype)
        ):
            torch.save(tensor, f)
            return
        tensor = tensor.detach().cpu().contiguous()
        whole = writable_bytes(tensor)
        step = self.block_bytes
        blocks = (whole[i : i + step] for i in range(0, len(whole), step))
        write_tensor(f, tensor.dtype, tuple(tensor.shape), self._paced(blocks))

    def _paced(self, blocks: Iterator[memoryview]) -> Iterator[memoryview]:
        if self.pace is None:
            return blocks
        return self.pace.paced(blocks)


class Pace:
    """Spaces the blocks of every writer thread so that together they write at most
    ``bytes_per_s`` (each block waits for its turn on one shared schedule).

    Example::

        pace = Pace(50e6)
        for block in pace.paced(blocks):   # 50 MB/s over every thread using ``pace``
            f.write(block)
    """

    def __init__(self, bytes_per_s: float) -> None:
        if not bytes_per_s > 0:
            raise ValueError(f"a write rate must be > 0 bytes/s, got {bytes_per_s}")
        self.bytes_per_s = float(bytes_per_s)
        self._lock = threading.Lock()
        self._next = time.monotonic()

    def take(self, nbytes: int) -> None:
        """Wait for the end of the next free slot of ``nbytes / bytes_per_s`` s."""
        with self._lock:
            now = time.monotonic()
            end = max(self._next, now) + nbytes / self.bytes_per_s
            self._next = end
        time.sleep(end - now)

    def paced(self, blocks: Iterator[memoryview]) -> Iterator[memoryview]:
        for block in blocks:
            self.take(len(block))
            yield block


def _filled_blocks(
    entry: DeferredEntry, first: int, rows: int, block_bytes: int
) -> Iterator[memoryview]:
    """Rows ``[first, first + rows)`` of ``entry``, filled block by block into one buffer."""
    whole = entry.placeholder
    row_bytes = max(1, whole[0].numel() * whole.element_size())
    per_block = max(1, block_bytes // row_bytes)
    buffer = torch.empty((min(per_block, rows), *whole.shape[1:]), dtype=whole.dtype)
    for start in range(0, rows, per_block):
        part = buffer[: min(per_block, rows - start)]
        entry.fill(first + start, part)
        yield writable_bytes(part)


def split_items(items: list[WriteItem], bins: int) -> list[list[WriteItem]]:
    """``items`` over ``bins`` files: byte items in turn, tensors largest first, each
    to the file with the fewest bytes so far (DCP's split)."""
    out: list[list[WriteItem]] = [[] for _ in range(max(1, bins))]
    sizes = [0] * len(out)
    tensors = [i for i in items if i.type != WriteItemType.BYTE_IO]
    for k, item in enumerate(i for i in items if i.type == WriteItemType.BYTE_IO):
        out[k % len(out)].append(item)
    for item in sorted(tensors, key=_item_bytes, reverse=True):
        k = sizes.index(min(sizes))
        out[k].append(item)
        sizes[k] += _item_bytes(item)
    return out


def _item_bytes(item: WriteItem) -> int:
    data = item.tensor_data
    return data.properties.dtype.itemsize * math.prod(data.chunk.sizes)
