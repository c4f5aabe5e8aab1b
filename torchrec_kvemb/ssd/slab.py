"""The slab file: one table shard's rows on disk, as fixed-size records, memory-mapped.

File layout::

    offset 0        header page (4096 bytes): magic, then the geometry as JSON
    offset 4096     record 0, record 1, ...   (``record_bytes`` each)

A record is ``words`` 64-bit little-endian words::

    word 0          id (int64)
    word 1          the row's eviction score in the in-memory tier (int64)
    word 2          checksum of the record's other words (see ``checksum``)
    word 3 ...      the row's weights, then its optimizer state, float32,
                    zero-padded to a whole word

Records are read and written in batches through a numpy view of a shared
``mmap`` of the file (a gather of records is one ``index_select``, a write one
``index_copy_``): no Python loop per row. The file grows by whole blocks that
are allocated on disk at once (``posix_fallocate``), so a full disk shows up
as an error at growth time, never as a fault on a later write to the mapping.

Example::

    slab = Slab(Path("/mnt/ssd/user.rank0.slab"), "user", dim=64, state_dim=1)
    slab.grow(1024)
    slab.write(torch.tensor([0, 1]), torch.tensor([7, 9]), torch.tensor([3, 3]), torch.ones(2, 65))
    scores, rows, ok = slab.decode(slab.read(torch.tensor([1, 0])), torch.tensor([9, 7]))
"""

from __future__ import annotations

import errno
import fcntl
import json
import mmap
import os
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from torchrec_kvemb.backend import implementation
from torchrec_kvemb.ops import native

MAGIC = b"KVSLAB01"
HEADER_BYTES = 4096
#: Words before the row's floats: id, score, checksum.
HEAD_WORDS = 3
CHECKSUM_WORD = 2
#: Reads of at least this many records are split over the I/O threads
#: (why: below it one warm ``index_select`` beats the thread hand-off).
PARALLEL_READ_MIN = 16_384
_CHECKSUM_CHUNK = 4096  # rows per checksum block: ~1 MB of words, stays in cache
_MIX = np.uint64(0xFF51AFD7ED558CCD)  # MurmurHash3 fmix64's first multiplier
_GOLDEN = 0x9E3779B97F4A7C15


class KVStorageError(OSError):
    """The SSD tier of a table could not use its files (full disk, no permission,
    a file from another table, ...). The message names the table and the path;
    the table's in-memory state is as it was before the call."""


def storage_error(table: str, path: Path | str, action: str, err: BaseException) -> KVStorageError:
    """A ``KVStorageError`` for ``err`` raised while doing ``action`` on ``path``."""
    code = getattr(err, "errno", None)
    reason = (
        "no space left on device"
        if code == errno.ENOSPC
        else (getattr(err, "strerror", None) or str(err))
    )
    message = f"table {table!r}: SSD tier cannot {action} {str(path)!r}: {reason}"
    return KVStorageError(code, message) if code is not None else KVStorageError(message)


# The two I/O primitives that can fail for lack of space: module functions, so
# that tests can stand in a full disk.
def _fallocate(fd: int, offset: int, length: int) -> None:
    os.posix_fallocate(fd, offset, length)


def _fsync(fd: int) -> None:
    os.fsync(fd)


def fsync_fd(fd: int) -> None:
    """fsync an open file descriptor (through ``_fsync``, which tests replace)."""
    _fsync(fd)


def fsync_path(path: Path) -> None:
    """fsync a file or directory by path."""
    fd = os.open(path, os.O_RDONLY)
    try:
        fsync_fd(fd)
    finally:
        os.close(fd)


def record_words(dim: int, state_dim: int) -> int:
    """64-bit words of one record: id, score, checksum, then ``dim + state_dim`` floats."""
    return HEAD_WORDS + (dim + state_dim + 1) // 2


def _salts(words: int) -> np.ndarray:
    salts = np.arange(1, words + 1, dtype=np.uint64) * np.uint64(_GOLDEN)
    return salts


