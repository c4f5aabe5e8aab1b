"""Stream a module's changed embedding rows to a sink while training goes on.

``EmbeddingStreamer(module, sink)``: call ``after_step()`` after each optimizer
step. It finds the rows changed since its previous call (the digest tracker of
:mod:`.incremental`: ids whose weights, optimizer state or score changed, and
ids evicted), puts them as one batch on a bounded queue and returns; a worker
thread hands the batches to the sink in order.

Bound on the training step: ``after_step`` waits for the queue at most
``max_wait_s``. Its total time is that wait plus finding the changes (one
``KVTable.export()`` and a digest per row: proportional to the stored rows, not
to the sink). When the queue is full, policy ``"drop_oldest"`` drops the oldest
queued batch without waiting, ``"block"`` waits up to ``max_wait_s`` for room and
then drops the new batch. Either way the drop is counted (``metrics()["dropped"]``)
and the dropped batch's ids are marked to be sent again, so the next batch
carries their current rows (or their eviction): a sink that applies batches in
order still converges to the tables' content.

Example::

    streamer = EmbeddingStreamer(ebc, FileSink("/stream/run1"), max_queue=8)
    for batch in batches:
        train_step(batch)
        streamer.after_step()
    streamer.close()          # sends what is queued, stops the worker
    streamer.metrics()        # {"published": ..., "dropped": ..., ...}
"""

from __future__ import annotations

import collections
import os
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any, Protocol

import torch

from torchrec_kvemb.checkpoint.incremental import HasKVTables, RowTracker

__all__ = ["CallableSink", "EmbeddingStreamer", "FileSink", "Sink"]

_POLICIES = ("drop_oldest", "block")

#: A batch: ``{"seq": int, "tables": {name: {"ids", "weights", "scores",
#: <optimizer state by name>, "evicted"}}}`` (CPU tensors, only changed tables).
Batch = dict[str, Any]


class Sink(Protocol):
    """Receives the streamer's batches, one call at a time, in order."""

    def write(self, batch: Batch) -> None: ...


class CallableSink:
    """A sink that calls ``fn(batch)``.

    Example::

        received = []
        streamer = EmbeddingStreamer(ebc, CallableSink(received.append))
    """

    def __init__(self, fn: Callable[[Batch], Any]) -> None:
        if not callable(fn):
            raise TypeError(f"CallableSink needs a callable, got {type(fn).__name__}")
        self.fn = fn

    def write(self, batch: Batch) -> None:
        self.fn(batch)


class FileSink:
    """A sink that writes each batch to ``directory/<seq:09d>.pt`` with ``torch.save``
    (into a temporary file, then renamed: a reader never sees a partial file).

    Example::

        sink = FileSink("/stream/run1")
        ...
        batch = torch.load(sink.files()[0])
    """

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = os.fspath(directory)
        os.makedirs(self.directory, exist_ok=True)

    def write(self, batch: Batch) -> None:
        final = os.path.join(self.directory, f"{batch['seq']:09d}.pt")
        tmp = os.path.join(self.directory, f".tmp-{uuid.uuid4().hex}")
        try:
            with open(tmp, "wb") as f:
                torch.save(batch, f)
            os.replace(tmp, final)
        except BaseException:
            if os.path.exists(tmp):
                os.remove(tmp)
            raise

    def files(self) -> list[str]:
        """Paths of the complete batch files, in order."""
        names = sorted(
            n for n in os.listdir(self.directory) if n.endswith(".pt") and not n.startswith(".")
        )
        return [os.path.join(self.directory, n) for n in names]


