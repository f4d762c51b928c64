"""Reading decode steps back: a record's format 7 blocks (journal.blocks) as StepValues, and
a run of them as a StepRun whose columns a projector folds at once. Format 6's rows are
read by journal.legacy.RowReader, which adds them to this reader.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import TYPE_CHECKING, Self

from kvledger.journal.step_rows import Step, decode_context
from kvledger.journal.step_values import _HALF, _MASK, Call, StepColumns, StepRun, StepValues
from kvledger.schemas import events as ev
from kvledger.schemas.decode_fingerprint import decode_chain_fingerprint
from kvledger.schemas.receipts import HandleResult, Receipt, receipt_encoder

if TYPE_CHECKING:
    import numpy as np  # imported where a run is read: the API's import loads no numpy

_RUNNING = (21, 27, 28)  # a block's columns a fold reads as running sums: mono, publish and start txn


class StepReader:
    """Rebuilds a record's rows in order (each row's differences are from the one before)."""

    def __init__(self, context: bytes) -> None:
        self.context = decode_context(context)  # raises msgspec's errors: the caller names the damage
        self._abis: list[str] = []  # the streams' cache ABIs in hex, made when a row's values are
        self._last = (0, 0, 0, 0, 0, 0, 0)

    def _values(self, x: Step, at: int) -> StepValues:
        ctx, last, prefixes = self.context, self._last, self.context.prefixes
        stream_id, request_id, generation, source, _ = ctx.streams[x.stream]
        abis = self._abis or self._hex_abis()
        seq = (last[0] + 3 + x.sequence) & _MASK
        mono = (last[1] + x.mono) & _MASK
        wall = (last[2] + x.mono + x.wall) & _MASK
        op = (last[3] + x.op) & _MASK
        ptxn, stxn = (last[4] + x.publish_txn[1]) & _MASK, (last[5] + x.start_txn[1]) & _MASK
        ccount = last[6]
        call = x.call
        if call is not None:
            ccount = (ccount + call.counter) & _MASK
        self._last = (seq, mono, wall, op, ptxn, stxn, ccount)
        return StepValues(
            ctx.first_position + at, stream_id, request_id, generation, source, abis[x.stream], x.position,
            seq, mono, wall, prefixes[x.prefix], op, x.gaps, f"{prefixes[x.publish_txn[0]]}{ptxn:016x}",
            f"{prefixes[x.start_txn[0]]}{stxn:016x}", x.snapshot, x.committed, x.accepted, x.layers, x.workspace,
            x.digest, x.output, x.token, None if call is None else (prefixes[call.prefix], ccount, call))

    def _hex_abis(self) -> list[str]:
        self._abis = [s[4].hex() for s in self.context.streams]
        return self._abis

    def receipt(self, events: tuple[ev.AppendPublishEvent, ev.OutputEmitEvent, ev.AppendStartEvent]) -> bytes:
        """The JSON receipt of a step's operation, as the writer returned it."""
        p, o, s = events
        return receipt_encoder.encode(Receipt(
            p.operation_id or "", decode_chain_fingerprint(p, o, s),
            (HandleResult(p.stream_id, p.handle_generation, p.payload.result_snapshot_version, s.stream_position,
                          p.payload.committed_length),),
            (p.event_id, o.event_id, s.event_id), p.global_position, s.global_position,
            self.context.committed_wall_ns))

    def _at(self, last: tuple[int, int, int, int, int, int, int]) -> Self:
        """A reader of the same record whose rows continue from `last` (a run's values
        read later, on request)."""
        again = type(self).__new__(type(self))
        again.context, again._abis, again._last = self.context, self._abis, last
        return again

    def block(self, item: bytes, at: int, columns: bool = True) -> StepRun:
        """A format 7 block (journal.blocks) whose first step is the record's event `at`:
        with `columns`, their columns for a fold and their values on request; otherwise
        their values now. Raises BadRow for a block that does not parse (its first
        step) or the first step whose values no Step could hold."""
        from kvledger.journal import blocks

        try:
            m, digests = blocks.read_many([item])
        except ValueError as exc:
            raise BadRow(0, [], exc) from None
        run = block_runs([self], m, digests, [at], columns)[0]
        if run is None:
            ctx = self.context
            bad = blocks.invalid(m[0], digests[0], len(ctx.streams), len(ctx.prefixes))
            assert bad is not None  # block_runs refuses only such a block
            raise BadRow(bad, self._block_values(m[0], digests[0], at, bad),
                         ValueError(f"step {bad} of its block holds a value out of its range")) from None
        return run

    def damaged_block(self, item: bytes, at: int) -> tuple[list[StepValues], int]:
        """A block whose CRC fails: the step to name (the first whose CRC fails, or one
        before it whose values no Step could hold) and the values of the steps before it."""
        from kvledger.journal import blocks

        k = blocks.damaged(item)
        if k == 0:
            return [], 0
        m, digests = blocks.read(item)
        bad = blocks.invalid(m[:, :k], digests[:32 * k], len(self.context.streams), len(self.context.prefixes))
        k = k if bad is None else bad
        return self._block_values(m, digests, at, k), k

    def _block_values(self, m: np.ndarray, digests: bytes, at: int, count: int) -> list[StepValues]:
        """The StepValues of a block's first `count` steps (`m` as blocks.read gives it)."""
        out = []
        for i, v in enumerate(m[:, :count].T.tolist()):
            x = Step(v[0], v[5], v[20], v[21], v[22], v[1], v[23], (v[24], v[25], v[26]), (v[2], v[27]),
                     (v[3], v[28]), v[6], v[7], v[8], v[9], v[10], digests[32 * i:32 * i + 32] if v[18] else None,
                     v[11], v[12], Call(v[4], v[29], v[13], v[15], v[16], v[17], v[14]) if v[19] else None)
            out.append(self._values(x, at + 3 * i))
        return out


