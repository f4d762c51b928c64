"""The worked traces of the spec, run through kvledger.Ledger on every backend."""

from __future__ import annotations

import msgspec
import pytest

from kvledger import Ledger, full_layers
from kvledger.engine.view import view_of
from kvledger.schemas.errors import ErrorCode, KvLedgerError

from lifecycle_helpers import ManualClock, allocate, base, decode, emit, prefill


@pytest.fixture
def ledger(db_url):
    with Ledger.open(db_url, clock=ManualClock()) as led:
        yield led


def rejected(code: ErrorCode, fn, *args, **kwargs) -> KvLedgerError:
    with pytest.raises(KvLedgerError) as err:
        fn(*args, **kwargs)
    assert err.value.code is code, err.value
    return err.value


def test_runtime_trace_0x07(ledger):
    """Worked Failure, Retry, Fork, And Release Trace: seq 0-13, generation 7 -> 8."""
    allocate(ledger, "R", capacity=8, generation=7)                         # seq 0
    b0 = base(ledger, "R")
    prompt = ledger.state("R").prompt
    ledger.begin_append("R", txn_id="prefill-1", kind="prefill", base=b0, start=0, token_ids=prompt)
    ledger.publish("R", txn_id="prefill-1", base=b0)                       # seq 2
    emit(ledger, "R", 101)                                                  # seq 3
    b1 = base(ledger, "R")
    ledger.begin_append("R", txn_id="decode-1", kind="decode", base=b1, start=4, token_ids=(101,))
    ledger.fail("R", txn_id="decode-1", outcome="failed", code="WORKER_FAILED")  # seq 5
    ledger.begin_append("R", txn_id="decode-2", kind="decode", base=b1, start=4, token_ids=(101,))
    ledger.publish("R", txn_id="decode-2", base=b1)                        # seq 7
    ledger.fork("R", base=base(ledger, "R"), child_handle_ids=["R.branch"], prefix_length=5,
                child_request_ids=["R.branch"])                             # seq 8
    ledger.truncate("R.branch", base=base(ledger, "R.branch"), new_length=3)  # seq 9
    ledger.finish("R", base=7)                                        # seq 10
    ledger.release("R", base=7)                                       # seq 11
    ledger.finish("R.branch", base=0)                                 # seq 12
    ledger.release("R.branch", base=0)                                # seq 13

    events = list(ledger.journal.read_all())
    assert len(events) == 14
    states, table = {}, []
    from kvledger.engine.evolve import evolve

    for e in events:
        states[e.stream_id] = evolve(states.get(e.stream_id), e)
        s = states[e.stream_id]
        table.append((e.event_type, e.stream_id, s.generation, s.snapshot_version, s.committed_length))
    assert table == [
        ("request_allocate", "R", 7, 0, 0),
        ("append_start", "R", 7, 0, 0),
        ("append_publish", "R", 7, 1, 4),
        ("output_emit", "R", 7, 1, 4),
        ("append_start", "R", 7, 1, 4),
        ("failure", "R", 7, 1, 4),
        ("append_start", "R", 7, 1, 4),
        ("append_publish", "R", 7, 2, 5),
        ("fork", "R.branch", 0, 0, 5),
        ("truncate", "R.branch", 0, 1, 3),
        ("finish", "R", 7, 2, 5),
        ("release", "R", 8, 3, 0),
        ("finish", "R.branch", 0, 1, 3),
        ("release", "R.branch", 1, 2, 0),
    ]
    # failure carries no result snapshot and leaves the base visible
    failure = events[5].payload
    assert failure.outcome == "failed" and failure.base_snapshot_version == 1
    assert not hasattr(failure, "result_snapshot_version")
    # the retry preserved the base of the failed attempt
    assert events[6].payload.base_snapshot_version == events[4].payload.base_snapshot_version == 1
    # the output frontier and the committed length are separate counters
    assert view_of(states["R"]).emitted_output_tokens == 1
    assert events[3].payload.output_index == 0 and events[7].payload.committed_length == 5


