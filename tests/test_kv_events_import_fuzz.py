"""`kvledger kv-events import` over generated files (issue 44): lines of every shape,
valid and invalid JSON, in both dialects. Each file is either refused with one coded
line (never INTERNAL_ERROR) and nothing written, or imported into a journal that
verifies clean and, for vllm, round-trips: the journaled batches written back as vllm
lines import into the same payloads."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvledger.cli import main
from kvledger.journal import open_journal
from kvledger.migrations.storage import init_database

from stored_rows import one_coded_line, picture

ODD = st.one_of(st.none(), st.booleans(), st.integers(-(2 ** 70), 2 ** 70), st.floats(), st.text(max_size=8),
                st.sampled_from([[], {}, [1], {"a": 1}, "0a0b", "zz", "", 2 ** 63, -1]))
JSONISH = st.recursive(ODD, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=4), c, max_size=3),
                       max_leaves=8)
HASH = st.one_of(st.integers(-(2 ** 63), 2 ** 64 - 1), st.binary(max_size=8).map(bytes.hex))
MAYBE_HASH = st.one_of(st.none(), HASH)
NAME = st.one_of(st.none(), st.sampled_from(["GPU", "CPU", "STORAGE"]), st.text(max_size=6))
SMALL = st.one_of(st.none(), st.integers(0, 100))
FIELDS = {
    "BlockStored": [("block_hashes", st.lists(HASH, max_size=3)), ("parent_block_hash", MAYBE_HASH),
                    ("token_ids", st.lists(st.integers(0, 2 ** 31), max_size=4)), ("block_size", st.integers(0, 64)),
                    ("lora_id", SMALL), ("medium", NAME), ("lora_name", NAME),
                    ("extra_keys", st.one_of(st.none(), st.lists(st.lists(st.text(max_size=3), max_size=2),
                                                                 max_size=2))),
                    ("group_idx", SMALL), ("kv_cache_spec_kind", NAME), ("kv_cache_spec_sliding_window", SMALL)],
    "BlockRemoved": [("block_hashes", st.lists(HASH, max_size=3)), ("medium", NAME), ("group_idx", SMALL)],
    "AllBlocksCleared": [],
}


@st.composite
def vllm_event(draw: Any) -> Any:
    kind = draw(st.sampled_from(sorted(FIELDS)))
    values = [(name, draw(s)) for name, s in FIELDS[kind]]
    if draw(st.booleans()) and values:  # positional, trailing fields cut
        cut = draw(st.integers(1, len(values)))
        return [kind, *[v for _, v in values[:cut]]]
    d = {"type": kind} | {k: v for k, v in values if v is not None or draw(st.booleans())}
    if draw(st.integers(0, 5)) == 0:
        d[draw(st.text(min_size=1, max_size=6))] = draw(JSONISH)  # a newer engine's field, or a clash
    return d


@st.composite
def vllm_line(draw: Any) -> bytes:
    batch: dict[str, Any] = {"seq": draw(st.integers(0, 12)), "ts": draw(st.floats(0, 1e9)),
                             "events": draw(st.lists(vllm_event(), max_size=3))}
    if draw(st.booleans()):
        batch["data_parallel_rank"] = draw(st.one_of(st.none(), st.integers(0, 2)))
    mutation = draw(st.sampled_from(["none"] * 4 + ["value", "event value", "drop", "twice", "text", "junk"]))
    if mutation == "value":
        batch[draw(st.sampled_from(["seq", "ts", "events", "data_parallel_rank", "other"]))] = draw(JSONISH)
    elif mutation == "event value" and batch["events"] and isinstance(batch["events"][0], dict):
        batch["events"][0][draw(st.sampled_from(["type", "block_hashes", "parent_block_hash", "token_ids",
                                                 "block_size", "medium", "group_idx"]))] = draw(JSONISH)
    elif mutation == "drop":
        batch.pop(draw(st.sampled_from(sorted(batch))))
    body = json.dumps(batch).encode()  # NaN and Infinity as json writes them (not JSON)
    if mutation == "twice":
        key = draw(st.sampled_from(sorted(batch)))
        body = b"{" + json.dumps(key).encode() + b":" + json.dumps(draw(JSONISH)).encode() + b"," + body[1:]
    elif mutation == "text":
        at = draw(st.integers(0, len(body)))
        body = body[:at] + draw(st.sampled_from([b"[" * 40, b"}", b"\xff", b"\\ud800", b"1e999", b"9" * 30,
                                                 b"true", b'"'])) + body[at:]
    elif mutation == "junk":
        # a line, not a blank one: blank lines are skipped, and a file of them imports nothing
        body = draw(st.binary(max_size=40).map(lambda b: b.replace(b"\n", b"")).filter(bytes.strip))
    return body


@st.composite
def trtllm_line(draw: Any) -> bytes:
    kind = draw(st.sampled_from(["created", "stored", "removed", "updated", "other"]))
    h = st.integers(0, 50)
    data: dict[str, Any] = {"type": kind}
    if kind == "created":
        data["num_blocks_per_cache_level"] = draw(st.lists(st.integers(0, 10), max_size=2))
    elif kind == "stored":
        data["parent_hash"] = draw(st.one_of(st.none(), h))
        data["blocks"] = draw(st.lists(st.fixed_dictionaries({
            "block_hash": h, "cache_level": st.integers(0, 2),
            "tokens": st.lists(st.fixed_dictionaries({"token_id": st.integers(0, 99)}), max_size=2),
            "lora_id": SMALL}), max_size=2))
    elif kind == "removed":
        data["block_hashes"] = draw(st.lists(h, max_size=3))
    elif kind == "updated":
        data["block_hash"] = draw(h)
        data["cache_level"] = draw(st.one_of(st.none(), st.fixed_dictionaries({"new_value": st.integers(0, 2)})))
        data["priority"] = draw(st.one_of(st.none(), st.fixed_dictionaries({"new_value": SMALL})))
    line = {"event_id": draw(st.integers(0, 12)), "data": data, "window_size": draw(st.one_of(st.none(),
                                                                                            st.integers(1, 64)))}
    mutation = draw(st.sampled_from(["none"] * 3 + ["line", "data", "block", "block field", "token"]))
    if mutation == "line":
        line[draw(st.sampled_from(["event_id", "data", "window_size"]))] = draw(JSONISH)
    elif mutation == "data":
        data[draw(st.sampled_from(sorted(data)))] = draw(JSONISH)
    elif mutation == "block" and data.get("blocks"):
        data["blocks"][0] = draw(JSONISH)
    elif mutation in ("block field", "token") and data.get("blocks"):
        block = data["blocks"][0]
        if mutation == "block field":
            block[draw(st.sampled_from(sorted(block)))] = draw(JSONISH)
        elif block["tokens"]:
            block["tokens"][0]["token_id"] = draw(JSONISH)
    return json.dumps(line).encode()


def _kv_payloads(url: str) -> list[tuple[str, Any]]:
    with open_journal(url) as j:
        return [(e.event_type, msgspec.to_builtins(e.payload)) for e in j.read_all()]


def _as_vllm_line(p: dict[str, Any]) -> str:
    events = []
    for e in p["events"]:
        e = dict(e)
        e.update(e.pop("unknown_fields", None) or {})
        events.append(e)
    return json.dumps({"seq": p["seq"], "ts": p["ts"], "events": events, "data_parallel_rank": p["data_parallel_rank"]})


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: Any) -> Path:
    path = tmp_path_factory.mktemp("fuzz") / "pristine.db"
    init_database(f"sqlite:///{path}")
    return path


def _fresh(pristine: Path, db: Path) -> str:
    shutil.copyfile(pristine, db)  # a migrated journal per example: migrating one costs more than the import
    return f"sqlite:///{db}"


def _check(tmp_path: Path, capsys: Any, pristine: Path, dialect: str, lines: list[bytes]) -> None:
    f = tmp_path / "f.jsonl"
    f.write_bytes(b"\n".join(lines) + b"\n")
    url = _fresh(pristine, tmp_path / "a.db")
    before = picture(url)
    code = main(["kv-events", "import", str(f), "--dialect", dialect, "--db", url])
    out, err = capsys.readouterr()
    event(f"{dialect} exit {code} {err.split(':', 1)[0]}")
    if code != 0:
        assert code == 2 and out == "" and one_coded_line(err).split(":")[0] != "INTERNAL_ERROR", err
        assert picture(url) == before  # all or nothing
        return
    assert main(["verify", "--db", url]) == 0, capsys.readouterr()
    capsys.readouterr()
    if dialect != "vllm":
        return
    first = _kv_payloads(url)
    back = tmp_path / "back.jsonl"
    back.write_text("".join(_as_vllm_line(p) + "\n" for t, p in first if t == "kv_events_batch"))
    url2 = _fresh(pristine, tmp_path / "b.db")
    assert main(["kv-events", "import", str(back), "--dialect", "vllm", "--db", url2]) == 0, capsys.readouterr().err
    capsys.readouterr()
    assert _kv_payloads(url2) == first
    assert first


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(lines=st.lists(vllm_line(), min_size=1, max_size=4))
def test_fuzz_vllm_import_lines(tmp_path, capsys, pristine, lines):
    _check(tmp_path, capsys, pristine, "vllm", lines)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(lines=st.lists(trtllm_line(), min_size=1, max_size=4))
def test_fuzz_trtllm_import_lines(tmp_path, capsys, pristine, lines):
    _check(tmp_path, capsys, pristine, "trtllm", lines)