def block_runs(readers: Sequence[StepReader], m: np.ndarray, digests: Sequence[bytes], at: Sequence[int],
               columns: bool) -> list[StepRun | None]:
    """The runs of blocks of one shape (journal.blocks.read_many's values and digests),
    block r read by readers[r] from its record's event at[r] as StepReader.block reads one,
    in array calls over all the blocks at once: a decode loop's records hold one block
    each, and a record at a time paid every array call once a record. None for a block
    holding a value no Step could (StepReader.block names the step)."""
    import numpy as np

    from kvledger.journal import blocks

    n = m.shape[2]
    lo, hi = m.min(axis=2).tolist(), m.max(axis=2).tolist()
    sums = m[:, 20:30].view(np.uint64).sum(axis=2).tolist()  # uint64 sums wrap as the masks do
    finals = m[:, :, -1].tolist()
    if columns:
        # the clocks and txn counters: running sums from where each reader's last run ended
        running = m[:, _RUNNING].view(np.uint64)
        running[:, :, 0] += np.array([(r._last[1], r._last[4], r._last[5]) for r in readers], np.uint64)
        running.cumsum(axis=2, out=running)
        tops = running[:, 0].max(axis=1).tolist()
    out: list[StepRun | None] = []
    for k, reader in enumerate(readers):
        ctx, last, steps, d = reader.context, reader._last, m[k], digests[k]
        if blocks.invalid(steps, d, len(ctx.streams), len(ctx.prefixes), (lo[k], hi[k])) is not None:
            out.append(None)
            continue
        s, final = sums[k], finals[k]
        op = (last[3] + s[3]) & _MASK
        event_id = f"{ctx.prefixes[final[1]]}{(op + final[24] + final[25] + final[26]) & _MASK:016x}"
        values = partial(reader._at(last)._block_values, steps, d, at[k], n)
        cols = None
        if columns and tops[k] < _HALF:  # else a clock a fold cannot hold in int64: no columns
            mono, ptxn, stxn = running[k]
            cols = StepColumns(steps[0], steps[5], mono.view(np.int64), steps[6], steps[7], steps[10], steps[12],
                               steps[2], ptxn, steps[3], stxn, ctx.streams, ctx.prefixes)
        reader._last = ((last[0] + 3 * n + s[0]) & _MASK, (last[1] + s[1]) & _MASK, (last[2] + s[1] + s[2]) & _MASK,
                        op, (last[4] + s[7]) & _MASK, (last[5] + s[8]) & _MASK, (last[6] + s[9]) & _MASK)
        out.append(StepRun(ctx.first_position + at[k], n, cols, event_id, values if cols is not None else values()))
    return out


class BadRow(Exception):
    """Row `offset` of a run does not rebuild (`error`); `values` are the rows before it."""

    def __init__(self, offset: int, values: list[StepValues], error: Exception) -> None:
        super().__init__(str(error))
        self.offset, self.values, self.error = offset, values, error

