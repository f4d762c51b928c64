"""`kvledger init` on NATS: create a cell's stream, after checking that the servers sync
every write.

Jepsen's analysis of NATS 2.12.1 found that JetStream's default (an fsync every two
minutes) loses acknowledged writes when servers lose power together, so a journal,
whose one promise is that nothing acknowledged is lost, needs `sync_interval: always`.
A client cannot read a server's configuration over its connection, so init reads it at
the servers' monitoring endpoints (the URL's `monitor` option, /varz): a server that
does not sync every write, or that cannot be asked, is refused unless the caller says
`allow_lazy_fsync` (`--allow-lazy-fsync`).

The stream: file storage, R3 unless the URL says `replicas`, delete and purge denied
(a journal is append-only), atomic publish and direct gets allowed, a duplicate window
for Nats-Msg-Id, and no limits that would age records out.
"""

from __future__ import annotations

import json
import time
import urllib.request
from typing import Any

from kvledger.journal.nats import STREAM_PREFIX
from kvledger.journal.nats_client import NatsClient
from kvledger.journal.url import nats_hosts, parse_url, redact
from kvledger.schemas.errors import ErrorCode, KvLedgerError

REVISION = "nats-1"  # the stream's layout (journal.nats), in its metadata
DUPLICATE_WINDOW_NS = 120 * 10**9
PEER_OFFLINE = 10005  # no suitable peers: a server the meta leader does not see yet
MAX_MSG_BYTES = 8 << 20  # a record or checkpoint larger is refused (FIELD_TOO_LARGE)


def stream_config(cell: str, replicas: int) -> dict[str, Any]:
    return {"name": STREAM_PREFIX + cell, "subjects": [f"kvl.{cell}.>"], "storage": "file",
            "num_replicas": replicas, "retention": "limits", "discard": "new", "deny_delete": True,
            "deny_purge": True, "allow_atomic": True, "allow_direct": True,
            "duplicate_window": DUPLICATE_WINDOW_NS, "max_msg_size": MAX_MSG_BYTES,
            "metadata": {"kvledger": REVISION}}


def lazy_servers(monitors: list[tuple[str, int]], timeout: float = 5.0) -> list[str]:
    """The monitoring addresses whose server does not sync every write, or cannot say."""
    lazy = []
    for host, port in monitors:
        try:
            with urllib.request.urlopen(f"http://{host}:{port}/varz", timeout=timeout) as r:
                config = json.loads(r.read()).get("jetstream", {}).get("config", {})
        except (OSError, ValueError):
            lazy.append(f"{host}:{port} (no answer)")
            continue
        if not config.get("sync_always"):
            lazy.append(f"{host}:{port}")
    return lazy


def init_cell(raw_url: str, *, allow_lazy_fsync: bool = False, wait: float = 30.0) -> str:
    """Create the cell's stream (an existing one made by init is left as it is); returns
    the layout revision."""
    url = parse_url(raw_url)
    shown = redact(url)
    monitor = url.query.get("monitor")
    if not allow_lazy_fsync:
        if not monitor:
            raise KvLedgerError(ErrorCode.INVALID_ARGUMENT, f"cannot tell whether the servers of {shown} sync "
                                "every write: name their monitoring ports (?monitor=HOST:PORT,...), or accept "
                                "losing acknowledged writes on power loss with --allow-lazy-fsync")
        lazy = lazy_servers(nats_hosts(str(monitor), "the monitoring address"))
        if lazy:
            raise KvLedgerError(ErrorCode.INVALID_ARGUMENT, f"NATS servers that do not sync every write "
                                f"(jetstream sync_interval: always): {', '.join(lazy)}; a power loss there "
                                "loses acknowledged writes (--allow-lazy-fsync accepts that)")
    cell = str(url.database)
    config = stream_config(cell, int(url.query.get("replicas", 3)))  # type: ignore[arg-type]
    client = NatsClient(url)
    try:
        deadline = time.monotonic() + wait
        while True:
            try:
                made = _create(client, config, shown)
            except KvLedgerError as exc:  # a cluster that just started, or a busy one: ask again
                if exc.code is not ErrorCode.DATABASE_UNREACHABLE or time.monotonic() > deadline:
                    raise
                continue
            if made is None:
                if (client.api(f"STREAM.INFO.{config['name']}").get("cluster") or {}).get("leader") \
                        or config["num_replicas"] == 1:
                    return REVISION
                made = {"code": 503}  # created, its replicas still electing a leader
            if time.monotonic() > deadline or (int(made.get("code", 0)) not in (500, 503)
                                               and made.get("err_code") != PEER_OFFLINE):
                raise KvLedgerError(ErrorCode.DATABASE_ERROR, f"{shown} refused to create the stream "
                                    f"{config['name']} (JetStream error {made.get('err_code')}: "
                                    f"{str(made.get('description', ''))[:160]})")
            time.sleep(0.2)  # no meta leader yet
    finally:
        client.close()


def _create(client: NatsClient, config: dict[str, Any], shown: str) -> dict[str, Any] | None:
    """Create the stream unless it exists (a create whose answer was lost may have made
    it): None when it is there, else the server's error."""
    found = client.api(f"STREAM.INFO.{config['name']}")
    if "error" not in found:
        if (found.get("config", {}).get("metadata") or {}).get("kvledger") != REVISION:
            raise KvLedgerError(ErrorCode.SCHEMA_MISMATCH, f"{shown} has a stream {config['name']} that "
                                "kvledger init did not make")
        return None
    error: dict[str, Any] | None = client.api(f"STREAM.CREATE.{config['name']}", config).get("error")
    return error


__all__ = ["REVISION", "init_cell", "lazy_servers", "stream_config"]
