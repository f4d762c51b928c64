"""`kvledger import` into a NATS cell (journal.nats): an exported journal loaded into an
empty stream as records in the journal's own format, one per imported receipt (each
keeps its operation's wall clock), with their chain and stream links, then each
handle's head and the manifests.

The stream holds nothing to roll back (delete and purge are denied), so everything is
read and checked before the first message is published: the exported events (kept in
memory: an import into NATS is bounded by memory), their receipts covering every
position once, in order. Every batch expects the stream's last sequence, so another
writer meanwhile stops the import rather than interleaving with it; an import stopped
by a failed publish leaves a cell that is not empty, which a second import refuses.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Protocol

from kvledger.journal.contract import HeadFacts, ImportTables
from kvledger.journal.keys import PREV_NONE, pack_prev
from kvledger.journal.manifests import pack_manifest
from kvledger.journal.nats_client import NatsClient, Refused
from kvledger.journal.nats_heads import head_encode, token
from kvledger.journal.readback import compact_parts
from kvledger.journal.record_format import FORMAT, GENESIS, chain, encode_record
from kvledger.journal.steps import StepWriter
from kvledger.schemas.errors import ErrorCode, KvLedgerError
from kvledger.schemas.events import Event


class Target(Protocol):
    """The cell an import writes (journal.nats.NatsJournal)."""

    client: NatsClient
    display_url: str
    stream: str
    prefix: str
    records_subject: str

BATCH = 500  # messages an atomic batch carries here (the server takes at most 1000)
Message = tuple[str, bytes, dict[str, str]]


def import_into(j: Target, events: Iterable[tuple[Event, bytes]], tables: Callable[[], ImportTables]) -> None:
    state = j.client.api(f"STREAM.INFO.{j.stream}").get("state") or {}
    if int(state.get("messages", 0)) or int(state.get("last_seq", 0)):
        raise KvLedgerError(ErrorCode.INVALID_ARGUMENT, f"{j.display_url} is not empty: import loads an exported "
                            "journal into an empty cell")
    bodies: dict[int, tuple[str, bytes]] = {e.global_position: (e.stream_id, body) for e, body in events}
    derived = tables()
    messages: list[Message] = []
    records: dict[str, int] = {}  # handle -> the stream sequence of its last record
    link, at = GENESIS, 0
    for r in sorted(derived.receipts, key=lambda r: r.first_global_position):
        if r.first_global_position != at + 1 or not all(p in bodies for p in range(at + 1, r.last_global_position + 1)):
            raise KvLedgerError(ErrorCode.INVALID_ARGUMENT, f"the exported journal's receipts do not cover its "
                                f"events once, in order (at position {at + 1})")
        own = [bodies.pop(p) for p in range(r.first_global_position, r.last_global_position + 1)]
        steps = StepWriter(r.first_global_position, r.committed_wall_ns)
        heads = [v for h in r.handles for v in (h.generation, h.snapshot_version, h.committed_length)]
        body = encode_record([b for _, b in own], [compact_parts(len(own), r.fingerprint, r.committed_wall_ns, heads),
                                                   steps.context()], FORMAT)
        link = chain(link, body)
        streams = list(dict.fromkeys(s for s, _ in own))
        seq = len(messages) + 1  # the stream is empty: a message's sequence is its place
        messages.append((j.records_subject, body, {
            "Kvl-First": str(r.first_global_position), "Kvl-Last": str(r.last_global_position),
            "Kvl-Chain": link.hex(), "Kvl-Prev": pack_prev([records.get(s, PREV_NONE) for s in streams]).hex()}))
        records.update((s, seq) for s in streams)
        at = r.last_global_position
    if bodies:
        raise KvLedgerError(ErrorCode.INVALID_ARGUMENT, f"{len(bodies)} exported events are in no receipt")
    _heads(j, derived.heads, records, messages)
    for sha, manifest in derived.manifests:
        messages.append((f"{j.prefix}.m.{sha}", pack_manifest(manifest), {}))
    for start in range(0, len(messages), BATCH):
        batch = messages[start:start + BATCH]
        subject, data, headers = batch[0]
        batch[0] = (subject, data, {**headers, "Nats-Expected-Last-Sequence": str(start)})
        try:
            j.client.publish_batch(batch)
        except Refused as refused:
            raise KvLedgerError(ErrorCode.DATABASE_ERROR, f"{j.display_url} refused an imported batch at stream "
                                f"sequence {start + 1} (JetStream error {refused.code}): the cell is left "
                                "partly imported") from None


def _heads(j: Target, heads: Mapping[str, HeadFacts], records: dict[str, int], messages: list[Message]) -> None:
    for handle, facts in sorted(heads.items()):
        if handle not in records:
            raise KvLedgerError(ErrorCode.INVALID_ARGUMENT, f"the exported journal has a head for {handle!r} "
                                "and no event of it")
        seq = len(messages) + 1
        messages.append((f"{j.prefix}.h.{token(handle)}", head_encode(handle, seq - records[handle], facts), {}))


__all__ = ["import_into"]
