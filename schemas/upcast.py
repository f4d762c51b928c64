"""Upcasters: read a stored payload written under an older schema_version.

Stored rows are never rewritten. Each upcaster lifts one version to the next; the
chain runs when an event is read. A version newer than the code knows is refused
(UNKNOWN_SCHEMA_VERSION): guessing at a future schema would be silent corruption.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvledger.schemas.canonical import layers_sha256

Upcaster = Callable[[dict[str, Any], dict[str, Any]], dict[str, Any]]

# (event_type, from_version) -> function(payload, envelope) returning the next version.
UPCASTERS: dict[tuple[str, int], Upcaster] = {}


def upcaster(event_type: str, from_version: int) -> Callable[[Upcaster], Upcaster]:
    def register(fn: Upcaster) -> Upcaster:
        UPCASTERS[(event_type, from_version)] = fn
        return fn

    return register


@upcaster("append_start", 1)
def _append_start_v1(payload: dict[str, Any], envelope: dict[str, Any]) -> dict[str, Any]:
    # v1 stored the interval as one half-open pair and had no explicit mask extent or
    # positions: under v1 the mask always covered exactly [0, end) and positions were
    # the interval itself, so both are derivable without guessing.
    p = dict(payload)
    start, end = p.pop("interval")
    p["interval_start"] = start
    p["interval_count"] = end - start
    p.setdefault("cache_positions", list(range(start, end)))
    p.setdefault("mask_key_extent", end)
    return p


@upcaster("append_start", 2)
def _append_start_v2(payload: dict[str, Any], envelope: dict[str, Any]) -> dict[str, Any]:
    # v2's ForwardCall did not record the thread count; v3 reads its absence as 0 (not
    # recorded), which is what the field's default says, so the payload stands as it is.
    return payload


@upcaster("append_publish", 1)
def _append_publish_v1(payload: dict[str, Any], envelope: dict[str, Any]) -> dict[str, Any]:
    # v1 listed each layer's rows. v2 counts the layers 0, 1, ... whose K and V are
    # complete over the rows the publish commits (those that end at committed_length):
    # a v1 record that named fewer, skipped one, or gave a layer other rows is counted
    # only up to there, so verify still reports that publish as a partial layer set. The
    # row digests combine into one (schemas.canonical.layers_sha256) when every layer
    # had one.
    p = dict(payload)
    layers = p.pop("layers")
    start, count = p["committed_length"] - p["accepted_count"], p["accepted_count"]
    by_layer = {r["layer"]: r for r in layers}
    n = 0
    while (r := by_layer.get(n)) is not None and len(by_layer) == len(layers) and r["k_complete"] \
            and r["v_complete"] and (r["start"], r["count"]) == (start, count):
        n += 1
    p["layers_complete"] = n
    digests = [r.get("rows_sha256") for r in sorted(layers, key=lambda r: r["layer"])]
    if digests and all(isinstance(d, str) for d in digests):
        p["rows_sha256"] = layers_sha256(digests)
    return p


@upcaster("kv_events_gap", 1)
def _kv_events_gap_v1(payload: dict[str, Any], envelope: dict[str, Any]) -> dict[str, Any]:
    # v2 added the code and size of a refused batch; a v1 gap was never one: both absent.
    return payload