def test_lifecycle_trace_0x01(ledger):
    """Worked Synthetic Lifecycle Trace, steps 1-5 (the spec's 'generation' is our
    snapshot_version; our generation advances on release)."""
    allocate(ledger, "H", capacity=16)
    prefill(ledger, "H")
    emit(ledger, "H", 55)  # the Loop 2 snapshot: logical 5, committed 4
    s1 = base(ledger, "H")
    assert ledger.state("H").committed_length == 4 and ledger.state("H").logical_length == 5

    # 1. two transactions capture the same base; txn-win stages layer 0 only
    ledger.begin_append("H", txn_id="txn-win", kind="decode", base=s1, start=4, token_ids=(55,))
    ledger.begin_append("H", txn_id="txn-lose", kind="decode", base=s1, start=4, token_ids=(55,))
    layer0_only = full_layers(2, 4, 1)[:1]
    rejected(ErrorCode.PARTIAL_LAYER_SET, ledger.publish, "H", txn_id="txn-win", base=s1,
             layers=layer0_only)
    assert ledger.state("H").committed_length == 4  # an intervening read sees [4,4]
    win = ledger.publish("H", txn_id="txn-win", base=s1, operation_id="pub-txn-win")
    assert win.handles[0].snapshot_version == 2 and win.handles[0].committed_length == 5

    # 2. retrying txn-win returns its receipt; the competitor is stale
    before = list(ledger.journal.read_raw())
    again = ledger.publish("H", txn_id="txn-win", base=s1, operation_id="pub-txn-win")
    assert again == win and list(ledger.journal.read_raw()) == before
    rejected(ErrorCode.STALE_BASE, ledger.publish, "H", txn_id="txn-lose", base=s1)
    ledger.fail("H", txn_id="txn-lose", outcome="rejected", code="STALE_BASE")

    # 3. fork into A and B; reorder swaps their coupled rows; A truncates; B cancels
    s2 = base(ledger, "H")
    ledger.fork("H", base=s2, child_handle_ids=["A", "B"], prefix_length=5)
    assert base(ledger, "H") == s2  # parent unchanged
    a, b = ledger.state("A"), ledger.state("B")
    assert (a.generation, a.snapshot_version, a.committed_length) == (0, 0, 5)
    assert a.handle_id != b.handle_id and a.request_id != b.request_id
    ledger.reorder("beam", rows=["A", "B"], permutation=[1, 0])
    assert (ledger.state("A").row_index, ledger.state("B").row_index) == (1, 0)
    ledger.truncate("A", base=base(ledger, "A"), new_length=3)
    assert ledger.state("A").committed_length == 3
    emit(ledger, "B", 77)
    bb = base(ledger, "B")
    ledger.begin_append("B", txn_id="b-txn", kind="decode", base=bb, start=5, token_ids=(77,))
    ledger.cancel("B", base=0)

    # 4. B's staged transaction was aborted by the cancel: late completion and publish fail
    assert ledger.state("B").open_txns == ()
    rejected(ErrorCode.STALE_BASE, ledger.publish, "B", txn_id="b-txn", base=bb,
             layers=full_layers(2, 5, 1)[:1])
    rejected(ErrorCode.STALE_BASE, ledger.publish, "B", txn_id="b-txn", base=bb)
    rejected(ErrorCode.HANDLE_TERMINAL, ledger.begin_append, "B", txn_id="b-2", kind="decode",
             base=base(ledger, "B"), start=5, token_ids=(77,))

    # 5. a fully prepared parent append loses to finish + release: fenced on generation
    emit(ledger, "H", 66)
    sp = base(ledger, "H")
    ledger.begin_append("H", txn_id="late", kind="decode", base=sp, start=5, token_ids=(66,))
    ledger.finish("H", base=sp[0])
    ledger.release("H", base=sp[0])
    assert ledger.state("H").generation == sp[0] + 1
    allocate(ledger, "J")  # another owner takes a slot: the handle name check alone would pass
    err = rejected(ErrorCode.STALE_BASE, ledger.publish, "H", txn_id="late", base=sp)
    assert "generation" in err.message


