"""Helpers for lifecycle tests: a ledger per backend and a few common moves."""

from __future__ import annotations

from kvledger import Ledger
from kvledger.engine.service import ManualClock  # noqa: F401 - re-exported for the tests

from factories import make_manifest


def base(ledger: Ledger, handle: str) -> tuple[int, int]:
    s = ledger.state(handle)
    return (s.generation, s.snapshot_version)


def allocate(ledger: Ledger, handle: str, prompt=(11, 22, 33, 44), capacity=16, generation=0, **kw):
    m = make_manifest(request_id=handle, prompt=tuple(prompt), **kw)
    ledger.allocate(handle, m, reserved_capacity=capacity, generation=generation)
    return m


def prefill(ledger: Ledger, handle: str, txn: str | None = None):
    s = ledger.state(handle)
    txn = txn or f"{handle}-prefill"
    b = (s.generation, s.snapshot_version)
    ledger.begin_append(handle, txn_id=txn, kind="prefill", base=b, start=0, token_ids=s.prompt)
    return ledger.publish(handle, txn_id=txn, base=b)


def emit(ledger: Ledger, handle: str, token: int):
    s = ledger.state(handle)
    return ledger.emit(handle, base=(s.generation, s.snapshot_version), output_index=len(s.outputs),
                       token_id=token)


def decode(ledger: Ledger, handle: str, txn: str, kind: str = "decode"):
    s = ledger.state(handle)
    b = (s.generation, s.snapshot_version)
    ledger.begin_append(handle, txn_id=txn, kind=kind, base=b, start=s.committed_length,
                        token_ids=(s.outputs[-1],))
    return ledger.publish(handle, txn_id=txn, base=b)
