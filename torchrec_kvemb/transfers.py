"""Row transfers between a table's (or a group's) arrays and its host-side tiers.

A step of tables over lower tiers moves rows in two directions
(docs/tiers.md, "Transfers"):

* **down** (demotion): the rows memory evicts leave by one gather of the
  arrays at their slots (``index_select`` of the weights and of the state),
  then one device-to-host copy; the tiers take their slices on the host;
* **up** (promotion): the rows the tiers hand back go up as one host buffer
  (pinned under CUDA), one host-to-device copy, one scatter
  (``dispatch.scatter_rows`` of the weights and of the state) at their slots.

A group of tables shares its arrays (global slots address every table's rows),
so one ``gather_down`` and one ``scatter_up`` per step serve the whole group
(``tiered_lookup``). On the CPU the copies are no-ops (the arrays are host
memory). On CUDA they run on a side stream (``torch.cuda.Stream``): the gather
is ordered on the current stream before it, so a demoted row's slot may be
overwritten by the current stream as soon as the gather is queued; the
current stream waits for the upward copy's event before its scatter, so a
lookup never reads a promoted row before it lands; the host waits for the
downward copy's event (``Down.rows``) before the tiers read the rows.

Example::

    down = gather_down(weights, state, evicted_slots)  # before the slots are refilled
    scatter_up(weights, state, promoted_slots, host_rows)
    tier.put(ids, scores, tier_scores, down.rows())    # the host copy, landed
"""

from __future__ import annotations

import torch

from torchrec_kvemb import dispatch

#: Side streams by device index (made once per device).
_STREAMS: dict[int, torch.cuda.Stream] = {}


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """The transfers' CUDA stream of ``device`` (made on first use)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _STREAMS.get(index)
    if stream is None:
        stream = _STREAMS[index] = torch.cuda.Stream(index)
    return stream


def host_buffer(rows: int, width: int, device: torch.device) -> torch.Tensor:
    """An empty float32 host buffer of ``[rows, width]``: pinned when ``device`` is
    CUDA (the copy to it or from it then does not block the host)."""
    return torch.empty(rows, width, pin_memory=device.type == "cuda")


class Down:
    """Rows gathered for a move to the host (``gather_down``); ``rows()`` gives
    them on the host once the copy has landed."""

    def __init__(self, rows: torch.Tensor, done: torch.cuda.Event | None = None) -> None:
        self._rows = rows
        self._done = done

    def rows(self) -> torch.Tensor:
        """``[n, dim + state_dim]`` float32 host rows (waits for the copy on CUDA)."""
        if self._done is not None:
            self._done.synchronize()
            self._done = None
        return self._rows


def gather_down(weights: torch.Tensor, state: torch.Tensor, slots: torch.Tensor) -> Down:
    """One gather of the rows at ``slots`` (weights, then state, side by side as
    float32) and one copy of them to the host; on CUDA the copy runs on the side
    stream after the gather (queued on the current stream) and ``Down.rows``
    waits for it."""
    dim = weights.shape[1]
    # why only on the CPU: one copy instead of two and a concatenation (the form the
    # CUDA twins ran with is the concatenation).
    if weights.dtype == state.dtype == torch.float32 and weights.device.type == "cpu":
        rows = torch.empty(slots.numel(), dim + state.shape[1], device=weights.device)
        dispatch.gather_rows(weights, slots, rows[:, :dim])
        dispatch.gather_rows(state, slots, rows[:, dim:])
    else:
        rows = torch.cat(
            [weights.index_select(0, slots).float(), state.index_select(0, slots).float()], dim=1
        )
    if rows.device.type != "cuda":
        return Down(rows)
    host = host_buffer(rows.shape[0], rows.shape[1], rows.device)
    side = side_stream(rows.device)
    side.wait_stream(torch.cuda.current_stream(rows.device))  # the gather first
    with torch.cuda.stream(side):
        host.copy_(rows, non_blocking=True)
        done = torch.cuda.Event()
        done.record(side)
    rows.record_stream(side)  # its memory is not reused before the copy leaves
    return Down(host, done)


def upload(rows: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``rows`` on ``device``: from host memory to CUDA by one copy on the side stream
    (non-blocking from pinned memory), which the current stream waits for before
    anything it queues next reads them."""
    if device.type != "cuda" or rows.device.type == "cuda":
        return rows.to(device)
    side = side_stream(device)
    current = torch.cuda.current_stream(device)
    with torch.cuda.stream(side):
        up = rows.to(device, non_blocking=rows.is_pinned())
        landed = torch.cuda.Event()
        landed.record(side)
    current.wait_event(landed)
    up.record_stream(current)  # made on the side stream, read on the current one
    return up


def scatter_up(
    weights: torch.Tensor, state: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor
) -> None:
    """``rows [n, dim + state_dim]`` (host memory, pinned under a CUDA table: one
    buffer) up in one copy, then one scatter at ``slots`` of ``weights`` and
    ``state``; on CUDA the copy runs on the side stream and the current stream
    waits for it before the scatter."""
    if slots.numel() == 0:
        return
    rows = upload(rows, weights.device)
    dim = weights.shape[1]
    dispatch.scatter_rows(weights, slots, rows[:, :dim].to(weights.dtype))
    if state.shape[1]:
        dispatch.scatter_rows(state, slots, rows[:, dim:].to(state.dtype))
