"""The record format (journal/records.py): format 2 (zstd) and the format 1 (zlib)
records written before it read back the same; damage is named, never inflated without
bound; manifests read back in either stored form."""

from __future__ import annotations

import zlib

import msgspec
import pytest

from kvledger.journal.records import (
    FORMAT,
    Damage,
    _Header,
    audit_record,
    decode_record,
    encode_record,
    pack_manifest,
    unpack_manifest,
)
from kvledger.schemas.errors import KvLedgerError

EVENTS = [b'{"event_type":"append_start","n":%d}' % i for i in range(50)]
RECEIPTS = [b'{"operation_id":"op-%d"}' % i for i in range(7)]


def _format1(events: list[bytes], receipts: list[bytes]) -> bytes:
    """A record as revision 0003's first writer stored it: zlib level 1."""
    crc = zlib.crc32
    return msgspec.msgpack.encode(_Header(
        1, [len(e) for e in events], [crc(e) for e in events], [len(r) for r in receipts],
        [crc(r) for r in receipts], zlib.compress(b"".join(events) + b"".join(receipts), 1)))


@pytest.mark.parametrize("encode", [encode_record, _format1], ids=["format2", "format1"])
def test_both_formats_read_back_exactly(encode):
    body = encode(EVENTS, RECEIPTS)
    record = decode_record(body, "t")
    assert record.events == EVENTS and record.receipts == RECEIPTS


def test_new_records_are_format_2_and_smaller_than_format_1():
    events = [b'{"event_type":"output_emit","payload":{"output_index":%d,"token_id":%d}}' % (i, i * 7919 % 50000)
              for i in range(2000)]
    new, old = encode_record(events, []), _format1(events, [])
    assert msgspec.msgpack.decode(new, type=_Header).format == FORMAT == 2
    assert len(new) < len(old)


@pytest.mark.parametrize("encode", [encode_record, _format1], ids=["format2", "format1"])
def test_a_changed_event_byte_is_named(encode):
    h = msgspec.msgpack.decode(encode(EVENTS, RECEIPTS), type=_Header)
    crcs = list(h.event_crcs)
    crcs[17] ^= 1  # as if event 17's bytes had changed under an unchanged CRC
    found = audit_record(msgspec.msgpack.encode(msgspec.structs.replace(h, event_crcs=crcs)))
    assert isinstance(found, Damage) and found.index == 17 and len(found.events) == 17


@pytest.mark.parametrize("encode", [encode_record, _format1], ids=["format2", "format1"])
def test_a_forged_length_never_inflates_beyond_what_the_data_can_hold(encode):
    h = msgspec.msgpack.decode(encode(EVENTS, RECEIPTS), type=_Header)
    lengths = list(h.event_lengths)
    lengths[-1] = 1 << 40
    found = audit_record(msgspec.msgpack.encode(msgspec.structs.replace(h, event_lengths=lengths)))
    assert isinstance(found, Damage)
    with pytest.raises(KvLedgerError) as err:
        decode_record(msgspec.msgpack.encode(msgspec.structs.replace(h, event_lengths=lengths)), "at 9")
    assert err.value.code.value == "CORRUPT_JOURNAL"


def test_flipped_compressed_bytes_are_damage_inside_the_record():
    body = encode_record(EVENTS, RECEIPTS)
    h = msgspec.msgpack.decode(body, type=_Header)
    for at in range(0, len(h.data), 3):
        data = bytearray(h.data)
        data[at] ^= 0x5A
        found = audit_record(msgspec.msgpack.encode(msgspec.structs.replace(h, data=bytes(data))))
        if isinstance(found, Damage):
            assert found.index is None or 0 <= found.index < len(EVENTS)
            assert found.events == EVENTS[:len(found.events)]  # what it keeps is exact
        else:  # the flip landed where zstd does not look (it cannot change a byte we read)
            assert found.events == EVENTS and found.receipts == RECEIPTS


def test_manifests_read_back_in_either_stored_form():
    body = b'{"artifact_identity":{"adapter_set":[]},"schema_version":1}' * 20
    packed = pack_manifest(body)
    assert len(packed) < len(body)
    assert unpack_manifest(packed) == body
    assert unpack_manifest(body) == body  # stored before format 2: as it is
    damaged = packed[:-3] + b"\x00\x00\x00"
    assert unpack_manifest(damaged) == damaged  # verify then sees a digest that does not match