def test_speculative_verify_100_102_103(ledger):
    prompt = tuple(range(1, 101))
    allocate(ledger, "S", prompt=prompt, capacity=128)
    ledger.state("S")
    m = ledger.state("S")
    assert len(m.prompt) == 100
    prefill(ledger, "S")
    b = base(ledger, "S")
    drafts = (501, 502, 503, 504)
    ledger.begin_append("S", txn_id="v1", kind="verify", base=b, start=100, token_ids=drafts)
    # committing the rejected d2's row is refused
    rejected(ErrorCode.REJECTED_SUFFIX, ledger.publish, "S", txn_id="v1", base=b, accepted_count=2,
             layers=full_layers(2, 100, 3))
    ledger.publish("S", txn_id="v1", base=b, accepted_count=2)
    s = ledger.state("S")
    assert s.committed_length == 102 and s.outputs == (501, 502)
    emit(ledger, "S", 999)  # the correction token c2
    s = ledger.state("S")
    assert len(s.outputs) == 3 and s.committed_length == 102 and s.has_frontier
    assert view_of(s).phase == "DECODE_FRONTIER_READY" and view_of(s).output_frontier_count == 1
    decode(ledger, "S", "c2")
    assert ledger.state("S").committed_length == 103


def test_repair_keeps_outputs_and_adds_one_row(ledger):
    allocate(ledger, "P", capacity=16)
    prefill(ledger, "P")
    emit(ledger, "P", 5)
    decode(ledger, "P", "d1")
    emit(ledger, "P", 6)
    ledger.finish("P", base=0, reason="eos")
    before = ledger.state("P")
    assert before.committed_length == 5 and before.outputs == (5, 6)
    v = view_of(before)
    assert v.phase == "FINISHED_RETAINED" and v.terminal_retained_logical_payload_bytes == 5 * 64
    decode(ledger, "P", "repair-1", kind="repair")
    after = ledger.state("P")
    assert after.outputs == before.outputs and after.committed_length == 6
    assert not after.logits_ready  # repair logits are discarded, never an output
    rejected(ErrorCode.HANDLE_TERMINAL, emit, ledger, "P", 7)


def test_shared_prefix_release_is_an_ownership_handoff(ledger):
    allocate(ledger, "A")
    allocate(ledger, "B")
    p = ledger.state("A").prefix_identity_sha256
    assert p == ledger.state("B").prefix_identity_sha256
    assert ledger.prefix_owners(p) == ("A", "B")
    for h in ("A", "B"):
        ledger.finish(h, base=0)
    ledger.release("A", base=0)
    assert ledger.prefix_owners(p) == ("B",)
    rejected(ErrorCode.PREFIX_STILL_OWNED, ledger.require_evictable, p)
    ledger.release("B", base=0)
    assert ledger.prefix_owners(p) == ()
    ledger.require_evictable(p)


def test_phases_across_a_chunked_prefill(ledger):
    allocate(ledger, "C", prompt=tuple(range(10, 20)), capacity=32)
    assert view_of(ledger.state("C")).phase == "WAITING_PREFILL"
    b = base(ledger, "C")
    ledger.begin_append("C", txn_id="c1", kind="prefill", base=b, start=0, token_ids=range(10, 16))
    assert view_of(ledger.state("C")).phase == "PREFILL_IN_FLIGHT"
    ledger.publish("C", txn_id="c1", base=b)
    v = view_of(ledger.state("C"))
    assert v.phase == "WAITING_PREFILL" and v.prompt_rows_remaining == 4
    rejected(ErrorCode.OUTPUT_NOT_READY, emit, ledger, "C", 1)
    b = base(ledger, "C")
    ledger.begin_append("C", txn_id="c2", kind="chunk", base=b, start=6, token_ids=range(16, 20))
    ledger.publish("C", txn_id="c2", base=b)
    assert view_of(ledger.state("C")).phase == "OUTPUT_READY"


