"""`kvledger kv-events record --metrics-port`: Prometheus metrics scraped over HTTP from a
real recorder process, checked against the summary it prints at exit (issue 44)."""

from __future__ import annotations

import signal
import socket
import time
import urllib.request
from typing import Any

import msgspec
import pytest

pytest.importorskip("zmq")
pytest.importorskip("prometheus_client")

from prometheus_client.parser import text_string_to_metric_families

from kv_publisher import Publisher, Workload, encode
from kv_recording import free_port, new_db, publish_batches, record_cli

P = "kvledger_kv_events_"


def _scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _wait_scrape(port: int, name: str, value: float, timeout: float = 60) -> dict[Any, float]:
    deadline = time.monotonic() + timeout
    while True:
        try:
            got = _scrape(port)
        except OSError:  # not serving yet
            got = {}
        if got.get((P + name, ())) == value or time.monotonic() > deadline:
            return got
        time.sleep(0.2)


def test_metrics_scraped_during_a_run_agree_with_the_summary(tmp_path):
    url = new_db(tmp_path)
    pub = Publisher("vllm")
    port = free_port()
    n = 300
    try:
        rec = record_cli(url, pub, "--metrics-port", str(port), "--log-level", "info")  # the line naming the URL
        first = _wait_scrape(port, "batches_total", 0)
        assert first.get((P + "last_committed_seq", ())) == -1
        time.sleep(0.5)
        w = Workload(51)
        publish_batches(pub, w, n, {}, drop=set(range(100, 120)))  # replayed
        pub.send([b"kv", (1 << 63).to_bytes(9, "big")[1:], encode("vllm", 1.0, w.batch(), 0)])  # seq 2^63-1
        pub.send([b"kv", (n + 5).to_bytes(8, "big"), b"\xc1"])  # not msgpack
        pub.send([b"other", (0).to_bytes(8, "big"), b""])  # another topic
        got = _wait_scrape(port, "batches_total", n)
        time.sleep(0.5)  # what arrived after the last commit (the skips, the other topic) is counted
        got = _scrape(port)
        rec.send_signal(signal.SIGTERM)
        out, err = rec.communicate(timeout=60)
    finally:
        pub.close()
    assert rec.returncode == 0, err.decode()
    assert f"serving metrics on http://127.0.0.1:{port}/metrics" in err.decode()
    s = msgspec.json.decode(out.splitlines()[-1])

    def metric(name: str, **labels: str) -> float:
        return got[(P + name, tuple(sorted(labels.items())))]

    assert metric("batches_total") == s["batches"] == n
    assert metric("events_total") == s["events"]
    assert metric("replayed_batches_total") == s["replayed"] >= 20
    assert metric("gaps_total") == s["gaps"] == 0 and metric("gap_seqs_total") == s["gap_seqs"]
    assert metric("restarts_total") == s["restarts"] == 0
    assert metric("duplicates_total") == s["duplicates"]
    assert metric("refused_batches_total", code="MALFORMED_EVENT") == s["skipped_codes"]["MALFORMED_EVENT"] == 2
    assert metric("refused_batches_total", code="FIELD_TOO_LARGE") == s["too_large"] == 0
    assert metric("other_topic_messages_total") == s["other_topics"] == 1
    assert metric("cap_gaps_total") == s["cap_gaps"] == 0
    assert metric("held_batches") == 0 and metric("held_bytes") == 0
    assert metric("held_bytes_peak") == s["held_bytes_peak"] > 0  # 120-299 waited for the replay
    assert metric("last_committed_seq") == n - 1
    assert metric("streams") == s["streams"] == 1
    commits = metric("commits_total")
    assert commits >= 1 and metric("commit_lag_seconds_count") == commits
    assert 0 < metric("commit_lag_seconds_sum") and 0 < metric("last_commit_lag_seconds") < 60
    # no label carries a seq, a stream or an id: only the fixed codes
    labels = {dict(k[1]).get("code") for k in got if k[0].startswith(P) and k[1] and "le" not in dict(k[1])}
    assert labels <= {"MALFORMED_EVENT", "CAPACITY_EXCEEDED", "FIELD_TOO_LARGE", "other"}


def test_a_metrics_port_in_use_is_a_coded_error(tmp_path):
    url = new_db(tmp_path)
    pub = Publisher("vllm")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        try:
            rec = record_cli(url, pub, "--metrics-port", str(taken.getsockname()[1]))
            out, err = rec.communicate(timeout=60)
        finally:
            pub.close()
    assert rec.returncode == 2
    lines = err.decode().strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("INVALID_ARGUMENT: cannot serve metrics on 127.0.0.1:"), lines
