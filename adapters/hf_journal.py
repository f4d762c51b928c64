"""The journal side of a transformers generate(): what each forward call, crop and beam
reorder means for the handles, as kvledger commands.

The wrapper owns request identity, outputs and the lifecycle; the K/V facts (which
cache columns a sequence holds, their digests) are read from the cache after each call.
One cache batch row is one sequence. Left padding is per row: a row's handle holds the
columns from its first real token on, so lengths are the row's, never get_seq_length().

Per forward call, in one journal commit before it runs: the previous call's
publications, the tokens chosen from them (output_emit), and the append_start of every
live row (ForwardCall names the call: re-execution rebuilds the same batch). A call's
digests are taken as soon as it returns (a beam reorder moves rows right after), and
published with the next commit, when an assisted crop has also said how many drafted
rows stay.

Assisted decoding: the token chosen after a verify (the bonus or correction token) is
the first "draft" of the next verify, accepted by construction like the worker's own
speculation (worker.serving._draft), so a verify's publish commits exactly the rows
transformers keeps after its crop. The first call of assisted decoding prefills the
prompt and verifies drafts at once: its verify starts once the prefill has published
(a verify starts from ready logits), before either is visible.

Beams: the expanded rows are forks of the first as far as their prefill rows are its
bytes (a batched kernel may give batch rows other bits), the rest of each one's prompt
its own append of that call; a reorder_cache(beam_idx) becomes, before the next call,
forks where a beam is selected twice, and a reorder event over the group. Beams left
behind stay open until the end, where each returned sequence is matched to the handle
that holds its tokens, emits its last one and finishes; all are then released. A
candidate ending on EOS (seen through a stopping criterion that stops nothing) may be
returned while the search goes on: before the next reorder moves its parent on, it
becomes a fork of the parent, the handle that emits its EOS at the end.

The end: generate never runs the last token it chooses. The closing call (closing_rows,
then one decode call on a cache of those handles' rows) emits it, runs it as a decode
and publishes it before the handle finishes: a finish aborts whatever is still open,
and a repair would commit rows of a handle already finished. Without it (close_frontier
off) the last token is emitted and the handle finishes one row short.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import torch

from kvledger.adapters import hf_rows
from kvledger.engine import commands as c
from kvledger.engine.gather import take_steps
from kvledger.engine.ids import new_id
from kvledger.engine.port import CommandPort, Results
from kvledger.schemas.canonical import layers_sha256
from kvledger.schemas.decode_batch import DecodeBatch
from kvledger.schemas.errors import ErrorCode, KvLedgerError
from kvledger.schemas.events import AppendKind, FinishReason, ForwardCall, LayerRows
from kvledger.schemas.manifest import Manifest, cache_abi_sha256

log = logging.getLogger("kvledger.hf")


@dataclass
class Open:
    txn: str
    kind: AppendKind
    start: int
    tokens: tuple[int, ...]
    call: ForwardCall
    ran: bool = False  # its forward call returned
    digests: list[str] | None = None  # per layer, once the rows are final


@dataclass
class Seq:
    handle: str
    group: str  # the batch item: its first handle
    pad: int  # cache columns before the row's first token
    prompt: tuple[int, ...]
    abi: str
    committed: int = 0
    outputs: list[int] = field(default_factory=list)
    finished: str | None = None
    released: bool = False
    opens: list[Open] = field(default_factory=list)
    children: int = 0

    @property
    def logits_ready(self) -> bool:
        return self.committed == len(self.prompt) + len(self.outputs)


@dataclass
class Plan:
    """What the caller knows before generate() runs."""

    request_ids: list[str]
    prompt_width: int  # columns of input_ids as given
    expand: int  # rows per request (num_beams, or num_return_sequences when sampling)
    beams: bool
    assisted: bool
    eos: frozenset[int]
    manifest_for: Any  # (request_id, prompt) -> Manifest
    reserve_for: Any  # prompt -> reserved capacity


def _check(results: Results) -> None:
    if refused := results.refused():
        raise refused[0][1]


class Tracker:
    def __init__(self, port: CommandPort, plan: Plan, num_layers: int, *, overlap: bool = False) -> None:
        self.port, self.plan, self.num_layers = port, plan, num_layers
        # overlap: a call's starts commit (the fsync) while the call runs; nothing is
        # published before that commit is seen durable (_settle, first thing after the call)
        self.overlap = overlap
        self._wait: Any = None
        self.rows: list[Seq | None] = []
        self.seqs: dict[str, Seq] = {}
        self.cache: Any = None  # the JournaledCache, set by it
        self.started = False
        self.written: set[int] = set()
        self.reorder: list[int] | None = None
        self.call: ForwardCall | None = None
        self.unmatched: list[tuple[int, list[int]]] = []  # returned sequences no handle holds
        self._drafts: tuple[Seq, tuple[int, ...], ForwardCall] | None = None
        # after generate: the next call runs each sequence's last token as a decode, whose
        # handle finishes only once that row is published (decide aborts what a finish leaves open)
        self.closing = False
        self.closing_reasons: dict[str, FinishReason] = {}
        self.keep_rows = False  # the frontier will be closed: keep the rows of beams forked at an EOS
        self.eos_candidates: list[tuple[str, tuple[int, ...]]] = []  # (group, generated ids), last one EOS
        self.saved: dict[str, hf_rows.Layers] = {}  # handle -> its rows [H_kv, n, d_h] per layer

    # -- cache notifications ----------------------------------------------------------
    def wrote(self, layer: int) -> None:
        self.written.add(layer)

    def reordered(self, beam_idx: list[int]) -> None:
        if self.reorder is not None:  # two reorders without a call between: compose them
            beam_idx = [self.reorder[j] for j in beam_idx]
        self.reorder = beam_idx

    # -- around each forward ------------------------------------------------------------
    def before_forward(self, ids: torch.Tensor, mask: torch.Tensor | None) -> None:
        batch, width = ids.shape
        past = self.cache.get_seq_length()
        call_id = new_id()
        threads = torch.get_num_threads()

        def call(index: int) -> ForwardCall:
            return ForwardCall(call_id=call_id, index=index, size=batch, new_pad=width,
                               key_extent=past + width, threads=threads)

        self.written = set()
        if not self.started:
            self.started = True
            self._start(ids, mask, call)
            return
        cmds: list[c.Command | c.Relative] = []
        steps: dict[str, list[c.Step]] = {}
        self._flush(steps)
        if self.reorder is not None or self.eos_candidates:
            cmds += self._chains(steps)
            steps = {}
            cmds += self._eos_forks()
        if self.reorder is not None:
            cmds += self._apply_reorder(self.reorder)
            self.reorder = None
        id_rows = ids.tolist()
        for r, seq in enumerate(self.rows):
            if seq is None or seq.finished is not None:
                continue  # a finished row is carried along by transformers: no append
            tokens = tuple(id_rows[r][-width:])
            st = steps.setdefault(seq.handle, [])
            if self.plan.assisted and not self.closing:
                st.append(self._begin(seq, "verify", tokens, call(r)))
                continue
            if width != 1:
                raise KvLedgerError(ErrorCode.INVALID_ARGUMENT, f"a decode call of {width} tokens per row is not "
                                                                "a generation mode kvledger.hf journals")
            t = tokens[0]
            st.append(c.EmitOutput(handle_id=seq.handle, base_generation=None, base_snapshot_version=None,
                                   output_index=len(seq.outputs), token_id=t))
            seq.outputs.append(t)
            reason: FinishReason = "eos" if t in self.plan.eos else "max_tokens"
            if self.closing:
                self.closing_reasons[seq.handle] = reason
                st.append(self._begin(seq, "decode", tokens, call(r)))
            elif t in self.plan.eos:  # transformers still runs the row: a repair closes the frontier
                seq.finished = reason
                st.append(c.Finish(handle_id=seq.handle, base_generation=None, reason=reason))
                st.append(self._begin(seq, "repair", tokens, call(r)))
            else:
                st.append(self._begin(seq, "decode", tokens, call(r)))
        decoding = take_steps(steps, cmds)
        self._submit(decoding, cmds + self._chains(steps))

    def _submit(self, batch: DecodeBatch, cmds: list[c.Command | c.Relative]) -> None:
        self._settle()
        if self.overlap:
            self._wait = self.port.submit_batch(batch, cmds, defer=True)
        else:
            _check(self.port.submit_batch(batch, cmds, defer=False)())

    def _settle(self) -> None:
        wait, self._wait = self._wait, None
        if wait is not None:
            _check(wait())

    def after_forward(self) -> None:
        self._settle()
        if self.written != set(range(self.num_layers)):
            missing = sorted(set(range(self.num_layers)) - self.written)
            raise KvLedgerError(ErrorCode.PARTIAL_LAYER_SET, f"the forward call wrote no rows in layers {missing}")
        layers = self._layers()
        singles: list[tuple[Seq, Open]] = []
        for r, seq in enumerate(self.rows):
            if seq is None:
                continue
            for o in seq.opens:
                if o.ran:
                    continue
                o.ran = True
                if o.kind == "verify":
                    continue  # its rows are final after the crop: digested at the next flush
                if o.kind in ("decode", "repair"):  # one row each, all in the call's last column
                    singles.append((seq, o))
                else:
                    o.digests = hf_rows.span_layers(layers, r, seq.pad + o.start, len(o.tokens))
        if singles:
            column = self.cache.get_seq_length() - 1
            rows = [self.rows.index(s) for s, _ in singles]
            for (_, o), d in zip(singles, hf_rows.column_layers(layers, rows, column)):
                o.digests = d
        if self.plan.expand > 1:
            self._check_expansion(layers)
        self._drafts_after_prefill()

    # -- the first call: allocate, prefill ------------------------------------------------
    def _start(self, ids: torch.Tensor, mask: torch.Tensor | None, call: Any) -> None:
        batch, width = ids.shape
        p = self.plan
        if batch != len(p.request_ids) * p.expand:
            raise KvLedgerError(ErrorCode.INVALID_ARGUMENT, f"{batch} rows for {len(p.request_ids)} requests")
        id_rows = ids.tolist()
        mask_rows = mask.tolist() if mask is not None else None
        cmds: list[c.Command | c.Relative] = []
        self.rows = [None] * batch
        for r in range(0, batch, p.expand):
            cols = mask_rows[r][:p.prompt_width] if mask_rows is not None else [1] * p.prompt_width
            pad = cols.index(1) if 1 in cols else p.prompt_width
            if pad == p.prompt_width or any(v != 1 for v in cols[pad:]):
                raise KvLedgerError(ErrorCode.INVALID_ARGUMENT, f"row {r}: the attention mask is not left padding "
                                                                "followed by the prompt")
            prompt = tuple(id_rows[r][pad:p.prompt_width])
            rid = p.request_ids[r // p.expand]
            m: Manifest = p.manifest_for(rid, prompt)
            seq = Seq(rid, rid, pad, prompt, cache_abi_sha256(m))
            self.rows[r] = self.seqs[rid] = seq
            cmds.append(c.Allocate(handle_id=rid, manifest=m, reserved_capacity=p.reserve_for(prompt)))
            cmds.append(c.Relative(self._begin(seq, "prefill", prompt, call(r))))
            if width > p.prompt_width:  # assisted: drafts ride along, verified once the prefill publishes
                self._drafts = (seq, tuple(id_rows[r][p.prompt_width:]), call(r))
        _check(self.port.execute_many(cmds))

    def _drafts_after_prefill(self) -> None:
        if self._drafts is None:
            return
        seq, drafts, call = self._drafts
        self._drafts = None
        steps: dict[str, list[c.Step]] = {}
        self._publish(seq, seq.opens[0], steps)
        st = steps[seq.handle]
        begin = self._begin(seq, "verify", drafts, call)
        seq.opens[-1].ran = True
        st.append(begin)
        _check(self.port.execute_many(self._chains(steps)))

    def _check_expansion(self, layers: hf_rows.Layers) -> None:
        """Beams 1..n-1 computed beam 0's prompt in its call, each in bits of its own batch row:
        a fork of beam 0 as far as those are beam 0's bytes, the rest its own append of that
        call and row (a chunk, or a prefill if its first row differs), digested as it holds it."""
        p = self.plan
        if not any(s is None for s in self.rows):
            return
        steps: dict[str, list[c.Step]] = {}
        forks: list[c.Command | c.Relative] = []
        own: dict[str, list[c.Step]] = {}
        for r in range(0, len(self.rows), p.expand):
            root = self.rows[r]
            assert root is not None
            prefill, n = root.opens[0], len(root.prompt)
            self._publish(root, prefill, steps)
            for k in range(1, p.expand):
                self.rows[r + k] = child = self._child(root)
                at = child.committed = hf_rows.same_columns(layers, r, r + k, root.pad, n)
                forks.append(self._fork(root, child, at))
                if at < n:
                    own[child.handle] = [self._begin(child, "chunk" if at else "prefill", root.prompt[at:],
                                                     msgspec.structs.replace(prefill.call, index=r + k))]
                    rest = child.opens[-1]
                    rest.ran, rest.digests = True, hf_rows.span_layers(layers, r + k, root.pad + at, n - at)
                    self._publish(child, rest, own)
        _check(self.port.execute_many([*self._chains(steps), *forks, *self._chains(own)]))

    # -- publications ----------------------------------------------------------------------
    def _flush(self, steps: dict[str, list[c.Step]]) -> None:
        """Publish every append whose call returned; a verify keeps the rows the crop left."""
        length = self.cache.get_seq_length()
        layers = None
        for r, seq in enumerate(self.rows):
            if seq is None:
                continue
            for o in list(seq.opens):
                if not o.ran:
                    continue
                if o.kind == "verify" and o.digests is None:
                    kept = max(0, min(len(o.tokens), length - seq.pad - o.start))
                    layers = layers or self._layers()
                    o.digests = hf_rows.span_layers(layers, r, seq.pad + o.start, kept)
                    self._publish(seq, o, steps, accepted=kept)
                else:
                    self._publish(seq, o, steps)

    def _publish(self, seq: Seq, o: Open, steps: dict[str, list[c.Step]], accepted: int | None = None) -> None:
        assert o.digests is not None, f"{seq.handle}: {o.kind} rows not digested"
        n = len(o.tokens) if accepted is None else accepted
        if o.kind == "verify":  # each layer named: the service checks the accepted rows per layer
            publish = c.Publish(handle_id=seq.handle, txn_id=o.txn, base_generation=None, base_snapshot_version=None,
                                layers=tuple(LayerRows(layer=i, start=o.start, count=n, k_complete=True,
                                                       v_complete=True, rows_sha256=d)
                                             for i, d in enumerate(o.digests)),
                                accepted_count=accepted)
        else:
            # The combined digest, as the worker sends it (after_forward saw every layer write):
            # the same bytes stored, and a decode step goes in a DecodeBatch, not a record per layer.
            publish = c.Publish(handle_id=seq.handle, txn_id=o.txn, base_generation=None, base_snapshot_version=None,
                                rows_sha256=layers_sha256(o.digests))
        steps.setdefault(seq.handle, []).append(publish)
        seq.opens.remove(o)
        seq.committed = o.start + n
        if o.kind == "verify":
            seq.outputs.extend(o.tokens[:n])

    def _begin(self, seq: Seq, kind: AppendKind, tokens: tuple[int, ...], call: ForwardCall) -> c.BeginAppend:
        start = seq.committed + sum(len(o.tokens) for o in seq.opens)
        o = Open(new_id(), kind, start, tokens, call)
        seq.opens.append(o)
        n = len(tokens)
        return c.BeginAppend(handle_id=seq.handle, txn_id=o.txn, kind=kind, base_generation=None,
                             base_snapshot_version=None, interval_start=start, interval_count=n, token_ids=tokens,
                             cache_positions=tuple(range(start, start + n)), mask_key_extent=start + n,
                             cache_abi_sha256=seq.abi, call=call)

    @staticmethod
    def _chains(steps: dict[str, list[c.Step]]) -> list[c.Command | c.Relative]:
        out: list[c.Command | c.Relative] = []
        for h, st in steps.items():
            if len(st) == 1:
                out.append(c.Relative(st[0]))
            elif st:
                out.append(c.Relative(c.Chain(handle_id=h, steps=tuple(st))))
        return out

    def _layers(self) -> hf_rows.Layers:
        return hf_rows.of_cache(self.cache)

    # -- beams ---------------------------------------------------------------------------
    def _child(self, parent: Seq) -> Seq:
        root = self.seqs[parent.group]
        root.children += 1
        child = Seq(f"{parent.group}.b{root.children}", parent.group, parent.pad, parent.prompt, parent.abi,
                    committed=parent.committed, outputs=list(parent.outputs))
        self.seqs[child.handle] = child
        return child

    @staticmethod
    def _fork(parent: Seq, child: Seq, prefix: int | None = None) -> c.Relative:
        """A fork at `prefix`, or at all the rows the parent has committed when it runs."""
        return c.Relative(c.Fork(parent_handle_id=parent.handle, base_generation=0, base_snapshot_version=0,
                                 child_handle_ids=(child.handle,), prefix_length=prefix,
                                 child_request_ids=(child.handle,)))

    def _apply_reorder(self, beam_idx: list[int]) -> list[c.Command | c.Relative]:
        """New row i takes old row beam_idx[i]: the first row to take an old row moves its
        handle there, any other is a fork of it; an old row nobody takes is left behind."""
        cmds: list[c.Command | c.Relative] = []
        old = self.rows
        new: list[Seq | None] = [None] * len(beam_idx)
        taken: set[int] = set()
        for i, j in enumerate(beam_idx):
            src = old[j]
            if src is None:
                continue
            if j not in taken:
                taken.add(j)
                new[i] = src
            else:
                new[i] = child = self._child(src)
                cmds.append(self._fork(src, child))
        n = self.plan.expand
        for g in range(0, len(new), n):
            members = [s for s in new[g:g + n] if s is not None]
            if len(members) < 2:
                continue
            order = {id(s): k for k, s in enumerate(old[g:g + n]) if s is not None}
            before = sorted(members, key=lambda s: (order.get(id(s), n), s.handle))
            perm = [before.index(s) for s in members]
            if perm != list(range(len(members))):
                cmds.append(c.Relative(c.Reorder(group_id=members[0].group, rows=tuple(s.handle for s in before),
                                                 bases=(), permutation=tuple(perm))))
        self.rows = new
        return cmds

    def _described_layers(self) -> hf_rows.Layers:
        """The cache's rows as self.rows describes them: before a reorder that no call has
        read yet (beam search reorders after its last call)."""
        return self.cache.before_reorder or hf_rows.of_cache(self.cache)

    def candidates(self, sequences: torch.Tensor) -> None:
        """One step of beam search's scored continuations, best first per request. Any
        of the best num_beams that ends on EOS may be returned, while the search goes on
        and the next reorder moves its parent's rows on or away: it becomes a fork of its
        parent before that (_eos_forks), a handle that can still emit it."""
        p = self.plan
        per = sequences.shape[0] // len(p.request_ids)
        self.eos_candidates = [(p.request_ids[i // per], tuple(row[p.prompt_width:]))
                               for i, row in enumerate(sequences.tolist()) if i % per < p.expand and row[-1] in p.eos]

    def _eos_forks(self) -> list[c.Command | c.Relative]:
        """A fork per EOS candidate of the last call, off the handle it continues (whose
        logits chose it), with a copy of that handle's rows if the frontier is to be closed."""
        found, self.eos_candidates = self.eos_candidates, []
        layers = self._described_layers()
        forks: list[c.Command | c.Relative] = []
        for group, gen in found:
            r, parent = next(((r, s) for r, s in enumerate(self.rows) if s is not None and s.group == group
                              and s.logits_ready and s.finished is None and tuple(s.outputs) == gen[:-1]),
                             (-1, None))
            if parent is None:
                log.warning("EOS candidate continues no handle (group %s, %d tokens)", group, len(gen))
                continue
            child = self._child(parent)
            forks.append(self._fork(parent, child))
            if self.keep_rows:
                self.saved[child.handle] = [(k.clone(), v.clone()) for k, v in _rows_of(layers, parent, r)]
        return forks

    # -- the end -------------------------------------------------------------------------
    def closing_rows(self, sequences: list[list[int]]) -> list[tuple[Seq, int, hf_rows.Layers]]:
        """Each returned sequence's handle, its last token and the handle's rows per layer
        [H_kv, n, d_h], from the cache as the last call left it. The last call's appends
        are published first: a verify's publish says which rows its crop kept."""
        self._settle()
        layers = self._described_layers()
        steps: dict[str, list[c.Step]] = {}
        self._flush(steps)
        _check(self.port.execute_many(self._chains(steps)))
        self.closing = True
        self.reorder = None  # generate's reorder after its last call moved rows no call reads
        self.eos_candidates = []  # of the last call: their parents are still in self.rows

        if not self.plan.beams:
            return [(seq, sequences[r][-1], _rows_of(layers, seq, r)) for r, seq in enumerate(self.rows)
                    if seq is not None and seq.finished is None]
        row_of = {id(s): r for r, s in enumerate(self.rows) if s is not None}
        ends, forks = self._match_beams(sequences, held=lambda s: id(s) in row_of or s.handle in self.saved)
        gone = [f"returned sequence {i}" for i, gen in self.unmatched if gen] + \
               [f"the sequence {seq.handle} returns" for seq, _, src in ends
                if id(src) not in row_of and src.handle not in self.saved]
        if gone:  # a beam that finished before the search did: its parent's rows were reordered away
            for seq, _, src in ends:
                if seq is not src:  # a fork not journaled: nothing for abort to cancel
                    del self.seqs[seq.handle]
            raise KvLedgerError(ErrorCode.FRONTIER_MISMATCH, f"{gone[0]} ended before the beam search did: the "
                                                             "rows its last token was chosen from left the cache, "
                                                             "so that token cannot run (close_frontier=False "
                                                             "does not run it)")
        if forks:
            _check(self.port.execute_many(forks))
        return [(seq, token, self.saved[src.handle] if src.handle in self.saved
                 else _rows_of(layers, src, row_of[id(src)])) for seq, token, src in ends]

    def finish(self, sequences: torch.Tensor) -> None:
        self._settle()
        steps: dict[str, list[c.Step]] = {}
        self._flush(steps)
        for handle, reason in self.closing_reasons.items():  # after its closing decode's publish
            self.seqs[handle].finished = reason
            steps.setdefault(handle, []).append(c.Finish(handle_id=handle, base_generation=None, reason=reason))
        _check(self.port.execute_many(self._chains(steps)))
        steps = {}
        seqs = sequences.tolist()
        p = self.plan
        if self.closing:
            pass  # each last token was emitted and run by the closing call
        elif p.beams:
            ends, forks = self._match_beams(seqs)
            if forks:
                _check(self.port.execute_many(forks))
            for holder, token, _ in ends:
                self._last(holder, token, steps)
        else:
            for r, seq in enumerate(self.rows):
                if seq is None or seq.finished is not None:
                    continue
                self._last(seq, seqs[r][-1], steps)
        cmds = self._chains(steps)
        steps = {}
        for seq in self.seqs.values():
            st = steps.setdefault(seq.handle, [])
            if seq.finished is None:
                seq.finished = "stop"
                st.append(c.Finish(handle_id=seq.handle, base_generation=None, reason="stop"))
            st.append(c.Release(handle_id=seq.handle, base_generation=None))
            seq.released = True
        _check(self.port.execute_many([*cmds, *self._chains(steps)]))
        self.saved = {}

    def _last(self, seq: Seq, token: int, steps: dict[str, list[c.Step]]) -> None:
        """The token chosen from the last call's logits, never run through the model."""
        st = steps.setdefault(seq.handle, [])
        st.append(c.EmitOutput(handle_id=seq.handle, base_generation=None, base_snapshot_version=None,
                               output_index=len(seq.outputs), token_id=token))
        seq.outputs.append(token)
        reason: FinishReason = "eos" if token in self.plan.eos else "max_tokens"
        seq.finished = reason
        st.append(c.Finish(handle_id=seq.handle, base_generation=None, reason=reason))

    def _match_beams(self, seqs: list[list[int]], held: Callable[[Seq], bool] = lambda s: True
                     ) -> tuple[list[tuple[Seq, int, Seq]], list[c.Command | c.Relative]]:
        """Each returned sequence ends at the handle whose outputs are all its tokens but
        the last (chosen from that handle's published logits), one whose rows are `held`
        if any is; two ending at the same handle: the second is a fork of it, taken before
        either emits. Per sequence: the handle it ends on, its last token and the handle
        holding the rows."""
        p = self.plan
        per = len(seqs) // len(p.request_ids)
        ends: list[tuple[Seq, int, Seq]] = []
        forks: list[c.Command | c.Relative] = []
        used: set[str] = set()
        for i, row in enumerate(seqs):
            group = p.request_ids[i // per]
            gen = row[p.prompt_width:]
            gen = gen[:next((k + 1 for k, t in enumerate(gen) if t in p.eos), len(gen))]
            holders = [s for s in self.seqs.values() if s.group == group and s.logits_ready
                       and s.finished is None and s.outputs == gen[:-1]]
            holder = next((s for s in holders if held(s)), holders[0] if holders else None)
            if holder is None or not gen:
                self.unmatched.append((i, gen))
                log.warning("returned beam held by no handle (group %s, index %d)", group, i)
                continue
            source = holder
            if holder.handle in used:
                child = self._child(holder)
                forks.append(self._fork(holder, child))
                holder = child
            used.add(holder.handle)
            ends.append((holder, gen[-1], source))
        return ends, forks

    def abort(self, exc: BaseException) -> None:
        """The generation raised: every open append fails, every handle is cancelled and
        released. Journal errors here are logged, never raised over `exc`."""
        detail = f"{type(exc).__name__}: {exc}"[:200]
        try:
            self._settle()
        except KvLedgerError as journal_exc:  # the starts it refused are not open: their failures are refused too
            log.error("journal refused the starts of the failed call: %s", journal_exc)
        cmds: list[c.Command | c.Relative] = []
        for seq in self.seqs.values():
            for o in seq.opens:
                cmds.append(c.Fail(handle_id=seq.handle, txn_id=o.txn, outcome="failed", code="FORWARD_FAILED",
                                   detail=detail))
            seq.opens = []
            if seq.finished is None:
                cmds.append(c.Relative(c.CancelRequest(handle_id=seq.handle, base_generation=0,
                                                       reason="generate raised")))
            cmds.append(c.Relative(c.Release(handle_id=seq.handle, base_generation=None)))
        if not cmds:
            return
        try:
            results = self.port.execute_many(cmds)
        except Exception as journal_exc:  # noqa: BLE001 - the generation's own exception is the one raised
            log.error("journal refused the failure events: %s", journal_exc)
            return
        for r in results:
            if isinstance(r, KvLedgerError):
                log.error("journal refused a failure event: %s", r)


def _rows_of(layers: hf_rows.Layers, seq: Seq, r: int) -> hf_rows.Layers:
    """Batch row r's rows of `seq` per layer, [H_kv, committed, d_h]: after its left padding."""
    lo, hi = seq.pad, seq.pad + seq.committed
    return [(k[r, :, lo:hi], v[r, :, lo:hi]) for k, v in layers]