def checksum(block: np.ndarray) -> np.ndarray:
    """Checksum ``[k]`` (int64) of records ``block [k, words]`` (int64).

    Each word but the checksum word is mixed with its position,
    ``x = ((w ^ salt_j) * M) ^ ((w ^ salt_j) * M >> 32)`` (``M``: fmix64's first
    multiplier; each step is a bijection of 64-bit words), and the ``x`` are
    summed modulo 2**64. So any change of one word (the id included) changes
    the sum; several changed words cancel with odds of about 2**-64. Numpy
    ufuncs on cache-sized blocks (13 M records of 280 bytes/s on one core);
    they release the GIL, so a prefetch thread overlaps the caller.
    """
    k, words = block.shape
    salts = _salts(words)
    out = np.empty(k, dtype=np.uint64)
    x = np.empty((min(k, _CHECKSUM_CHUNK), words), dtype=np.uint64)
    t = np.empty_like(x)
    shift = np.uint64(32)
    src = block.view(np.uint64)
    for lo in range(0, k, _CHECKSUM_CHUNK):
        n = min(_CHECKSUM_CHUNK, k - lo)
        xv, tv = x[:n], t[:n]
        np.bitwise_xor(src[lo : lo + n], salts, out=xv)
        xv[:, CHECKSUM_WORD] = salts[CHECKSUM_WORD]  # the checksum word counts as 0
        np.multiply(xv, _MIX, out=xv)
        np.right_shift(xv, shift, out=tv)
        np.bitwise_xor(xv, tv, out=xv)
        xv.sum(axis=1, out=out[lo : lo + n])
    return out.view(np.int64)


def checksums(block: torch.Tensor) -> torch.Tensor:
    """``checksum`` of records ``block [k, words]`` (int64 tensor), by the native
    kernel where it runs (the same bits)."""
    if implementation("cpu") == "native" and block.is_contiguous():
        return native.record_checksum(block)
    return torch.from_numpy(checksum(block.numpy()))


class _Files:
    """A slab's file descriptors (data, and the one holding the lock), closed once."""

    def __init__(self) -> None:
        self.fd = -1
        self.lock_fd = -1

    def close(self) -> None:
        for fd in (self.fd, self.lock_fd):
            if fd >= 0:
                os.close(fd)
        self.fd = self.lock_fd = -1