def test_chain_is_one_operation_fenced_by_its_first_step(ledger):
    from kvledger.engine import commands as c

    allocate(ledger, "Q")
    prefill(ledger, "Q")
    emit(ledger, "Q", 9)
    s = ledger.state("Q")
    b = (s.generation, s.snapshot_version)
    ledger.begin_append("Q", txn_id="d1", kind="decode", base=b, start=4, token_ids=(9,))
    before = list(ledger.journal.read_raw())

    def chain(base, op="chain-1"):
        return c.Chain(handle_id="Q", operation_id=op, steps=(
            c.Publish(handle_id="Q", txn_id="d1", base_generation=base[0], base_snapshot_version=base[1]),
            c.EmitOutput(handle_id="Q", base_generation=None, base_snapshot_version=None, output_index=1,
                         token_id=8),
            c.BeginAppend(handle_id="Q", txn_id="d2", kind="decode", base_generation=None,
                          base_snapshot_version=None, interval_start=5, interval_count=1, token_ids=(8,),
                          cache_positions=(5,), mask_key_extent=6, cache_abi_sha256=s.cache_abi_sha256)))

    stale = (b[0], b[1] - 1)
    rejected(ErrorCode.STALE_BASE, ledger.execute, chain(stale))
    assert list(ledger.journal.read_raw()) == before  # all or nothing
    receipt = ledger.execute(chain(b))
    assert len(receipt.event_ids) == 3 and receipt.handles[0].committed_length == 5
    assert ledger.execute(chain(b)) == receipt  # a retry returns the one receipt
    after = ledger.state("Q")
    assert after.outputs == (9, 8) and after.open_txn("d2") is not None
    # only a later step may leave its base unnamed
    unnamed_first = c.Chain(handle_id="Q", steps=(c.Finish(handle_id="Q", base_generation=None),))
    rejected(ErrorCode.INVALID_ARGUMENT, ledger.execute, unnamed_first)
    rejected(ErrorCode.INVALID_ARGUMENT, ledger.execute, c.Finish(handle_id="Q", base_generation=None))


def test_submitted_commands_are_acknowledged_only_by_the_wait(ledger):
    """submit_many (the worker's overlapped commit): the rows are written when it
    returns, but no state, hook or receipt sees them before the wait; then the results
    are what execute_many would have given, in order, a refused command included."""
    from kvledger.engine import commands as c

    from factories import make_manifest

    service = ledger.service
    seen: list = []
    service.on_commit.append(lambda receipt, events: seen.append(receipt))
    allocate(ledger, "W")
    seen.clear()
    s = ledger.state("W")
    good = c.BeginAppend(handle_id="W", txn_id="p", kind="prefill", base_generation=0,
                         base_snapshot_version=s.snapshot_version, interval_start=0, interval_count=2,
                         token_ids=s.prompt[:2], cache_positions=(0, 1), mask_key_extent=2,
                         cache_abi_sha256=s.cache_abi_sha256)
    stale = c.Finish(handle_id="W", base_generation=7)
    other = c.Allocate(handle_id="W2", manifest=make_manifest(request_id="W2"), reserved_capacity=8)
    wait = service.submit_many([good, stale, other])
    assert seen == [] and service.states["W"] == s and "W2" not in service.states
    r_good, r_stale, r_other = wait()
    assert seen == [r_good, r_other]
    assert isinstance(r_stale, KvLedgerError) and r_stale.code is ErrorCode.STALE_BASE
    assert ledger.state("W").open_txn("p") is not None and ledger.state("W2").stream_position == 1
    assert ledger.journal.receipt(r_other.operation_id) == r_other


