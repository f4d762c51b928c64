"""`kvledger kv-events record | serve | import`: KV-event streams of serving engines
(vLLM, SGLang, TensorRT-LLM) journaled as their own streams (docs/guides/kv-events.md).

    kvledger kv-events record --endpoint tcp://127.0.0.1:5557 --replay-endpoint tcp://127.0.0.1:5558
    kvledger kv-events record --bind tcp://*:5557 --engine engine-a=tcp://engine-a:5558
    kvledger kv-events serve --bind tcp://127.0.0.1:5600
    kvledger kv-events import events.jsonl --dialect trtllm

pyzmq is a core dependency: the light install records, serves and imports.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
from typing import TYPE_CHECKING

from kvledger import args as a
from kvledger.args import DB_HELP
from kvledger.schemas.errors import ErrorCode, KvLedgerError

log = logging.getLogger("kvledger.kv_events")

if TYPE_CHECKING:
    from collections.abc import Callable

    from kvledger.adapters import kv_events_zmq as z
    from kvledger.journal.port import Journal

# HOST: a name, an IPv4 address, `*` (bind on every interface) or a bracketed IPv6 address.
_ENDPOINT = re.compile(r"tcp://(?:\*|[A-Za-z0-9_.-]+|\[[0-9A-Fa-f:.]+\]):(?P<port>[0-9]{1,5})"
                       r"|(?:ipc|inproc)://\S+")


def endpoint(value: str) -> str:
    """A ZMQ endpoint: tcp://HOST:PORT (PORT 1..65535), ipc://PATH or inproc://NAME."""
    found = _ENDPOINT.fullmatch(value) if len(value) <= 200 and value.isprintable() else None
    if found is None:
        raise KvLedgerError(ErrorCode.INVALID_ARGUMENT, f"{value[:60]!r} is not a ZMQ endpoint "
                                                        "(tcp://HOST:PORT, ipc://PATH)")
    if found["port"] is not None and not 0 < int(found["port"]) < 65536:
        raise KvLedgerError(ErrorCode.INVALID_ARGUMENT, f"{value[:60]!r}: port {int(found['port'])} is outside "
                                                        "1..65535")
    return value


def engine_spec(value: str) -> tuple[str, str]:
    """NAME=REPLAY_ENDPOINT of `record --engine`: NAME is the engine's topic (split at the
    last `=`; empty for vLLM's default topic), the endpoint one the collector connects to."""
    name, sep, where = value.rpartition("=")
    if not sep:
        raise KvLedgerError(ErrorCode.INVALID_ARGUMENT, f"--engine {value[:60]!r} is not NAME=REPLAY_ENDPOINT")
    _topic(name)
    if len(name.encode()) > 100:  # the collector reads a topic frame of at most 100 bytes
        raise KvLedgerError(ErrorCode.INVALID_ARGUMENT, f"--engine {value[:60]!r}: a NAME is at most 100 bytes of "
                                                        "UTF-8")
    endpoint(where)
    if where.startswith("tcp://*:"):
        raise KvLedgerError(ErrorCode.INVALID_ARGUMENT, f"--engine {value[:60]!r}: tcp://*:PORT is where the "
                                                        "engine binds; name its host (tcp://HOST:PORT)")
    return name, where


def seconds(value: str) -> float:
    try:
        s = float(value)
    except ValueError:
        raise KvLedgerError(ErrorCode.INVALID_ARGUMENT, f"{value[:40]!r} is not a number of seconds") from None
    if not 0 < s <= 31_536_000:
        raise KvLedgerError(ErrorCode.INVALID_ARGUMENT, f"{value[:40]!r} seconds is outside (0, 31536000]")
    return s


def _topic(value: str) -> str:
    if len(value) > 100 or any(ord(ch) < 32 for ch in value):
        raise KvLedgerError(ErrorCode.INVALID_ARGUMENT, "a topic is at most 100 printable characters")
    return value


