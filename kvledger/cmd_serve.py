"""`kvledger demo` and `kvledger generate`: the worker under the journal."""

from __future__ import annotations

import argparse
import json
import sys
import uuid
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, get_args

from kvledger.args import JsonDoc
from kvledger.cli import add_slo_arguments
from kvledger.engine import WRITERS
from kvledger.engine.ids import instance_name
from kvledger.schemas.errors import ErrorCode, KvLedgerError

if TYPE_CHECKING:
    from rich.progress import Progress

    from kvledger.journal import Journal
    from kvledger.schemas.events import Event
    from kvledger.worker.serving import Worker



def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    # The parsers for demo and generate are declared in cli.py (their command lines are
    # part of the foundation); this module supplies what they run.
    for name, run in (("demo", _cmd_demo), ("generate", _cmd_generate)):
        sub.choices[name].set_defaults(run=run)
    for name in ("demo", "generate"):
        sub.choices[name].add_argument(
            "--writer", choices=WRITERS, default="thread",
            help="where the command service decides and commits: thread (in this process, the "
                 "default) or process (a writer process beside the model call, off its GIL; on a "
                 "CPU, torch then leaves it one core). Same journal, guards and durability")
    demo = sub.choices["demo"]
    add_slo_arguments(demo)


def _make_room(args: argparse.Namespace) -> None:
    if args.writer == "process" and not str(args.device).startswith("cuda"):
        from kvledger.worker.serving import leave_a_core

        leave_a_core()


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    k = (len(v) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def own_events(journal: Journal, after: int, source_instance: str) -> list[Event]:
    """The events after `after` that this run's service wrote (its source instance names
    the run), renumbered 1.. in their global order: another run writing to the same
    journal meanwhile must not count in this run's summary, and the projector folds
    positions without gaps."""
    from msgspec.structs import replace

    mine = (e for e in journal.read_all(after=after) if e.source_instance == source_instance)
    return [replace(e, global_position=i) for i, e in enumerate(mine, 1)]


def summarize(journal: Journal, after: int, slo_ttft_ms: float, slo_tbt_ms: float, source_instance: str) -> JsonDoc:
    from kvledger.replay.metrics import WindowSpec
    from kvledger.replay.projector import Projector
    from kvledger.replay.report import build
    from kvledger.schemas.events import AppendStartEvent

    # This run touched only handles it created, so a fold of its own events is complete.
    events = own_events(journal, after, source_instance)
    projector = Projector().feed(events)
    report = build(projector, WindowSpec(slo_ttft_ns=int(slo_ttft_ms * 1e6), slo_tbt_ns=int(slo_tbt_ms * 1e6)))
    ttft = [r.ttft_ns / 1e6 for r in report.requests if r.ttft_ns is not None]
    tpot = [r.tpot_ns / 1e6 for r in report.requests if r.tpot_ns is not None]
    w = report.window
    return {
        "ledger_peaks_bytes": {k: p.value for k, p in report.peaks.items()},
        "ttft_ms": {"p50": _percentile(ttft, 0.5), "p99": _percentile(ttft, 0.99)},
        "tpot_ms": {"p50": _percentile(tpot, 0.5), "p99": _percentile(tpot, 0.99)},
        "goodput": {"completed": w.completed, "slo_valid": w.slo_valid, "fraction": w.goodput_fraction,
                    "requests_per_s": w.goodput_rps, "tokens_per_s": w.token_goodput_tps,
                    "slo_ttft_ms": slo_ttft_ms, "slo_tbt_ms": slo_tbt_ms},
        "cancelled": sum(1 for r in report.requests if r.outcome == "cancelled"),
        "events_written": len(events),
        "source_instance": source_instance,
        "events_by_type": dict(Counter(e.event_type for e in events)),
        "appends_by_kind": dict(Counter(e.payload.kind for e in events if isinstance(e, AppendStartEvent))),
    }


def _progress(total: int) -> tuple[Progress | None, Callable[[Worker], None] | None]:
    if not sys.stderr.isatty():
        return None, None
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    bar = Progress(TextColumn("serving"), BarColumn(), MofNCompleteColumn(), TextColumn("requests"),
                   TimeElapsedColumn(), transient=True, console=None)
    task = bar.add_task("demo", total=total)

    def on_step(worker: Worker) -> None:
        done = sum(1 for lv in worker.live.values() if lv.done is not None and "." not in lv.handle[-2:])
        bar.update(task, completed=min(done, total))

    return bar, on_step


def _cmd_demo(args: argparse.Namespace) -> int:
    import torch

    from kvledger.cmd_telemetry import demo_telemetry, finish_demo_telemetry
    from kvledger.demo import DemoOptions, run_demo
    from kvledger.journal import redact, resolve_url, tuning
    from kvledger.migrations.storage import open_or_create_journal

    url = resolve_url(args.db)
    run_id = uuid.uuid4().hex[:8]
    source = f"kvledger-demo-{run_id}"  # stamps every event of this run: its summary counts only those
    _make_room(args)
    # The telemetry flags are checked (and their files opened) before the journal is: a
    # refused command must not leave a new database behind.
    telemetry = demo_telemetry(args)
    try:
        journal = open_or_create_journal(url)
    except BaseException:
        finish_demo_telemetry(telemetry, args)
        raise
    with journal:
        first = journal.last_position()
        bar, on_step = _progress(args.requests)
        if bar:
            bar.start()
        try:
            options = DemoOptions(requests=args.requests, max_new_tokens=args.max_new_tokens, seed=args.seed,
                                  run_id=run_id, model_dir=args.model, device=args.device, source_instance=source,
                                  writer=args.writer)
            result = run_demo(journal, options, on_step=on_step, telemetry=telemetry)
        finally:
            if bar:
                bar.stop()
            telemetry_out = finish_demo_telemetry(telemetry, args)
        summary = summarize(journal, first, args.slo_ttft_ms, args.slo_tbt_ms, source)
        position = journal.last_position()
    out: JsonDoc = {
        "journal": redact(url), "position": position, "requests": result["requests"],
        "handles": result["handles"], "tokens": result["tokens"],
        "iterations": result["iterations"], "model_calls": result["model_calls"],
        "seconds": round(result["seconds"], 3),
        "tokens_per_s": round(result["tokens"] / result["seconds"], 1) if result["seconds"] else None,
        "errors": result["errors"], **summary,
        "writer": {"kind": args.writer, "torch_threads": torch.get_num_threads(), **tuning.describe()},
    }
    if telemetry_out is not None:
        out["telemetry"] = telemetry_out
    if args.json:
        print(json.dumps(out))
    else:
        _print_demo(out)
        if telemetry_out is not None:
            print(f"telemetry: {telemetry_out['written']} of {telemetry_out['records']} records written "
                  f"to {telemetry_out['file']}, {telemetry_out['dropped']} dropped", file=sys.stderr)
    return 0 if not result["errors"] else 1


def _fmt(v: float | None, unit: str = "") -> str:
    if v is None:
        return "n/a"
    if isinstance(v, float):
        return f"{v:,.2f}{unit}"
    return f"{v:,}{unit}"


def _writer_row(w: JsonDoc) -> str:
    where = f" on CPU {w['io_cpu']}" if w["io_cpu"] is not None else ""
    cpus = ",".join(map(str, w["model_cpus"]))
    return f"{w['kind']}{where}, torch x{w['torch_threads']} on CPU {cpus}"


def _event_rows(out: JsonDoc) -> list[tuple[str, int]]:
    """Events written by type, in the order of the event union; append starts also by kind."""
    from kvledger.schemas.events import EVENT_CLASSES, AppendKind

    rows: list[tuple[str, int]] = []
    for kind in EVENT_CLASSES:
        if kind.startswith("kv_events"):
            continue  # an engine's KV-event streams: never written by the demo
        rows.append((kind, out["events_by_type"].get(kind, 0)))
        if kind == "append_start":
            rows += [(f"  {k}", out["appends_by_kind"][k]) for k in get_args(AppendKind)
                     if k in out["appends_by_kind"]]
    return rows


def _print_demo(out: JsonDoc) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title="kvledger demo", show_header=False)
    t.add_column("metric", style="bold")
    t.add_column("value", justify="right")
    rows = [
        ("requests (handles incl. forks)", f"{out['requests']} ({out['handles']})"),
        ("cancelled", _fmt(out["cancelled"])),
        ("tokens generated", _fmt(out["tokens"])),
        ("wall time / tokens per s", f"{out['seconds']:.2f} s / {_fmt(out['tokens_per_s'])}"),
        ("iterations / model calls", f"{out['iterations']} / {out['model_calls']}"),
        ("events written", _fmt(out["events_written"])),
        *((f"  {kind}", _fmt(n)) for kind, n in _event_rows(out)),
        ("writer", _writer_row(out["writer"])),
    ]
    for k, v in out["ledger_peaks_bytes"].items():
        rows.append((f"peak {k} bytes", _fmt(v)))
    rows += [
        ("TTFT p50 / p99", f"{_fmt(out['ttft_ms']['p50'], ' ms')} / {_fmt(out['ttft_ms']['p99'], ' ms')}"),
        ("TPOT p50 / p99", f"{_fmt(out['tpot_ms']['p50'], ' ms')} / {_fmt(out['tpot_ms']['p99'], ' ms')}"),
        (f"goodput (TTFT<={out['goodput']['slo_ttft_ms']:.0f} ms, TBT<={out['goodput']['slo_tbt_ms']:.0f} ms)",
         f"{out['goodput']['slo_valid']}/{out['goodput']['completed']} requests, "
         f"{_fmt(out['goodput']['requests_per_s'], ' req/s')}"),
        ("journal", f"{out['journal']} (position {out['position']})"),
    ]
    for k, v in rows:
        t.add_row(k, v)
    Console().print(t)
    if out["errors"]:
        print(f"{len(out['errors'])} errors (rejected commands, requests not served), first: "
              f"{out['errors'][0]}", file=sys.stderr)
    print(f"next: kvledger verify --db {out['journal']}  |  kvledger replay --db {out['journal']}")


