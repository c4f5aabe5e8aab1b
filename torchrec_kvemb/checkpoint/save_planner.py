"""DCP's save planner for ``checkpoint.save``: write each deferred row entry once it
is gathered (:mod:`torchrec_kvemb.state_dict.deferred`).

DCP's file writer asks the planner for each entry's data as it writes it, on its
writer threads; waiting there lets the writers write the first tables while the
later ones are still being gathered.

Example::

    with deferred_rows() as deferred:
        state = {"model": model.state_dict()}
    threading.Thread(target=deferred.fill).start()
    dcp.save(state, checkpoint_id=path, planner=DeferredRowsSavePlanner(deferred))
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import WriteItem

from torchrec_kvemb.state_dict.deferred import DeferredRows


class DeferredRowsSavePlanner(DefaultSavePlanner):
    """DCP's default save planner; an entry of ``deferred`` is handed to the writer
    only once it is filled."""

    def __init__(self, deferred: DeferredRows) -> None:
        super().__init__()
        self._deferred = deferred

    def resolve_data(self, write_item: WriteItem) -> Any:
        data = super().resolve_data(write_item)
        if isinstance(data, torch.Tensor):
            self._deferred.wait_for(data)
        return data
