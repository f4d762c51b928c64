"""Issue 17, class 2: the Python API never writes an event its own decoder rejects.

Every hostile argument is refused with a stable code before anything is written: the
journal's rows (and, on SQLite, its file bytes) are identical afterwards, and the journal
still replays, verifies and round-trips through export and import. A hypothesis fuzz
over the API's arguments holds the same for whatever it generates.
"""

from __future__ import annotations

import math
from pathlib import Path

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import select

from kvledger import Ledger
from kvledger.engine import commands as c
from kvledger.journal.tables import metadata
from kvledger.migrations.storage import open_or_create_journal
from kvledger.replay import WindowSpec, export_jsonl, import_jsonl, replay_journal, verify_journal
from kvledger.schemas.errors import ErrorCode as E
from kvledger.schemas.errors import KvLedgerError
from kvledger.schemas.manifest import SamplingPolicy

from factories import make_manifest
from stored_rows import nats_messages

INVALID = E.INVALID_ARGUMENT


# -- what "unchanged" and "still replays" mean ----------------------------------------

def rows(ledger: Ledger) -> list:
    """Every row of every journal table, in primary-key order."""
    with ledger.journal.engine.connect() as conn:
        return [(t.name, [tuple(r) for r in conn.execute(select(t).order_by(*t.primary_key.columns))])
                for t in metadata.sorted_tables]


def file_bytes(url: str) -> bytes | None:
    """The SQLite database and its WAL (the -shm index changes on plain reads)."""
    if not url.startswith("sqlite"):
        return None
    db = Path(url.removeprefix("sqlite:///"))
    return b"".join(p.read_bytes() for p in (db, Path(f"{db}-wal")) if p.exists())


def snapshot(ledger: Ledger, url: str) -> tuple:
    if url.startswith("nats"):  # no tables: every message the cell's stream stores
        return nats_messages(url), None
    return rows(ledger), file_bytes(url)


def assert_replays(ledger: Ledger, tmp_path: Path) -> None:
    """state() of every handle, a full replay, a clean verify, and export + import."""
    journal = ledger.journal
    for h in journal.heads():
        ledger.state(h)
    replay_journal(journal, WindowSpec(slo_ttft_ns=10**9, slo_tbt_ns=10**8))
    assert verify_journal(journal).ok
    out = tmp_path / f"export-{journal.last_position()}.jsonl"
    n = export_jsonl(journal, out)
    with open_or_create_journal(f"sqlite:///{tmp_path}/imported-{journal.last_position()}.db") as copy:
        assert import_jsonl(copy, out).events == n == journal.last_position()
        assert copy.heads().keys() == journal.heads().keys()


def prefilled(ledger: Ledger, handle: str, request_id: str | None = None) -> tuple[int, int]:
    """A handle with its prompt committed and logits ready; returns its base."""
    m = make_manifest(request_id=request_id or handle)
    ledger.allocate(handle, m, reserved_capacity=64)
    s = ledger.state(handle)
    base = (s.generation, s.snapshot_version)
    ledger.begin_append(handle, txn_id=f"{handle}-p", kind="prefill", base=base, start=0, token_ids=s.prompt)
    ledger.publish(handle, txn_id=f"{handle}-p", base=base)
    s = ledger.state(handle)
    return s.generation, s.snapshot_version


# -- the examples and their relatives, one by one ------------------------------

def _nan_manifest():
    m = make_manifest(request_id="nan")
    policy = msgspec.structs.replace(m.request_policy, sampling=SamplingPolicy(kind="temperature",
                                                                               temperature=math.nan))
    return msgspec.structs.replace(m, request_policy=policy)


