"""EmbeddingStreamer: ordered delivery, bounded waits with counted drops, sinks."""

import threading
import time

import pytest
import torch

from tests.checkpoint.test_incremental import _ebc, _step
from torchrec_kvemb.checkpoint.streaming import CallableSink, EmbeddingStreamer, FileSink


def _replay(batches):
    """Apply batches in order: {table: {id: (weights, scores, momentum1)}}."""
    state: dict[str, dict[int, tuple]] = {}
    for batch in batches:
        for name, t in batch["tables"].items():
            rows = state.setdefault(name, {})
            for i in t["evicted"].tolist():
                rows.pop(i, None)
            for k, i in enumerate(t["ids"].tolist()):
                rows[i] = (t["weights"][k], t["scores"][k], t["momentum1"][k])
    return state


def _assert_converged(state, ebc):
    for name, table in ebc.kv_tables().items():
        live = table.export()
        rows = state.get(name, {})
        assert sorted(rows) == live["ids"].tolist(), name
        for k, i in enumerate(live["ids"].tolist()):
            w, s, m = rows[i]
            assert torch.equal(w, live["weights"][k]) and int(s) == int(live["scores"][k])
            assert torch.equal(m, live["momentum1"][k])


def test_all_updates_reach_callable_sink_in_order():
    ebc = _ebc()
    gen = torch.Generator().manual_seed(0)
    received = []
    streamer = EmbeddingStreamer(ebc, CallableSink(received.append), max_queue=4)
    for _ in range(10):
        _step(ebc, gen)
        assert streamer.after_step()
    assert not streamer.after_step()  # nothing changed: nothing queued
    streamer.close()
    assert [b["seq"] for b in received] == list(range(10))
    m = streamer.metrics()
    assert m["published"] == 10 and m["dropped"] == 0 and m["sink_errors"] == 0
    assert 1 <= m["queue_high_water"] <= 4
    assert sum(b["tables"]["user"]["evicted"].numel() for b in received) > 0
    _assert_converged(_replay(received), ebc)
    with pytest.raises(RuntimeError, match="closed"):
        streamer.after_step()


@pytest.mark.parametrize("policy", ["drop_oldest", "block"])
def test_slow_sink_drops_are_counted_and_step_wait_is_bounded(policy):
    ebc = _ebc()
    gen = torch.Generator().manual_seed(1)
    received = []
    release = threading.Event()

    def slow(batch):  # a sink stuck until the training loop ends
        release.wait(10)
        received.append(batch)

    max_wait_s = 0.02
    streamer = EmbeddingStreamer(
        ebc, CallableSink(slow), max_queue=1, policy=policy, max_wait_s=max_wait_s
    )
    longest = 0.0
    for _ in range(15):
        _step(ebc, gen)
        start = time.perf_counter()
        streamer.after_step()
        longest = max(longest, time.perf_counter() - start)
    release.set()
    assert streamer.flush(timeout=10)
    m = streamer.metrics()
    assert m["dropped"] > 0
    assert m["published"] == len(received) and m["published"] + m["dropped"] == 15
    assert m["queue_high_water"] == 1
    # A correctness bound, not a benchmark: the step never waits for the slow sink.
    assert longest < max_wait_s + 0.5
    seqs = [b["seq"] for b in received]
    assert seqs == sorted(seqs)
    # Dropped batches' ids are re-sent with the next batch: after one more call
    # (no training in between) replaying what the sink got gives the live tables.
    assert streamer.flush(timeout=10)
    streamer.after_step()  # False when the last batch of the loop was kept
    streamer.close()
    assert streamer.metrics()["published"] == len(received)
    _assert_converged(_replay(received), ebc)


def test_sink_errors_are_counted_and_do_not_stop_streaming():
    ebc = _ebc()
    gen = torch.Generator().manual_seed(2)
    calls = []

    def flaky(batch):
        calls.append(batch["seq"])
        if batch["seq"] == 1:
            raise OSError("disk full")

    streamer = EmbeddingStreamer(ebc, CallableSink(flaky))
    for _ in range(3):
        _step(ebc, gen)
        streamer.after_step()
    streamer.close()
    assert calls == [0, 1, 2]
    assert streamer.metrics()["sink_errors"] == 1 and streamer.metrics()["published"] == 2
    assert isinstance(streamer.last_error, OSError)


def test_file_sink_writes_readable_files_and_close_drains(tmp_path):
    ebc = _ebc()
    gen = torch.Generator().manual_seed(3)
    sink = FileSink(tmp_path)
    gate = threading.Event()

    class Gated:
        def write(self, batch):
            gate.wait(5)
            sink.write(batch)

    streamer = EmbeddingStreamer(ebc, Gated(), max_queue=16)
    for _ in range(5):
        _step(ebc, gen)
        streamer.after_step()
    assert streamer.metrics()["published"] == 0  # all still queued behind the gate
    gate.set()
    streamer.close()
    assert streamer.metrics()["published"] == 5, streamer.last_error
    files = sink.files()
    assert len(files) == 5
    batches = [torch.load(f, weights_only=True) for f in files]
    assert [b["seq"] for b in batches] == list(range(5))
    assert batches[0]["tables"]["user"]["weights"].shape[1] == 4
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp")]
    _assert_converged(_replay(batches), ebc)


def test_bad_arguments():
    ebc = _ebc()
    with pytest.raises(ValueError, match="policy"):
        EmbeddingStreamer(ebc, CallableSink(print), policy="later")
    with pytest.raises(ValueError, match="max_queue"):
        EmbeddingStreamer(ebc, CallableSink(print), max_queue=0)
    with pytest.raises(TypeError, match="kv_tables"):
        EmbeddingStreamer(object(), CallableSink(print))
