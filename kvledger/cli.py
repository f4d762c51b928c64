"""The `kvledger` command line.

Exit status: 0 success, 1 findings (verify, reconcile, crash-test), 2 bad input or an
error with a stable code (one line on stderr, never a traceback).
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Callable
from typing import NoReturn

from kvledger import args as a
from kvledger.args import DB_HELP
from kvledger.schemas.errors import ErrorCode, KvLedgerError

# Modules with a `register(subparsers)` function, one per command family.
COMMAND_MODULES: list[str] = ["cmd_serve", "cmd_replay", "cmd_telemetry", "cmd_recover", "cmd_kv_events"]


def add_slo_arguments(p: argparse.ArgumentParser) -> None:
    """The goodput SLO options, with the one default (replay.metrics)."""
    from kvledger.replay.metrics import DEFAULT_SLO_TBT_MS, DEFAULT_SLO_TTFT_MS

    p.add_argument("--slo-ttft-ms", type=a.millis, default=DEFAULT_SLO_TTFT_MS, metavar="MS",
                   help=f"TTFT limit for goodput (default: {DEFAULT_SLO_TTFT_MS:g})")
    p.add_argument("--slo-tbt-ms", type=a.millis, default=DEFAULT_SLO_TBT_MS, metavar="MS",
                   help=f"limit on every time-between-tokens for goodput (default: {DEFAULT_SLO_TBT_MS:g})")


def _cmd_init(args: argparse.Namespace) -> int:
    from kvledger.journal import redact, resolve_url
    from kvledger.migrations.storage import init_database

    revision = init_database(args.db, allow_lazy_fsync=args.allow_lazy_fsync)
    target = redact(resolve_url(args.db))
    if args.json:
        print(json.dumps({"database": target, "revision": revision}))
    else:
        print(f"{target} is at revision {revision}")
    return 0


def _cmd_schema(args: argparse.Namespace) -> int:
    import msgspec

    from kvledger.schemas.events import Event

    print(json.dumps(msgspec.json.schema(Event), indent=None if args.compact else 2))
    return 0


class _Parser(argparse.ArgumentParser):
    """argparse's own refusals (an unknown option or command, a missing or conflicting
    one) are coded like every checked argument: one line, INVALID_ARGUMENT, exit 2, never
    its usage text. Subcommands' parsers are of this class too (add_subparsers' default)."""

    def error(self, message: str) -> NoReturn:
        raise KvLedgerError(ErrorCode.INVALID_ARGUMENT, f"{self.prog}: {message} (see {self.prog} --help)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="kvledger",
        description=(
            "Event-sourced, durable source of truth for per-request KV-cache state: every "
            "allocate/append/fork/truncate/cancel/finish/release is a journaled event, "
            "committed by one conditional write, replayable at any position."
        ),
        epilog="Exit status: 0 ok, 1 findings, 2 bad input or error (one line with a stable code).",
    )
    parser.add_argument("--version", action="version", version=f"kvledger {_installed_version()}",
                        help="print the installed kvledger's version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser(
        "init", help="create or migrate the journal tables to the head revision",
        description="Create the journal tables, or migrate them to the head revision. On PostgreSQL it also "
                    "sets the tables' storage parameters (kvl_heads' fillfactor), which a journal made by an "
                    "earlier kvledger gets by running init again as the tables' owner (another role's init "
                    "succeeds and warns that the setting is left). Safe to run any number of times.")
    p.add_argument("--db", help=DB_HELP)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--allow-lazy-fsync", action="store_true",
                   help="NATS: create the cell's stream even on servers that do not sync every write "
                        "(an acknowledged write can then be lost on power loss)")
    p.set_defaults(run=_cmd_init)

    p = sub.add_parser(
        "schema", help="print the JSON Schema of the event union",
        description="Print the JSON Schema of every journal event (one discriminated union over the event "
                    "types), the contract an exported audit file or a second reader is checked against. "
                    "Needs no database.")
    p.add_argument("--compact", action="store_true", help="print it on one line (default: indented)")
    p.set_defaults(run=_cmd_schema)

    p = sub.add_parser(
        "demo",
        help="run the main job: a torch GQA worker serving ~32 requests under the journal",
        description="Serve N ragged requests on a torch GQA worker with every KV-cache state change "
                    "journaled: chunked prefill, a fork and reorder, a cancel, a truncate, a repair, a "
                    "speculative request and one injected failed decode that is retried. Prints requests, "
                    "tokens, events by type, ledger peaks, TTFT/TPOT percentiles and goodput. Needs "
                    "kvledger[worker].",
    )
    p.add_argument("--db", help=DB_HELP)
    p.add_argument("--requests", type=a.REQUESTS, default=32,
                   help="number of requests to serve (default 32; 8 or more play every scenario)")
    p.add_argument("--max-new-tokens", type=a.NEW_TOKENS, default=16,
                   help="new tokens generated per request (default 16)")
    p.add_argument("--seed", type=a.SEED, default=0, help="seed for prompts and sampling (32 bits; default 0)")
    p.add_argument("--model", type=a.model_dir,
                   help="Hugging Face checkpoint directory (default: small random model)")
    p.add_argument("--device", type=a.device, default="cpu",
                   help="where the model runs: cpu, cuda or cuda:N (default cpu)")
    p.add_argument("--json", action="store_true", help="print one JSON object")

    p = sub.add_parser(
        "generate", help="greedy completion of one prompt, journaled",
        description="Complete one prompt (token ids) and journal every step: allocate, each prefill and "
                    "decode append and its publish, each emitted token, finish and release. Runs on this "
                    "package's worker (greedy) or, with --runtime hf, through transformers' generate(). A "
                    "prompt plus generation beyond the model's positions is refused (CONTEXT_TOO_LONG) "
                    "before anything is written. Needs kvledger[worker] (kvledger[hf] for --runtime hf).")
    p.add_argument("--model", type=a.model_dir,
                   help="Hugging Face checkpoint directory (default: small random model)")
    p.add_argument("--prompt-ids", type=a.token_ids, required=True,
                   help="comma-separated token ids, e.g. 1,2,3")
    p.add_argument("--max-new-tokens", type=a.NEW_TOKENS, default=16,
                   help="tokens to generate after the prompt (default 16)")
    p.add_argument("--db", help=DB_HELP)
    p.add_argument("--device", type=a.device, default="cpu",
                   help="where the model runs: cpu, cuda or cuda:N (default cpu)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--runtime", choices=("kvledger", "hf"), default="kvledger",
                   help="kvledger: this package's worker (greedy); hf: transformers' generate() "
                        "journaled through kvledger.hf (needs --model)")
    p.add_argument("--num-beams", type=a.integer(1, 64), default=1, help="beam search width (--runtime hf; default 1)")
    p.add_argument("--do-sample", action="store_true", help="sample instead of greedy (--runtime hf)")
    p.add_argument("--seed", type=a.SEED, default=0, help="torch seed for --do-sample (--runtime hf; default 0)")

    # Each command family registers its own subcommands (kvledger/cmd_*.py).
    for name in COMMAND_MODULES:
        importlib.import_module(f"kvledger.{name}").register(sub)
    _add_log_options(parser, top=True)
    for subparser in _subparsers(parser):  # before or after the command: `kvledger -q demo`, `kvledger demo -q`
        _add_log_options(subparser, top=False)
    return parser


def _installed_version() -> str:
    """The version pip installed (the package metadata), not a constant that can drift from it."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kvledger")
    except PackageNotFoundError:  # run from a source tree without `pip install`
        return "unknown (not installed)"


