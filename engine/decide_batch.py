"""A whole DecodeBatch decided in one call, against the handles' states.

A decode step (schemas.decode_batch) is defined by its chain (commands.batch_chain:
publish, emit, start), which the general path (engine.chain: decide and evolve) decides.
Most steps a worker sends are the plain case: an active handle at the step's base (or
the handle's current), one open append that is neither a verify nor a repair, ending at
the last token, the emitted output next in line, the next append starting where the
publication ends, within the reserved capacity, with the handle's cache ABI. For those
the state the step leaves follows from a handful of fields, and is computed here column
by column with no command struct, draft or event. Any other step is asked of the general
path itself (engine.chain.general_after), so a refusal carries exactly its code and
message; a step it accepts in another form is left to the caller to plan there.
tests/test_decide_batch.py holds the batch decision to the general path over random
batches and states.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

from msgspec.structs import replace

from kvledger.engine import commands as c
from kvledger.engine.chain import general_after
from kvledger.engine.state import HandleState, OpenTxn, grown
from kvledger.schemas.decode_batch import DecodeBatch
from kvledger.schemas.errors import KvLedgerError


class BatchDecision(NamedTuple):
    """Per step: `plain[i]`, the state a plain step leaves; or `refused[i]`, the general
    path's refusal; neither: the general path accepts it, not as a plain step."""

    plain: list[HandleState | None]
    refused: list[KvLedgerError | None]


def decide_batch(batch: DecodeBatch, states: Mapping[str, HandleState | None], monotonic_ns: int) -> BatchDecision:
    """Decide every step of `batch` in order, each against `states` as the steps before
    it on the same handle leave them. Pure: nothing is stamped or written."""
    local: dict[str, HandleState | None] = {}
    plain: list[HandleState | None] = []
    refused: list[KvLedgerError | None] = []
    handles, txns, outputs, tokens = batch.handle_ids, batch.txn_ids, batch.output_indexes, batch.tokens
    nexts, positions, abis, bases = batch.next_txn_ids, batch.positions, batch.cache_abi_sha256, batch.bases
    for i, h in enumerate(handles):
        s = local[h] if h in local else states.get(h)
        after = None
        if s is not None and (bases is None or (base := bases[i]) is None
                              or base == (s.generation, s.snapshot_version)):
            after = plain_after(s, txns[i], outputs[i], tokens[i], nexts[i], positions[i], abis[i], monotonic_ns)
        if after is not None:
            local[h] = after
            plain.append(after)
            refused.append(None)
            continue
        plain.append(None)
        try:
            local.update(general_after({**states, **local}, c.batch_step(batch, i), monotonic_ns))
        except KvLedgerError as exc:
            refused.append(exc)
        else:
            refused.append(None)
    return BatchDecision(plain, refused)


def admits(s: HandleState) -> bool:
    """Whether a plain step may be decided on state `s`, whatever the step: plain_after's
    half that asks of the state alone (engine.lanes holds such states as columns)."""
    if s.lifecycle != "ACTIVE" or len(s.open_txns) != 1:
        return False
    t = s.open_txns[0]
    # the publication leaves logits ready only when its rows reach the last token
    return (t.kind != "verify" and t.kind != "repair" and t.base_snapshot_version == s.snapshot_version
            and t.interval_start + t.interval_count == len(s.prompt) + len(s.outputs))


def plain_after(s: HandleState, txn_id: str, output_index: int, token: int, next_txn_id: str, at: int,
                cache_abi_sha256: str, monotonic_ns: int) -> HandleState | None:
    """The state a plain decode step leaves, or None (not the plain case: the general
    path decides it): publish the running append `txn_id`, emit `token` as output
    `output_index`, start `next_txn_id` at position `at`. The base was checked."""
    if not admits(s):
        return None
    txn = s.open_txns[0]
    v = s.snapshot_version
    t = txn.interval_start + txn.interval_count
    if (txn_id != txn.txn_id or output_index != len(s.outputs) or at != t
            or cache_abi_sha256 != s.cache_abi_sha256 or t + 1 > s.reserved_capacity
            or next_txn_id in s.aborted_txn_ids):
        return None
    outputs, output_ns = grown(s.outputs, s.output_ns, (token,), (monotonic_ns,))
    return replace(
        s, stream_position=s.stream_position + 3, snapshot_version=v + 1, committed_length=t,
        logits_ready=False, outputs=outputs, output_ns=output_ns,
        open_txns=(OpenTxn(next_txn_id, "decode", v + 1, t, 1, (token,)),),
    )