class EmbeddingStreamer:
    """Publishes the rows each training step changes to a sink from a worker thread.

    ``after_step()`` never waits more than ``max_wait_s`` for the queue (see the
    module docstring for the full bound and the drop policies).

    Example::

        streamer = EmbeddingStreamer(ebc, CallableSink(publish), policy="block")
        for batch in batches:
            train_step(batch)
            streamer.after_step()
        streamer.close()
    """

    def __init__(
        self,
        module: HasKVTables,
        sink: Sink,
        max_queue: int = 8,
        policy: str = "drop_oldest",
        max_wait_s: float = 0.05,
    ) -> None:
        if not hasattr(module, "kv_tables"):
            raise TypeError(f"{type(module).__name__} has no kv_tables(): not a KV module")
        if not hasattr(sink, "write"):
            raise TypeError(f"sink {type(sink).__name__} has no write(batch) method")
        if max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_queue}")
        if policy not in _POLICIES:
            raise ValueError(f"policy must be one of {_POLICIES}, got {policy!r}")
        if max_wait_s < 0:
            raise ValueError(f"max_wait_s must be >= 0, got {max_wait_s}")
        self.module = module
        self.sink = sink
        self.max_queue = max_queue
        self.policy = policy
        self.max_wait_s = max_wait_s
        self._tracker = RowTracker()
        self._queue: collections.deque[Batch] = collections.deque()
        self._cond = threading.Condition()
        self._closed = False
        self._busy = False  # the worker is inside sink.write
        self._seq = 0
        self._metrics = {"published": 0, "dropped": 0, "queue_high_water": 0, "sink_errors": 0}
        self.last_error: BaseException | None = None
        self._worker = threading.Thread(target=self._run, name="EmbeddingStreamer", daemon=True)
        self._worker.start()

    # ------------------------------------------------------------ training side
    def after_step(self) -> bool:
        """Queue the changes since the previous call; returns False when there were
        none (nothing queued) or the batch was dropped. Call from one thread."""
        if self._closed:
            raise RuntimeError("EmbeddingStreamer is closed")
        deltas = self._tracker.diff(self.module.kv_tables())
        tables = {}
        for name, delta in deltas.items():
            if delta.empty:
                continue
            payload = {k: v.cpu() for k, v in delta.rows.items()}
            payload["evicted"] = delta.evicted.cpu()
            tables[name] = payload
        if not tables:
            return False
        batch: Batch = {"seq": self._seq, "tables": tables}
        self._seq += 1
        dropped: Batch | None = None
        with self._cond:
            if len(self._queue) >= self.max_queue:
                if self.policy == "drop_oldest":
                    dropped = self._queue.popleft()
                else:
                    deadline = time.monotonic() + self.max_wait_s
                    while len(self._queue) >= self.max_queue:
                        left = deadline - time.monotonic()
                        if left <= 0:
                            break
                        self._cond.wait(left)
                    if len(self._queue) >= self.max_queue:
                        dropped = batch
            if dropped is not batch:
                self._queue.append(batch)
                high = self._metrics["queue_high_water"]
                self._metrics["queue_high_water"] = max(high, len(self._queue))
                self._cond.notify_all()
            if dropped is not None:
                self._metrics["dropped"] += 1
        if dropped is not None:
            self._resend(dropped)
        return dropped is not batch

    def _resend(self, batch: Batch) -> None:
        for name, payload in batch["tables"].items():
            self._tracker.invalidate(name, torch.cat([payload["ids"], payload["evicted"]]))

    # -------------------------------------------------------------- worker side
    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return  # closed and drained
                batch = self._queue.popleft()
                self._busy = True
                self._cond.notify_all()  # room for a blocked after_step
            try:
                self.sink.write(batch)
            except Exception as e:  # a sink error must not stop training
                with self._cond:
                    self._metrics["sink_errors"] += 1
                    self.last_error = e
                    self._busy = False
                    self._cond.notify_all()
            else:
                with self._cond:
                    self._metrics["published"] += 1
                    self._busy = False
                    self._cond.notify_all()

    # ----------------------------------------------------------------- control
    def metrics(self) -> dict[str, int]:
        """``published`` (batches the sink took), ``dropped`` (batches dropped
        for a full queue), ``queue_high_water`` (most batches queued at once) and
        ``sink_errors`` (batches whose ``write`` raised; ``last_error`` is the last)."""
        with self._cond:
            return dict(self._metrics)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until the sink has taken every queued batch (training waits: use it
        at a checkpoint or the end, not every step). Returns False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and not self._busy, timeout)

    def close(self, timeout: float | None = None) -> None:
        """Hand every queued batch to the sink, then stop the worker (idempotent).
        Raises ``TimeoutError`` when the worker has not finished in ``timeout`` s."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._worker.join(timeout)
        if self._worker.is_alive():
            raise TimeoutError(f"sink still busy after {timeout} s")

    def __enter__(self) -> EmbeddingStreamer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