# Prompt tokens per prefill call of `generate`: attention's memory is chunk x context, not
# prompt x prompt, which for a long prompt exhausts memory.
PREFILL_CHUNK = 512


def _cmd_generate(args: argparse.Namespace) -> int:
    if args.runtime == "hf":
        from kvledger.cmd_hf import generate

        if not args.model:
            raise KvLedgerError(ErrorCode.INVALID_ARGUMENT, "--runtime hf needs --model DIR")
        return print_generated(args, *generate(args))
    from kvledger.engine.remote import command_service
    from kvledger.journal import resolve_url
    from kvledger.migrations.storage import open_or_create_journal
    from kvledger.worker.loading import load_model, require_context
    from kvledger.worker.serving import RequestSpec, Worker

    prompt = args.prompt_ids  # parsed and bounded by kvledger.args.token_ids
    model, artifact = load_model(args.model, device=args.device)
    if max(prompt) >= model.cfg.vocab_size:
        raise KvLedgerError(ErrorCode.INVALID_ARGUMENT, f"token id {max(prompt)} >= vocab {model.cfg.vocab_size}")
    capacity = len(prompt) + args.max_new_tokens + 1
    require_context(model.cfg, capacity)  # before the journal is opened
    url = resolve_url(args.db)
    handle = f"gen-{uuid.uuid4().hex[:12]}"
    _make_room(args)
    with open_or_create_journal(url) as journal:
        first = journal.last_position()
        source = instance_name("kvledger-generate")
        with command_service(journal, writer=args.writer, source_instance=source) as service:
            worker = Worker(model, service=service, artifact=artifact, max_running=1, capacity=capacity,
                            prefill_chunk=PREFILL_CHUNK, prefill_tokens=PREFILL_CHUNK, device=args.device)
            worker.submit(RequestSpec(request_id=handle, prompt=prompt, max_new_tokens=args.max_new_tokens))
            outputs = worker.run()[handle]
        position = journal.last_position()
    if worker.errors:
        raise KvLedgerError(ErrorCode.CORRUPT_JOURNAL, f"generation rejected: {worker.errors[0]}")
    return print_generated(args, url, handle, prompt, outputs, first, position)


def print_generated(args: argparse.Namespace, url: str, handle: str, prompt: tuple[int, ...] | list[int],
                    outputs: list[int], first: int, position: int) -> int:
    """What `generate` prints, whichever runtime generated: the ids (or, with --json, the
    journal's part in it too)."""
    if args.json:
        from kvledger.journal import redact

        print(json.dumps({"handle_id": handle, "prompt_ids": list(prompt), "output_ids": outputs,
                          "events_written": position - first, "journal": redact(url), "position": position}))
    else:
        print(",".join(map(str, outputs)))
    return 0
