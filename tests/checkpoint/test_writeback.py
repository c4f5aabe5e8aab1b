"""``writeback.start_writeback``: available on Linux; on a real file it leaves the
bytes as written; a no-op for small ranges and in-memory streams; the record
writer asks it for exactly the large blocks it writes, at their file offsets."""

import io
import os
import sys

import torch

from torchrec_kvemb.checkpoint import tensor_record, writeback
from torchrec_kvemb.checkpoint.saved_tensor import locate, writable_bytes


def test_available_on_linux():
    assert writeback.available() == sys.platform.startswith("linux")


def test_a_real_file_keeps_its_bytes(tmp_path):
    data = bytes(range(256)) * (writeback.MIN_BYTES // 256 * 3 + 7)
    path = tmp_path / "f"
    with open(path, "wb", buffering=0) as f:
        f.write(b"x" * 13)
        f.write(data)
        writeback.start_writeback(f, 13, len(data))
        writeback.start_writeback(f, 0, 5)  # below MIN_BYTES: nothing
    assert path.read_bytes() == b"x" * 13 + data
    writeback.start_writeback(io.BytesIO(data), 0, len(data))  # no descriptor: nothing


def test_the_record_writer_starts_writeback_of_its_large_blocks(tmp_path, monkeypatch):
    calls: list[tuple[int, int]] = []
    real = tensor_record.start_writeback

    def recording(f, offset, nbytes):
        if nbytes >= writeback.MIN_BYTES:
            calls.append((offset, nbytes))
        real(f, offset, nbytes)

    monkeypatch.setattr(tensor_record, "start_writeback", recording)
    rows = torch.arange(3 * writeback.MIN_BYTES // 4 + 5, dtype=torch.float32).view(-1, 1)
    block = writeback.MIN_BYTES + 12
    view = writable_bytes(rows)
    path = tmp_path / "record"
    with open(path, "wb", buffering=0) as f:
        f.write(b"y" * 101)
        blocks = [view[i : i + block] for i in range(0, len(view), block)]
        length = tensor_record.write_tensor(f, rows.dtype, tuple(rows.shape), blocks)
    with open(path, "rb") as f:
        saved = locate(f, 101, length)
    full = [b for b in blocks if len(b) >= writeback.MIN_BYTES]
    starts = [saved.data_offset + i * block for i in range(len(full))]
    assert calls == [(s, len(b)) for s, b in zip(starts, full, strict=True)]
    back = torch.load(io.BytesIO(path.read_bytes()[101 : 101 + length]), weights_only=True)
    assert torch.equal(back, rows)


def test_a_refusal_is_ignored():
    r, w = os.pipe()  # a pipe: sync_file_range refuses it (ESPIPE)
    with open(w, "wb", buffering=0) as f:
        writeback.start_writeback(f, 0, writeback.MIN_BYTES)
    os.close(r)