def test_relative_commands_take_the_state_their_batch_leaves_and_stay_fenced(ledger, db_url):
    """Relative commands (what a worker sends) are bound at decision time to the state the
    earlier commands of the batch leave; bound against a stale view they are refused by
    the journal's guard like any command, never applied to a head they did not see."""
    from kvledger.engine import commands as c

    from factories import make_manifest

    service = ledger.service
    allocate(ledger, "R")
    s = ledger.state("R")
    start = c.BeginAppend(handle_id="R", txn_id="p", kind="prefill", base_generation=None,
                          base_snapshot_version=None, interval_start=0, interval_count=4,
                          token_ids=s.prompt, cache_positions=(0, 1, 2, 3), mask_key_extent=4,
                          cache_abi_sha256="")
    publish = c.Publish(handle_id="R", txn_id="p", base_generation=None, base_snapshot_version=None)
    emit = c.EmitOutput(handle_id="R", base_generation=None, base_snapshot_version=None, output_index=0,
                        token_id=9)
    fork = c.Fork(parent_handle_id="R", base_generation=0, base_snapshot_version=0,
                  child_handle_ids=("R.1",), prefix_length=None, child_request_ids=("R.1",))
    # a fork that names its prefix is bound to the parent's state and forks there
    at = msgspec.structs.replace(fork, child_handle_ids=("R.2",), prefix_length=2, child_request_ids=("R.2",))
    results = service.execute_many([c.Relative(x) for x in (start, publish, emit, fork, at)])
    assert all(not isinstance(r, KvLedgerError) for r in results), results
    assert ledger.state("R").outputs == (9,) and ledger.state("R.1").committed_length == 4
    assert ledger.state("R.2").committed_length == 2 and ledger.state("R.2").outputs == ()
    [beyond, unnamed] = service.execute_many([
        c.Relative(msgspec.structs.replace(at, child_handle_ids=("R.3",), prefix_length=5, child_request_ids=())),
        msgspec.structs.replace(fork, child_handle_ids=("R.4",), base_snapshot_version=1)])
    assert beyond.code is ErrorCode.FORK_BEYOND_COMMITTED and unnamed.code is ErrorCode.INVALID_ARGUMENT
    [unknown, absolute] = service.execute_many([
        c.Relative(c.Finish(handle_id="nope", base_generation=None)),
        c.Relative(c.Allocate(handle_id="R", manifest=make_manifest(request_id="R"), reserved_capacity=8))])
    assert unknown.code is ErrorCode.UNKNOWN_HANDLE and absolute.code is ErrorCode.INVALID_ARGUMENT
    with Ledger.open(db_url, clock=ManualClock()) as other:  # another writer moves the head
        other.truncate("R", base=base(other, "R"), new_length=2)
    [late] = service.execute_many([c.Relative(c.Truncate(handle_id="R", base_generation=0,
                                                         base_snapshot_version=0, new_length=1))])
    assert isinstance(late, KvLedgerError) and late.code is ErrorCode.STALE_BASE
    assert ledger.state("R", refresh=True).committed_length == 2


def test_a_batch_of_allocations_reads_once_and_decides_each_against_the_journal(ledger, db_url, monkeypatch):
    """A worker's service (commands built valid, not strict) asks the journal once which
    handles of a batch's allocations exist, and reads no stream for those that do not.
    One that another writer created is refused as if its stream had been read
    (HANDLE_EXISTS), and a later command of the batch on it is decided against that
    stream, as before; the others commit."""
    from kvledger.engine import commands as c
    from kvledger.engine.service import CommandService

    from factories import make_manifest

    with Ledger.open(db_url, clock=ManualClock()) as other:
        allocate(other, "X")
    journal = ledger.journal
    service = CommandService(journal, clock=ManualClock())
    reads: list[str] = []
    real = journal.read_stream
    monkeypatch.setattr(journal, "read_stream", lambda h, after=0: reads.append(h) or real(h, after))
    s = ledger.state("X", refresh=True)
    reads.clear()
    assert not service.strict and "X" not in service.states
    start = c.BeginAppend(handle_id="X", txn_id="p", kind="prefill", base_generation=None,
                          base_snapshot_version=None, interval_start=0, interval_count=2, token_ids=s.prompt[:2],
                          cache_positions=(0, 1), mask_key_extent=2, cache_abi_sha256=s.cache_abi_sha256)
    results = service.execute_many(
        [c.Allocate(handle_id=h, manifest=make_manifest(request_id=h), reserved_capacity=8) for h in ("A", "X", "B")]
        + [c.Relative(start)])
    assert reads == ["X"]  # the one that exists; none for A and B
    a, x, b, started = results
    assert isinstance(x, KvLedgerError) and x.code is ErrorCode.HANDLE_EXISTS
    assert not isinstance(a, KvLedgerError) and not isinstance(b, KvLedgerError), results
    assert not isinstance(started, KvLedgerError), started
    assert service.state("X").open_txn("p") is not None
    assert service.state("A").stream_position == 1 == service.state("B").stream_position


