"""Argument types of the command line: every numeric and path argument of every command
is checked where argparse parses it, so a value outside its sane range is one coded line
(exit 2) before any journal is opened or any work starts.

The types raise KvLedgerError, which argparse lets through (it only rewrites ValueError,
TypeError and ArgumentTypeError into a usage message). Output paths are checked twice:
writable when parsed (a probe file beside them, so a read-only place or a full disk is
refused before an hour-long run, not after it), and, once all arguments are known,
never one of the command's inputs (`check_outputs`): `export --out` onto the database
itself would replace the journal.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import re
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from kvledger.schemas.errors import ErrorCode, KvLedgerError

# A --json document (or a part of one): nested JSON values, shaped per command.
JsonDoc = dict[str, Any]

MAX_INT64 = (1 << 63) - 1
# Milliseconds become integer nanoseconds in the journal's BIGINT clock columns.
MAX_MS = MAX_INT64 // 1_000_000
SQLITE_COMPANIONS = ("", "-wal", "-shm", "-journal")
DB_HELP = "database URL (default: $KVLEDGER_DB, else sqlite:///kvledger.db)"


def _bad(message: str) -> KvLedgerError:
    return KvLedgerError(ErrorCode.INVALID_ARGUMENT, message)


def _short(value: str) -> str:
    """The value as shown in a message: bounded, and on one line whatever it contains."""
    shown = value if len(value) <= 40 else value[:40] + "..."
    return repr(shown)


# -- numbers -----------------------------------------------------------------------------

def integer(lo: int, hi: int) -> Callable[[str], int]:
    """An int in [lo, hi] written in decimal: no float, no expression."""

    def parse(value: str) -> int:
        try:
            n = int(value)
        except ValueError:
            raise _bad(f"{_short(value)} is not an integer") from None
        if not lo <= n <= hi:
            raise _bad(f"{_short(value)} is outside [{lo}, {hi}]")
        return n

    parse.__name__ = "integer"  # argparse names the type in its own messages
    return parse


def millis(value: str) -> float:
    """A duration in milliseconds: finite, >= 0, and small enough to count in int64 ns."""
    try:
        ms = float(value)
    except ValueError:
        raise _bad(f"{_short(value)} is not a number of milliseconds") from None
    if not math.isfinite(ms) or not 0 <= ms <= MAX_MS:
        raise _bad(f"{_short(value)} ms is outside [0, {MAX_MS}]")
    return ms


SEED = integer(0, (1 << 32) - 1)  # one 32-bit seed: workload prompts, sampling and crash plans
PORT = integer(0, 65535)
POSITION = integer(0, MAX_INT64)
REQUESTS = integer(1, 100_000)
BLOCK_BYTES = integer(1, 1 << 40)  # one KV-event block's bytes (kv-events, replay --block-bytes)
TRIALS = integer(1, 1_000_000)
# Generation length before the model is known; the model's context bounds it again
# (CONTEXT_TOO_LONG) before anything is written.
NEW_TOKENS = integer(1, 1 << 20)
MAX_PROMPT = 1 << 20


_HOST = re.compile(r"[A-Za-z0-9._:-]{1,253}")


def host(value: str) -> str:
    """An address to listen on: a host name, an IPv4 or IPv6 address (0.0.0.0: every interface)."""
    shown = value[1:-1] if value.startswith("[") and value.endswith("]") else value
    if not _HOST.fullmatch(shown):
        raise _bad(f"{_short(value)} is not a host name or an IP address")
    return shown


METRICS_PORT_HELP = "serve Prometheus /metrics on HOST:PORT while the command runs (0: any free port)"
METRICS_HOST_HELP = "the address /metrics listens on (default 127.0.0.1; 0.0.0.0 for every interface)"


def token_ids(value: str) -> tuple[int, ...]:
    """Comma-separated non-negative token ids (the vocabulary bounds them later)."""
    parts = [p for p in value.split(",") if p.strip()]
    if not parts or len(parts) > MAX_PROMPT:
        raise _bad(f"--prompt-ids needs 1 to {MAX_PROMPT} comma-separated token ids")
    try:
        ids = tuple(int(p) for p in parts)
    except ValueError:
        raise _bad("--prompt-ids must be comma-separated integers") from None
    if min(ids) < 0 or max(ids) > MAX_INT64:
        raise _bad("--prompt-ids must be non-negative token ids")
    return ids


def name(value: str) -> str:
    """A short name stored in the journal (a checkpoint's): 1 to 128 printable characters."""
    if not 1 <= len(value) <= 128 or not value.isprintable():
        raise _bad(f"{_short(value)} is not a name of 1 to 128 printable characters")
    return value


# -- model and device --------------------------------------------------------------------

_DEVICE = re.compile(r"cpu|cuda(:\d{1,3})?")


def device(value: str) -> str:
    """cpu, cuda or cuda:N, and CUDA only where torch sees a device."""
    if not _DEVICE.fullmatch(value):
        raise _bad(f"--device {_short(value)}: expected cpu, cuda or cuda:N")
    if value.startswith("cuda"):
        import torch

        n = int(value.partition(":")[2] or 0)
        if not torch.cuda.is_available() or n >= torch.cuda.device_count():
            raise _bad(f"--device {value}: no such CUDA device")
    return value


def model_dir(value: str) -> str:
    """A Hugging Face checkpoint directory whose config this code implements."""
    from kvledger.worker.loading import read_config

    read_config(Path(value).expanduser())
    return value


# -- paths -------------------------------------------------------------------------------

class OutputPath(str):
    """A file the command writes (marks it for check_outputs)."""


class InputPath(str):
    """A file the command reads: no output may land on it."""


def input_file(value: str) -> InputPath:
    return InputPath(value)


def output_file(value: str) -> OutputPath:
    """A regular file to write, new or existing, in a directory this process can write.

    Probed now by writing a block beside it (then removed), so a read-only place or a
    full disk is refused before the work starts. Devices and other special files are
    refused: writing them is not writing a file (/dev/full stands for a full disk)."""
    if not value:
        raise KvLedgerError(ErrorCode.UNWRITABLE_OUTPUT, "an output path is empty")
    path = Path(value).expanduser()
    where = _short(value)
    if path.is_dir():
        raise KvLedgerError(ErrorCode.UNWRITABLE_OUTPUT, f"{where} is a directory")
    if path.exists() and not path.is_file():
        raise KvLedgerError(ErrorCode.UNWRITABLE_OUTPUT, f"{where} is not a regular file")
    real = Path(os.path.realpath(path))
    if not real.parent.is_dir():
        raise KvLedgerError(ErrorCode.UNWRITABLE_OUTPUT, f"the directory of {where} does not exist")
    if real.exists() and not os.access(real, os.W_OK):
        raise KvLedgerError(ErrorCode.UNWRITABLE_OUTPUT, f"{where} is read-only")
    try:
        fd, probe = tempfile.mkstemp(prefix=".kvledger-probe-", dir=real.parent)
    except OSError as exc:
        raise KvLedgerError(ErrorCode.UNWRITABLE_OUTPUT, f"cannot write beside {where}: {exc.strerror}") from None
    try:
        os.write(fd, bytes(4096))
        os.fsync(fd)
    except OSError as exc:
        raise KvLedgerError(ErrorCode.UNWRITABLE_OUTPUT, f"cannot write {where}: {exc.strerror}") from None
    finally:
        os.close(fd)
        os.unlink(probe)
    return OutputPath(value)


def output_or_stdout(value: str) -> OutputPath:
    """An output file, or '-' for standard output."""
    return OutputPath("-") if value == "-" else output_file(value)


def check_outputs(args: argparse.Namespace) -> None:
    """Refuse an output that is one of the command's inputs: its database (SQLite: the
    file or a companion -wal, -shm, -journal), or a file it reads. Compared after
    resolving symlinks, and by inode for hard links. Two outputs may not coincide either."""
    marked = {k: v for k, v in vars(args).items() if isinstance(v, (OutputPath, InputPath))}
    for k, v in marked.items():  # plain str from here on: encoders refuse str subclasses
        setattr(args, k, str(v))
    outputs = [v for v in marked.values() if isinstance(v, OutputPath) and v != "-"]
    if not outputs:
        return
    inputs = [Path(v).expanduser() for v in marked.values() if isinstance(v, InputPath) and v != "-"]
    if "db" in vars(args):
        inputs += _database_files(args.db)
    seen: list[Path] = []
    for out in outputs:
        path = Path(out).expanduser()
        for other in inputs:
            if _same(path, other):
                raise KvLedgerError(ErrorCode.OUTPUT_IS_INPUT, f"{_short(out)} is {_short(str(other))}, an "
                                                               "input of this command: refusing to overwrite it")
        if any(_same(path, p) for p in seen):
            raise _bad(f"{_short(out)} is given as two outputs")
        seen.append(path)


def _database_files(raw_url: str | None) -> list[Path]:
    from kvledger.journal import parse_url, resolve_url

    try:
        url = parse_url(resolve_url(raw_url))
    except KvLedgerError:
        return []  # the command itself reports a bad URL, in its own words
    if url.get_backend_name() != "sqlite" or url.database in (None, "", ":memory:"):
        return []
    db = Path(url.database).expanduser()
    return [Path(f"{db}{suffix}") for suffix in SQLITE_COMPANIONS]


def _same(a: Path, b: Path) -> bool:
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        return os.path.samefile(a, b)  # hard links
    except OSError:  # one of them does not exist (yet): not the same file
        return False


@contextlib.contextmanager
def writing(path: str) -> Iterator[None]:
    """Where an output is written: an OSError then (the disk filled during the run) is
    UNWRITABLE_OUTPUT, one line, not a traceback."""
    try:
        yield
    except OSError as exc:
        raise KvLedgerError(ErrorCode.UNWRITABLE_OUTPUT,
                            f"cannot write {_short(str(path))}: {exc.strerror or exc}") from None