HOSTILE = {
    # (method, args, kwargs, code)
    "empty handle id": ("allocate", ("", make_manifest("n")), {"reserved_capacity": 8}, INVALID),
    "10,000-character handle id": ("allocate", ("x" * 10_000, make_manifest("n")), {"reserved_capacity": 8}, INVALID),
    "integer handle": ("allocate", (5, make_manifest("n")), {"reserved_capacity": 8}, INVALID),
    "NUL in a handle id": ("allocate", ("a\x00b", make_manifest("n")), {"reserved_capacity": 8}, INVALID),
    "lone surrogate in a handle id": ("allocate", ("a\ud800", make_manifest("n")), {"reserved_capacity": 8},
                                      INVALID),
    "lone surrogate in a read": ("state", ("\ud800",), {}, INVALID),  # found by the fuzz test
    "float capacity": ("allocate", ("n", make_manifest("n")), {"reserved_capacity": 1.5}, INVALID),
    "bool capacity": ("allocate", ("n", make_manifest("n")), {"reserved_capacity": True}, INVALID),
    "negative generation": ("allocate", ("n", make_manifest("n")), {"reserved_capacity": 8, "generation": -1}, INVALID),
    "generation beyond BIGINT": ("allocate", ("n", make_manifest("n")),
                                 {"reserved_capacity": 8, "generation": 1 << 63}, INVALID),
    "empty operation id": ("allocate", ("n", make_manifest("n")), {"reserved_capacity": 8, "operation_id": ""},
                           INVALID),
    "int operation id": ("allocate", ("n", make_manifest("n")), {"reserved_capacity": 8, "operation_id": 7}, INVALID),
    "empty request id in the manifest": ("allocate", ("n", make_manifest("")), {"reserved_capacity": 8}, INVALID),
    "NaN temperature in the manifest": ("allocate", ("n", _nan_manifest()), {"reserved_capacity": 8}, INVALID),
    "not a manifest": ("allocate", ("n", {"request_id": "n"}), {"reserved_capacity": 8}, INVALID),
    "too many copy tiers": ("allocate", ("n", make_manifest("n")),
                            {"reserved_capacity": 8, "copy_tiers": ("gpu",) * 65}, INVALID),
    "kind='bogus'": ("begin_append", ("h",), {"txn_id": "t", "kind": "bogus", "base": "BASE", "start": "END",
                                             "token_ids": (1,)}, INVALID),
    "token id beyond 64 bits": ("begin_append", ("h",), {"txn_id": "t", "kind": "decode", "base": "BASE",
                                                         "start": "END", "token_ids": (1 << 70,)}, INVALID),
    "base is None": ("begin_append", ("h",), {"txn_id": "t", "kind": "decode", "base": None, "start": 0,
                                              "token_ids": (1,)}, INVALID),
    "token ids not a sequence": ("begin_append", ("h",), {"txn_id": "t", "kind": "decode", "base": "BASE",
                                                          "start": 0, "token_ids": 5}, INVALID),
    "float start": ("begin_append", ("h",), {"txn_id": "t", "kind": "decode", "base": "BASE", "start": 4.0,
                                             "token_ids": (1,)}, INVALID),
    "negative token id": ("emit", ("h",), {"base": "BASE", "output_index": 0, "token_id": -1}, INVALID),
    "string output index": ("emit", ("h",), {"base": "BASE", "output_index": "0", "token_id": 1}, INVALID),
    "detail of 5,000 characters": ("fail", ("h",), {"txn_id": "t", "detail": "x" * 5000}, INVALID),
    "empty failure code": ("fail", ("h",), {"txn_id": "t", "code": ""}, INVALID),
    "unknown outcome": ("fail", ("h",), {"txn_id": "t", "outcome": "exploded"}, INVALID),
    "child request id of 257 characters": ("fork", ("h",), {"base": "BASE", "child_handle_ids": ("k",),
                                                            "prefix_length": 2, "child_request_ids": ("r" * 257,)},
                                           INVALID),
    # derived by decide: "<256-character parent request id>.0" is longer than an Id
    "derived child request id too long": ("fork", ("long",), {"base": "LONGBASE", "child_handle_ids": ("k",),
                                                              "prefix_length": 2}, E.FIELD_TOO_LARGE),
    "reorder of 5,000 rows": ("reorder", ("g",), {"rows": ("h",) * 5000, "permutation": range(5000),
                                                  "bases": [(0, 1)] * 5000}, INVALID),
    "unknown keyword": ("reorder", ("g",), {"rows": ("h",), "permutation": (0,), "bases": [(0, 1)],
                                            "colour_permutation": (0,)}, INVALID),
    "cancel reason of 5,000 characters": ("cancel", ("h",), {"base": 0, "reason": "x" * 5000}, INVALID),
    "finish reason unknown": ("finish", ("h",), {"base": 0, "reason": "bored"}, INVALID),
    "release with a float base": ("release", ("h",), {"base": 0.0}, INVALID),
    "state of an integer": ("state", (5,), {}, INVALID),
    "state of a 10,000-character id": ("state", ("x" * 10_000,), {}, INVALID),
    "view of an empty id": ("view", ("",), {}, INVALID),
    "prefix owners of a list": ("prefix_owners", ([1, 2],), {}, INVALID),
    "execute a non-command": ("execute", (object(),), {}, INVALID),
    "execute a raw command with a negative length": ("execute", (c.Truncate(
        handle_id="h", base_generation=0, base_snapshot_version=1, new_length=-3),), {}, INVALID),
}


