"""Database URLs: parse, validate and redact.

A credential in a URL must never reach a message, a summary or a log. A URL can carry
one in the password part (`user:SECRET@host`) or in its query (`?password=SECRET`,
`?passfile=...`, `?sslpassword=...`, ...), so `redact` shows a query value only for an
option known to hold no secret, and every message here names the URL by its redacted
form (or by its parts: host, port, database). Driver messages are never shown: see
journal.driver_errors, which says what failed in its own words.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from urllib.parse import parse_qsl, quote, quote_plus, unquote

from sqlalchemy.engine import URL, Dialect, make_url
from sqlalchemy.exc import ArgumentError

from kvledger.schemas.errors import ErrorCode, KvLedgerError

DEFAULT_URL = "sqlite:///kvledger.db"
_DRIVERS = {
    "sqlite": "sqlite+pysqlite",
    "sqlite+pysqlite": "sqlite+pysqlite",
    "postgresql": "postgresql+psycopg",
    "postgres": "postgresql+psycopg",
    "postgresql+psycopg": "postgresql+psycopg",
}
# Query options whose values are shown. Any other value (password, passfile, sslkey,
# sslpassword, options, an option nobody knows, ...) is shown as ***: an allow-list,
# because a deny-list misses the next way to spell a secret.
SHOWN_OPTIONS = frozenset({
    # sqlite3.connect and SQLite URI parameters
    "timeout", "uri", "mode", "cache", "immutable", "nolock", "vfs", "check_same_thread",
    "detect_types", "isolation_level", "cached_statements",
    # libpq connection parameters that hold no secret
    "host", "hostaddr", "port", "dbname", "user", "connect_timeout", "client_encoding",
    "application_name", "fallback_application_name", "keepalives", "keepalives_idle",
    "keepalives_interval", "keepalives_count", "tcp_user_timeout", "sslmode", "sslnegotiation",
    "sslcompression", "sslcert", "sslcertmode", "sslrootcert", "sslcrl", "sslcrldir", "sslsni",
    "requirepeer", "require_auth", "channel_binding", "gssencmode", "krbsrvname", "gsslib",
    "target_session_attrs", "load_balance_hosts", "min_protocol_version", "max_protocol_version",
    "ssl_min_protocol_version", "ssl_max_protocol_version",
})
# Options that name a credential: shown by name, their values as ***. The name of an
# option in neither set is hidden too (`?password=ab&cd=x` is a password with an
# unencoded &, and `cd` is part of it).
SECRET_OPTIONS = frozenset({"password", "passfile", "sslkey", "sslpassword", "sslkeylogfile", "options",
                            "service", "oauth_client_secret", "scram_client_key", "scram_server_key"})
_SQLITE_OPTIONS = frozenset({"timeout", "uri", "check_same_thread", "detect_types", "isolation_level",
                             "cached_statements"})
_SHOWN_CHARS = 200  # a part of a URL longer than this is cut in messages


def resolve_url(url: str | None) -> str:
    """--db, else KVLEDGER_DB, else the embedded SQLite default."""
    return url or os.environ.get("KVLEDGER_DB") or DEFAULT_URL


def parse_url(raw: str) -> URL:
    """A validated URL with its driver set, or BAD_DATABASE_URL. Everything that can be
    checked without connecting is checked here, so a bad URL never reaches a driver."""
    if raw.startswith(NATS_PREFIX):
        return parse_nats_url(raw)
    try:
        url = make_url(raw)
    except (ArgumentError, ValueError, TypeError):
        raise KvLedgerError(
            ErrorCode.BAD_DATABASE_URL,
            "cannot parse database URL (expected sqlite:///PATH or "
            "postgresql+psycopg://USER@HOST:PORT/DB)",
        ) from None
    if _ambiguous(raw, url):
        raise KvLedgerError(ErrorCode.BAD_DATABASE_URL, "the database URL has a password and more "
                            "than one '@', or an '@' after its host: write an '@' inside a password "
                            "or an option (or anywhere else) as %40")
    driver = _DRIVERS.get(url.drivername)
    if driver is None:
        raise KvLedgerError(
            ErrorCode.BAD_DATABASE_URL,
            f"unsupported database driver {clip(url.drivername)!r} in {redact(url)} "
            "(use sqlite or postgresql+psycopg)",
        )
    url = url.set(drivername=driver)
    if driver.startswith("sqlite"):
        _check_sqlite(url)
    else:
        _check_postgres(url)
    return url


def _ambiguous(raw: str, url: URL) -> bool:
    """Where the URL's '@' splits it is not where a reader would: `user:p@ss@host` (the
    grammar ends the password at the first @, the rest would be shown as the host), or an
    '@' in the path or an option (`host/db?password=@secret`: SQLAlchemy's parser takes
    everything before it for user and password and the secret for the host; RFC 3986
    ends the user info at the first '/', '?' or '#')."""
    if url.password is None:
        return False
    userinfo = raw.split("://", 1)[-1].split("@", 1)[0]  # as written: %2F is no '/'
    return raw.count("@") > 1 or any(c in userinfo for c in "/?#")


def _check_sqlite(url: URL) -> None:
    if url.username is not None or url.password is not None or url.host or url.port:
        # Not echoed: what a user put where a server would go is not known to be harmless.
        raise KvLedgerError(ErrorCode.BAD_DATABASE_URL,
                            "a SQLite URL names a file, not a server or a user (use "
                            "sqlite:///relative/path.db or sqlite:////absolute/path.db)")
    uri = str(url.query.get("uri", "")).lower() in ("true", "1")
    unknown = set(url.query) - _SQLITE_OPTIONS if not uri else set()
    if unknown:
        raise KvLedgerError(ErrorCode.BAD_DATABASE_URL,
                            f"{_unknown(unknown)} in {redact(url)} (SQLite takes: "
                            f"{', '.join(sorted(_SQLITE_OPTIONS))})")
    try:
        # The dialect converts and checks the options it knows (timeout=abc, ...).
        _dialect(url).create_connect_args(url)
    except (ArgumentError, ValueError, TypeError):
        raise KvLedgerError(ErrorCode.BAD_DATABASE_URL,
                            f"an option value in {redact(url)} is not valid") from None
    if url.database and "\x00" in url.database:
        raise KvLedgerError(ErrorCode.BAD_DATABASE_URL, f"the file name in {redact(url)} holds a NUL character")
    if url.database not in (None, "", ":memory:") and not uri:
        try:
            parent = Path(url.database).expanduser().resolve().parent
            found = parent.is_dir()
        except (OSError, RuntimeError):  # a name too long, a symlink loop
            raise KvLedgerError(ErrorCode.BAD_DATABASE_URL,
                                f"the operating system refuses the file name in {redact(url)}") from None
        if not found:
            raise KvLedgerError(
                ErrorCode.BAD_DATABASE_URL, f"directory {clip(str(parent))} of {redact(url)} does not exist"
            )


def _check_postgres(url: URL) -> None:
    if not url.database:
        raise KvLedgerError(ErrorCode.BAD_DATABASE_URL, f"no database name in {redact(url)}")
    try:
        import psycopg
    except ImportError:  # the light install: psycopg (and its libpq) come with the postgres extra
        raise KvLedgerError(ErrorCode.INVALID_ARGUMENT, f"{redact(url)} needs the PostgreSQL driver, which is "
                            "not installed: pip install 'kvledger[postgres]'") from None
    try:
        cargs, ckwargs = _dialect(url).create_connect_args(url)
        # libpq parses the options without connecting: an unknown option or a malformed
        # value is refused here, not by a connection attempt.
        psycopg.conninfo.make_conninfo(*cargs, **ckwargs)
    except (ArgumentError, ValueError, TypeError):
        raise KvLedgerError(ErrorCode.BAD_DATABASE_URL,
                            f"an option value in {redact(url)} is not valid") from None
    except psycopg.Error:
        known = {o.keyword.decode() for o in psycopg.pq.Conninfo.get_defaults()}
        unknown = set(url.query) - known
        what = _unknown(unknown) if unknown else "an option value libpq refuses"
        raise KvLedgerError(ErrorCode.BAD_DATABASE_URL, f"{what} in {redact(url)} (see libpq's "
                            "connection parameters)") from None


def _dialect(url: URL) -> Dialect:
    return url.get_dialect()()


def _unknown(keys: set[str]) -> str:
    # Counted, not named: in `?password=ab&cd` the unknown option `cd` is the tail of a
    # password with an unencoded &. The redacted URL beside it shows the names it may.
    return f"{len(keys)} unknown option(s)" if len(keys) > 1 else "an unknown option"


def clip(text: str, limit: int = _SHOWN_CHARS) -> str:
    return text if len(text) <= limit else f"{text[:limit]}...({len(text)} chars)"


def redact(url: URL | str) -> str:
    """The URL as it may be shown: no password, *** for every query value that is not
    known to be harmless (SHOWN_OPTIONS), and *** for the name of an unknown option."""
    if isinstance(url, str) and url.startswith(NATS_PREFIX):
        try:
            url = parse_nats_url(url)
        except KvLedgerError:
            return "nats://<a URL that does not parse>"
    if not isinstance(url, str) and url.get_backend_name() == "nats":
        return _redact_nats(url)
    if isinstance(url, str):
        raw = url
        try:
            url = make_url(raw)
        except (ArgumentError, ValueError, TypeError):
            return "<unparseable URL>"
        if _ambiguous(raw, url):  # see parse_url: where a secret ends is unknown
            return f"{url.drivername}://<a URL with an '@' that is not between its user and host>"
    if url.host and "@" in url.host:  # the tail of a password with an unencoded @ (see above)
        url = url.set(host=url.host.rsplit("@", 1)[1], password=url.password or "***")
    shown = url.set(query={}).render_as_string(hide_password=True)
    pairs = []
    for key in sorted(url.query):
        values = url.query[key]
        for value in values if isinstance(values, tuple) else (values,):
            if key in SHOWN_OPTIONS:
                pairs.append(f"{quote_plus(key)}={quote_plus(value)}")
            else:
                pairs.append(f"{quote_plus(key) if key in SECRET_OPTIONS else '***'}=***")
    return clip(shown + ("?" + "&".join(pairs) if pairs else ""), 4 * _SHOWN_CHARS)


def describe(url: URL) -> str:
    """What a message calls the database: the SQLite file, or the PostgreSQL server,
    port and database (parts that hold no credential)."""
    if url.get_backend_name() == "sqlite":
        return f"SQLite database {clip(url.database or ':memory:')}"
    if url.get_backend_name() == "nats":
        return f"NATS JetStream at {clip(str(url.host))}, cell {url.database}"
    host = url.host or url.query.get("host") or "localhost"
    port = url.port or url.query.get("port") or 5432
    return f"PostgreSQL at {clip(str(host))}:{clip(str(port), 20)}, database {clip(str(url.database))}"


# -- NATS JetStream (journal.nats): nats://[USER[:PASSWORD]@]HOST[:PORT][,HOST[:PORT]...]/CELL[?OPTIONS]
NATS_PREFIX = "nats://"
NATS_PORT = 4222
# monitor: the servers' monitoring ports (`kvledger init` reads their fsync setting there);
# replicas: the stream's (init); timeout: seconds a request waits; creds: a credentials file.
NATS_OPTIONS = frozenset({"monitor", "replicas", "timeout", "creds"})
_NATS_SHOWN = frozenset({"monitor", "replicas", "timeout"})
_CELL = re.compile(r"[A-Za-z0-9_-]{1,64}").fullmatch
_HOST = re.compile(r"[A-Za-z0-9._-]{1,253}").fullmatch


def nats_hosts(text: str, what: str) -> list[tuple[str, int]]:
    hosts = []
    for part in text.split(","):
        host, colon, port = part.rpartition(":") if ":" in part else (part, "", str(NATS_PORT))
        if not _HOST(host) or not port.isdigit() or not 0 < int(port) < 65536:
            # not quoted: a password written without its '@' would land here
            raise KvLedgerError(ErrorCode.BAD_DATABASE_URL, f"{what} is not HOST[:PORT] in a NATS URL")
        hosts.append((host, int(port)))
    return hosts


def parse_nats_url(raw: str) -> URL:
    """A NATS journal URL as a URL (backend "nats", `host` the servers joined by commas,
    `database` the cell), or BAD_DATABASE_URL. Messages never quote the user info."""
    rest, _, query = raw[len(NATS_PREFIX):].partition("?")
    if rest.count("@") > 1 or "#" in raw:
        raise KvLedgerError(ErrorCode.BAD_DATABASE_URL, "a NATS URL has at most one '@' (write one inside a "
                            "password as %40) and no '#'")
    auth, _, rest = rest.rpartition("@")
    hosts, _, cell = rest.partition("/")
    servers = nats_hosts(hosts.strip("[]"), "the server") if hosts else []
    if not servers or not _CELL(cell):
        raise KvLedgerError(ErrorCode.BAD_DATABASE_URL, "expected nats://HOST:PORT[,HOST:PORT...]/CELL, the "
                            "cell named by 1 to 64 letters, digits, '-' or '_'")
    options: dict[str, str] = {}
    for key, value in parse_qsl(query, keep_blank_values=True):
        if key not in NATS_OPTIONS or key in options:
            raise KvLedgerError(ErrorCode.BAD_DATABASE_URL, f"{'a repeated' if key in options else 'an unknown'} "
                                f"option in a NATS URL (it takes {', '.join(sorted(NATS_OPTIONS))})")
        options[key] = value
    if "monitor" in options:
        nats_hosts(options["monitor"], "the monitoring address")
    if "replicas" in options and options["replicas"] not in ("1", "2", "3", "4", "5"):
        raise KvLedgerError(ErrorCode.BAD_DATABASE_URL, "replicas is 1 to 5")
    if "timeout" in options:
        try:
            ok = 0 < float(options["timeout"]) <= 3600
        except ValueError:
            ok = False
        if not ok:
            raise KvLedgerError(ErrorCode.BAD_DATABASE_URL, "timeout is a number of seconds, over 0")
    user, colon, password = auth.partition(":")
    return URL.create("nats", username=unquote(user) or None, password=unquote(password) if colon else None,
                      host=",".join(f"{h}:{p}" for h, p in servers), database=cell, query=options)


def nats_servers(url: URL) -> list[str]:
    """The server URLs a client connects to (credentials go to the client apart)."""
    return [f"nats://{h}:{p}" for h, p in nats_hosts(str(url.host), "the server")]


def _redact_nats(url: URL) -> str:
    user = f"{quote_plus(url.username)}{':***' if url.password is not None else ''}@" if url.username else ""
    if not user and url.password is not None:
        user = ":***@"
    pairs = [f"{k}={quote(str(v), safe=':,') if k in _NATS_SHOWN else '***'}" for k, v in sorted(url.query.items())]
    return clip(f"{NATS_PREFIX}{user}{url.host}/{url.database}" + ("?" + "&".join(pairs) if pairs else ""),
                4 * _SHOWN_CHARS)
