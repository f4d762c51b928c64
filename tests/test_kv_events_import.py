"""kvledger kv-events import: TensorRT-LLM and vLLM JSONL streams, all or nothing, and
the wire decoder's forms (vLLM maps, SGLang arrays, a newer engine's unknown field)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgspec
import pytest

from kvledger.cli import main
from kvledger.journal import open_journal
from kvledger.schemas import events as ev
from kvledger.schemas.errors import ErrorCode, KvLedgerError


def _trt(event_id: int, data: dict[str, Any], window: int = 32) -> str:
    return json.dumps({"event_id": event_id, "data": data, "window_size": window})


def _block(h: int, tokens: list[int], level: int = 0) -> dict[str, Any]:
    return {"type": "stored_block", "block_hash": h, "lora_id": None, "cache_level": level, "priority": 35,
            "tokens": [{"type": "unique_token", "token_id": t, "token_extra_id": 0} for t in tokens]}


def _replay(url: str, capsys: Any, *extra: str) -> dict[str, Any]:
    capsys.readouterr()
    assert main(["replay", "--db", url, "--json", *extra]) == 0
    doc: dict[str, Any] = msgspec.json.decode(capsys.readouterr().out)
    return doc


def test_trtllm_import_maps_stores_moves_removes_gaps_and_restarts(tmp_path, capsys):
    lines = [
        _trt(0, {"type": "created", "num_blocks_per_cache_level": [128, 512]}),
        _trt(1, {"type": "stored", "parent_hash": None, "blocks": [_block(11, [1, 2]), _block(12, [3, 4])]}),
        _trt(2, {"type": "stored", "parent_hash": 12, "blocks": [_block(13, [5, 6])]}),
        _trt(3, {"type": "updated", "block_hash": 11, "cache_level": {"type": "event_diff", "old_value": 0,
                                                                      "new_value": 1}, "priority": None}),
        _trt(4, {"type": "removed", "block_hashes": [13, 11]}),
        # event 5 never made it into the file
        _trt(6, {"type": "stored", "parent_hash": 12, "blocks": [_block(14, [7, 8])]}),
        # the engine restarted: event ids from 0 again
        _trt(0, {"type": "created", "num_blocks_per_cache_level": [128, 512]}),
        _trt(1, {"type": "stored", "parent_hash": None, "blocks": [_block(21, [9, 9])]}),
    ]
    f = tmp_path / "trt.jsonl"
    f.write_text("\n".join(lines) + "\n")
    url = f"sqlite:///{tmp_path / 'kv.db'}"
    assert main(["kv-events", "import", str(f), "--dialect", "trtllm", "--db", url, "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert (summary["batches"], summary["gaps"], summary["restarts"]) == (8, 1, 1)
    with open_journal(url) as j:
        got = list(j.read_all())
    gaps = [e.payload for e in got if isinstance(e, ev.KvEventsGapEvent)]
    assert [(g.first_seq, g.last_seq) for g in gaps] == [(5, 5)]
    # Before the restart (position of the event_id 6 batch): 12 on level 0, 14 on level 0,
    # 11 moved to level 1 then removed from there, 13 removed.
    before = next(e.global_position for e in got if isinstance(e, ev.KvEventsBatchEvent) and e.payload.seq == 6)
    doc = _replay(url, capsys, "--at", str(before))
    (s,) = doc["kv_blocks"]
    assert {k: p["resident_blocks"] for k, p in s["pools"].items()} == {"cache_level_0/32": 2, "cache_level_1/32": 0}
    assert s["uncertain"] and s["findings"] == []
    end = _replay(url, capsys)["kv_blocks"][0]
    assert end["epoch"] == 1 and not end["uncertain"]
    assert {k: p["resident_blocks"] for k, p in end["pools"].items() if p["resident_blocks"]} == {"cache_level_0/32": 1}
    assert main(["verify", "--db", url]) == 0


def test_vllm_import_and_all_or_nothing(tmp_path, capsys):
    good = [{"seq": s, "ts": 100.0 + s, "data_parallel_rank": 0,
             "events": [{"type": "BlockStored", "block_hashes": [f"{s:064x}"], "parent_block_hash": None,
                         "token_ids": [1, 2, 3, 4], "block_size": 4, "medium": "GPU"}]} for s in range(5)]
    f = tmp_path / "v.jsonl"
    f.write_text("\n".join(json.dumps(b) for b in good) + "\n")
    url = f"sqlite:///{tmp_path / 'kv.db'}"
    assert main(["kv-events", "import", str(f), "--dialect", "vllm", "--db", url]) == 0
    doc = _replay(url, capsys, "--block-bytes", "1000")
    pool = doc["kv_blocks"][0]["pools"]["GPU/-"]
    assert (pool["resident_blocks"], pool["resident_bytes"], pool["stored"]) == (5, 5000, 5)
    assert pool["block_seconds"] == 10.0  # 1+2+3+4 block-seconds over ts 100..104
    capsys.readouterr()
    assert main(["replay", "--db", url, "--block-bytes", "1000"]) == 0
    shown = capsys.readouterr().out
    assert "KV-event block pools" in shown and "5,000" in shown
    # Bad input: one coded line, exit 2, nothing written (a new file is not even created).
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(good[0]) + "\n" + '{"seq": 1, "events": [{"type": "BlockMoved"}]}\n')
    fresh = tmp_path / "fresh.db"
    assert main(["kv-events", "import", str(bad), "--dialect", "vllm", "--db", f"sqlite:///{fresh}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("MALFORMED_EVENT") and "bad.jsonl:2" in err and len(err.strip().splitlines()) == 1
    assert not fresh.exists()
    # The same stream again is refused; the journal is untouched.
    with open_journal(url) as j:
        before = j.last_position()
    assert main(["kv-events", "import", str(f), "--dialect", "vllm", "--db", url]) == 2
    assert capsys.readouterr().err.startswith("INVALID_ARGUMENT")
    with open_journal(url) as j:
        assert j.last_position() == before


def test_wire_forms():
    from kvledger.adapters.kv_events_wire import decode_batch, split_live, split_replay

    enc = msgspec.msgpack.encode
    vllm = enc([1.5, [{"type": "BlockStored", "block_hashes": [b"\x01\x02", 7], "parent_block_hash": None,
                       "token_ids": [1, 2], "block_size": 2, "lora_id": None, "medium": "GPU", "lora_name": None,
                       "new_field": b"\xff"}], 0])
    ts, (e,), rank = decode_batch(vllm)
    assert (ts, rank, e.block_hashes, e.unknown_fields) == (1.5, 0, ("0102", 7), {"new_field": "ff"})
    sglang = enc([2.0, [["BlockStored", [b"\x01"], None, [1], 1, None], ["BlockRemoved", [b"\x01"]],
                        ["AllBlocksCleared"]]])
    _, events, rank = decode_batch(sglang)
    assert [type(x).__name__ for x in events] == ["BlockStored", "BlockRemoved", "AllBlocksCleared"]
    assert rank is None and events[1].block_hashes == ("01",)
    seq = (5).to_bytes(8, "big")
    assert split_live([b"t", seq, b"p"]) == (b"t", 5, b"p") and split_live([seq, b"p"]) == (b"", 5, b"p")
    assert split_replay([b"", b"t", seq, b"p"]) == (5, b"p") and split_replay([b"", seq, b"p"]) == (5, b"p")
    assert split_replay([b"", (-1).to_bytes(8, "big", signed=True), b""]) is None
    junks = (b"\xc1", enc({"ts": "x", "events": []}), enc([1.0, [["Nope"]]]), enc([1.0, [{"type": "BlockStored"}]]))
    for junk in junks:
        with pytest.raises(KvLedgerError) as exc:
            decode_batch(junk)
        assert exc.value.code is ErrorCode.MALFORMED_EVENT


def test_kv_event_arguments_are_refused_with_a_code(capsys):
    assert main(["kv-events", "record", "--endpoint", "http://x", "--idle-exit", "1"]) == 2
    assert capsys.readouterr().err.startswith("INVALID_ARGUMENT")
    assert main(["kv-events", "record", "--endpoint", "tcp://127.0.0.1:1", "--idle-exit", "-1"]) == 2
    assert capsys.readouterr().err.startswith("INVALID_ARGUMENT")
    assert main(["kv-events", "import", str(Path("/nonexistent.jsonl")), "--dialect", "vllm"]) == 2


def test_reconcile_kv_index_finds_exactly_the_mutations(tmp_path, capsys):
    """An index dumped from the journal's block pool is clean; with one block dropped, one
    invented and one kept from before the publisher restarted, reconcile finds exactly
    those three (exit 1)."""
    from kvledger.replay.kv_blocks import resident
    from kvledger.replay.run import project
    from kvledger.replay.sources import journal_events

    def batch(seq: int, stores: list[int], removes: list[int] = ()) -> str:  # type: ignore[assignment]
        events = [{"type": "BlockStored", "block_hashes": [h], "parent_block_hash": None, "token_ids": [h],
                   "block_size": 1, "medium": "GPU"} for h in stores]
        events += [{"type": "BlockRemoved", "block_hashes": [h], "medium": "GPU"} for h in removes]
        return json.dumps({"seq": seq, "ts": float(seq), "events": events, "data_parallel_rank": 0})

    lines = [batch(s, [100 + s]) for s in range(10)] + [batch(10, [], [100, 101])]
    lines += [batch(s, [200 + s]) for s in range(6)]  # the publisher restarted: seq from 0
    f = tmp_path / "v.jsonl"
    f.write_text("\n".join(lines) + "\n")
    url = f"sqlite:///{tmp_path / 'kv.db'}"
    assert main(["kv-events", "import", str(f), "--dialect", "vllm", "--db", url]) == 0
    with open_journal(url) as j:
        state = project(journal_events(j)).kv.state
        end = j.last_position()
    (sid,) = state.streams
    blocks = {str(h): ["GPU"] for h in resident(state, sid)["GPU/-"]}
    assert sorted(blocks) == [str(200 + s) for s in range(6)]
    dump = tmp_path / "index.json"

    def run(index: dict[str, list[str]]) -> tuple[int, dict[str, Any]]:
        dump.write_text(json.dumps({"position": end, "streams": {sid: index}}))
        capsys.readouterr()
        code = main(["reconcile", "--kv-index", str(dump), "--db", url, "--json"])
        return code, json.loads(capsys.readouterr().out)

    code, doc = run(blocks)
    assert code == 0 and doc["findings"] == [] and doc["journal_blocks"] == 6
    mutated = dict(blocks)
    del mutated["203"]  # missing
    mutated["999"] = ["GPU"]  # extra: never stored
    mutated["105"] = ["GPU"]  # stale: resident until the restart
    code, doc = run(mutated)
    assert code == 1
    assert sorted((f["code"], f["block_hash"]) for f in doc["findings"]) == [
        ("KV_INDEX_EXTRA", "999"), ("KV_INDEX_MISSING", "203"), ("KV_INDEX_STALE", "105")]
    # 100 was removed before the restart: an index holding it is wrong, not stale
    code, doc = run({**blocks, "100": ["GPU"]})
    assert [(f["code"], f["block_hash"]) for f in doc["findings"]] == [("KV_INDEX_EXTRA", "100")]
    # bad dumps are refused with a code
    dump.write_text('{"streams": []}')
    assert main(["reconcile", "--kv-index", str(dump), "--db", url]) == 2
    assert capsys.readouterr().err.startswith("INVALID_ARGUMENT")


def test_block_pool_findings(tmp_path, capsys):
    """A store under an unknown parent, a remove of an unknown block, a double store; after
    a gap the same kind of finding is marked uncertain, and a clear makes the state certain."""
    def line(seq: int, *events: dict[str, Any]) -> str:
        return json.dumps({"seq": seq, "ts": float(seq), "events": list(events)})

    def stored(h: int, parent: int | None = None) -> dict[str, Any]:
        return {"type": "BlockStored", "block_hashes": [h], "parent_block_hash": parent, "token_ids": [h],
                "block_size": 1}

    def removed(h: int) -> dict[str, Any]:
        return {"type": "BlockRemoved", "block_hashes": [h]}

    f = tmp_path / "f.jsonl"
    f.write_text("\n".join([
        line(0, stored(1), stored(2, 1)),  # clean chain
        line(1, stored(3, 77)),  # parent 77 never stored
        line(2, removed(88)),  # 88 never stored
        line(3, stored(1)),  # 1 stored again while resident
        line(5, removed(99)),  # after the gap (seq 4 missing): uncertain
        line(6, {"type": "AllBlocksCleared"}),
        line(7, removed(1)),  # certain again: 1 was cleared
    ]) + "\n")
    url = f"sqlite:///{tmp_path / 'kv.db'}"
    assert main(["kv-events", "import", str(f), "--dialect", "vllm", "--db", url]) == 0
    (s,) = _replay(url, capsys)["kv_blocks"]
    got = [(x["code"], x["seq"], x.get("uncertain", False)) for x in s["findings"]]
    assert got == [("KV_PARENT_UNKNOWN", 1, False), ("KV_REMOVE_UNKNOWN", 2, False), ("KV_DOUBLE_STORE", 3, False),
                   ("KV_REMOVE_UNKNOWN", 5, True), ("KV_REMOVE_UNKNOWN", 7, False)]
    assert s["gaps"] == 1 and not s["uncertain"] and s["pools"]["-/-"]["resident_blocks"] == 0


def test_the_conditional_write_makes_a_repeat_write_nothing(db_url):
    """The same decisions appended twice return the first receipts and write nothing; a
    second recorder that decided from a stale cursor is refused by the head guard."""
    pytest.importorskip("zmq")  # the reference publisher's encoder module imports it
    from kvledger.adapters.kv_events_recorder import Recorder
    from kvledger.adapters.kv_events_wire import decode_batch
    from kvledger.journal.contract import Rejection

    from kv_publisher import Workload, encode

    def decisions(seqs: range) -> Recorder:
        rec = Recorder("tcp://127.0.0.1:1", "kv", {}, replayable=False)
        w = Workload(11)
        payloads = [encode("vllm", 1.0 + s, w.batch(), 0) for s in range(10)]
        for s in seqs:
            rec.message(s, payloads[s], decode_batch(payloads[s]), replayed=False)
        return rec

    with open_journal(db_url) as j:
        ops = decisions(range(10)).take()
        first = j.append(ops)
        end = j.last_position()
        again = j.append(ops)
        assert again == first and j.last_position() == end
        stale = decisions(range(5)).take()  # grouped differently: another operation id
        (r,) = j.append(stale)
        assert isinstance(r, Rejection) and r.code == "HANDLE_EXISTS" and j.last_position() == end
        batches = [e.payload.seq for e in j.read_all() if isinstance(e, ev.KvEventsBatchEvent)]
    assert batches == list(range(10))


# -- issue 44: hostile import files ----------------------------------------------------

_STORED = {"type": "BlockStored", "block_hashes": ["0a0b"], "parent_block_hash": None, "token_ids": [1, 2],
           "block_size": 2, "lora_id": None, "medium": "GPU"}
HOSTILE = {
    "seq true": '{"seq": true, "events": []}',
    "seq a float": '{"seq": 1.0, "events": []}',
    "seq past 2^63-2": '{"seq": 9223372036854775807, "events": []}',
    "seq of 40 digits": '{"seq": 1234567890123456789012345678901234567890, "events": []}',
    "seq of 5000 digits": '{"seq": ' + "9" * 5000 + ', "events": []}',
    "a key twice": '{"seq": 0, "seq": 1, "events": []}',
    "a key twice in an event": '{"seq": 0, "events": [{"type": "BlockRemoved", "block_hashes": [1], '
                               '"block_hashes": [2]}]}',
    "rank a string": '{"seq": 0, "events": [], "data_parallel_rank": "3"}',
    "rank true": '{"seq": 0, "events": [], "data_parallel_rank": true}',
    "an unknown line key": '{"seq": 0, "events": [], "topic": "kv"}',
    "ts NaN": '{"seq": 0, "ts": NaN, "events": []}',
    "ts 1e400": '{"seq": 0, "ts": 1e400, "events": []}',
    "a hash of 40 digits": '{"seq": 0, "events": [{"type": "BlockRemoved", "block_hashes": '
                           '[1234567890123456789012345678901234567890]}]}',
    "a token of 2^64": '{"seq": 0, "events": [{"type": "BlockStored", "block_hashes": [1], '
                       '"token_ids": [18446744073709551616]}]}',
    "extra_keys nested 5000 deep": '{"seq": 0, "events": [{"type": "BlockStored", "block_hashes": [1], '
                                   '"extra_keys": ' + "[" * 5000 + "]" * 5000 + "}]}",
    "nested 100000 deep": "[" * 100_000 + "]" * 100_000,
    "a hash that is not hex": '{"seq": 0, "events": [{"type": "BlockRemoved", "block_hashes": ["0a 0b"]}]}',
    "a lone surrogate": '{"seq": 0, "events": [{"type": "BlockRemoved", "block_hashes": [1], '
                        '"medium": "\\ud800"}]}',
    "not UTF-8": b'{"seq": 0, "events": [], "x": "\xff"}',
    "trtllm event_id true": ("trtllm", '{"event_id": true, "data": {"type": "created"}}'),
    "trtllm a block that is a number": ("trtllm", '{"event_id": 0, "data": {"type": "stored", "blocks": [1]}}'),
    "trtllm a list as a block hash": ("trtllm", '{"event_id": 0, "data": {"type": "removed", '
                                                '"block_hashes": [[1]]}}'),
    "trtllm a token id of 2^70": ("trtllm", '{"event_id": 0, "data": {"type": "stored", "blocks": [{"block_hash": 1, '
                                            '"tokens": [{"token_id": 1180591620717411303424}]}]}}'),
    "trtllm window_size a string": ("trtllm", '{"event_id": 0, "data": {"type": "created"}, "window_size": "32"}'),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_lines_are_refused_with_a_code_naming_the_line(db_url, capsys, tmp_path, case):
    """Each was journaled (true as a seq, a key twice: the last won, a string rank:
    dropped) or ended in INTERNAL_ERROR (huge and nested values) before."""
    from stored_rows import one_coded_line, picture

    dialect, line = HOSTILE[case] if isinstance(HOSTILE[case], tuple) else ("vllm", HOSTILE[case])
    good = ('{"event_id": 0, "data": {"type": "created"}}' if dialect == "trtllm"
            else json.dumps({"seq": 0, "ts": 1.0, "events": [_STORED]}))
    f = tmp_path / "hostile.jsonl"
    f.write_bytes(good.encode() + b"\n\n" + (line if isinstance(line, bytes) else line.encode()) + b"\n")
    before = picture(db_url)
    assert main(["kv-events", "import", str(f), "--dialect", dialect, "--db", db_url, "--stream", case]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "hostile.jsonl:3:" in one_coded_line(err, "MALFORMED_EVENT")
    assert picture(db_url) == before


def test_an_endless_line_is_refused_without_holding_more_than_the_bound(tmp_path):
    """/dev/zero as the file, under a 1 GB address-space limit: the line is refused at
    the bound (64 MiB), with its number; before, it was read whole (MemoryError)."""
    url = f"sqlite:///{tmp_path / 'kv.db'}"
    done = subprocess.run(["prlimit", f"--as={1 << 30}", sys.executable, "-m", "kvledger", "kv-events", "import",
                           "/dev/zero", "--dialect", "vllm", "--db", url], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == "", done.stderr
    assert done.stderr.startswith("FIELD_TOO_LARGE: /dev/zero:1: line longer than 67108864 bytes"), done.stderr
    assert not (tmp_path / "kv.db").exists()


def test_vllm_positional_events_with_hex_hashes_import_as_the_tagged_form(tmp_path, capsys):
    """docs/guides/kv-events.md: events as tagged maps or positional arrays, a bytes hash as hex.
    The array form was refused ('a block hash is int or bytes, not str')."""
    tagged = [{"seq": 0, "ts": 1.0, "data_parallel_rank": 0, "events": [
                  _STORED, {"type": "BlockStored", "block_hashes": ["0c", 7], "parent_block_hash": "0a0b",
                            "token_ids": [3, 4], "block_size": 2, "lora_id": 5, "medium": "GPU"}]},
              {"seq": 1, "ts": 2.0, "data_parallel_rank": 0, "events": [
                  {"type": "BlockRemoved", "block_hashes": ["0c", "0a0b"], "medium": "GPU"},
                  {"type": "AllBlocksCleared"}]}]
    positional = [{"seq": 0, "ts": 1.0, "data_parallel_rank": 0, "events": [
                      ["BlockStored", ["0a0b"], None, [1, 2], 2, None, "GPU"],
                      ["BlockStored", ["0c", 7], "0a0b", [3, 4], 2, 5, "GPU"]]},
                  {"seq": 1, "ts": 2.0, "data_parallel_rank": 0, "events": [
                      ["BlockRemoved", ["0c", "0a0b"], "GPU"], ["AllBlocksCleared"]]}]
    journaled = []
    for name, lines in (("tagged", tagged), ("positional", positional)):
        f = tmp_path / f"{name}.jsonl"
        f.write_text("".join(json.dumps(x) + "\n" for x in lines))
        url = f"sqlite:///{tmp_path / name}.db"
        assert main(["kv-events", "import", str(f), "--dialect", "vllm", "--db", url]) == 0, capsys.readouterr().err
        with open_journal(url) as j:
            journaled.append([msgspec.to_builtins(e.payload) for e in j.read_all()])
    assert journaled[0] == journaled[1]
    assert journaled[1][0]["events"][1]["parent_block_hash"] == "0a0b"


def test_a_line_past_the_bound_is_held_once(tmp_path):
    """A file that is one 65 MiB line: refused at the 64 MiB bound, with at most that much
    (and a piece) allocated: Python's readline(limit) held its pieces and their join, 2x."""
    import tracemalloc

    from kvledger.adapters.kv_events_import import import_operations
    from kvledger.schemas.codec import MAX_EVENT_BYTES

    f = tmp_path / "zeros.jsonl"
    with f.open("wb") as out:
        out.truncate(MAX_EVENT_BYTES + (1 << 20))  # zero bytes, no newline
    tracemalloc.start()
    try:
        with pytest.raises(KvLedgerError) as exc:
            import_operations(f, "vllm", {}, "zeros")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert exc.value.code is ErrorCode.FIELD_TOO_LARGE and f"{f}:1: line longer than" in str(exc.value)
    assert peak < MAX_EVENT_BYTES * 1.25, peak