def test_a_lone_allocation_asks_which_handles_exist_and_reads_no_stream(ledger, monkeypatch):
    """One allocation of a handle the service has not seen is decided on the same one
    existence read as a batch of them (a stream read is three statements on PostgreSQL)."""
    from kvledger.engine import commands as c
    from kvledger.engine.service import CommandService

    from factories import make_manifest

    journal = ledger.journal
    service = CommandService(journal, clock=ManualClock())
    reads: list[str] = []
    asked: list[list[str]] = []
    real_read, real_existing = journal.read_stream, journal.existing
    monkeypatch.setattr(journal, "read_stream", lambda h, after=0: reads.append(h) or real_read(h, after))
    monkeypatch.setattr(journal, "existing", lambda hs: asked.append(list(hs)) or real_existing(hs))
    [r] = service.execute_many([c.Allocate(handle_id="L", manifest=make_manifest(request_id="L"),
                                           reserved_capacity=8)])
    assert not isinstance(r, KvLedgerError) and reads == [] and asked == [["L"]]


def test_a_handle_created_by_another_writer_after_the_read_takes_none_of_the_batch(ledger, db_url, monkeypatch):
    """The race the batched read leaves open: another writer creates X after the service
    found it absent. The allocation is refused by the guarded write, and the start the
    service decided on it, whose base equals the other writer's head (a new handle's
    head is always generation 0, snapshot 0, position 1), is refused too: nothing
    reported refused is written, and X's stream is the other writer's alone."""
    from kvledger.engine import commands as c
    from kvledger.engine.service import CommandService

    from factories import make_manifest

    with Ledger.open(db_url, clock=ManualClock()) as other:
        allocate(other, "X")
        theirs = other.journal.read_stream("X")
    service = CommandService(ledger.journal, clock=ManualClock())
    monkeypatch.setattr(ledger.journal, "existing", lambda handles: set())  # read before X was created
    start = c.BeginAppend(handle_id="X", txn_id="p", kind="prefill", base_generation=None,
                          base_snapshot_version=None, interval_start=0, interval_count=2, token_ids=(11, 22),
                          cache_positions=(0, 1), mask_key_extent=2, cache_abi_sha256="")
    cmds = [c.Allocate(handle_id=h, manifest=make_manifest(request_id=h), reserved_capacity=8) for h in ("X", "A")]
    x, a, started = service.execute_many([*cmds, c.Relative(start)])
    assert isinstance(x, KvLedgerError) and x.code is ErrorCode.HANDLE_EXISTS
    assert not isinstance(a, KvLedgerError)
    assert isinstance(started, KvLedgerError) and started.code is ErrorCode.STALE_BASE
    assert ledger.journal.read_stream("X") == theirs
    assert ledger.journal.head("X").stream_position == 1


def test_a_publish_gives_its_layers_or_their_combined_digest(ledger):
    """The worker's compact publish (layers=None with rows_sha256) stores the same digest
    as naming every layer with its own; naming both, or a malformed digest, is refused."""
    from kvledger.schemas.canonical import layers_sha256

    allocate(ledger, "R", capacity=8)
    b0 = base(ledger, "R")
    prompt = ledger.state("R").prompt
    n, layers = len(prompt), ledger.state("R").num_layers
    per_layer = [f"{i:064x}" for i in range(layers)]
    named = tuple(msgspec.structs.replace(r, rows_sha256=d) for r, d in zip(full_layers(layers, 0, n), per_layer))
    ledger.begin_append("R", txn_id="p", kind="prefill", base=b0, start=0, token_ids=prompt)
    rejected(ErrorCode.INVALID_ARGUMENT, ledger.publish, "R", txn_id="p", base=b0, layers=named,
             rows_sha256=layers_sha256(per_layer))
    rejected(ErrorCode.INVALID_ARGUMENT, ledger.publish, "R", txn_id="p", base=b0, rows_sha256="xyz")
    ledger.publish("R", txn_id="p", base=b0, rows_sha256=layers_sha256(per_layer))
    emit(ledger, "R", 7)
    b1 = base(ledger, "R")
    ledger.begin_append("R", txn_id="d", kind="decode", base=b1, start=n, token_ids=(7,))
    ledger.publish("R", txn_id="d", base=b1, layers=tuple(
        msgspec.structs.replace(r, rows_sha256=d) for r, d in zip(full_layers(layers, n, 1), per_layer)))
    publishes = [e.payload.rows_sha256 for e in ledger.journal.read_all() if e.event_type == "append_publish"]
    assert publishes == [layers_sha256(per_layer)] * 2
