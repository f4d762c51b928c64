"""The worker's K/V store: committed rows per handle in preallocated slots.

One slab per layer, [slots, H_kv, capacity, d_h], K and V apart: the stored cache stays
at H_kv heads (query heads share them by broadcast inside attention). A handle owns
one slot. Row r of a handle is visible only if r < committed: rows in [committed,
pending) are staged by appends whose publication has not committed. `commit` moves
the frontier only after the journal said yes; `discard` drops the staged rows. So a
reader never sees half a publication, and a rejected one changes nothing visible.
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch
from torch import Tensor

from kvledger.schemas.errors import ErrorCode, KvLedgerError
from kvledger.worker.model import ModelConfig


class KVStore:
    def __init__(self, cfg: ModelConfig, *, slots: int, capacity: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> None:
        shape = (cfg.num_layers, slots, cfg.num_kv_heads, capacity, cfg.head_dim)
        # zeros, not empty: masked-out slots are multiplied by an exact 0 in attention,
        # which is only exact for finite values.
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.capacity = capacity
        self._head_rows = torch.arange(cfg.num_kv_heads, device=device) * capacity
        self._layer_rows = torch.arange(cfg.num_layers, device=device) * (slots * cfg.num_kv_heads * capacity)
        self._free = list(range(slots - 1, -1, -1))
        self.slot: dict[str, int] = {}
        self.committed: dict[str, int] = {}
        self.pending: dict[str, int] = {}
        self.reserved: dict[str, int] = {}

    # -- ownership ---------------------------------------------------------------
    def open(self, handle_id: str, reserved: int) -> int:
        if handle_id in self.slot:
            return self.slot[handle_id]
        if reserved > self.capacity:
            raise KvLedgerError(ErrorCode.CAPACITY_EXCEEDED,
                                f"{handle_id} reserves {reserved} rows, slots hold {self.capacity}")
        if not self._free:
            raise KvLedgerError(ErrorCode.CAPACITY_EXCEEDED, "no free K/V slot")
        s = self._free.pop()
        self.slot[handle_id], self.committed[handle_id], self.pending[handle_id] = s, 0, 0
        self.reserved[handle_id] = reserved
        return s

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def release(self, handle_id: str) -> None:
        s = self.slot.pop(handle_id, None)
        if s is not None:
            self._free.append(s)
            for d in (self.committed, self.pending, self.reserved):
                d.pop(handle_id, None)

    def fork(self, parent: str, child: str, prefix: int) -> None:
        """A logical fork realized as a copy of the committed prefix into a new slot."""
        s = self.open(child, self.reserved[parent])
        p = self.slot[parent]
        self.k[:, s, :, :prefix] = self.k[:, p, :, :prefix]
        self.v[:, s, :, :prefix] = self.v[:, p, :, :prefix]
        self.committed[child] = self.pending[child] = prefix

    def reorder(self, rows: tuple[str, ...], permutation: tuple[int, ...]) -> None:
        """A committed reorder of a group's rows: new row i takes old row permutation[i].
        The group keeps its slots in row order and the contents move between them (one
        gather over the slot axis, as a beam search's reorder_cache does), so each
        handle's rows follow it to its new row's slot."""
        slots = [self.slot[h] for h in rows]
        src = torch.tensor([slots[j] for j in permutation], device=self.k.device)
        dst = torch.tensor(slots, device=self.k.device)
        self.k[:, dst] = self.k[:, src]  # the right side is a copy: overlapping moves are safe
        self.v[:, dst] = self.v[:, src]
        for i, j in enumerate(permutation):
            self.slot[rows[j]] = slots[i]

    # -- staging and publication ---------------------------------------------------
    def staged(self, handle_id: str, until: int) -> None:
        self.pending[handle_id] = until

    def commit(self, handle_id: str, length: int) -> None:
        """The journal committed a publication ending at `length`."""
        self.committed[handle_id] = length
        self.pending[handle_id] = max(self.pending[handle_id], length)

    def discard(self, handle_id: str) -> None:
        self.pending[handle_id] = self.committed[handle_id]

    def truncate(self, handle_id: str, length: int) -> None:
        self.committed[handle_id] = self.pending[handle_id] = length

    # -- reads ---------------------------------------------------------------------
    def read(self, handle_id: str) -> tuple[Tensor, Tensor]:
        """The visible K and V: [L, H_kv, committed, d_h] copies."""
        s, t = self.slot[handle_id], self.committed[handle_id]
        return self.k[:, s, :, :t].clone(), self.v[:, s, :, :t].clone()

    def layer_rows(self, slots: Tensor, positions: Tensor) -> Tensor:
        """[B, H_kv]: where (slot, head, position) sits in one layer's slab seen as rows of
        d_h (`self.k[layer].view(-1, d_h)`); add `layer * slots * H_kv * capacity` for the
        whole store seen that way."""
        _, _, heads, cap, _ = self.k.shape
        return torch.add(positions, slots, alpha=heads * cap)[:, None] + self._head_rows

    def rows_sha256(self, handle_id: str, start: int, count: int) -> list[str]:
        """Per layer, the digest of its K then V rows [start, start+count), as stored."""
        return self.rows_sha256_many([(handle_id, start, count)])[0]

    def rows_sha256_many(self, spans: list[tuple[str, int, int]]) -> list[list[str]]:
        """rows_sha256 for many (handle, start, count) at once. Single-row spans (a decode
        step) are gathered in one copy for the whole batch, laid out so that each digest
        reads one contiguous run of bytes (layer l of member b: its K row, then its V row)."""
        out: list[list[str] | None] = [None] * len(spans)
        single = [i for i, (_, _, n) in enumerate(spans) if n == 1]
        if single:
            layers, _, heads, _, dim = self.k.shape
            dev = self.k.device
            rows = self.layer_rows(torch.tensor([self.slot[spans[i][0]] for i in single], device=dev),
                                   torch.tensor([spans[i][1] for i in single], device=dev))
            idx = (rows[:, None, :] + self._layer_rows[None, :, None]).reshape(-1)  # [B, L, H_kv]
            k = self.k.view(-1, dim).index_select(0, idx).view(len(single), layers, heads * dim)
            v = self.v.view(-1, dim).index_select(0, idx).view(len(single), layers, heads * dim)
            # numpy's stubs declare ndarray's buffer protocol (__buffer__) only for Python >= 3.12
            buf = memoryview(_bytes(torch.stack((k, v), dim=2))).cast("B")  # type: ignore[arg-type]
            n = len(buf) // (len(single) * layers)
            digests = [hashlib.sha256(buf[o:o + n]).hexdigest() for o in range(0, len(buf), n)]
            for j, i in enumerate(single):
                out[i] = digests[j * layers:(j + 1) * layers]
        for i, (h, start, n) in enumerate(spans):
            if out[i] is None:
                s = self.slot[h]
                kb = _bytes(self.k[:, s, :, start:start + n])  # [L, H, n, d_h]
                vb = _bytes(self.v[:, s, :, start:start + n])
                out[i] = _per_layer(kb, vb)
        return out  # type: ignore[return-value]  # the loops above fill every entry

    def payload_bytes(self, handle_id: str) -> int:
        """Bytes of the visible rows: committed x B_token (H_kv heads, never H_q)."""
        t = self.committed[handle_id]
        layers, _, heads, _, dim = self.k.shape
        return t * layers * heads * dim * (self.k.element_size() + self.v.element_size())


def _bytes(t: Tensor) -> np.ndarray:
    return t.contiguous().view(torch.uint8).cpu().numpy()


def _per_layer(k: np.ndarray, v: np.ndarray) -> list[str]:
    digests = []
    for layer in range(k.shape[0]):
        h = hashlib.sha256(k[layer].data)
        h.update(v[layer].data)
        digests.append(h.hexdigest())
    return digests
