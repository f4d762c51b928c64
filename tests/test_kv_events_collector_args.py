"""`kv-events record --bind ... --engine NAME=REPLAY_ENDPOINT`: what the collector's
options refuse (each INVALID_ARGUMENT, one line), a fuzz of --engine over arbitrary text,
and the command end to end with its per-engine JSON summary."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from kvledger.cli import main
from kvledger.cmd_kv_events import endpoint, engine_spec
from kvledger.schemas.errors import ErrorCode, KvLedgerError

from kv_publisher import Publisher, Wiring, Workload, encode
from kv_recording import await_true, free_port, new_db, stream_events

REFUSED = [
    (["--bind", "tcp://*:0"], "1..65535"),
    (["--bind", "tcp://*:5557", "--engine", "kv"], "NAME=REPLAY_ENDPOINT"),
    (["--bind", "tcp://*:5557", "--engine", "kv=tcp://engine"], "not a ZMQ endpoint"),
    (["--bind", "tcp://*:5557", "--engine", "kv=tcp://*:5558"], "name its host"),
    (["--bind", "tcp://*:5557", "--engine", "kv=tcp://a:1", "--engine", "kv=tcp://b:1"], "given twice"),
    (["--bind", "tcp://*:5557", "--bind", "tcp://*:5557"], "given to --bind twice"),
    (["--bind", "tcp://*:5557", "--engine", "\u00e9" * 51 + "=tcp://a:1"], "at most 100 bytes"),
    (["--bind", "tcp://*:5557", "--topic", "kv"], "--topic is for one publisher"),
    (["--bind", "tcp://*:5557", "--replay-endpoint", "tcp://a:1"], "--replay-endpoint is for one publisher"),
    (["--endpoint", "tcp://a:1", "--engine", "kv=tcp://a:2"], "use it with --bind"),
    (["--endpoint", "tcp://a:1", "--bind", "tcp://*:5557"], "not allowed with"),
    ([], "one of the arguments"),
]


@pytest.mark.parametrize(("argv", "says"), REFUSED)
def test_bad_collector_options_are_coded_errors(capsys, tmp_path, argv, says):
    url = new_db(tmp_path)
    assert main(["kv-events", "record", *argv, "--db", url, "--idle-exit", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("INVALID_ARGUMENT") and says in err and err.count("\n") == 1, err


def test_a_port_in_use_is_a_coded_error(capsys, tmp_path):
    ctx = zmq.Context()
    taken = ctx.socket(zmq.PULL)
    port = taken.bind_to_random_port("tcp://127.0.0.1")
    try:
        assert main(["kv-events", "record", "--bind", f"tcp://127.0.0.1:{port}", "--db", new_db(tmp_path),
                     "--idle-exit", "1"]) == 2
    finally:
        taken.close(0)
        ctx.term()
    err = capsys.readouterr().err
    assert err.startswith("INVALID_ARGUMENT") and f"cannot bind tcp://127.0.0.1:{port}" in err, err


def test_help_explains_the_bind_form(capsys):
    with pytest.raises(SystemExit):
        main(["kv-events", "record", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "tcp://*:5557" in out and "tcp://COLLECTOR:5557" in out and "port + r" in out and "unknown_engines" in out


def _check(value: str) -> None:
    try:
        name, where = engine_spec(value)
    except KvLedgerError as exc:
        assert exc.code is ErrorCode.INVALID_ARGUMENT
        return
    assert f"{name}={where}" == value and endpoint(where) == where and not where.startswith("tcp://*:")
    assert len(name.encode()) <= 100 and all(ord(ch) >= 32 for ch in name)


NAMES = st.one_of(st.text(max_size=12), st.sampled_from(["kv", "", "a=b", "\n", "x" * 101, "\u00e9" * 60]))
WHERE = st.one_of(st.text(max_size=20), st.sampled_from(["tcp://127.0.0.1:5558", "tcp://*:5558", "tcp://h:0",
                                                         "tcp://h:70000", "ipc:///tmp/r", "inproc://r", "tcp://h"]))


@settings(max_examples=400, deadline=None)
@given(name=NAMES, sep=st.sampled_from(["=", "", "==", ":"]), where=WHERE)
def test_fuzz_engine_specs(name, sep, where):
    _check(name + sep + where)


@settings(max_examples=200, deadline=None)
@given(value=st.text(max_size=260))
def test_fuzz_engine_any_text(value):
    _check(value)


def test_the_command_collects_and_prints_each_engine(tmp_path):
    url = new_db(tmp_path)
    port = free_port()
    named = Publisher("vllm", topic="kv", wiring=Wiring(connect=f"tcp://127.0.0.1:{port}"))
    w = Workload(9)
    proc = subprocess.Popen([sys.executable, "-m", "kvledger", "kv-events", "record", "--bind", f"tcp://*:{port}",
                             "--engine", f"kv={named.replay_endpoint}", "--db", url, "--idle-exit", "2", "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ,
                                                                                 "KVLEDGER_LOG": "warning"})
    try:
        def recorded() -> bool:
            named.publish(w.batch())
            return bool(stream_events(url))
        await_true("the first batch journaled", recorded)
        for _ in range(5):
            named.publish(w.batch())
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
        named.close()
    assert proc.returncode == 0, err
    doc = json.loads(out)
    (engine,) = doc["engines"]
    assert engine["engine"] == "kv" and engine["rank"] == 0 and engine["stream_id"] == "kv:collector|kv|dp0"
    assert engine["replay_endpoint"] == named.replay_endpoint and doc["unknown_engines"] == 0
    assert engine["batches"] == doc["batches"] == named.seq and doc["gaps"] == 0


# -- the Collector's routing, without sockets -------------------------------------------

def _collector(engines: dict[str, str], max_held_bytes: int = 256 << 20) -> tuple[Any, list[str]]:
    from kvledger.adapters import kv_events_zmq as z
    from kvledger.adapters.kv_events_collector import Collector

    opened: list[str] = []

    def dealer(where: str) -> Any:
        opened.append(where)
        return None  # the Recorder decides without it; the loop's sockets are not under test here

    return Collector({}, engines, z.RecordOptions(max_held_bytes=max_held_bytes), dealer), opened


def _frames(topic: bytes, seq: int, rank: int | None = 0) -> list[bytes]:
    payload = encode("vllm", 1.0, Workload(seq).batch(2), rank)  # type: ignore[arg-type]
    return [topic, seq.to_bytes(8, "big"), payload]


def test_the_collector_tells_engines_apart_by_topic_and_rank():
    col, opened = _collector({"kv": "tcp://engine:5558"})
    assert col.live(_frames(b"kv", 0, 0)) is None
    assert col.live(_frames(b"kv", 0, 1)) is None  # rank 1 of the same engine: a stream of its own
    assert col.live(_frames(b"other", 0, 0)) is None
    assert opened == ["tcp://engine:5558", "tcp://engine:5559"]  # rank r replays at port + r, as vLLM binds it
    assert sorted(col.engines) == [("kv", 0), ("kv", 1), ("other", 0)]
    assert [e.replay for e in col.engines.values()] == ["tcp://engine:5558", "tcp://engine:5559", None]
    col.live(_frames(b"other", 2, 0))  # unknown: the lost seq 1 is a gap at once, no replay asked
    taken = col.take_group()
    sids = sorted({w.handle_id for op in taken.ops for w in op.writes})
    assert sids == ["kv:collector|kv|dp0", "kv:collector|kv|dp1", "kv:collector|other|dp0"]
    s = taken.summary
    assert s is not None and (s.batches, s.gaps, s.unknown_engines, s.streams) == (4, 1, 1, 3)
    other = col.engines[("other", 0)].rec
    assert other.replay_wanted is None and col.engines[("kv", 0)].rec.replay_wanted == 0


@pytest.mark.parametrize(("frames", "code"), [
    ([b"1" * 8, b"x"], "MALFORMED_EVENT"),
    ([b"t" * 101, (0).to_bytes(8, "big"), b"\x93"], "MALFORMED_EVENT"),
    ([b"\xff\xfe", (0).to_bytes(8, "big"), b"\x93"], "MALFORMED_EVENT"),
    ([b"kv", (0).to_bytes(8, "big"), b"not msgpack"], "MALFORMED_EVENT"),
    ([b"kv", b"\x7f" + b"\xff" * 7, b"\x93"], "MALFORMED_EVENT"),
])
def test_what_no_engine_takes_is_skipped_and_counted(frames, code):
    col, _ = _collector({})
    error = col.live(frames)
    assert error is not None and error.code.value == code
    taken = col.take_group()
    assert taken.ops == [] and taken.summary is not None
    assert taken.summary.skipped == 1 and taken.summary.skipped_codes == {code: 1} and not col.engines


def test_one_engine_stream_too_many_is_refused_with_a_code():
    from kvledger.adapters.kv_events_collector import MAX_ENGINES

    col, _ = _collector({})
    for i in range(MAX_ENGINES):
        assert col.live(_frames(f"e{i}".encode(), 0)) is None
    error = col.live(_frames(b"one-more", 0))
    assert error is not None and error.code is ErrorCode.CAPACITY_EXCEEDED
    assert len(col.engines) == MAX_ENGINES and col.take_group().summary.skipped_codes == {"CAPACITY_EXCEEDED": 1}


def test_max_held_bytes_bounds_all_engines_together():
    """Two named engines each hold a batch waiting for a replay, each within the cap alone,
    together past it: the one holding most gives up its hole as a gap (cap_gaps) and
    journals its batch."""
    small, big = _frames(b"a", 3), _frames(b"b", 3)
    big[2] = encode("vllm", 1.0, Workload(1).batch(40), 0)
    sizes = []
    for frames in (small, big):
        alone, _ = _collector({"a": "tcp://a:1", "b": "tcp://b:1"})
        alone.live(frames)
        sizes.append(alone.take_group().summary.held_bytes)
    assert 0 < sizes[0] < sizes[1]
    cap = sum(sizes) - 1
    col, _ = _collector({"a": "tcp://a:1", "b": "tcp://b:1"}, max_held_bytes=cap)
    assert col.live(small) is None and col.live(big) is None
    a, b = col.engines[("a", 0)].rec.summary, col.engines[("b", 0)].rec.summary
    assert a.held_batches == 1 and b.held_batches == 0  # b held more: its hole 0..2 was given up
    assert (b.cap_gaps, b.cap_gap_seqs, b.batches) == (1, 3, 1) and a.cap_gaps == 0
    taken = col.take_group()
    assert taken.summary is not None and taken.summary.cap_gaps == 1 and taken.summary.held_bytes == sizes[0]
