"""Refusals of the general path that the worked traces do not reach, each held here: a
rule removed from engine/decide.py fails a case. Through the Ledger on every backend
(the stable code, the journal unchanged); through `decide` itself where the command's
own validation refuses first (a negative count) or no journal state leads there."""

from __future__ import annotations

from collections.abc import Callable

import msgspec
import pytest

from kvledger import Ledger, full_layers
from kvledger.engine import commands as c
from kvledger.engine.decide import decide
from kvledger.schemas.errors import ErrorCode, KvLedgerError

from factories import make_manifest
from lifecycle_helpers import ManualClock, allocate, base, emit, prefill

E = ErrorCode


@pytest.fixture
def ledger(db_url):
    """R: a prompt of 4, prefilled, its first output (101) emitted and not yet processed;
    S: prefilled."""
    with Ledger.open(db_url, clock=ManualClock()) as led:
        allocate(led, "R")
        prefill(led, "R")
        emit(led, "R", 101)
        allocate(led, "S")
        prefill(led, "S")
        yield led


def refused(ledger: Ledger, code: ErrorCode, case: str, call: Callable[..., object], *args: object,
            **kwargs: object) -> None:
    before = (list(ledger.journal.read_raw()), ledger.journal.heads())
    with pytest.raises(KvLedgerError) as err:
        call(*args, **kwargs)
    assert err.value.code is code, (case, err.value)
    assert (list(ledger.journal.read_raw()), ledger.journal.heads()) == before, case


# kind, start, token ids -> the code, for an append on R (committed 4, 5 tokens held)
APPENDS = {
    "verify without ready logits": ("verify", 4, (101,), E.OUTPUT_NOT_READY),
    "a prefill not at 0": ("prefill", 4, (101,), E.POSITION_MASK_MISMATCH),
    "a repair of an active request": ("repair", 4, (101,), E.FRONTIER_MISMATCH),
    "past the tokens held": ("chunk", 4, (101, 5), E.FRONTIER_MISMATCH),
}


def test_an_append_the_request_cannot_take_is_refused(ledger):
    b = base(ledger, "R")
    for case, (kind, start, tokens, code) in APPENDS.items():
        refused(ledger, code, case, ledger.begin_append, "R", txn_id="t", kind=kind, base=b, start=start,
                token_ids=tokens)
    abi = ledger.state("R").cache_abi_sha256
    uneven = c.BeginAppend(handle_id="R", txn_id="t", kind="decode", base_generation=b[0], base_snapshot_version=b[1],
                           interval_start=4, interval_count=2, token_ids=(101,), cache_positions=(4, 5),
                           mask_key_extent=6, cache_abi_sha256=abi)
    refused(ledger, E.POSITION_MASK_MISMATCH, "fewer token ids than the interval", ledger.execute, uneven)


def test_a_publication_short_of_its_append_is_refused(ledger):
    """The layer set names every layer over the append's interval with its rows; a
    decode publishes all it staged; a verify accepts at most what it staged."""
    ledger.begin_append("R", txn_id="d", kind="decode", base=base(ledger, "R"), start=4, token_ids=(101,))
    layers = full_layers(ledger.state("R").num_layers, 4, 1)
    cases = {
        "a layer starting elsewhere": (E.PARTIAL_LAYER_SET, (msgspec.structs.replace(layers[0], start=3),
                                                             *layers[1:]), None),
        "a layer of more rows": (E.PARTIAL_LAYER_SET, (msgspec.structs.replace(layers[0], count=2), *layers[1:]),
                                 None),
        "a decode accepting fewer": (E.PARTIAL_LAYER_SET, None, 0),
    }
    for case, (code, named, accepted) in cases.items():
        refused(ledger, code, case, ledger.publish, "R", txn_id="d", base=base(ledger, "R"), layers=named,
                accepted_count=accepted)
    ledger.publish("R", txn_id="d", base=base(ledger, "R"))
    ledger.begin_append("R", txn_id="v", kind="verify", base=base(ledger, "R"), start=5, token_ids=(7, 8))
    refused(ledger, E.REJECTED_SUFFIX, "a verify accepting more", ledger.publish, "R", txn_id="v",
            base=base(ledger, "R"), accepted_count=3)