@pytest.fixture
def ledger(db_url):
    with Ledger.open(db_url) as ledger:
        base = prefilled(ledger, "h")
        long_base = prefilled(ledger, "long", request_id="r" * 256)
        ledger._bases = {"BASE": base, "LONGBASE": long_base, "END": ledger.state("h").committed_length}
        yield ledger


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_api_argument_is_refused_and_the_journal_is_untouched(ledger, db_url, tmp_path, case):
    method, args, kwargs, code = HOSTILE[case]
    kwargs = {k: ledger._bases.get(v, v) if isinstance(v, str) else v for k, v in kwargs.items()}
    before = snapshot(ledger, db_url)
    with pytest.raises(KvLedgerError) as info:
        getattr(ledger, method)(*args, **kwargs)
    assert info.value.code is code, info.value
    assert "\n" not in str(info.value)
    assert snapshot(ledger, db_url) == before
    assert_replays(ledger, tmp_path)


def test_execute_many_refuses_the_bad_command_alone(ledger, db_url, tmp_path):
    base = ledger._bases["BASE"]
    good = c.EmitOutput(handle_id="h", base_generation=base[0], base_snapshot_version=base[1],
                        output_index=0, token_id=7)
    bad = c.EmitOutput(handle_id="h" * 300, base_generation=0, base_snapshot_version=1, output_index=0, token_id=7)
    first, second, third = ledger.execute_many([bad, good, 42])
    assert isinstance(first, KvLedgerError) and first.code is INVALID
    assert not isinstance(second, KvLedgerError)
    assert isinstance(third, KvLedgerError) and third.code is INVALID
    assert_replays(ledger, tmp_path)


def test_longest_valid_ids_are_written_and_replay(ledger, tmp_path):
    """The bounds are the events' own: 256 characters (any Unicode) is accepted and replays."""
    h = "\u00e9" * 255 + "z"
    ledger.allocate(h, make_manifest(request_id="\U0001f600" * 256), reserved_capacity=8,
                    operation_id="o" * 256, copy_tiers=("t" * 256,) * 64)
    assert ledger.state(h).request_id == "\U0001f600" * 256
    assert_replays(ledger, tmp_path)


# -- fuzz ------------------------------------------------------------------------------

# Numbers of every type and size, strings of every length around the bounds, and junk.
NUMBERS = st.one_of(
    st.integers(-3, 70), st.integers(), st.integers(-(1 << 70), 1 << 70), st.sampled_from([(1 << 63) - 1, 1 << 63,
                                                                                          (1 << 64) - 1, 1 << 64]),
    st.floats(), st.booleans(), st.none(), st.decimals(allow_nan=False),
)
TEXT = st.one_of(
    st.text(max_size=8), st.text(min_size=250, max_size=260), st.sampled_from(["", "x" * 10_000, "a\x00b",
                                                                               "\ud800", "h\nSTALE_BASE: x"]),
    st.binary(max_size=8),
)
JUNK = st.one_of(NUMBERS, TEXT, st.lists(st.integers(-2, 5), max_size=3), st.dictionaries(st.text(max_size=3),
                                                                                          st.integers(), max_size=2))


HANDLES = st.one_of(TEXT, NUMBERS)
OPS = st.one_of(st.none(), st.sampled_from(["op-1", "op-2"]), TEXT, NUMBERS)
TOKENS = st.one_of(st.lists(st.integers(0, 600), min_size=1, max_size=4), st.lists(NUMBERS, max_size=3), JUNK)
METHODS = ["allocate", "begin_append", "publish", "fail", "emit", "fork", "truncate", "reorder", "cancel",
           "finish", "release", "state"]