MAX_HELD_BYTES = 256 << 20  # adapters.kv_events_recorder's (not imported: --help loads no recorder)
DEFAULT_RCVHWM = 1000  # adapters.kv_events_zmq.RCVHWM
HELD_BYTES = a.integer(0, 1 << 40)
RCVHWM = a.integer(1, 1 << 24)  # 0 would be ZMQ's "no limit"
TOPICS_SHOWN = 8


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    top = sub.add_parser("kv-events", help="record, serve and import the KV-cache events of vLLM, SGLang "
                                           "and TensorRT-LLM (their prefix-cache residency)",
                         description="Journal the KV-cache events serving engines publish (block stored, removed, "
                                     "cleared), so their prefix-cache residency can be replayed, served back to "
                                     "routers and reconciled. `record` subscribes to live engines, `serve` answers "
                                     "replay and snapshot requests from the journal, `import` loads recorded files.")
    kv = top.add_subparsers(dest="kv_command", metavar="SUBCOMMAND", required=True)

    p = kv.add_parser("record", help="subscribe to an engine's KV-event publisher and journal every "
                                     "batch exactly once (gaps replayed or journaled, restarts journaled)",
                      description="Subscribe to one engine (--endpoint) or collect a fleet (--bind) and journal every "
                                  "event batch exactly once: a seq hole is replayed from the engine's replay socket "
                                  "or journaled as a gap, a publisher restart is journaled, a restarted recorder "
                                  "catches up by replay. Memory is bounded (--max-held-bytes); bad messages are "
                                  "skipped with a code. Runs until SIGINT/SIGTERM or --idle-exit.")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--endpoint", type=endpoint,
                       help="record one engine: its publisher's PUB endpoint, connected to (e.g. tcp://HOST:5557)")
    where.add_argument("--bind", type=endpoint, action="append", metavar="ENDPOINT",
                       help="collect: bind here (tcp://*:5557 on every interface, tcp://HOST:5557 on one; "
                            "repeatable, e.g. for port + rank under data parallelism) and record every engine "
                            "whose publisher connects (vLLM's endpoint tcp://COLLECTOR:5557), each engine's topic "
                            "and data_parallel_rank a stream of its own (kv:collector|TOPIC|dpRANK)")
    p.add_argument("--replay-endpoint", type=endpoint,
                   help="with --endpoint: the publisher's replay ROUTER endpoint, asked for missed batches "
                        "(default: none, every hole is journaled as a gap)")
    p.add_argument("--engine", type=engine_spec, action="append", default=[], metavar="NAME=REPLAY_ENDPOINT",
                   help="with --bind, repeatable: the engine publishing on topic NAME (vLLM's `topic`; empty "
                        "for its default) answers replays at REPLAY_ENDPOINT, rank r at its port + r as vLLM binds "
                        "them; an engine not named is recorded without replay (a warning, counted in "
                        "unknown_engines, each lost batch a gap)")
    p.add_argument("--topic", type=_topic, default="",
                   help="the topic to record (default: none, every message, which SGLang's [seq, payload] form "
                        "needs); messages on other topics are counted and named, and when only those arrive the "
                        "exit status is 1")
    p.add_argument("--dialect", choices=("auto", "vllm", "sglang"), default="auto",
                   help="message form: vllm [topic, seq, payload], sglang [seq, payload]; auto takes either "
                        "(default)")
    p.add_argument("--block-bytes", type=a.BLOCK_BYTES, metavar="N",
                   help="bytes per block: the summary then gives the streams' resident bytes "
                        "(default: block counts only)")
    p.add_argument("--db", help=DB_HELP)
    p.add_argument("--idle-exit", type=seconds, metavar="SECONDS",
                   help="stop after this long without a message of the topic (default: run until SIGINT/SIGTERM); "
                        "what is held then is journaled, each hole below it as a gap")
    p.add_argument("--max-held-bytes", type=HELD_BYTES, default=MAX_HELD_BYTES, metavar="N",
                   help=f"bytes of batches held while a replay is pending (default {MAX_HELD_BYTES}, "
                        f"{MAX_HELD_BYTES >> 20} MiB; with --bind, all engines together); past it the oldest hole "
                        "(of the stream holding most) is journaled as a gap and what follows it is journaled")
    p.add_argument("--rcvhwm", type=RCVHWM, default=DEFAULT_RCVHWM, metavar="N",
                   help=f"messages each socket queues before ZMQ pushes back on the publisher (default "
                        f"{DEFAULT_RCVHWM}); a publisher then drops, which shows as a seq hole: replayed or "
                        "journaled as a gap")
    p.add_argument("--metrics-port", type=a.PORT, metavar="P", help=a.METRICS_PORT_HELP)
    p.add_argument("--metrics-host", type=a.host, default="127.0.0.1", metavar="H", help=a.METRICS_HOST_HELP)
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object (with --bind, each "
                                                       "engine stream's under `engines`)")
    p.set_defaults(run=_cmd_record)

    p = kv.add_parser("import", help="load a recorded KV-event stream from a JSONL file, all or nothing",
                      description="Load a KV-event stream recorded to a file (TensorRT-LLM's get_kv_cache_events() "
                                  "dicts, or vLLM batches) into the journal as one stream, all or nothing: one "
                                  "bad line and nothing is written.")
    p.add_argument("file", type=a.input_file, metavar="FILE.jsonl",
                   help="the recorded stream, one event dict (trtllm) or one batch (vllm) per line")
    p.add_argument("--dialect", choices=("trtllm", "vllm"), required=True,
                   help="trtllm: get_kv_cache_events() dicts, one a line; vllm: one batch a line")
    p.add_argument("--stream", type=_topic, metavar="NAME",
                   help="the stream's source name (default: import:FILE's name)")
    p.add_argument("--db", help=DB_HELP)
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    p.set_defaults(run=_cmd_import)

    p = kv.add_parser("serve", help="answer vLLM's replay protocol from the journal (any seq ever recorded), "
                                    "and snapshot requests (resident blocks + the seq they are valid at)",
                      description="Bind a ROUTER socket and answer, from the journal, vLLM's replay requests (the "
                                  "batches from any seq ever recorded) and snapshot requests (the resident blocks "
                                  "and the seq they are valid at), so a router can rebuild its index without the "
                                  "engine. Read-only. Runs until SIGINT/SIGTERM or --idle-exit.")
    p.add_argument("--bind", type=endpoint, required=True, help="ROUTER endpoint to bind, e.g. tcp://127.0.0.1:5600")
    p.add_argument("--db", help=DB_HELP)
    p.add_argument("--idle-exit", type=seconds, metavar="SECONDS",
                   help="stop after this long without a request (default: run until SIGINT/SIGTERM)")
    p.add_argument("--json", action="store_true", help="print the summary (answered, refused, peaks) as one JSON "
                                                       "object")
    p.set_defaults(run=_cmd_serve)


