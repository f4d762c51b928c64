"""Row digests of a transformers cache, exactly as kvledger's own worker records them.

Per layer: SHA-256 over the K rows then the V rows of the interval, each laid out
[H_kv, n, d_h] as stored (worker.kvstore.rows_sha256); an append's one digest combines
the layers' (schemas.canonical.layers_sha256, done by the publish). Read from the tensors the cache holds
after the forward, never from what the model was given.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

Layers = Sequence[tuple[Tensor, Tensor]]  # per layer: keys, values [B, H_kv, T, d_h]


def of_cache(cache: Any) -> list[tuple[Tensor, Tensor]]:
    """A transformers cache's layers as (keys, values) [B, H_kv, T, d_h]."""
    return [(layer.keys, layer.values) for layer in cache.layers]


def _bytes(t: Tensor) -> np.ndarray:
    return t.detach().contiguous().view(torch.uint8).cpu().numpy()


def span_layers(layers: Layers, row: int, start: int, count: int) -> list[str]:
    """Per layer, the digest of batch row `row`'s cache columns [start, start+count)."""
    per_layer = []
    for k, v in layers:
        h = hashlib.sha256(_bytes(k[row, :, start:start + count]).data)
        h.update(_bytes(v[row, :, start:start + count]).data)
        per_layer.append(h.hexdigest())
    return per_layer


def same_columns(layers: Layers, row: int, other: int, start: int, count: int) -> int:
    """How many of the columns [start, start+count) batch rows `row` and `other` hold as
    the same bytes in every layer's K and V: the first column that differs, or count."""
    differs = torch.zeros(count, dtype=torch.bool)
    for k, v in layers:
        for t in (k, v):
            a = t[row, :, start:start + count].contiguous().view(torch.uint8)  # [H_kv, n, d_h bytes]
            b = t[other, :, start:start + count].contiguous().view(torch.uint8)
            differs |= (a != b).any(dim=2).any(dim=0).cpu()
    hit = differs.nonzero()
    return int(hit[0]) if len(hit) else count


def column_layers(layers: Layers, rows: Sequence[int], column: int) -> list[list[str]]:
    """span_layers(layers, r, column, 1) for many rows at once (a decode step)."""
    if not rows:
        return []
    k0 = layers[0][0]
    if k0.device.type == "cpu" and all(k.is_contiguous() and v.is_contiguous() for k, v in layers):
        # Views of the cache's own memory: one gather per tensor, then a hash per row and
        # layer. torch's per-op dispatch here cost more than the hashing.
        picked = np.asarray(rows)
        ks = [k.view(torch.uint8).numpy()[picked, :, column] for k, _ in layers]  # [R, H_kv, d_h bytes]
        vs = [v.view(torch.uint8).numpy()[picked, :, column] for _, v in layers]
        sha = hashlib.sha256
        out = []
        for r in range(len(rows)):
            per_layer = []
            for k, v in zip(ks, vs):
                h = sha(k[r])
                h.update(v[r])
                per_layer.append(h.hexdigest())
            out.append(per_layer)
        return out
    idx = torch.tensor(list(rows), device=k0.device)
    # [R, L, 2, H, d]: row r's layer l reads one contiguous run, K then V
    stacked = torch.stack([torch.stack((k[:, :, column].index_select(0, idx), v[:, :, column].index_select(0, idx)),
                                       dim=1) for k, v in layers], dim=1)
    buf = memoryview(_bytes(stacked)).cast("B")  # type: ignore[arg-type]  # numpy's buffer stubs: Python >= 3.12 only
    n_layers = len(layers)
    n = len(buf) // (len(rows) * n_layers)
    out = []
    for r in range(len(rows)):
        base = r * n_layers * n
        out.append([hashlib.sha256(buf[base + i * n:base + (i + 1) * n]).hexdigest() for i in range(n_layers)])
    return out
