"""The CLI's logging. The library logs through stdlib `logging` (loggers under "kvledger",
e.g. "kvledger.worker") and never configures it; the CLI renders every record with
structlog's ProcessorFormatter on stderr: JSON lines when stderr is not a terminal,
readable ones otherwise. stdout stays for results (--json).

Levels: kvledger's own loggers at --log-level (default $KVLEDGER_LOG, else info); other
libraries' loggers (SQLAlchemy, alembic) at warning, or at --log-level when that is
higher. -q is --log-level error: errors only.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import MutableMapping
from typing import Any

LEVELS = ("debug", "info", "warning", "error")
DEFAULT_LEVEL = "info"


def default_level() -> str:
    """$KVLEDGER_LOG when it names a level, else info."""
    env = os.environ.get("KVLEDGER_LOG", "").strip().lower()
    return env if env in LEVELS else DEFAULT_LEVEL


class _Stderr(logging.Handler):
    """Writes to sys.stderr as it is when a record is written, not when this was made: a
    caller (or pytest) may swap it between runs of kvledger.cli.main in one process.
    Its structlog formatter is made for the first record: most commands write none, and
    structlog (with rich, which it loads when installed) is slow to import."""

    def __init__(self, tty: bool) -> None:
        super().__init__()
        self.tty = tty

    def format(self, record: logging.LogRecord) -> str:
        if self.formatter is None:
            self.setFormatter(_formatter(self.tty))
        return super().format(record)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            sys.stderr.write(self.format(record) + "\n")
            sys.stderr.flush()
        except Exception:  # noqa: BLE001 - logging's own contract: a failed write is handleError's
            self.handleError(record)


def configure(level: str = DEFAULT_LEVEL) -> None:
    """Install the CLI's handler on the root logger (replacing one an earlier call
    installed) and set the levels."""
    handler = _Stderr(sys.stderr.isatty())
    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, _Stderr)]:
        root.removeHandler(old)
    root.addHandler(handler)
    number = logging.getLevelNamesMapping()[level.upper()]
    root.setLevel(max(number, logging.WARNING))
    logging.getLogger("kvledger").setLevel(number)


def _formatter(tty: bool) -> logging.Formatter:
    import structlog

    # JSON: a traceback, if a record carries one, becomes one string field (the console
    # renderer formats it itself)
    render: list[Any] = ([structlog.dev.ConsoleRenderer()] if tty else
                         [structlog.processors.format_exc_info, structlog.processors.JSONRenderer()])
    return structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[
            structlog.contextvars.merge_contextvars,
            structlog.stdlib.add_log_level,
            structlog.stdlib.add_logger_name,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.stdlib.ExtraAdder(),
            _without_message,
        ],
        processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            *render,
        ],
    )


def _without_message(_logger: Any, _method: str, event_dict: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    # `message`: the text another handler's formatter left on the record (`event` holds it)
    event_dict.pop("message", None)
    return event_dict


__all__ = ["DEFAULT_LEVEL", "LEVELS", "configure", "default_level"]