SUMMARY_KEYS = ("batches", "events", "replayed", "duplicates", "gaps", "gap_seqs", "restarts", "streams")
# record's own: what it refused, what the held-bytes cap cost, what it saw on other topics
COLLECT_KEYS = ("unknown_engines",)
RECORD_KEYS = ("received", "skipped", "skipped_codes", "too_large", "cap_gaps", "cap_gap_seqs", "held_bytes_peak",
               "backlog_peak", "other_topics", "topics_seen")


def _summary(s: object, as_json: bool, extra: dict[str, object] | None = None, keys: tuple[str, ...] = ()) -> None:
    _print({k: getattr(s, k) for k in (*SUMMARY_KEYS, *keys)} | (extra or {}), as_json)


def _print(doc: dict[str, object], as_json: bool) -> None:
    """One JSON object, or one line of key=value (a dict value as JSON)."""
    print(json.dumps(doc) if as_json else " ".join(f"{k}={json.dumps(v) if isinstance(v, dict | list) else v}"
                                                   for k, v in doc.items()))


def _resident_bytes(journal: Journal, endpoint: str, topic: str, block_bytes: int) -> dict[str, object]:
    """The recorded streams' resident bytes now (their block pools, folded from the journal)."""
    from kvledger.adapters.kv_events_recorder import stream_id
    from kvledger.replay.kv_blocks import KvBlocks, report
    from kvledger.schemas.kv_events import KV_LIFECYCLE

    prefix = stream_id(endpoint, topic, None)[:-3]
    fold = KvBlocks()
    for sid, head in journal.heads().items():
        if head.lifecycle == KV_LIFECYCLE and sid.startswith(prefix):
            fold.feed(journal.read_stream(sid))
    return {"resident_bytes": {r.stream_id: sum(p.resident_bytes or 0 for p in r.pools.values())
                               for r in report(fold.state, block_bytes)}}


def _cmd_import(args: argparse.Namespace) -> int:
    from pathlib import Path

    from kvledger.adapters.kv_events_import import import_operations
    from kvledger.adapters.kv_events_recorder import stream_id
    from kvledger.migrations.storage import creating_journal

    path = Path(args.file)
    source = args.stream or f"import:{path.name}"
    with creating_journal(args.db) as journal:
        heads = journal.heads()
        if any(sid.startswith(stream_id(source, "", None)[:-3]) for sid in heads):
            raise KvLedgerError(ErrorCode.INVALID_ARGUMENT, f"the journal already holds stream {source!r}: "
                                                            "name another with --stream")
        ops, rec = import_operations(path, args.dialect, heads, source)
        if ops:
            journal.append(ops)  # one transaction: all or nothing
    _summary(rec.summary, args.json)
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    import msgspec
    import zmq

    from kvledger.adapters import kv_events_serve as s
    from kvledger.adapters import kv_events_zmq as z
    from kvledger.migrations.storage import open_existing_journal

    stop = z.Stop()
    z.install_signals(stop)
    with open_existing_journal(args.db) as journal:
        try:
            served = s.serve(journal, args.bind, stop=stop, idle_exit=args.idle_exit)
        except zmq.ZMQError as exc:
            raise KvLedgerError(ErrorCode.INVALID_ARGUMENT, f"cannot bind {args.bind}: {exc}") from None
    _print(msgspec.structs.asdict(served), args.json)
    return 0


