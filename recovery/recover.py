"""Crash recovery: reopen a journal whose writer died, prove it, resolve what was in
flight, rebuild the K/V of every live handle and run its request to completion.

    with open_journal(url) as journal:
        report = recover(journal)          # the default small random model
        assert report.ok

The algorithm (docs/guides/recover-after-crash.md):
  1. verify the journal (replay.verify). A journal with findings is not continued.
  2. live handles = head rows not RELEASED; fold each stream.
  3. the model named by --model must have served them: the cache ABI a worker on this
     model would declare must equal each handle's (else ABI_MISMATCH, nothing written).
  4. in-doubt operations: an append started but neither published nor failed gets a
     `failure` with outcome `aborted`, through the command service, with a
     deterministic operation id (`recover-abort-<handle>-<txn>`): a second recovery,
     or a retry after a crash of this one, writes nothing new.
  5. re-execute the appends of the live handles (and of their fork ancestors up to the
     fork) call by call with their recorded shapes (kvledger.worker.reexec) and compare every
     recorded row digest. Any mismatch stops here: K/V that differs from what was
     published is not continued.
  6. continue: a worker adopts every live handle with its rebuilt rows, its outputs
     and, when its newest publication's logits are ready, those logits; it runs each
     request to max_new_tokens (finish + release). A finished or cancelled handle is
     only released.

Request parameters come from the manifest: prompt, request_policy.max_new_tokens,
sampling kind/temperature/seed. A fork child is a live handle of its own: it inherits
its parent's manifest and samples with seed + child_index + 1 (the worker's rule).
What a client asked of a running request (Worker.cancel, truncate, reorder, repair) and
its speculation and the n of a parallel-sampling request are not request state and are
not replayed: a recovered request simply runs to max_new_tokens.

Run recovery only after the writer has stopped. Running it beside a live writer is
safe (every write is fenced by the conditional write) but aborts the writer's
in-flight appends.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec

from kvledger.engine import commands as c
from kvledger.engine.ids import instance_name
from kvledger.engine.service import CommandService
from kvledger.engine.state import HandleState
from kvledger.journal.port import Journal
from kvledger.schemas import events as ev
from kvledger.schemas.errors import ErrorCode, KvLedgerError
from kvledger.schemas.kv_events import KV_LIFECYCLE
from kvledger.schemas.manifest import Manifest, cache_abi_sha256

if TYPE_CHECKING:
    from kvledger.schemas.manifest import ArtifactIdentity
    from kvledger.worker.model import Transformer
    from kvledger.worker.serving import RequestSpec

# A finding or a mismatch as plain JSON values (msgspec.to_builtins, dataclasses.asdict).
PlainFinding = dict[str, Any]

SOURCE = "kvledger-recover"


@dataclass
class RecoveryReport:
    journal: str
    position_before: int
    position_after: int = 0
    verify_findings: list[PlainFinding] = field(default_factory=list)  # before recovery
    verify_after: list[PlainFinding] = field(default_factory=list)
    live_handles: list[str] = field(default_factory=list)
    aborted: list[tuple[str, str]] = field(default_factory=list)  # (handle, txn id)
    rebuilt: list[str] = field(default_factory=list)
    not_rebuildable: dict[str, str] = field(default_factory=dict)  # handle -> why
    rows_reexecuted: int = 0
    digest_mismatches: list[PlainFinding] = field(default_factory=list)
    continued: list[str] = field(default_factory=list)
    released: list[str] = field(default_factory=list)
    unfinished: list[str] = field(default_factory=list)  # still live after recovery
    tokens_generated: int = 0
    outputs: dict[str, list[int]] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def events_written(self) -> int:
        return self.position_after - self.position_before

    @property
    def ok(self) -> bool:
        return not (self.verify_findings or self.verify_after or self.digest_mismatches or self.errors
                    or self.unfinished or self.not_rebuildable)

    def to_dict(self) -> dict[str, Any]:  # JSON values
        d = asdict(self)
        d["aborted"] = [list(x) for x in self.aborted]
        d["events_written"] = self.events_written
        d["ok"] = self.ok
        return d


def verify_findings(journal: Journal) -> list[PlainFinding]:
    """The one adapter between recovery and replay.verify (its API is still settling):
    every finding of a whole-journal verify, as plain dicts."""
    from kvledger.replay.verify import verify_journal

    return [msgspec.to_builtins(f) for f in verify_journal(journal).findings]


def recover(journal: Journal, *, served: tuple[Transformer, ArtifactIdentity] | None = None,
            model_dir: str | None = None,
            device: str = "cpu", continue_requests: bool = True, verify_after: bool = True,
            source_instance: str | None = None, display: str | None = None) -> RecoveryReport:
    """Recover `journal` after a crash (see the module docstring). `served`: an already
    loaded model and its artifact (load_model's pair); otherwise `model_dir` is loaded
    (None: the default small random model) in the dtype the handles' cache schema names."""
    t0 = time.perf_counter()
    display = display or journal.display_url
    report = RecoveryReport(display, journal.last_position())
    report.verify_findings = verify_findings(journal)
    if report.verify_findings:  # a journal that breaks its own rules is not continued
        return _done(report, journal, t0, verify_after=False)

    # this run's clock is its own: a second recovery (after a reboot) is another source
    service = CommandService(journal, source_instance=source_instance or instance_name(SOURCE))
    # KV-event streams (an engine's prefix cache, kvledger kv-events) are no handles to continue
    live = sorted(h for h, f in journal.heads().items() if f.lifecycle not in ("RELEASED", KV_LIFECYCLE))
    report.live_handles = live
    if not live:
        return _done(report, journal, t0, verify_after=False)
    states = _live_states(service, live)
    streams = {h: journal.read_stream(h) for h in live}

    # The model that served them, checked before anything is written.
    manifests = {h: _manifest(journal, states[h], streams) for h in live}
    loaded = None
    if continue_requests:
        loaded = served or _model(model_dir, device, manifests)
        _check_abi(*loaded, states, manifests)

    # In-doubt operations: appends started but neither published nor failed.
    aborts = [c.Fail(handle_id=h, txn_id=t.txn_id, outcome="aborted", code=ErrorCode.TXN_ABORTED.value,
                     detail="recovery: started but neither published nor failed when its writer stopped",
                     operation_id=f"recover-abort-{h}-{t.txn_id}")
              for h in live for t in states[h].open_txns]
    for cmd, result in zip(aborts, service.execute_many(aborts)):
        if isinstance(result, KvLedgerError):
            report.errors.append(f"abort of {cmd.txn_id} on {cmd.handle_id}: {result}")
        else:
            report.aborted.append((cmd.handle_id, cmd.txn_id))
    states = _live_states(service, live, refresh=True)
    if loaded is None or report.errors:  # loaded: continue_requests
        return _done(report, journal, t0, verify_after)
    model, artifact = loaded

    # Rebuild K/V by re-execution, proving every recorded row digest.
    from kvledger.worker.reexec import reexecute

    events, skipped = _rebuild_events(journal, live, states)
    report.not_rebuildable.update(skipped)
    # slots hold every needed handle's reservation and every recorded call's key extent
    # (a call shared with a handle not rebuilt here still runs at its recorded shape)
    capacity = max([e.payload.reserved_capacity for e in events
                    if isinstance(e, (ev.RequestAllocateEvent, ev.ForkEvent))]
                   + [e.payload.call.key_extent for e in events
                      if isinstance(e, ev.AppendStartEvent) and e.payload.call is not None] + [1])
    slots = len({e.stream_id for e in events}) + 1
    r = reexecute(model, events, slots=slots, capacity=capacity)
    report.rows_reexecuted = r.verified_rows
    report.digest_mismatches = [asdict(m) for m in r.mismatches]
    for h in r.skipped:
        report.not_rebuildable.setdefault(h, "an append without a recorded model call (not run by a worker)")
    if report.digest_mismatches:
        return _done(report, journal, t0, verify_after)
    rebuildable = [h for h in live if h not in report.not_rebuildable]
    for h in rebuildable:
        if states[h].lifecycle == "ACTIVE" and r.store.committed.get(h) != states[h].committed_length:
            report.not_rebuildable[h] = (f"re-execution rebuilt {r.store.committed.get(h)} rows, "
                                         f"the journal commits {states[h].committed_length}")
    rebuildable = [h for h in rebuildable if h not in report.not_rebuildable]
    report.rebuilt = rebuildable

    # Continue every unfinished request to completion.
    from kvledger.worker.serving import Worker

    seeds = _seeds(rebuildable, states, streams, manifests, journal)
    need = max([states[h].reserved_capacity for h in rebuildable] + [1])
    worker = Worker(model, service=service, artifact=artifact, max_running=max(16, len(rebuildable)),
                    capacity=need, device=str(next(model.parameters()).device))
    for h in rebuildable:
        s = states[h]
        if s.lifecycle == "ACTIVE":
            k, v = r.store.read(h)
        else:  # finished or cancelled: only its release is left, rows are not needed
            k = v = r.store.k[:, 0, :, :0]
            s = msgspec.structs.replace(s, committed_length=0)
        worker.adopt(s, _spec(s, manifests[h], seeds[h]), k, v, r.logits.get(h) if s.logits_ready else None)
    before = {h: len(states[h].outputs) for h in rebuildable}
    outputs = worker.run()
    report.continued = [h for h in rebuildable if states[h].lifecycle == "ACTIVE"]
    report.outputs = {h: list(outputs.get(h, ())) for h in rebuildable}
    report.tokens_generated = sum(len(report.outputs[h]) - before[h] for h in rebuildable)
    report.errors.extend(worker.errors)
    heads = journal.heads()
    report.released = [h for h in rebuildable if heads[h].lifecycle == "RELEASED"]
    report.unfinished = [h for h in rebuildable if heads[h].lifecycle != "RELEASED"]
    return _done(report, journal, t0, verify_after)


# -- steps ------------------------------------------------------------------------------

def _done(report: RecoveryReport, journal: Journal, t0: float, verify_after: bool) -> RecoveryReport:
    report.position_after = journal.last_position()
    if verify_after and report.events_written:
        report.verify_after = verify_findings(journal)
    report.seconds = time.perf_counter() - t0
    return report


def _manifest(journal: Journal, s: HandleState, streams: dict[str, list[ev.Event]]) -> Manifest:
    for e in streams.get(s.handle_id, ()):
        if isinstance(e, ev.RequestAllocateEvent):
            return e.payload.manifest
    body = journal.manifest(s.manifest_sha256)
    if body is None:
        raise KvLedgerError(ErrorCode.CORRUPT_JOURNAL, f"manifest {s.manifest_sha256[:12]} of "
                                                       f"{s.handle_id} is not stored")
    return msgspec.json.decode(body, type=Manifest)


def _live_states(service: CommandService, live: list[str], *, refresh: bool = False) -> dict[str, HandleState]:
    states = {}
    for h in live:
        s = service.state(h, refresh=refresh)
        if s is None:  # a head is written with its stream's first event
            raise KvLedgerError(ErrorCode.CORRUPT_JOURNAL, f"{h} has a head but no events")
        states[h] = s
    return states


def _model(model_dir: str | None, device: str, manifests: dict[str, Manifest]) -> tuple[Transformer, ArtifactIdentity]:
    from kvledger.worker.loading import DTYPES, load_model

    dtypes = {m.cache_schema.key_dtype.name for m in manifests.values()}
    dtype = dtypes.pop() if len(dtypes) == 1 else "fp32"
    if dtype not in DTYPES:
        dtype = "fp32"
    return load_model(model_dir, device=device, dtype=dtype)


def _check_abi(model: Transformer, artifact: ArtifactIdentity, states: dict[str, HandleState],
               manifests: dict[str, Manifest]) -> None:
    """Each live handle's cache ABI must be the one a worker on this model declares."""
    from kvledger.worker.serving import RequestSpec, Worker

    probe = Worker(model, service=None, artifact=artifact, max_running=1, capacity=1,
                   device=str(next(model.parameters()).device))
    want = cache_abi_sha256(probe.manifest(RequestSpec(request_id="abi-probe", prompt=(0,), max_new_tokens=1)))
    wrong = sorted(h for h, s in states.items() if s.cache_abi_sha256 != want)
    if wrong:
        m = manifests[wrong[0]]
        raise KvLedgerError(ErrorCode.ABI_MISMATCH, (
            f"{len(wrong)} live handle(s), first {wrong[0]}, were served with cache ABI "
            f"{states[wrong[0]].cache_abi_sha256[:12]} (model {m.artifact_identity.model_artifact_sha256[:12]}); "
            f"this model gives {want[:12]} (model {artifact.model_artifact_sha256[:12]}): pass the "
            f"serving model with --model; nothing was written"))


def _rebuild_events(journal: Journal, live: list[str], states: dict[str, HandleState]
                    ) -> tuple[list[ev.Event], dict[str, str]]:
    """The events to re-execute: every live handle's stream, and each fork ancestor's
    stream up to the fork that created a needed child, in global order. Appends of
    other handles that shared a model call are stood in for by placeholder rows (the
    recorded call shape is what determines the rows; the digests prove it)."""
    bound: dict[str, float] = {h: float("inf") for h in live if states[h].lifecycle == "ACTIVE"}
    streams: dict[str, list[ev.Event]] = {}
    todo = list(bound)
    skipped: dict[str, str] = {}
    while todo:
        h = todo.pop()
        if h not in streams:
            streams[h] = journal.read_stream(h)
        first = streams[h][0] if streams[h] else None
        if isinstance(first, ev.ForkEvent):
            parent = first.payload.parent_handle_id
            if bound.get(parent, -1) < first.global_position:
                bound[parent] = first.global_position
                todo.append(parent)
    out: list[ev.Event] = []
    for h, limit in bound.items():
        for e in streams[h]:
            if e.global_position >= limit:
                break
            if isinstance(e, ev.AppendStartEvent) and e.payload.call is None:
                skipped[h] = "an append without a recorded model call (not run by a worker)"
            out.append(e)
    out.sort(key=lambda e: e.global_position)
    return out, skipped


def _seeds(handles: Iterable[str], states: dict[str, HandleState], streams: dict[str, list[ev.Event]],
           manifests: dict[str, Manifest], journal: Journal) -> dict[str, int]:
    """Sampling seed per handle: the manifest's; a fork child adds child_index + 1 to its
    parent's (the worker's rule), so a recovered child samples what it would have."""
    cache: dict[str, int] = {}

    def seed(h: str) -> int:
        if h in cache:
            return cache[h]
        stream = streams.get(h) or journal.read_stream(h)
        first = stream[0]
        if isinstance(first, ev.ForkEvent):
            value = seed(first.payload.parent_handle_id) + first.payload.child_index + 1
        elif isinstance(first, ev.RequestAllocateEvent):
            value = first.payload.manifest.request_policy.sampling.seed
        else:
            value = manifests[h].request_policy.sampling.seed
        cache[h] = value
        return value

    return {h: seed(h) for h in handles}


def _spec(s: HandleState, m: Manifest, seed: int) -> RequestSpec:
    from kvledger.worker.serving import RequestSpec

    sampling = m.request_policy.sampling
    return RequestSpec(request_id=s.request_id, prompt=s.prompt,
                       max_new_tokens=m.request_policy.max_new_tokens,
                       temperature=0.0 if sampling.kind == "greedy" else sampling.temperature, seed=seed)


__all__ = ["RecoveryReport", "recover", "verify_findings"]