def _log_level(value: str) -> str:
    from kvledger.logs import LEVELS

    if value.lower() not in LEVELS:
        raise KvLedgerError(ErrorCode.INVALID_ARGUMENT, f"--log-level {value[:40]!r}: expected one of "
                                                        f"{', '.join(LEVELS)}")
    return value.lower()


def _add_log_options(p: argparse.ArgumentParser, *, top: bool) -> None:
    # A subcommand's copy sets the value only when given (SUPPRESS), so it never hides the top's.
    default = None if top else argparse.SUPPRESS
    p.add_argument("--log-level", type=_log_level, default=default, metavar="LEVEL",
                   help="debug, info, warning or error: kvledger's log records on stderr at this level "
                        "and above (default: $KVLEDGER_LOG, else info; JSON lines when stderr is not a terminal)")
    p.add_argument("-q", "--quiet", dest="log_level", action="store_const", const="error", default=default,
                   help="errors only (--log-level error): no info or warning records on stderr")


def _subparsers(p: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    found: list[argparse.ArgumentParser] = []
    for action in p._actions:  # argparse has no public way to list its subparsers
        if isinstance(action, argparse._SubParsersAction):
            for child in dict.fromkeys(action.choices.values()):
                found += [child, *_subparsers(child)]
    return found


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    from kvledger.journal import tuning
    from kvledger.logs import configure, default_level

    args: argparse.Namespace | None = None
    try:
        args = parser.parse_args(argv)  # the argument types raise coded errors (kvledger.args)
        configure(args.log_level or default_level())  # logs go to stderr: stdout is for results (--json)
        tuning.check()  # a KVLEDGER_TUNING that is neither on nor off is refused, not guessed
        a.check_outputs(args)
        _check_extras(args)
        run: Callable[[argparse.Namespace], int] = args.run  # set by each command's register()
        return run(args)
    except KvLedgerError as exc:
        print(str(exc), file=sys.stderr)  # one line: str() escapes control characters
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    except ModuleNotFoundError as exc:
        print(str(_missing_extra(exc, args)), file=sys.stderr)
        return 2
    except Exception as exc:  # noqa: BLE001 - the last resort: never a traceback for a user
        print(str(_last_resort(exc, args)), file=sys.stderr)
        return 2


# The optional dependencies and the extra that installs each (pyproject.toml).
EXTRA_OF = {"torch": "worker", "safetensors": "worker", "psycopg": "postgres", "transformers": "hf"}


# Commands that always run the torch worker: refused before any work without its extra.
NEEDS_WORKER = frozenset({"demo", "generate", "crash-test"})


def _check_extras(args: argparse.Namespace) -> None:
    if args.command not in NEEDS_WORKER:
        return
    import importlib.util

    for module in ("torch", "safetensors"):
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            raise _missing_extra(ModuleNotFoundError(f"No module named {module!r}", name=module), args)


def _missing_extra(exc: ModuleNotFoundError, args: argparse.Namespace | None) -> KvLedgerError:
    """A command that needs an extra the light install left out: name the extra. Any other
    missing module is a broken install or a bug (the last resort says which)."""
    module = (exc.name or "").split(".")[0]
    extra = EXTRA_OF.get(module)
    if extra is None:
        return _last_resort(exc, args)
    command = " ".join(filter(None, (getattr(args, "command", None), getattr(args, "kv_command", None))))
    return KvLedgerError(ErrorCode.INVALID_ARGUMENT, f"`kvledger {command}` needs {module}, which is not "
                                                     f"installed: pip install 'kvledger[{extra}]'")


def _last_resort(exc: Exception, args: argparse.Namespace | None) -> KvLedgerError:
    """A driver error that no journal boundary translated gets its code here; anything
    else is a bug, reported in one line by its class and place (KVLEDGER_DEBUG=1 raises
    it with its traceback). The exception's own text is not shown: it may quote a URL."""
    import os
    import traceback

    from kvledger.journal.driver_errors import is_driver_error, translate

    if os.environ.get("KVLEDGER_DEBUG") == "1":
        raise exc
    if is_driver_error(exc):
        from kvledger.journal.url import parse_url, resolve_url

        try:
            url = parse_url(resolve_url(getattr(args, "db", None)))
        except KvLedgerError:
            url = None
        return translate(exc, url)
    frame = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
    at = f" at {os.path.basename(frame.filename)}:{frame.lineno}" if frame else ""
    return KvLedgerError(ErrorCode.INTERNAL_ERROR, f"unexpected {type(exc).__name__}{at} in "
                         f"`kvledger {getattr(args, 'command', '')}` (a bug; KVLEDGER_DEBUG=1 shows the traceback)")


if __name__ == "__main__":
    raise SystemExit(main())