def test_a_command_whose_parts_do_not_line_up_is_refused(ledger):
    b = base(ledger, "R")
    refused(ledger, E.INVALID_ARGUMENT, "an allocation of no copy tier", ledger.allocate, "T",
            make_manifest(request_id="T"), reserved_capacity=16, copy_tiers=())
    refused(ledger, E.INVALID_ARGUMENT, "a request id for one of two", ledger.fork, "R", base=b,
            child_handle_ids=["a", "b"], prefix_length=4, child_request_ids=["x"])
    refused(ledger, E.INVALID_ARGUMENT, "one base for two rows", ledger.reorder, "g", rows=["R", "S"],
            permutation=[1, 0], bases=[b])


@pytest.mark.sqlite_case("decide is pure: the states it is handed come from one journal, of any backend")
def test_what_validation_or_the_journal_never_lets_through_is_refused_by_decide(ledger):
    """Defences behind the commands' validation, decided on states as the journal holds
    them: a negative length, a chain handed to decide whole, a prefill past the prompt
    of a handle holding outputs it has not committed (no command leads there)."""
    r, b = ledger.state("R"), base(ledger, "R")
    with pytest.raises(KvLedgerError) as err:
        decide({"R": r}, c.Truncate(handle_id="R", base_generation=b[0], base_snapshot_version=b[1], new_length=-1))
    assert err.value.code is E.INVALID_ARGUMENT and "negative" in err.value.message
    with pytest.raises(KvLedgerError) as err:
        decide({"R": r}, c.Chain(handle_id="R", steps=()))
    assert err.value.code is E.INVALID_ARGUMENT and "not decided on its own" in err.value.message
    ledger.fork("R", base=b, child_handle_ids=["F"], prefix_length=0)
    f = msgspec.structs.replace(ledger.state("F"), outputs=(101,))  # committed 0, 5 tokens held
    prefill_all = c.BeginAppend(handle_id="F", txn_id="p", kind="prefill", base_generation=f.generation,
                                base_snapshot_version=f.snapshot_version, interval_start=0, interval_count=5,
                                token_ids=f.logical_tokens(0, 5), cache_positions=tuple(range(5)),
                                mask_key_extent=5, cache_abi_sha256=f.cache_abi_sha256)
    with pytest.raises(KvLedgerError) as err:
        decide({"F": f}, prefill_all)
    assert err.value.code is E.POSITION_MASK_MISMATCH and "prompt rows only" in err.value.message


def test_a_manifest_that_contradicts_itself_is_refused(ledger):
    from kvledger.schemas.manifest import ParallelShard

    m = make_manifest(request_id="M")
    cs, replace = m.cache_schema, msgspec.structs.replace
    assert cs.kv_heads_per_rank > 1  # so one more query head is no multiple of it
    cases = {
        "another schema version": (E.UNKNOWN_SCHEMA_VERSION, replace(m, schema_version=m.schema_version + 1)),
        "an empty prompt": (E.INVALID_MANIFEST, make_manifest(request_id="M", prompt=())),
        "a negative token id": (E.INVALID_MANIFEST, make_manifest(request_id="M", prompt=(1, -5))),
        "a scalar of no bytes": (E.INVALID_MANIFEST, replace(m, cache_schema=replace(
            cs, value_dtype=replace(cs.value_dtype, bytes_per_scalar=0)))),
        "query heads across kv heads": (E.INVALID_MANIFEST, replace(m, cache_schema=replace(
            cs, num_query_heads=cs.kv_heads_per_rank + 1))),
        "a rank outside its group": (E.INVALID_MANIFEST, replace(m, cache_schema=replace(
            cs, parallel_shard=ParallelShard(tp_rank=1, tp_size=1)))),
        "a negative token budget": (E.INVALID_MANIFEST, replace(m, request_policy=replace(
            m.request_policy, max_new_tokens=-1))),
        "a digest in capitals": (E.INVALID_MANIFEST, replace(m, artifact_identity=replace(
            m.artifact_identity, model_config_sha256="C" * 64))),
    }
    for case, (code, manifest) in cases.items():
        refused(ledger, code, case, ledger.allocate, "M", manifest, reserved_capacity=16)