def _topics(s: z.Summary) -> str:
    """The other topics seen, for a line that says why nothing was recorded."""
    return ", ".join(f"{name!r} ({n})" for name, n in list(s.topics_seen.items())[:TOPICS_SHOWN]) + \
        (", ..." if s.other_topics > sum(s.topics_seen.values()) else "")


def _cmd_record(args: argparse.Namespace) -> int:
    """Exit 0; 1 when messages arrived only on other topics than --topic (nothing of it
    recorded: the summary names the topics seen); 2 on an error."""
    from kvledger.adapters import kv_events_zmq as z
    from kvledger.migrations.storage import open_or_create_journal

    _check_collect(args)
    metrics = None
    if args.metrics_port is not None:
        from kvledger.adapters.kv_events_metrics import RecorderMetrics

        metrics = RecorderMetrics()
        port = metrics.serve(args.metrics_host, args.metrics_port)
        log.info("serving metrics on http://%s:%d/metrics", args.metrics_host, port)
    stop = z.Stop()
    z.install_signals(stop)

    def progress(s: z.Summary) -> None:
        line = (f"{s.batches} batches, {s.events} events, {s.replayed} replayed, {s.gaps} gaps, "
                f"{s.restarts} restarts, {s.held_batches} held ({s.held_bytes} bytes), {s.skipped} skipped")
        if not s.received and s.other_topics:
            line += f"; nothing on topic {args.topic!r}, {s.other_topics} messages on others: {_topics(s)}"
        log.info("%s", line)

    try:
        with open_or_create_journal(args.db) as journal:
            options = z.RecordOptions(replay_endpoint=args.replay_endpoint, topic=args.topic,
                                      idle_exit=args.idle_exit, dialect=args.dialect,
                                      max_held_bytes=args.max_held_bytes, rcvhwm=args.rcvhwm)
            watch = None if metrics is None else metrics.watch
            if args.bind is not None:
                return _collect(journal, args, options, stop, progress, watch)
            summary = z.record(journal, args.endpoint, options, stop=stop, progress=progress, watch=watch)
            extra = None if args.block_bytes is None else \
                _resident_bytes(journal, args.endpoint, args.topic, args.block_bytes)
    finally:
        if metrics is not None:
            metrics.close()
    _summary(summary, args.json, extra, RECORD_KEYS)
    if not summary.received and summary.other_topics:
        log.warning("no message on topic %r; %d on other topics: %s", args.topic, summary.other_topics,
                    _topics(summary))
        return 1
    return 0


def _check_collect(args: argparse.Namespace) -> None:
    """--bind (collect) and --endpoint (one publisher) take options of their own."""
    if args.bind is None:
        if args.engine:
            raise KvLedgerError(ErrorCode.INVALID_ARGUMENT, "--engine names a collected engine: use it with --bind")
        return
    for flag, given in (("--replay-endpoint", args.replay_endpoint), ("--topic", args.topic),
                        ("--block-bytes", args.block_bytes), ("--dialect sglang", args.dialect == "sglang")):
        if given:
            raise KvLedgerError(ErrorCode.INVALID_ARGUMENT, f"{flag} is for one publisher (--endpoint); with --bind "
                                                            "each engine is its topic, its replay an --engine")
    names = [name for name, _ in args.engine]
    if len(set(names)) != len(names):
        twice = sorted({n for n in names if names.count(n) > 1})[0]
        raise KvLedgerError(ErrorCode.INVALID_ARGUMENT, f"--engine {twice!r} is given twice")
    if len(set(args.bind)) != len(args.bind):
        raise KvLedgerError(ErrorCode.INVALID_ARGUMENT, "an endpoint is given to --bind twice")


def _collect(journal: Journal, args: argparse.Namespace, options: z.RecordOptions, stop: z.Stop,
             progress: Callable[[z.Summary], None], watch: Callable[[z.Deciding, z.Committed], None] | None) -> int:
    """`record --bind`: the summary with each engine's (`engines`)."""
    import msgspec

    from kvledger.adapters.kv_events_collector import collect

    summary, engines = collect(journal, args.bind, dict(args.engine), options, stop=stop, progress=progress,
                               watch=watch)
    _summary(summary, args.json, {"engines": [msgspec.structs.asdict(e) for e in engines]},
             (*RECORD_KEYS, *COLLECT_KEYS))
    return 0
