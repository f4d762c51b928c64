"""One model call over a ragged batch of appends, staged into the K/V store.

The worker and crash recovery both run appends through `run_call`, so a journal's
appends re-execute with exactly the shapes they first ran with (batch size, padded
query rows, padded key extent): on CPU fp32 that reproduces every row bit for bit.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from kvledger.worker.kvstore import KVStore
from kvledger.worker.model import Transformer


class Member(NamedTuple):
    handle_id: str
    past: int  # rows already in the slot (committed, or staged by a pipelined call)
    token_ids: tuple[int, ...]


class CallShape(NamedTuple):
    size: int
    new_pad: int
    key_extent: int


def shape_of(members: list[Member]) -> CallShape:
    return CallShape(len(members), max(len(m.token_ids) for m in members),
                     max(m.past + len(m.token_ids) for m in members))


class _SlabView:
    """KVView over the store: stage this call's rows in place past each slot's
    frontier (invisible until commit), then attend over the slab's prefix."""

    def __init__(self, store: KVStore, members: list[Member], shape: CallShape,
                 device: torch.device) -> None:
        self.store = store
        self.members = members
        slots = [store.slot[m.handle_id] for m in members]
        self.slots = torch.tensor(slots, device=device)
        # Members in consecutive slots (a batch admitted together) are read as a view of
        # the slab instead of a gathered copy: SDPA reads through the strides, bit for bit
        # the same result, without copying every member's history per layer.
        self.span = slice(slots[0], slots[0] + len(slots)) \
            if slots == list(range(slots[0], slots[0] + len(slots))) else None
        self.past = torch.tensor([m.past for m in members], device=device)
        self.extent = shape.key_extent
        self.decode = shape.new_pad == 1
        if self.decode:  # where each member's new row goes, per head, in a layer's slab
            self.rows = store.layer_rows(self.slots, self.past).reshape(-1)
        q_pos = self.past[:, None] + torch.arange(shape.new_pad, device=device)[None, :]
        keys = torch.arange(shape.key_extent, device=device)
        self.mask = (keys[None, None, :] <= q_pos[:, :, None])[:, None]  # [B, 1, T_new, T_kv]

    def __call__(self, layer: int, k_new: Tensor, v_new: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        K, V = self.store.k[layer], self.store.v[layer]
        if self.decode:  # one index_copy_ per tensor: under half the cost of K[slots, :, past] = ...
            d = K.shape[-1]
            K.view(-1, d).index_copy_(0, self.rows, k_new.reshape(-1, d))
            V.view(-1, d).index_copy_(0, self.rows, v_new.reshape(-1, d))
        else:
            for b, m in enumerate(self.members):
                s, n = int(self.slots[b]), len(m.token_ids)
                K[s, :, m.past:m.past + n] = k_new[b, :, :n]
                V[s, :, m.past:m.past + n] = v_new[b, :, :n]
        e, slots = self.extent, self.slots
        if self.span is not None:
            return K[self.span, :, :e], V[self.span, :, :e], self.mask
        # index_select over the key-extent view: the same contiguous copy as advanced
        # indexing K[slots, :, :extent], at under half the cost.
        return K[:, :, :e].index_select(0, slots), V[:, :, :e].index_select(0, slots), self.mask


@torch.inference_mode()
def run_call(model: Transformer, store: KVStore, members: list[Member], shape: CallShape,
             *, all_rows: bool = False) -> Tensor:
    """Run one forward over `members` with exactly `shape`; stage their rows.

    Returns logits [B, R, V]: R = new_pad when all_rows (speculative verify needs every
    row), else R = 1, the last real row of each member."""
    device = store.k.device
    assert shape.size == len(members)
    # Built as Python lists and converted once: a tensor op per member cost more than the
    # forward's attention at batch 16 on CPU.
    pad = shape.new_pad
    ids = torch.tensor([(*m.token_ids, *(0,) * (pad - len(m.token_ids))) for m in members],
                       dtype=torch.long, device=device)
    pos = torch.tensor([range(m.past, m.past + pad) for m in members], dtype=torch.long, device=device)
    view = _SlabView(store, members, shape, device)
    rows = "all" if all_rows else torch.tensor([len(m.token_ids) - 1 for m in members], device=device)
    logits: Tensor = model(ids, pos, kv=view, logits_rows=rows)
    for m in members:
        store.staged(m.handle_id, m.past + len(m.token_ids))
    return logits