class Slab:
    """A file of fixed-size records, memory-mapped (see the module docstring).

    Opens ``path`` if it exists (its geometry must match; ``fresh``: empties it
    first) or creates it. The
    file is locked (``flock``) while open: a second table on the same file, in
    this process or another, gets a ``KVStorageError``.
    """

    def __init__(
        self,
        path: Path,
        table: str,
        dim: int,
        state_dim: int,
        io_threads: int = 16,
        fresh: bool = False,
    ) -> None:
        self.path = Path(path)
        self.table = table
        self.dim = dim
        self.state_dim = state_dim
        self.words = record_words(dim, state_dim)
        self.record_bytes = 8 * self.words
        self.io_threads = max(1, io_threads)
        self._geometry = {
            "format": 1,
            "dim": dim,
            "state_dim": state_dim,
            "record_bytes": self.record_bytes,
        }
        self._files = _Files()
        # why: a slab dropped without close() must not keep its fds (and lock) open.
        weakref.finalize(self, self._files.close)
        self._mmap: mmap.mmap | None = None
        self._array: np.ndarray | None = None
        self._tensor: torch.Tensor | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        self.records = 0
        try:
            self._open(fresh)
        except BaseException:
            self.close()
            raise

    # ----------------------------------------------------------------- open
    def _open(self, fresh: bool) -> None:
        exists = self.path.exists()
        try:
            self._files.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            self._files.lock_fd = os.open(self.path, os.O_RDONLY)
        except OSError as err:
            raise storage_error(self.table, self.path, "open", err) from err
        try:
            fcntl.flock(self._files.lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as err:
            raise KVStorageError(
                f"table {self.table!r}: SSD tier file {str(self.path)!r} is open in another "
                "table or process (two ranks or tables must not share a file)"
            ) from err
        if fresh:
            os.ftruncate(self._files.fd, 0)
        size = os.fstat(self._files.fd).st_size
        if exists and size > 0:
            self._check_header()
            self.records = (size - HEADER_BYTES) // self.record_bytes
        else:
            self._write_header()
        self._remap()

    def _write_header(self) -> None:
        text = json.dumps(self._geometry).encode()
        header = MAGIC + text + bytes(HEADER_BYTES - len(MAGIC) - len(text))
        try:
            _fallocate(self._files.fd, 0, HEADER_BYTES)
            os.pwrite(self._files.fd, header, 0)
            fsync_fd(self._files.fd)
            fsync_path(self.path.parent)
        except OSError as err:
            raise storage_error(self.table, self.path, "write", err) from err

    def _check_header(self) -> None:
        header = os.pread(self._files.fd, HEADER_BYTES, 0)
        geometry = None
        if header[: len(MAGIC)] == MAGIC:
            try:
                geometry = json.loads(header[len(MAGIC) :].rstrip(b"\0"))
            except ValueError:
                geometry = None
        if geometry is None:
            raise KVStorageError(
                f"table {self.table!r}: {str(self.path)!r} is not an SSD tier slab file"
            )
        if geometry != self._geometry:
            raise KVStorageError(
                f"table {self.table!r}: slab file {str(self.path)!r} holds records of "
                f"{geometry}, the table needs {self._geometry}"
            )

    def _remap(self) -> None:
        self._tensor = self._array = None
        self._mmap = None  # the old mapping stays alive while a reader holds its array
        if self.records == 0:
            return
        length = HEADER_BYTES + self.records * self.record_bytes
        self._mmap = mmap.mmap(self._files.fd, length, mmap.MAP_SHARED)
        # why: the kernel's default read-around reads 128 KiB per fault, 450x a record.
        self._mmap.madvise(mmap.MADV_RANDOM)
        self._array = np.frombuffer(
            self._mmap, dtype=np.int64, count=self.records * self.words, offset=HEADER_BYTES
        ).reshape(self.records, self.words)
        self._tensor = torch.from_numpy(self._array)

    # ------------------------------------------------------------ records
    def grow(self, records: int) -> None:
        """Make the file hold at least ``records`` records, allocated on disk."""
        if records <= self.records:
            return
        start = HEADER_BYTES + self.records * self.record_bytes
        try:
            _fallocate(self._files.fd, start, (records - self.records) * self.record_bytes)
        except OSError as err:
            # Give back what a partial allocation added: the file keeps its size.
            os.ftruncate(self._files.fd, start)
            raise storage_error(self.table, self.path, "grow", err) from err
        self.records = records
        self._remap()

    def view(self) -> torch.Tensor:
        """The records ``[records, words]`` int64, a view of the mapping."""
        if self._tensor is None:
            return torch.empty(0, self.words, dtype=torch.int64)
        return self._tensor

    def read(self, records: torch.Tensor, view: torch.Tensor | None = None) -> torch.Tensor:
        """Copies of ``records`` as ``[k, words]`` int64 (from ``view``: a mapping
        taken earlier, for a reader on another thread)."""
        view = self.view() if view is None else view
        k = records.numel()
        out = torch.empty(k, self.words, dtype=torch.int64)
        if k < PARALLEL_READ_MIN or self.io_threads == 1:
            torch.index_select(view, 0, records, out=out)
            return out
        # Cold pages fault one at a time per thread: threads give the disk a queue.
        chunk = -(-k // self.io_threads)
        with self._pool_lock:  # a prefetch thread reads too
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.io_threads, thread_name_prefix="kv-ssd-read")
        jobs = [
            self._pool.submit(
                torch.index_select, view, 0, records[lo : lo + chunk], out=out[lo : lo + chunk]
            )
            for lo in range(0, k, chunk)
        ]
        for job in jobs:
            job.result()
        return out

    def read_verified(
        self, records: torch.Tensor, ids: torch.Tensor, view: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(read(records, view), verify(block, ids))`` in one pass where the native
        kernels run (copy and check of each record while it is in cache)."""
        if not (implementation("cpu") == "native" and records.numel() < PARALLEL_READ_MIN):
            block = self.read(records, view)
            return block, self.verify(block, ids)
        view = self.view() if view is None else view
        return native.read_records(view, records.contiguous(), ids.contiguous())

    def write(
        self, records: torch.Tensor, ids: torch.Tensor, scores: torch.Tensor, rows: torch.Tensor
    ) -> None:
        """Write ``rows [k, dim + state_dim]`` of ``ids`` to ``records`` (distinct)."""
        if records.numel() == 0:
            return
        if implementation("cpu") == "native" and rows.dtype == torch.float32:
            # why native: encoded in place, one pass (no [k, words] block, no numpy
            # checksum): ~4x less time for the SSD-tier benchmark's demotions.
            native.write_records(
                self.view(),
                records.contiguous(),
                ids.contiguous(),
                scores.contiguous(),
                rows.contiguous(),
            )
        else:
            self.view().index_copy_(0, records, self.encode(ids, scores, rows))

    def encode(self, ids: torch.Tensor, scores: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Records ``[k, words]`` int64 for ``ids``, ``scores`` and float32 ``rows``."""
        k, width = rows.shape
        block = torch.empty(k, self.words, dtype=torch.int64)
        block[:, 0] = ids
        block[:, 1] = scores
        floats = block[:, HEAD_WORDS:].view(torch.float32)
        floats[:, :width] = rows
        floats[:, width:] = 0.0
        block[:, CHECKSUM_WORD] = checksums(block)
        return block

    def verify(self, block: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """``[k]`` bool: the records ``block`` read for ``ids`` hold those ids and
        their checksums match (a torn or corrupted record fails)."""
        ok = block[:, 0] == ids
        if block.shape[0]:
            ok &= block[:, CHECKSUM_WORD] == checksums(block)
        return ok

    def decode(
        self, block: torch.Tensor, ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(scores [k], rows [k, dim + state_dim] float32, ok [k] bool)`` of
        records read for ``ids`` (``ok``: see ``verify``)."""
        return block[:, 1], self.rows(block), self.verify(block, ids)

    def rows(self, block: torch.Tensor) -> torch.Tensor:
        """The float32 rows ``[k, dim + state_dim]`` of records ``block`` (a view)."""
        return block[:, HEAD_WORDS:].view(torch.float32)[:, : self.dim + self.state_dim]

    # ---------------------------------------------------------- durability
    def sync(self) -> None:
        """Write every record to disk (msync + fsync)."""
        try:
            if self._mmap is not None:
                self._mmap.flush()
            fsync_fd(self._files.fd)
        except OSError as err:
            raise storage_error(self.table, self.path, "sync", err) from err

    def drop_cache(self) -> None:
        """Write dirty records back, then drop the file's pages from memory: unmap
        them from this process (a mapped page stays cached) and
        ``posix_fadvise(DONTNEED)`` the file. The next reads go to the disk."""
        self.sync()
        if self._mmap is not None:
            self._mmap.madvise(mmap.MADV_DONTNEED)
        os.posix_fadvise(self._files.fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def close(self) -> None:
        """Unmap and close the file (a mapping still held by a reader stays valid)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        mapping = self._mmap
        self._tensor = self._array = self._mmap = None
        if mapping is not None:
            try:
                mapping.close()
            except BufferError:
                pass  # a reader still holds a view; the mapping closes with it
        self._files.close()
