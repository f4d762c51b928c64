"""A producer's iteration as one DecodeBatch plus its other commands.

The worker and the HF adapter build each sequence's commands of an iteration as a chain
(publish, then what follows on the handle). The decode steps among them, on handles
no other command of the iteration acts on, go to the service as one DecodeBatch
(`submit_split`); the rest as commands, in the same commit.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvledger.engine import commands as c
from kvledger.engine.port import CommandPort, Results
from kvledger.schemas.decode_batch import BatchBuilder, DecodeBatch


def decode_shape(steps: Sequence[c.Command]) -> tuple[c.Publish, c.EmitOutput, c.BeginAppend] | None:
    """The steps when they are a decode step as commands.batch_chain builds one (up to
    the publication's base): publish (no layers named, not a verify's), emit a token,
    start one row that processes that token, all on one handle, no step with an
    operation id or a base of its own after the first; else None."""
    if len(steps) != 3:
        return None
    publish, emit, start = steps
    if type(publish) is not c.Publish or type(emit) is not c.EmitOutput or type(start) is not c.BeginAppend:
        return None
    at = start.interval_start
    if (publish.layers is not None or publish.accepted_count is not None or start.kind != "decode"
            or start.interval_count != 1 or start.token_ids != (emit.token_id,) or start.cache_positions != (at,)
            or start.mask_key_extent != at + 1 or not publish.handle_id == emit.handle_id == start.handle_id
            or publish.operation_id is not None or emit.operation_id is not None or start.operation_id is not None
            or emit.base_generation is not None or emit.base_snapshot_version is not None
            or start.base_generation is not None or start.base_snapshot_version is not None):
        return None
    return publish, emit, start


def add_step(batch: BatchBuilder, steps: Sequence[c.Command]) -> bool:
    """Add `steps` to `batch` if they are a decode step (decode_shape), as a step whose
    chain (commands.batch_chain) is exactly theirs; else False."""
    shape = decode_shape(steps)
    if shape is None:
        return False
    publish, emit, start = shape
    i = batch.add(publish.handle_id, publish.txn_id, start.interval_start, emit.output_index, emit.token_id,
                  start.txn_id, publish.rows_sha256, start.cache_abi_sha256)
    if publish.workspace_bytes or start.call is not None:
        batch.detail(i, workspace_bytes=publish.workspace_bytes, call=start.call)
    return True


def take_steps(steps: dict[str, list[c.Step]], cmds: Sequence[c.Command | c.Relative]) -> DecodeBatch:
    """Of each handle's steps (what a producer would send as its chain), the decode steps
    (decode_shape) on handles no command of `cmds` acts on, as one DecodeBatch, taken
    out of `steps`: no chain is built for them."""
    others = {h for cmd in cmds for h in c.handles_of(cmd)}
    batch = BatchBuilder()
    for h in [h for h, st in steps.items() if h not in others and add_step(batch, st)]:
        del steps[h]
    return batch.build()


def split_steps(cmds: Sequence[c.Command | c.Relative]) -> tuple[DecodeBatch, list[int]] | None:
    """The Relative decode chains of `cmds` on handles no other command acts on, as one
    DecodeBatch in their order (`c.batch_step(batch, j) == cmds[at[j]]`), with their
    places `at`; None if there are none."""
    others: set[str] = set()  # handles a command other than such a chain acts on
    found: list[tuple[int, c.Chain]] = []
    for i, cmd in enumerate(cmds):
        inner = cmd.command if isinstance(cmd, c.Relative) else cmd
        if (type(cmd) is c.Relative and type(inner) is c.Chain and inner.operation_id is None
                and inner.steps and inner.steps[0].handle_id == inner.handle_id and decode_shape(inner.steps)):
            found.append((i, inner))
        else:
            others.update(c.handles_of(inner))
    batch, at = BatchBuilder(), []
    for i, chain in found:
        if chain.handle_id not in others:
            add_step(batch, chain.steps)
            at.append(i)
    return (batch.build(), at) if at else None


def submit_split(port: CommandPort, cmds: Sequence[c.Command | c.Relative], *,
                 defer: bool = True) -> Callable[[], Results]:
    """`cmds` in one commit: its plain decode steps as one DecodeBatch (split_steps),
    the rest as commands (port.submit_batch); the results come back in the order of
    `cmds`."""
    split = split_steps(cmds)
    if split is None:
        return port.submit_many(cmds, defer=defer)
    steps, at = split
    taken = set(at)
    order = at + [i for i in range(len(cmds)) if i not in taken]
    wait = port.submit_batch(steps, [cmds[i] for i in order[len(at):]], defer=defer)

    def results() -> Results:
        got = wait()
        out = list(got)
        for j, i in enumerate(order):
            out[i] = got[j]
        return Results(out)

    return results
