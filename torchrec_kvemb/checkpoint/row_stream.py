"""Reading ranges of rows of a DCP checkpoint's entries in blocks, into a few reused buffers.

``checkpoint.load`` reads the rows of KV tables (``weight`` and the optimizer
state, most of a checkpoint's bytes) with :func:`stream_rows`: one thread per
file reads each saved tensor's rows straight from the file
(:mod:`.saved_tensor`), a block at a time, into one of ``BUFFERS`` buffers of
``BLOCK_BYTES``, and hands the block to a sink (which places it into its table
and releases the buffer). Nothing the size of a table is allocated, and the
memory a block lands in is warm: a load of 1.1 GB into fresh tensors spent about
0.3 s of its time faulting their pages in.

A record :mod:`.saved_tensor` does not take is read with DCP's own path into a
tensor of its own, handed over as one block.

Example::

    def sink(block: RowBlock) -> None:
        target[block.start : block.start + len(block.rows)] = block.rows
        block.release()

    stream_rows(reader, metadata, {"model.t.weight": (400, 100)}, sink)
"""

from __future__ import annotations

import math
import queue
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from torchrec_kvemb.checkpoint.saved_tensor import locate, read_bytes_into

#: Bytes of one block. why: 6 buffers of 8 MiB (48 MiB in all) loaded 1.1 GB as
#: fast as 8 of 16 MiB or 16 of 8 MiB here (1.0-1.5 s each, alternating in one process).
BLOCK_BYTES = 8 << 20
#: Buffers in flight: enough for every file's reader to hold one while the sink
#: places others.
BUFFERS = 6


@dataclass(frozen=True)
class RowBlock:
    """Rows ``[start, start + len(rows))`` of the range read of entry ``key``."""

    key: str
    start: int
    rows: torch.Tensor
    #: Call once ``rows`` is used: its buffer goes back to the readers.
    release: Callable[[], None]
    #: The entry's first column ``rows`` hold (a chunk saved by column shards holds
    #: some columns of every row; 0 for whole rows).
    column: int = 0


class _Buffers:
    """``count`` byte buffers of ``nbytes`` shared by the readers (a reader waits
    for a free one); a larger request gets a buffer of its own."""

    def __init__(self, count: int, nbytes: int) -> None:
        self.nbytes = nbytes
        self._free: queue.SimpleQueue = queue.SimpleQueue()
        for _ in range(count):
            self._free.put(torch.empty(nbytes, dtype=torch.uint8))

    def take(self, nbytes: int) -> tuple[torch.Tensor, Callable[[], None]]:
        if nbytes > self.nbytes:
            return torch.empty(nbytes, dtype=torch.uint8), _nothing
        buffer = self._free.get()
        return buffer, partial(self._free.put, buffer)


def _nothing() -> None:
    """The release of a buffer no pool owns: it is freed with its last reference."""


def stream_rows(
    reader: dcp.FileSystemReader,
    metadata: Metadata,
    requests: Mapping[str, tuple[int, int]],
    sink: Callable[[RowBlock], None],
) -> None:
    """Read rows ``[first, first + count)`` (``requests[key] = (first, count)``) of
    each tensor entry ``key`` of the checkpoint, handing every block to ``sink`` (on
    the reading threads). Raises the first error of any reader once all stopped."""
    reader.set_up_storage_reader(metadata, is_coordinator=False)
    per_file: dict[str, list[ReadItem]] = {}
    for key, (first, count) in requests.items():
        md = metadata.state_dict_metadata[key]
        if count == 0:
            continue
        chunk = ChunkStorageMetadata(
            offsets=torch.Size([first] + [0] * (len(md.size) - 1)),
            sizes=torch.Size([count, *md.size[1:]]),
        )
        for item in create_read_items_for_chunk_list(key, md, [chunk]):
            path = metadata.storage_data[item.storage_index].relative_path
            per_file.setdefault(path, []).append(item)
    if not per_file:
        return
    buffers = _Buffers(BUFFERS, BLOCK_BYTES)
    read = partial(_read_file, reader, metadata, buffers, sink)
    with ThreadPoolExecutor(len(per_file), thread_name_prefix="kvemb-rows") as pool:
        futures = [pool.submit(read, path, items) for path, items in per_file.items()]
    errors = [f.exception() for f in futures if f.exception() is not None]
    if errors:
        raise errors[0]


def _read_file(
    reader: dcp.FileSystemReader,
    metadata: Metadata,
    buffers: _Buffers,
    sink: Callable[[RowBlock], None],
    relative_path: str,
    items: list[ReadItem],
) -> None:
    storage = metadata.storage_data
    items = sorted(items, key=lambda i: storage[i.storage_index].offset)
    with reader.fs.create_stream(reader.fs.concat_path(reader.path, relative_path), "rb") as f:
        for item in items:
            key = item.dest_index.fqn
            dtype = metadata.state_dict_metadata[key].properties.dtype
            info = storage[item.storage_index]
            offsets, lengths = tuple(item.storage_offsets), tuple(item.lengths)
            saved = None if info.transform_descriptors else locate(f, info.offset, info.length)
            if saved is None or not saved.readable_as(dtype, offsets, lengths):
                rows = _read_with_dcp(reader, item, dtype)
                sink(RowBlock(key, item.dest_offsets[0], rows, _nothing, _column(item)))
                continue
            row_shape = lengths[1:]
            row_bytes = math.prod(row_shape) * dtype.itemsize
            per_block = max(1, buffers.nbytes // max(1, row_bytes))
            for done in range(0, lengths[0], per_block):
                n = min(per_block, lengths[0] - done)
                buffer, release = buffers.take(n * row_bytes)
                rows = buffer[: n * row_bytes].view(dtype).view(n, *row_shape)
                try:
                    read_bytes_into(f, saved.data_offset + (offsets[0] + done) * row_bytes, rows)
                except BaseException:
                    release()
                    raise
                sink(RowBlock(key, item.dest_offsets[0] + done, rows, release, _column(item)))


def _column(item: ReadItem) -> int:
    """The first column a read item's rows hold in their entry (0 for 1-D entries)."""
    return int(item.dest_offsets[1]) if len(item.dest_offsets) > 1 else 0


class _OneTarget:
    """The part of a load planner DCP's reader uses, for one target tensor."""

    def __init__(self, target: torch.Tensor) -> None:
        self.target = target

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        return self.target

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        """DCP's reader filled ``target`` in place: nothing is left to copy."""


def _read_with_dcp(reader: dcp.FileSystemReader, item: ReadItem, dtype: torch.dtype):
    """``item`` read by DCP's own path into a new tensor."""
    target = torch.empty(tuple(item.lengths), dtype=dtype)
    dcp.FileSystemReader.read_data(reader, LoadPlan([item]), _OneTarget(target)).wait()
    return target
