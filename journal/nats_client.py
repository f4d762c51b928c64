"""A synchronous JetStream client for journal.nats: nats-py's asyncio connection run on
an event loop in a private thread, and the few JetStream API calls the journal makes,
spoken as the server's JSON API (stream create and info, direct gets, atomic batch
publish) rather than through nats-py's JetStream layer, whose coverage of direct-get
batches and atomic publish lags the server's.

Every failure becomes a KvLedgerError with a stable code, its message naming the
servers by the redacted URL: never the client's own text, which may quote credentials.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import threading
from collections.abc import Coroutine, Sequence
from typing import Any, NamedTuple, TypeVar

from sqlalchemy.engine import URL

from kvledger.journal import faults
from kvledger.journal.url import nats_servers, redact
from kvledger.schemas.errors import ErrorCode, KvLedgerError

T = TypeVar("T")
DEFAULT_TIMEOUT = 30.0  # seconds a request waits: long enough to ride out a leader election on a loaded machine
# A commit's acknowledgement awaited this long, then decided again (idempotent: the same
# Msg-Id and operation ids): a batch sent to a leader that died is never answered.
COMMIT_WAIT = 5.0
GET_BATCH = 256  # messages one direct get asks for at a time
# JetStream's error codes the journal answers (server/errors.json)
WRONG_LAST_SEQUENCE = 10071  # an expected last subject sequence did not hold
WRONG_LAST_SEQUENCE_CLUSTERED = 10164  # the same, or another publish on the subject is in flight
LAST_SEQUENCE_NOT_READY = 10163  # the server cannot check an expectation yet (a new leader)
BATCH_DUPLICATE = 10201  # an atomic batch held a message id already stored
BATCH_INCOMPLETE = 10176  # a message of the batch did not arrive: nothing of it is stored
STREAM_NOT_FOUND = 10059
MESSAGE_TOO_LARGE = 10054  # also what the client answers a message over the servers' max_payload


class Msg(NamedTuple):
    """A stored message: its stream sequence, subject, headers and data."""

    seq: int
    subject: str
    headers: dict[str, str]
    data: bytes


class Refused(Exception):
    """The server refused a publish: its JetStream error code and description."""

    def __init__(self, code: int, description: str) -> None:
        super().__init__(f"{code}: {description}")
        self.code = code
        self.description = description


class _NoResponder(Exception):
    """A direct get found no server to answer it (status 503)."""


_FIRST_WAIT = 0.01  # seconds before asking again what went unanswered (then doubling: _again)


class NatsClient:
    """One connection to the servers of `url`, used by one journal from any thread
    (calls are serialized by the caller's lock)."""

    def __init__(self, url: URL) -> None:
        try:
            import nats
        except ImportError:  # the light install: nats-py comes with the nats extra
            raise KvLedgerError(ErrorCode.INVALID_ARGUMENT, f"{redact(url)} needs the NATS client, which is not "
                                "installed: pip install 'kvledger[nats]'") from None

        self.display = redact(url)
        self.timeout = float(url.query.get("timeout", DEFAULT_TIMEOUT))  # type: ignore[arg-type]
        options: dict[str, Any] = {"servers": nats_servers(url), "connect_timeout": min(self.timeout, 5.0),
                                   "allow_reconnect": True, "max_reconnect_attempts": 1,
                                   "reconnect_time_wait": 0.2}
        if url.username:
            options["user"], options["password"] = url.username, url.password or ""
        if url.query.get("creds"):
            creds = str(url.query["creds"])
            if not os.access(creds, os.R_OK):  # the path is not shown: redact hides it
                raise KvLedgerError(ErrorCode.INVALID_ARGUMENT, f"the creds file of {self.display} cannot be read")
            options["user_credentials"] = creds
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kvledger-nats", daemon=True)
        self._thread.start()
        try:
            self.nc = self._run(nats.connect(**options, error_cb=_quiet, disconnected_cb=_quiet_cb,
                                             reconnected_cb=_quiet_cb, closed_cb=_quiet_cb), self.timeout + 5)
            # connected: from now on a lost server is retried without end (a failover takes seconds),
            # where the first connect gave up after trying each server twice
            self.nc.options["max_reconnect_attempts"] = -1
        except KvLedgerError:
            self._stop_loop()
            raise
        except Exception:  # noqa: BLE001 - the client's own text may quote credentials: our words only
            self._stop_loop()
            raise KvLedgerError(ErrorCode.DATABASE_UNREACHABLE, f"cannot connect to the NATS servers of "
                                f"{self.display}") from None

    # -- the loop ------------------------------------------------------------------

    def _run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        import nats.errors

        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result((timeout or self.timeout) + 1)
        except nats.errors.MaxPayloadError:  # refused before it is sent: nothing of it is stored
            raise Refused(MESSAGE_TOO_LARGE, "a message over the servers' max_payload") from None
        except TimeoutError:
            future.cancel()
            raise self._unreachable("did not answer in time") from None

    def _unreachable(self, what: str) -> KvLedgerError:
        return KvLedgerError(ErrorCode.DATABASE_UNREACHABLE, f"the NATS servers of {self.display} {what}")

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._loop.close()

    def close(self) -> None:
        try:
            self._run(self.nc.close(), 5)
        except Exception:  # noqa: BLE001 - closing a connection that already broke
            pass
        self._stop_loop()

    # -- requests ------------------------------------------------------------------

    async def _request(self, subject: str, payload: bytes, headers: dict[str, str] | None,
                       read: bool = True, wait: float | None = None) -> Any:
        """One request; while nobody answers it (a stream electing its leader, after a
        failover or a create), asked again until the timeout (`wait`, if shorter). A read
        is asked again also when its answer does not come (the server it went to was
        killed); a publish is not: its caller decides again on what is stored."""
        import nats.errors

        deadline = self._loop.time() + min(self.timeout, wait or self.timeout)
        wait = _FIRST_WAIT
        while True:
            left = deadline - self._loop.time()
            try:
                return await self.nc.request(subject, payload, timeout=min(left, 2.0) if read else left,
                                             headers=headers)
            except nats.errors.NoRespondersError:
                error = KvLedgerError(ErrorCode.DATABASE_UNREACHABLE, f"no JetStream answers at {self.display} "
                                      "(is JetStream enabled, and the stream's servers up?)")
            except nats.errors.TimeoutError:
                error = self._unreachable("did not answer in time")
                if not read:
                    raise error from None
            except nats.errors.MaxPayloadError:
                raise
            except nats.errors.Error:
                error = self._unreachable("closed the connection")
                if not read:
                    raise error from None
            wait = await self._again(deadline, wait, error)

    async def _again(self, deadline: float, wait: float, error: KvLedgerError) -> float:
        """Wait `wait` seconds before asking again what went unanswered, and return the next
        wait (doubling, up to 0.5 s); raise `error` instead when that would pass `deadline`."""
        if self._loop.time() + wait > deadline:
            raise error
        await asyncio.sleep(wait)
        return min(2 * wait, 0.5)

    def api(self, subject: str, request: dict[str, Any] | None = None) -> dict[str, Any]:
        """One JetStream API call ($JS.API.<subject>): its JSON answer, errors included."""
        msg = self._run(self._request(f"$JS.API.{subject}", json.dumps(request).encode() if request else b"", None))
        answer: dict[str, Any] = json.loads(msg.data)
        return answer

    def publish(self, subject: str, data: bytes, headers: dict[str, str]) -> dict[str, Any]:
        """One message, acknowledged: the PubAck, or Refused."""
        msg = self._run(self._request(subject, data, headers, read=False))
        return _ack(msg.data)

    def publish_batch(self, messages: Sequence[tuple[str, bytes, dict[str, str]]],
                      wait: float | None = None) -> dict[str, Any]:
        """An atomic batch (all stored or none): the commit's PubAck, or Refused; its
        acknowledgement awaited `wait` seconds at most (None: the timeout)."""
        return self._run(self._batch(messages, wait))

    async def _batch(self, messages: Sequence[tuple[str, bytes, dict[str, str]]],
                     wait: float | None = None) -> dict[str, Any]:
        batch_id = self.nc._nuid.next().decode()
        last = len(messages)
        for i, (subject, data, headers) in enumerate(messages, 1):
            h = {"Nats-Batch-Id": batch_id, "Nats-Batch-Sequence": str(i), **headers}
            if i == last:
                if faults.ACTIVE and last > 1:  # the messages so far reach the server before the point acts
                    await self.nc.flush()
                    faults.fault("mid_batch")
                h["Nats-Batch-Commit"] = "1"
                return _ack((await self._request(subject, data, h, read=False, wait=wait)).data)
            # unacknowledged: the server refuses the commit of a batch with a gap (BATCH_INCOMPLETE),
            # and one round trip a commit is what a writer waits on
            await self.nc.publish(subject, data, headers=h)
        raise AssertionError("an empty batch")

    # -- direct gets ---------------------------------------------------------------

    def get(self, stream: str, request: dict[str, Any]) -> Msg | None:
        """One message (`last_by_subj`, `seq`, `next_by_subj`) as the stream's leader has
        it; None: none. (A direct get may be answered by a replica that has not yet
        applied the last commits: fine for reading what is known to be stored, not for
        deciding what is.)"""
        return self.get_each(stream, [request])[0]

    def get_each(self, stream: str, requests: Sequence[dict[str, Any]]) -> list[Msg | None]:
        """`get` of each request, sent at once."""
        return self._run(self._get_each(stream, requests))

    async def _get_each(self, stream: str, requests: Sequence[dict[str, Any]]) -> list[Msg | None]:
        subject = f"$JS.API.STREAM.MSG.GET.{stream}"
        answers = await asyncio.gather(*(self._request(subject, json.dumps(r).encode(), None) for r in requests))
        return [self._leader_msg(a.data) for a in answers]

    def _leader_msg(self, data: bytes) -> Msg | None:
        answer = json.loads(data)
        error = answer.get("error")
        if error is not None:
            if int(error.get("code", 0)) == 404:
                return None
            raise KvLedgerError(ErrorCode.DATABASE_ERROR, f"a read at {self.display} was refused (JetStream error "
                                f"{error.get('err_code')}: {str(error.get('description', ''))[:120]})")
        m = answer["message"]
        headers = _parse_headers(base64.b64decode(m["hdrs"])) if m.get("hdrs") else {}
        return Msg(int(m["seq"]), str(m["subject"]), headers, base64.b64decode(m.get("data") or b""))

    def get_many(self, stream: str, request: dict[str, Any]) -> list[Msg]:
        """The messages a batched direct get answers (`batch`, with `seq` and
        `next_by_subj`, or `multi_last`), up to its end-of-batch."""
        return self._run(self._get_many(stream, request))

    async def _get_many(self, stream: str, request: dict[str, Any]) -> list[Msg]:
        # No responder (503) comes while the cluster still spreads the stream's direct-get
        # interest to the server this client is on (a new stream, a moved replica): asked
        # again until the timeout, as a request nobody answers is (_request).
        deadline, wait = self._loop.time() + self.timeout, _FIRST_WAIT
        while True:
            try:
                return await self._get_many_once(stream, request)
            except _NoResponder:
                pass
            wait = await self._again(deadline, wait, self._unreachable("have no JetStream responder for the stream"))

    async def _get_many_once(self, stream: str, request: dict[str, Any]) -> list[Msg]:
        inbox = self.nc.new_inbox()
        sub = await self.nc.subscribe(inbox)
        try:
            await self.nc.publish(f"$JS.API.DIRECT.GET.{stream}", json.dumps(request).encode(), reply=inbox)
            found: list[Msg] = []
            while True:
                try:
                    msg = await sub.next_msg(timeout=self.timeout)
                except TimeoutError:
                    raise self._unreachable("did not answer in time") from None
                stored = self._stored(msg, end_ok=True)
                if stored is None:
                    return found
                found.append(stored)
        finally:
            await sub.unsubscribe()

    def _stored(self, msg: Any, end_ok: bool = False) -> Msg | None:
        headers = dict(msg.headers or {})
        status = headers.get("Status")
        if status == "404" or (end_ok and status == "204"):
            return None
        if status is not None or "Nats-Sequence" not in headers:
            if status == "503":
                raise _NoResponder
            raise KvLedgerError(ErrorCode.DATABASE_ERROR, f"a direct get at {self.display} answered status "
                                f"{status} ({str(headers.get('Description', ''))[:80]})")
        return Msg(int(headers["Nats-Sequence"]), headers.get("Nats-Subject", ""), headers, bytes(msg.data))


def _parse_headers(block: bytes) -> dict[str, str]:
    """A NATS header block (`NATS/1.0` then `Key: Value` lines) as a dict."""
    headers: dict[str, str] = {}
    for line in block.decode(errors="replace").split("\r\n")[1:]:
        key, colon, value = line.partition(":")
        if colon:
            headers[key.strip()] = value.strip()
    return headers


def _ack(data: bytes) -> dict[str, Any]:
    answer: dict[str, Any] = json.loads(data)
    error = answer.get("error")
    if error:
        raise Refused(int(error.get("err_code", 0)), str(error.get("description", "")))
    return answer


async def _quiet(exc: Exception) -> None:
    """nats-py's error callback: reconnects are retried by the client, and a request that
    fails says so to its caller; nothing to log (a message may quote the URL)."""


async def _quiet_cb() -> None:
    pass


# Refusals after which the batch is decided again on what is stored: another writer was first.
RETRY = frozenset({WRONG_LAST_SEQUENCE, WRONG_LAST_SEQUENCE_CLUSTERED, LAST_SEQUENCE_NOT_READY, BATCH_DUPLICATE,
                   BATCH_INCOMPLETE})

__all__ = ["BATCH_DUPLICATE", "GET_BATCH", "MESSAGE_TOO_LARGE", "RETRY", "STREAM_NOT_FOUND", "WRONG_LAST_SEQUENCE",
           "Msg", "NatsClient", "Refused"]
