"""Records: the journal's stored form since revision 0003, one row per commit. This module
names what the rest of the journal (and tests, migrations, bench) use of them; the code
is in the modules below.

A record holds the commit's events as the canonical JSON bodies the one-row-per-event
layout stored (the same bytes, so readers, `verify` and `export` see exactly what they
saw before), a decode step as values rather than three events (journal.steps,
journal.blocks), and the commit's receipts, compressed together with zstd.

- journal.record_format: the format written, 7, and the frame formats 5 to 7 share
- journal.legacy: formats 1 to 6, read-only
- journal.readback: what a record reads back as (Record, Damage), compact receipts
- journal.audit: reading a record of any format, and naming its damage
- journal.keys: the lookup keys of ids and the stream links SQL stores beside a record
- journal.manifests: manifests as kvl_manifests stores them

Tamper evidence (issue 17): each event and receipt carries a CRC-32 of its own bytes in
the record's lists, and each record a chain digest, SHA-256(previous record's chain ||
SHA-256(body)). A changed byte anywhere in a record breaks the chain there; its CRCs
name the first event whose bytes changed (a decode step's: its first event; in a format 7
block, the block's CRC column names the step). The chain costs 32 bytes a commit.
"""

from __future__ import annotations

from kvledger.journal.audit import (
    audit_record,
    decode_record,
    operation_ids,
    record_ids,
    record_streams,
    unpack_record,
)
from kvledger.journal.inflate import compress
from kvledger.journal.keys import (
    MAX_RUN,
    PREV_INDEXED,
    PREV_NONE,
    counted_keys,
    id_key,
    id_keys,
    id_runs,
    op_key,
    pack_prev,
    stab,
    stable_key,
    unpack_prev,
)
from kvledger.journal.legacy import Header4 as _Header
from kvledger.journal.manifests import (
    MANIFEST_REF,
    allocation_manifest,
    manifest_ref,
    manifest_ref_position,
    pack_manifest,
    unpack_manifest,
)
from kvledger.journal.readback import (
    FORMATS,
    Damage,
    Record,
    RecordParts,
    _compact_decode,
    compact_parts,
    compact_receipt,
    expand_receipts,
)
from kvledger.journal.record_format import (
    FORMAT,
    GENESIS,
    block_records,
    chain,
    encode_record,
    pack_record,
)
from kvledger.journal.record_format import Frame as _Header5

__all__ = [
    "FORMAT",
    "FORMATS",
    "GENESIS",
    "MANIFEST_REF",
    "MAX_RUN",
    "PREV_INDEXED",
    "PREV_NONE",
    "Damage",
    "Record",
    "RecordParts",
    "_Header",
    "_Header5",
    "_compact_decode",
    "allocation_manifest",
    "audit_record",
    "block_records",
    "chain",
    "compact_parts",
    "compact_receipt",
    "compress",
    "counted_keys",
    "decode_record",
    "encode_record",
    "expand_receipts",
    "id_key",
    "id_keys",
    "id_runs",
    "manifest_ref",
    "manifest_ref_position",
    "op_key",
    "operation_ids",
    "pack_manifest",
    "pack_prev",
    "pack_record",
    "record_ids",
    "record_streams",
    "stab",
    "stable_key",
    "unpack_manifest",
    "unpack_prev",
    "unpack_record",
]
