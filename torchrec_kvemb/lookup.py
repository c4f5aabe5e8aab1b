"""The pooled lookup of a group of KV tables, with the optimizer fused into backward.

Forward pools the group's rows by slot; backward reduces the gradient per row
and applies each table's optimizer in place (no ``.grad`` for KV tables). The
backend of each op is chosen in ``dispatch.py``.
"""

from __future__ import annotations

import torch

from torchrec_kvemb.contracts import Bags, GroupLookup
from torchrec_kvemb.group import KVTableGroup


class GroupPooledLookup(torch.autograd.Function):
    """``anchor`` (an empty tensor that requires grad) ties the output into autograd.

    Example::

        lookup = group.lookup_train(ids, table_idx)
        pooled = GroupPooledLookup.apply(anchor, group, lookup, ids, table_idx, bags, bag_list)
        pooled.sum().backward()   # rows of the group updated in place
    """

    @staticmethod
    def forward(ctx, anchor, group, lookup, ids, table_idx, bags, bag_list):
        ctx.group = group
        ctx.lookup = lookup
        ctx.bags = bags
        ctx.learning_rates = group.learning_rate_tensor()
        if bag_list is None:  # every id a bag of its own: its row, unpooled
            return group.rows_forward(lookup.slots, ids, table_idx, bags, False)
        return group.pooled_forward(lookup.slots, ids, table_idx, bags, bag_list, False)

    @staticmethod
    def backward(ctx, grad_out):
        ctx.group.fused_backward(ctx.lookup, grad_out, ctx.bags, ctx.learning_rates)
        return (None,) * 7


def pooled_train(
    anchor: torch.Tensor,
    group: KVTableGroup,
    ids: torch.Tensor,
    table_idx: torch.Tensor,
    bags: Bags,
    bag_list: torch.Tensor | None,
    custom_scores: torch.Tensor | None = None,
    custom_tables: list[bool] | None = None,
) -> torch.Tensor:
    """A training batch of the group: new ids get rows, the pooled rows ``[B, dim]``
    (meaningful for the bags in ``bag_list``; ``None``: every id is a bag of its
    own and its row comes out, ``[n, dim]``) come out tied into autograd, and
    backward updates the rows."""
    lookup: GroupLookup = group.lookup_train(ids, table_idx, custom_scores, custom_tables)
    return GroupPooledLookup.apply(anchor, group, lookup, ids, table_idx, bags, bag_list)


def pooled_eval(
    group: KVTableGroup,
    ids: torch.Tensor,
    offsets: torch.Tensor | None,
    table_of_bag: torch.Tensor,
    per_sample_weights: torch.Tensor | None,
    mean_of_bag: torch.Tensor | None,
    bag_list: torch.Tensor,
    out_offset: torch.Tensor | None = None,
    out_shape: tuple[int, int] | None = None,
    unpooled: bool = False,
    into: torch.Tensor | None = None,
) -> torch.Tensor:
    """An evaluation batch of the group (read-only), probed and pooled in one call
    where the group has one: ids without a row pool zeros; bag ``b``'s row at flat
    offset ``out_offset[b]`` of a new ``out_shape`` tensor, or ``[B, dim]``;
    ``offsets`` None or ``unpooled``: every id's row, ``[n, dim]``; ``into``: memory
    the output may be written into, the result being the returned tensor
    (``KVTableGroup.pooled_eval``)."""
    return group.pooled_eval(
        ids, offsets, table_of_bag, per_sample_weights, mean_of_bag, bag_list, out_offset,
        out_shape, unpooled, into,
    )  # fmt: skip