@st.composite
def api_calls(draw):
    """One API call. A quarter of them are clean (every argument plausible, so the journal
    moves on and later calls meet a richer state); the others put hostile values in some
    of the arguments."""
    clean = draw(st.integers(0, 3)) == 0

    def arg(valid, hostile=JUNK):
        return valid if clean else draw(st.one_of(st.just(valid), hostile))

    which = draw(st.sampled_from(METHODS))
    h = arg(draw(st.sampled_from(["h", "f1", "new"])), HANDLES)
    base = arg("BASE", st.one_of(st.tuples(NUMBERS, NUMBERS), JUNK))
    kw = {"operation_id": arg(None, OPS)}
    if which == "allocate":
        h = arg(f"n{draw(st.integers(0, 999))}", HANDLES)  # mostly a new handle
        rid = arg("new", TEXT)
        args = (h, make_manifest(request_id=rid) if isinstance(rid, str) else rid)
        kw |= {"reserved_capacity": arg(32, NUMBERS), "generation": arg(0, NUMBERS),
               "copy_tiers": arg(("gpu",)), "allocator_bytes_per_copy": arg(0, NUMBERS)}
    elif which == "begin_append":
        args = (h,)
        kw |= {"txn_id": arg("t1", TEXT), "kind": arg("decode", TEXT), "base": base,
               "start": arg("END", NUMBERS), "token_ids": arg([5], TOKENS)}
    elif which == "publish":
        args = (h,)
        kw |= {"txn_id": arg("t1", TEXT), "base": base, "workspace_bytes": arg(0, NUMBERS)}
    elif which == "fail":
        args = (h,)
        kw |= {"txn_id": arg("t1", TEXT), "outcome": arg("failed", TEXT), "code": arg("FAILED", TEXT),
               "detail": arg("", TEXT)}
    elif which == "emit":
        args = (h,)
        kw |= {"base": base, "output_index": arg(0, NUMBERS), "token_id": arg(5, NUMBERS)}
    elif which == "fork":
        args = (h,)
        kw |= {"base": base, "child_handle_ids": arg(("f1",), st.lists(HANDLES, max_size=2)),
               "prefix_length": arg(2, NUMBERS), "child_request_ids": arg((), st.lists(TEXT, max_size=2))}
    elif which == "truncate":
        args = (h,)
        kw |= {"base": base, "new_length": arg(1, NUMBERS)}
    elif which == "reorder":
        args = (arg("g", TEXT),)
        kw |= {"rows": arg(("h",), st.lists(HANDLES, max_size=2)),
               "permutation": arg((0,), st.lists(NUMBERS, max_size=2)), "bases": arg(None)}
    elif which in ("cancel", "finish", "release"):
        args = (h,)
        kw |= {"base": arg(0, NUMBERS)}
        if which != "release":
            kw["reason"] = arg("max_tokens" if which == "finish" else "", TEXT)
    else:
        args, kw = (h,), {}
    return which, args, kw


def _fuzz(ledger: Ledger, url: str, tmp_path: Path, examples: int) -> None:
    prefilled(ledger, "h")
    seen: set = set()

    @settings(max_examples=examples, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(call=api_calls())
    def run(call):
        which, args, kw = call
        s = ledger.service.state("h", refresh=True)
        kw = {k: {"BASE": (s.generation, s.snapshot_version), "END": s.committed_length}.get(v, v)
              if isinstance(v, str) else v for k, v in kw.items()}
        before = snapshot(ledger, url)
        try:
            getattr(ledger, which)(*args, **kw)
        except KvLedgerError as exc:
            assert exc.code in E
            assert snapshot(ledger, url) == before, (which, args, kw, exc)
            seen.add(("refused", exc.code))
        else:
            seen.add(("ok", which))

    run()
    assert any(k == "ok" for k, _ in seen) and any(k == "refused" for k, _ in seen), seen
    assert_replays(ledger, tmp_path)


def test_fuzz_api_arguments_sqlite(tmp_path):
    url = f"sqlite:///{tmp_path}/fuzz.db"
    with Ledger.open(url) as ledger:
        _fuzz(ledger, url, tmp_path, examples=400)


def test_fuzz_api_arguments_postgres(pg_admin, tmp_path):
    url = pg_admin.create()
    with Ledger.open(url) as ledger:
        _fuzz(ledger, url, tmp_path, examples=150)
