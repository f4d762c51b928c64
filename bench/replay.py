"""2. Replay: events/s into full projections against msgspec decode-only of the same
stored rows, and how cost and memory scale from 100k to 1M events.

The journal is synthetic but lifecycle-valid (what `kvledger verify` accepts): many
requests, 64 live at a time, each allocate -> prefill -> G x (emit, decode start,
publish) -> emit -> finish -> release, interleaved round-robin like a serving loop.
Bodies are written with the journal's own encoder to a JSONL file and read back as
bytes, so both contenders start from identical stored rows. Scale runs happen in a
fresh child process each, so peak RSS is the replay's own.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from bench import Context, peak_rss_mb

GOALS = {
    "replay_events_per_s": (">=", 300_000),
    "replay_vs_decode_only": (">=", 0.5),
    "replay_cost_ratio_1m_vs_100k": ("<=", 1.2),
}
NOTES = {
    "replay_events_per_s": "decode (msgspec, C) + engine.evolve + ledger deltas per event, "
                           "pure Python past the decode; best of repeats, in-process bodies",
    "replay_vs_decode_only": "the same rows decoded to Event structs and dropped",
    "replay_peak_rss_mb_1m": "child process replaying a 1M-event file, streamed line by line",
}


def write_journal(path: Path, events: int, *, live: int = 64, prompt: int = 24, outputs: int = 16) -> int:
    """A lifecycle-valid synthetic journal of about `events` events; returns the count."""
    from kvledger.journal.builders import allocate_payload, cache_schema, make_manifest
    from kvledger.schemas import events as ev
    from kvledger.schemas.codec import encode_event
    from kvledger.schemas.manifest import ScalarType
    from kvledger.worker.model import DEFAULT_CONFIG

    cfg = DEFAULT_CONFIG
    fp32 = ScalarType("fp32", 4)
    schema = cache_schema(layers=cfg.num_layers, kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                          query_heads=cfg.num_heads, key_dtype=fp32, value_dtype=fp32)
    digest_rows = "d" * 64
    position = 0
    t = 0

    class Req:
        __slots__ = ("h", "pos", "snap", "step", "committed", "outputs", "txn")

    def envelope(cls, r: Req, payload) -> bytes:
        nonlocal position, t
        position += 1
        r.pos += 1
        t += 250_000
        return encode_event(cls(
            event_id=uuid.uuid4().hex, global_position=position, stream_id=r.h, stream_position=r.pos,
            schema_version=ev.CURRENT_VERSION[cls.event_type], request_id=r.h, handle_generation=0,
            operation_id=f"op-{position}", source_instance="bench", local_sequence=position,
            monotonic_ns=t, observed_wall_time=1_700_000_000_000_000_000 + t, payload=payload))


    n_req = 0

    def new() -> tuple[Req, bytes]:
        nonlocal n_req
        n_req += 1
        r = Req()
        r.h, r.pos, r.snap, r.step, r.committed, r.outputs, r.txn = f"r{n_req}", 0, 0, 0, 0, 0, ""
        toks = tuple((n_req * 7 + i) % cfg.vocab_size for i in range(prompt))
        m = make_manifest(r.h, toks, schema=schema, namespace="bench", max_new_tokens=outputs,
                          max_context_tokens=prompt + outputs + 1)
        body = envelope(ev.RequestAllocateEvent, r, allocate_payload(m, reserved_capacity=prompt + outputs + 1))
        return r, body

    abi = None
    written = 0
    with open(path, "wb") as f:
        reqs: list[Req] = []
        while written < events:
            while len(reqs) < live:
                r, body = new()
                if abi is None:
                    abi = json.loads(body)["payload"]["cache_abi_sha256"]
                f.write(body + b"\n")
                written += 1
                reqs.append(r)
            for r in list(reqs):
                out: list[bytes] = []
                if r.step == 0:  # prefill
                    r.txn = uuid.uuid4().hex[:16]
                    toks = tuple((int(r.h[1:]) * 7 + i) % cfg.vocab_size for i in range(prompt))
                    out.append(envelope(ev.AppendStartEvent, r, ev.AppendStart(
                        txn_id=r.txn, kind="prefill", base_snapshot_version=r.snap, interval_start=0,
                        interval_count=prompt, token_ids=toks, cache_positions=tuple(range(prompt)),
                        mask_key_extent=prompt, cache_abi_sha256=abi)))
                    out.append(envelope(ev.AppendPublishEvent, r, ev.AppendPublish(
                        txn_id=r.txn, base_snapshot_version=r.snap, result_snapshot_version=r.snap + 1,
                        committed_length=prompt, accepted_count=prompt,
                        layers_complete=cfg.num_layers, rows_sha256=digest_rows,
                        logits_ready=True)))
                    r.snap += 1
                    r.committed = prompt
                    r.step = 1
                elif r.outputs < outputs:
                    tok = (r.outputs * 31 + 5) % cfg.vocab_size
                    out.append(envelope(ev.OutputEmitEvent, r, ev.OutputEmit(
                        output_index=r.outputs, token_id=tok, snapshot_version=r.snap)))
                    r.outputs += 1
                    if r.outputs == outputs:
                        out.append(envelope(ev.FinishEvent, r, ev.Finish(
                            reason="max_tokens", output_count=r.outputs, committed_length=r.committed)))
                        out.append(envelope(ev.ReleaseEvent, r, ev.Release(
                            base_snapshot_version=r.snap, result_generation=1,
                            result_snapshot_version=r.snap + 1, released_length=r.committed)))
                        reqs.remove(r)
                    else:
                        r.txn = uuid.uuid4().hex[:16]
                        out.append(envelope(ev.AppendStartEvent, r, ev.AppendStart(
                            txn_id=r.txn, kind="decode", base_snapshot_version=r.snap,
                            interval_start=r.committed, interval_count=1, token_ids=(tok,),
                            cache_positions=(r.committed,), mask_key_extent=r.committed + 1,
                            cache_abi_sha256=abi)))
                        out.append(envelope(ev.AppendPublishEvent, r, ev.AppendPublish(
                            txn_id=r.txn, base_snapshot_version=r.snap, result_snapshot_version=r.snap + 1,
                            committed_length=r.committed + 1, accepted_count=1,
                            layers_complete=cfg.num_layers, rows_sha256=digest_rows,
                            logits_ready=True)))
                        r.snap += 1
                        r.committed += 1
                for body in out:
                    f.write(body + b"\n")
                written += len(out)
    return written


def _read(path: Path) -> list[bytes]:
    with open(path, "rb") as f:
        return f.read().splitlines()


def measure(bodies: list[bytes]) -> tuple[float, float]:
    """(decode-only events/s, full replay events/s) over the same bodies."""
    from kvledger.replay.metrics import WindowSpec
    from kvledger.replay.report import build
    from kvledger.replay.run import project
    from kvledger.schemas.codec import decode_event

    t0 = time.perf_counter()
    for b in bodies:
        decode_event(b)
    decode_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    p = project(decode_event(b) for b in bodies)
    build(p, WindowSpec(slo_ttft_ns=1_000_000_000, slo_tbt_ns=100_000_000))
    replay_s = time.perf_counter() - t0
    return len(bodies) / decode_s, len(bodies) / replay_s


def _child(path: str) -> None:
    """Run in a fresh process: replay a file streamed line by line; print JSON."""
    from kvledger.replay.metrics import WindowSpec
    from kvledger.replay.report import build
    from kvledger.replay.run import project
    from kvledger.replay.sources import jsonl_events

    t0 = time.perf_counter()
    p = project(jsonl_events(path))
    build(p, WindowSpec(slo_ttft_ns=1_000_000_000, slo_tbt_ns=100_000_000))
    dt = time.perf_counter() - t0
    print(json.dumps({"events": p.position, "seconds": dt, "peak_rss_mb": peak_rss_mb()}))


def _scale_run(path: Path) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-c", f"from bench.replay import _child; _child({str(path)!r})"],
                         capture_output=True, text=True, check=True, cwd=Path(__file__).resolve().parents[1])
    return json.loads(out.stdout.strip().splitlines()[-1])


def run(ctx: Context) -> dict[str, Any]:
    n = ctx.size(smoke=5_000, quick=100_000, full=100_000)
    big = ctx.size(smoke=20_000, quick=1_000_000, full=1_000_000)
    small_path, big_path = ctx.tmp / "replay_small.jsonl", ctx.tmp / "replay_big.jsonl"
    t0 = time.perf_counter()
    n = write_journal(small_path, n)
    ctx.log(f"   wrote {n} events in {time.perf_counter() - t0:.1f} s")
    bodies = _read(small_path)
    decode_rates, replay_rates = [], []
    for _ in range(ctx.repeats):
        d, r = measure(bodies)
        decode_rates.append(d)
        replay_rates.append(r)
    del bodies
    decode_rate, replay_rate = max(decode_rates), max(replay_rates)
    t0 = time.perf_counter()
    nb = write_journal(big_path, big)
    ctx.log(f"   wrote {nb} events in {time.perf_counter() - t0:.1f} s")
    small = min((_scale_run(small_path) for _ in range(ctx.repeats)), key=lambda x: x["seconds"])
    large = _scale_run(big_path)
    per_small = small["seconds"] / small["events"]
    per_large = large["seconds"] / large["events"]
    return {
        "replay_events_per_s": round(replay_rate),
        "decode_only_events_per_s": round(decode_rate),
        "replay_vs_decode_only": round(replay_rate / decode_rate, 3),
        f"replay_events_{n}_file_per_s": round(small["events"] / small["seconds"]),
        f"replay_events_{nb}_file_per_s": round(large["events"] / large["seconds"]),
        "replay_cost_ratio_1m_vs_100k": round(per_large / per_small, 3),
        "replay_peak_rss_mb_100k": round(small["peak_rss_mb"], 1),
        "replay_peak_rss_mb_1m": round(large["peak_rss_mb"], 1),
    }
