"""`kvledger import` into a NATS cell (journal.nats): an exported journal loaded into an
empty stream as records in the journal's own format, one per imported receipt (each
keeps its operation's wall clock), with their chain and stream links, then each
handle's head and the manifests.

All or nothing, though an import is many atomic batches (a batch holds at most 1000
messages): everything is read and checked before the first message is published (the
exported events are kept in memory: an import into NATS is bounded by memory), and the
messages are framed by two markers on `<prefix>.i`, `begin` first and `done` last.
Every batch expects the stream's last sequence, so another writer meanwhile stops the
import rather than interleaving with it. An import that fails partway deletes the
stream and makes it again as it was, empty (messages cannot be deleted, the stream
can); one killed partway leaves `begin` without `done`, which every later open of the
cell refuses as CORRUPT_JOURNAL (`unfinished`), and which a second import replaces.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

from kvledger.journal.contract import HeadFacts, ImportTables
from kvledger.journal.keys import PREV_NONE, pack_prev
from kvledger.journal.manifests import pack_manifest
from kvledger.journal.nats_client import STREAM_NOT_FOUND, NatsClient, Refused
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
BEGIN, DONE = b"begin", b"done"  # the markers that frame an import (see the module's doc)


def unfinished(client: NatsClient, stream: str, prefix: str) -> bool:
    """The cell holds an import that began and did not finish."""
    last = client.get(stream, {"last_by_subj": f"{prefix}.i"})
    return last is not None and last.data == BEGIN


def import_into(j: Target, events: Iterable[tuple[Event, bytes]], tables: Callable[[], ImportTables]) -> None:
    info = j.client.api(f"STREAM.INFO.{j.stream}")
    state = info.get("state") or {}
    restart = unfinished(j.client, j.stream, j.prefix)
    if not restart and (int(state.get("messages", 0)) or int(state.get("last_seq", 0))):
        raise KvLedgerError(ErrorCode.INVALID_ARGUMENT, f"{j.display_url} is not empty: import loads an exported "
                            "journal into an empty cell")
    messages = _messages(j, events, tables)  # read and checked whole before the cell is touched
    if restart:
        _recreate(j, info["config"])
    try:
        _publish(j, messages)
    except KvLedgerError as exc:
        try:
            _recreate(j, info["config"])
        except KvLedgerError:
            raise KvLedgerError(exc.code, f"{exc.message}; undoing the import failed too: the cell refuses "
                                "every use until an import into it completes") from None
        raise KvLedgerError(exc.code, f"{exc.message}; the import was undone: the cell is empty") from None


def _messages(j: Target, events: Iterable[tuple[Event, bytes]], tables: Callable[[], ImportTables]
              ) -> list[Message]:
    bodies: dict[int, tuple[str, bytes]] = {e.global_position: (e.stream_id, body) for e, body in events}
    derived = tables()
    messages: list[Message] = [(f"{j.prefix}.i", BEGIN, {})]
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
    messages.append((f"{j.prefix}.i", DONE, {}))
    return messages


def _publish(j: Target, messages: list[Message]) -> None:
    for start in range(0, len(messages), BATCH):
        batch = messages[start:start + BATCH]
        subject, data, headers = batch[0]
        batch[0] = (subject, data, {**headers, "Nats-Expected-Last-Sequence": str(start)})
        try:
            j.client.publish_batch(batch)
        except Refused as refused:
            raise KvLedgerError(ErrorCode.DATABASE_ERROR, f"{j.display_url} refused an imported batch at stream "
                                f"sequence {start + 1} (JetStream error {refused.code})") from None


def _recreate(j: Target, config: dict[str, Any]) -> None:
    """The stream deleted and made again with `config`: empty, as before the import."""
    for subject, request in ((f"STREAM.DELETE.{j.stream}", None), (f"STREAM.CREATE.{j.stream}", config)):
        error = j.client.api(subject, request).get("error")
        if error is not None and not (request is None and error.get("err_code") == STREAM_NOT_FOUND):
            raise KvLedgerError(ErrorCode.DATABASE_ERROR, f"{j.display_url}: {subject.split('.')[1].lower()} "
                                f"of the stream {j.stream} after a failed import was refused (JetStream error "
                                f"{error.get('err_code')}); run `kvledger init` and import again")


def _heads(j: Target, heads: Mapping[str, HeadFacts], records: dict[str, int], messages: list[Message]) -> None:
    for handle, facts in sorted(heads.items()):
        if handle not in records:
            raise KvLedgerError(ErrorCode.INVALID_ARGUMENT, f"the exported journal has a head for {handle!r} "
                                "and no event of it")
        seq = len(messages) + 1
        messages.append((f"{j.prefix}.h.{token(handle)}", head_encode(handle, seq - records[handle], facts), {}))


__all__ = ["import_into", "unfinished"]
