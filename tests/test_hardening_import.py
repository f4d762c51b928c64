"""Issue 17, import: non-canonical lines (9) and malformed ones (11) are refused with a
stable code in one line, the input is streamed with a bound per line and the first bad
line ends it (17), and a refused import leaves the journal byte-identical. A hypothesis
fuzz test feeds hostile lines to `import` and `verify --journal`."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvledger.journal import open_journal
from kvledger.migrations.storage import init_database

from stored_rows import FIXTURES, TABLES, cli, nats_messages, one_coded_line, picture, sql

ROOT = Path(__file__).resolve().parent.parent
LINES = (FIXTURES / "two_request_trajectory.jsonl").read_bytes().splitlines()
EMIT = LINES[6]  # line 7: A's first output_emit
assert EMIT.startswith(b'{"event_type":"output_emit","payload":{"output_index":0,"token_id":101,')


def with_line(tmp_path: Path, n: int, line: bytes, *, replace: bool = True) -> Path:
    """The fixture with line `n` (1-based) replaced by (or preceded by) `line`."""
    rest = LINES[n:] if replace else LINES[n - 1:]
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b"\n".join([*LINES[:n - 1], line, *rest]) + b"\n")
    return path


def refused(capsys, db_url: str, path: Path, code: str) -> str:
    """Import `path`, assert the refusal (exit 2, one coded line, nothing on stdout) and
    that the journal is byte-identical; return the line."""
    before = picture(db_url)
    rc, out, err = cli(capsys, "import", "--db", db_url, str(path))
    assert rc == 2 and out == "", (rc, out, err)
    line = one_coded_line(err, code)
    assert picture(db_url) == before
    return line


# -- 9: non-canonical input ------------------------------------------------------------

NON_CANONICAL = {
    # the same key twice: another parser would keep the first value, msgspec keeps the last
    "duplicate key, other value": EMIT.replace(b'"token_id":101', b'"token_id":999,"token_id":101'),
    "duplicate key, same value": EMIT.replace(b'"stream_id":"A"', b'"stream_id":"A","stream_id":"A"'),
    "duplicate envelope key": EMIT.replace(b'{"event_type":"output_emit",',
                                           b'{"event_type":"output_emit","event_type":"output_emit",'),
    "whitespace": EMIT.replace(b'"token_id":101', b'"token_id": 101'),
    "escaped letter": EMIT.replace(b'"request_id":"A"', b'"request_id":"\\u0041"'),
    "key order": EMIT.replace(b'"output_index":0,"token_id":101', b'"token_id":101,"output_index":0'),
    "negative zero": EMIT.replace(b'"output_index":0', b'"output_index":-0'),
    "omitted default": EMIT.replace(b'"caused_by_event_id":null,', b""),
}


@pytest.mark.parametrize("name", sorted(NON_CANONICAL))
def test_non_canonical_lines_are_refused(db_url, tmp_path, capsys, name):
    line = NON_CANONICAL[name]
    assert line != EMIT and json.loads(line) is not None  # valid JSON, the same event, other bytes
    path = with_line(tmp_path, 7, line)
    message = refused(capsys, db_url, path, "NON_CANONICAL_EVENT")
    assert f"{path}:7:" in message
    if name.startswith("duplicate"):
        assert "duplicate key" in message
    # verify says the same about the file, at the same line
    rc, out, _ = cli(capsys, "verify", "--journal", str(path), "--json")
    report = json.loads(out)
    assert rc == 1 and (report["findings"][0]["code"], report["findings"][0]["line"]) == ("NON_CANONICAL_EVENT", 7)


def test_the_canonical_file_imports_byte_for_byte(db_url, tmp_path, capsys):
    path = with_line(tmp_path, 7, EMIT)
    assert path.read_bytes() == (FIXTURES / "two_request_trajectory.jsonl").read_bytes()
    assert cli(capsys, "import", "--db", db_url, str(path))[0] == 0
    with open_journal(db_url) as journal:  # the bodies as stored, on every backend
        stored = [bytes(b) for _, b in journal.read_raw()]
    assert stored == LINES


# -- 11: malformed lines -----------------------------------------------------------------

MALFORMED = {
    "deep array": (b"[" * 100_000 + b"]" * 100_000, "MALFORMED_EVENT"),
    "deep payload": (EMIT.replace(b'"payload":{', b'"payload":' + b'{"a":' * 50_000 + b"{")
                     + b"}" * 50_000, "MALFORMED_EVENT"),
    "event_type list": (EMIT.replace(b'"event_type":"output_emit"', b'"event_type":["output_emit"]'),
                        "MALFORMED_EVENT"),
    "event_type object": (EMIT.replace(b'"event_type":"output_emit"', b'"event_type":{"a":1}'),
                          "MALFORMED_EVENT"),
    "junk bytes": (b"\x00\xff\xfe junk \x01\x02", "MALFORMED_EVENT"),
    "invalid utf-8 in a string": (EMIT.replace(b'"request_id":"A"', b'"request_id":"\xff"'), "MALFORMED_EVENT"),
    "raw control character": (EMIT.replace(b'"request_id":"A"', b'"request_id":"A\x07"'), "MALFORMED_EVENT"),
    "huge number": (EMIT.replace(b'"token_id":101', b'"token_id":' + b"9" * 400), "MALFORMED_EVENT"),
    "number out of range": (EMIT.replace(b'"token_id":101', b'"token_id":1e999'), "MALFORMED_EVENT"),
    "negative count": (EMIT.replace(b'"output_index":0', b'"output_index":-1'), "MALFORMED_EVENT"),
    "float count": (EMIT.replace(b'"output_index":0', b'"output_index":0.5'), "MALFORMED_EVENT"),
    "unknown schema version": (EMIT.replace(b'"schema_version":1', b'"schema_version":7'),
                               "UNKNOWN_SCHEMA_VERSION"),
    "unknown event type": (EMIT.replace(b'"output_emit"', b'"teleport"'), "UNKNOWN_EVENT_TYPE"),
    "an id too long": (EMIT.replace(b'"request_id":"A"', b'"request_id":"' + b"A" * 300 + b'"'),
                       "FIELD_TOO_LARGE"),
    # decodes, but no journal could store it (PostgreSQL text holds no NUL): refused on every backend
    "a NUL in an id": (EMIT.replace(b'"request_id":"A"', b'"request_id":"A\\u0000"'), "MALFORMED_EVENT"),
    "not an object": (b"[1,2,3]", "MALFORMED_EVENT"),
}


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_malformed_lines_are_refused_with_their_code(db_url, tmp_path, capsys, name):
    line, code = MALFORMED[name]
    path = with_line(tmp_path, 7, line)
    assert f"{path}:7:" in refused(capsys, db_url, path, code)
    rc, out, err = cli(capsys, "verify", "--journal", str(path), "--json")
    report = json.loads(out)
    assert rc == 1 and err == "" and report["findings"][0]["line"] == 7
    assert report["findings"][0]["code"] == code


def test_an_event_the_journal_forbids_is_corrupt_journal(db_url, tmp_path, capsys):
    # a second output at index 0: decodes and is canonical, but breaks an invariant
    path = with_line(tmp_path, 8, EMIT.replace(b'"global_position":7', b'"global_position":8'), replace=False)
    message = refused(capsys, db_url, path, "CORRUPT_JOURNAL")
    assert f"{path}:8:" in message and "kvledger verify --journal" in message


def test_a_newline_in_a_hostile_id_keeps_the_error_on_one_line(db_url, tmp_path, capsys):
    # "\n" in JSON is a newline in the id: the message names the id, escaped
    line = EMIT.replace(b'"stream_id":"A"', b'"stream_id":"A\\nSTALE_BASE: forged"')
    message = refused(capsys, db_url, with_line(tmp_path, 7, line), "CORRUPT_JOURNAL")
    assert "A\\nSTALE_BASE: forged" in message


# -- 17: streamed, first bad line ends it, all or nothing ------------------------------

def test_a_bad_last_line_leaves_the_journal_as_it_was(db_url, tmp_path, capsys):
    """20 good events are inserted inside the import's transaction before line 21
    fails: the rollback takes them all back."""
    last = LINES[20]
    assert last.startswith(b'{"event_type":"release",')
    path = with_line(tmp_path, 21, last.replace(b'"release",', b'"release","event_type":"release",', 1))
    refused(capsys, db_url, path, "NON_CANONICAL_EVENT")
    if db_url.startswith("nats"):
        assert nats_messages(db_url) == []
    else:
        assert {t: sql(db_url, f"SELECT count(*) FROM {t}")[0][0] for t in TABLES} == dict.fromkeys(TABLES, 0)


def _child_import(db_url: str, source: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvledger", "import", "--db", db_url, source],
                          cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def test_a_fifo_whose_writer_never_closes_is_refused_at_its_first_bad_line(db_url, tmp_path):
    fifo = tmp_path / "in.fifo"
    import os

    os.mkfifo(fifo)
    release = threading.Event()

    def writer() -> None:
        with open(fifo, "wb") as f:  # blocks until the import opens the other end
            f.write(b"\n".join(LINES[:5]) + b"\nnot json\n")
            f.flush()
            release.wait(60)  # keep the FIFO open: no EOF ever comes

    before = picture(db_url)
    t = threading.Thread(target=writer, daemon=True)
    t.start()
    try:
        start = time.monotonic()
        done = _child_import(db_url, str(fifo))
        assert time.monotonic() - start < 30
    finally:
        release.set()
        t.join(10)
    assert done.returncode == 2 and f"{fifo}:6:" in one_coded_line(done.stderr, "MALFORMED_EVENT")
    assert picture(db_url) == before


@pytest.mark.parametrize("device, code", [("/dev/urandom", "MALFORMED_EVENT"), ("/dev/zero", "FIELD_TOO_LARGE")])
def test_endless_devices_are_refused_promptly(db_url, device, code):
    before = picture(db_url)
    start = time.monotonic()
    done = _child_import(db_url, device)
    assert time.monotonic() - start < 60
    assert done.returncode == 2 and done.stdout == ""
    one_coded_line(done.stderr, code)
    assert picture(db_url) == before


def test_an_unreadable_file_is_refused_before_the_journal_is_touched(db_url, tmp_path, capsys):
    refused(capsys, db_url, tmp_path / "missing.jsonl", "INVALID_ARGUMENT")
    refused(capsys, db_url, tmp_path, "INVALID_ARGUMENT")  # a directory


# -- fuzz: hostile lines never reach the user as a traceback ---------------------------

ENVELOPE_FIELDS = ["event_type", "event_id", "global_position", "stream_id", "stream_position",
                   "schema_version", "request_id", "handle_generation", "operation_id", "monotonic_ns"]
ODD_VALUES = st.one_of(
    st.none(), st.booleans(), st.floats(allow_nan=False), st.text(max_size=20),
    st.integers(min_value=-(10 ** 30), max_value=10 ** 30),
    st.lists(st.integers(), max_size=3), st.dictionaries(st.text(max_size=5), st.integers(), max_size=3),
)


def _dumps(obj: object) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


@st.composite
def hostile_line(draw) -> bytes:
    base = json.loads(LINES[draw(st.integers(0, len(LINES) - 1))])
    kind = draw(st.sampled_from(["junk", "deep", "duplicate", "wrong type", "payload type", "huge",
                                 "version", "control", "number text"]))
    if kind == "junk":
        return draw(st.binary(max_size=300))
    if kind == "deep":
        depth = draw(st.integers(100, 200_000))
        opener, closer = draw(st.sampled_from([(b"[", b"]"), (b'{"a":', b"}")]))
        return opener * depth + closer * draw(st.integers(0, depth))
    field = draw(st.sampled_from(ENVELOPE_FIELDS))
    if kind == "duplicate":
        value = base[field] if draw(st.booleans()) else draw(ODD_VALUES)
        return b"{" + _dumps(field) + b":" + _dumps(value) + b"," + _dumps(base)[1:]
    if kind == "wrong type":
        base[field] = draw(ODD_VALUES)
    elif kind == "payload type":
        key = draw(st.sampled_from(sorted(base["payload"])))
        base["payload"][key] = draw(ODD_VALUES)
    elif kind == "huge":
        base[field] = draw(st.sampled_from([2 ** 63, 2 ** 64, 10 ** 40, -(2 ** 63) - 1, -1]))
    elif kind == "version":
        base["schema_version"] = draw(st.integers(-5, 10 ** 6))
        if draw(st.booleans()):
            base["event_type"] = draw(st.text(max_size=12))
    elif kind == "control":
        char = chr(draw(st.integers(0, 31)))
        text_field = draw(st.sampled_from(["event_id", "stream_id", "request_id"]))
        base[text_field] = base[text_field] + char
        raw = _dumps(base)
        # half the time the control character is raw (not valid JSON), else escaped
        return raw if draw(st.booleans()) else raw.replace(json.dumps(char)[1:-1].encode(), char.encode())
    elif kind == "number text":
        body = _dumps(base)
        return body.replace(b'"stream_position":', b'"stream_position":'
                            + draw(st.sampled_from([b"1e999", b"-0", b"01", b"1.0", b"9" * 30])) + b"+", 1)
    return _dumps(base)


@pytest.fixture(scope="module")
def pristine_sqlite(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("fuzz") / "pristine.db"
    init_database(f"sqlite:///{path}")
    return path


def _check_one(capsys, db_url: str, path: Path, reset) -> None:
    before = picture(db_url)
    rc, out, err = cli(capsys, "import", "--db", db_url, str(path))
    vrc, vout, verr = cli(capsys, "verify", "--journal", str(path), "--json")
    assert verr == "" and vrc in (0, 1), (vrc, verr)
    report = json.loads(vout)
    event(f"import exit {rc} {err.split(':', 1)[0]}")  # --hypothesis-show-statistics
    if rc == 0:  # a mutation that happens to be a valid journal: import and verify agree
        assert vrc == 0 and report["ok"] and err == "", report["findings"][:3]
        reset()
        return
    assert rc == 2 and out == "", (rc, out, err)
    one_coded_line(err)
    assert picture(db_url) == before
    assert vrc == 1 and not report["ok"]  # what import refuses, verify finds


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(line=hostile_line(), at=st.integers(1, len(LINES)), replace=st.booleans())
def test_fuzz_hostile_lines_sqlite(tmp_path, capsys, pristine_sqlite, line, at, replace):
    db = tmp_path / "fuzz.db"
    shutil.copyfile(pristine_sqlite, db)
    url = f"sqlite:///{db}"
    _check_one(capsys, url, with_line(tmp_path, at, line, replace=replace),
               lambda: shutil.copyfile(pristine_sqlite, db))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(line=hostile_line(), at=st.integers(1, len(LINES)), replace=st.booleans())
def test_fuzz_hostile_lines_postgres(pg_admin, tmp_path, capsys, line, at, replace):
    url = _fuzz_pg_url(pg_admin)

    def reset() -> None:
        for table in TABLES:  # constant names
            sql(url, f"DELETE FROM {table}")

    _check_one(capsys, url, with_line(tmp_path, at, line, replace=replace), reset)


_PG_URL: dict[int, str] = {}


def _fuzz_pg_url(pg_admin) -> str:
    # one migrated database for every example: creating one per example costs seconds
    if id(pg_admin) not in _PG_URL:
        _PG_URL[id(pg_admin)] = pg_admin.create()
    return _PG_URL[id(pg_admin)]
