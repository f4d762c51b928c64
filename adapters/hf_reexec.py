"""The re-execution proof with transformers as the executor: run every journaled append
of an HF journal again through the same model and compare every publication's row digest.

Each append_start names its forward call (ForwardCall: batch size, query width, key
extent, CPU threads), so a call is rebuilt with the shape it ran with: every member's
committed rows right-aligned in a DynamicCache (transformers left-pads), its tokens
right-aligned in the call's columns, the 2D attention mask transformers had (none when
nothing is padded), positions from the mask. A batch row no append names (a row that
finished, a beam expanded from another) runs as a placeholder of the same shape. On the
same model, device and dtype the rows come out bit for bit, so a digest that differs
names an append whose recorded rows are not what this model computes.

A row's columns in its call hold its rows up to the append's end, right-aligned: those
before the call's new columns come from its cache, the others run in the call. Rows of the
handle's own that run again (a beam forked off the first part way into the prompt that one
call computed for both, then appending the rest) are run from the tokens the handle starts
with, and must come out as the rows it holds: if not, its publication is a mismatch.

A request the model cannot run at all is set aside, never run into a shape error: rows of
another cache geometry (layers, KV heads, head dims) or token ids outside the model's
vocabulary (another artifact: ARTIFACT_MISMATCH), or a call whose recorded shape does not
hold its members or is beyond any real batch (a malformed journal: MALFORMED_EVENT).
Every request sharing a call with one set aside is set aside too: the call cannot be
rebuilt without it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from transformers.cache_utils import DynamicCache

from kvledger.adapters import hf_identity, hf_rows
from kvledger.schemas import events as ev
from kvledger.schemas.canonical import layers_sha256
from kvledger.worker.reexec import Mismatch


@dataclass
class HfReexecution:
    verified_rows: int = 0
    verified_appends: int = 0
    mismatches: list[Mismatch] = field(default_factory=list)
    skipped: set[str] = field(default_factory=set)  # handles with an append that names no call
    artifacts: set[str] = field(default_factory=set)  # model_artifact_sha256 of the journal's requests
    unrunnable: dict[str, tuple[str, str]] = field(default_factory=dict)  # handle -> (code, why), not re-executed


# Bounds on a rebuilt call, past any real batch: a journal's recorded shape must not
# size an allocation (its ids and mask are size x key_extent) nor spawn threads.
MAX_CALL_ROWS = 4096
MAX_CALL_CELLS = 1 << 26
MAX_THREADS = 1024


def reexecute_hf(model: Any, events: Iterable[ev.Event]) -> HfReexecution:
    threads = torch.get_num_threads()
    try:
        with torch.inference_mode():
            return _reexecute(model, events)
    finally:
        torch.set_num_threads(threads)


@dataclass
class _Padding:
    """Whether transformers passed a 2D mask: it drops an all-ones one when generate
    starts, so every call of a generation whose prompts were padded has one, even once
    the padded rows have finished and only placeholders stand for them."""

    origin: dict[str, str] = field(default_factory=dict)  # handle -> the call that prefilled it
    padded: dict[str, bool] = field(default_factory=dict)  # prefill call -> any row padded
    # (prefill call, batch row) -> its left padding: a row that finished keeps its mask
    # in generate's later calls, where only a placeholder stands for it
    row_pad: dict[tuple[str, int], int] = field(default_factory=dict)


@dataclass
class _Rows:
    k: Tensor  # [L, H_kv, T, d_h]: committed rows
    v: Tensor


@dataclass
class _Staged:
    """A call's rows of one handle, before publication: positions [at, at + T)."""

    k: Tensor  # [L, H_kv, T, d_h]
    v: Tensor
    at: int


@dataclass
class _Model:
    """What a request's rows must match to be recomputed by this model."""

    geometry: tuple[int, int, int]  # cache layers, KV heads, head dim
    vocab: int

    @classmethod
    def of(cls, model: Any) -> _Model:
        cs = hf_identity.cache_schema(model)
        return cls((cs.num_cache_layers, cs.kv_heads_per_rank, cs.head_dim),
                   int(model.get_input_embeddings().num_embeddings))

    def refuses(self, cs: Any, tokens: Iterable[int]) -> str | None:
        geometry = (cs.num_cache_layers, cs.kv_heads_per_rank, cs.head_dim)
        if geometry != self.geometry:
            return ("rows of {} layers x {} KV heads x {} dims; the model's are {} x {} x {}"
                    .format(*geometry, *self.geometry))
        return self.outside(tokens)

    def outside(self, tokens: Iterable[int]) -> str | None:
        top = max(tokens, default=-1)
        return f"token id {top} is outside the model's vocabulary of {self.vocab}" if top >= self.vocab else None


def _reexecute(model: Any, events: Iterable[ev.Event]) -> HfReexecution:
    events = list(events)
    state = _Reexecution(model, _Model.of(model))
    state.know_calls(events)
    for e in events:
        if isinstance(e, ev.RequestAllocateEvent):
            state.allocate(e)
        elif isinstance(e, ev.ForkEvent):
            state.fork(e)
        elif isinstance(e, ev.AppendStartEvent):
            state.starts[(e.stream_id, e.payload.txn_id)] = e
            if e.payload.call is None:
                state.out.skipped.add(e.stream_id)
        elif isinstance(e, (ev.AppendPublishEvent, ev.FailureEvent)):
            state.end(e)
        elif isinstance(e, ev.TruncateEvent):
            r = state.store.get(e.stream_id)
            if r is not None:
                r.k, r.v = r.k[:, :, :e.payload.new_length], r.v[:, :, :e.payload.new_length]
        elif isinstance(e, ev.ReleaseEvent):
            state.store.pop(e.stream_id, None)
            state.staged.pop(e.stream_id, None)
    return state.out


@dataclass
class _Reexecution:
    """The proof's state as it reads the journal: each handle's committed rows, the rows
    its last call staged, the calls' members and which of them ran."""

    model: Any
    ours: _Model
    out: HfReexecution = field(default_factory=HfReexecution)
    store: dict[str, _Rows] = field(default_factory=dict)
    staged: dict[str, _Staged] = field(default_factory=dict)
    tokens: dict[str, tuple[int, ...]] = field(default_factory=dict)  # handle -> its prompt, or its fork's
    starts: dict[tuple[str, str], ev.AppendStartEvent] = field(default_factory=dict)
    calls: dict[str, list[ev.AppendStartEvent]] = field(default_factory=dict)
    ran: set[str] = field(default_factory=set)
    padding: _Padding = field(default_factory=_Padding)

    def know_calls(self, events: list[ev.Event]) -> None:
        """A call's members, known before it runs: the verify half of an assisted prefill call
        starts only once the prefill published, after the point where the call is rebuilt.
        A beam forked off another after a call both ran in: its tokens, before its fork."""
        for e in events:
            if isinstance(e, ev.AppendStartEvent) and e.payload.call is not None:
                self.calls.setdefault(e.payload.call.call_id, []).append(e)
            elif isinstance(e, ev.RequestAllocateEvent):
                self.tokens[e.stream_id] = e.payload.manifest.input_identity.prompt_token_ids
            elif isinstance(e, ev.ForkEvent):
                self.tokens[e.stream_id] = e.payload.token_ids

    def allocate(self, e: ev.RequestAllocateEvent) -> None:
        m = e.payload.manifest
        self.out.artifacts.add(m.artifact_identity.model_artifact_sha256)
        why = self.ours.refuses(m.cache_schema, m.input_identity.prompt_token_ids)
        if why is not None:
            self.out.unrunnable[e.stream_id] = ("ARTIFACT_MISMATCH", why)
            return
        param = next(self.model.parameters())
        empty = torch.zeros((*self.ours.geometry[:2], 0, self.ours.geometry[2]), dtype=param.dtype,
                            device=param.device)
        self.store[e.stream_id] = _Rows(empty, empty.clone())

    def fork(self, e: ev.ForkEvent) -> None:
        h, src = e.stream_id, e.payload.parent_handle_id
        parent, n = self.store.get(src), e.payload.prefix_length
        if parent is None:
            self.out.unrunnable[h] = self.out.unrunnable.get(src, ("MALFORMED_EVENT",
                                                                   f"a fork of {src}, never allocated"))
            return
        self.store[h] = _Rows(parent.k[:, :, :n].clone(), parent.v[:, :, :n].clone())
        self.padding.origin[h] = self.padding.origin.get(src, "")

    def end(self, e: ev.AppendPublishEvent | ev.FailureEvent) -> None:
        """An append's end: its call runs (once, at its first member's end), and a
        publication's rows are checked against what the call computed."""
        h = e.stream_id
        start = self.starts.pop((h, e.payload.txn_id), None)
        if start is None or start.payload.call is None:
            return
        call_id = start.payload.call.call_id
        if call_id not in self.ran:
            members = self.calls.pop(call_id)
            if _runnable(members, self.store, self.tokens, self.ours, self.out):
                _run(self.model, self.store, self.tokens, self.staged, members, self.padding)
            self.ran.add(call_id)
        if isinstance(e, ev.AppendPublishEvent) and h not in self.out.unrunnable:
            _publish(self.store.get(h), self.staged.get(h), start, e, self.out)


def _runnable(members: list[ev.AppendStartEvent], store: dict[str, _Rows], tokens: dict[str, tuple[int, ...]],
              ours: _Model, out: HfReexecution) -> bool:
    """Whether a call can be rebuilt on this model; if not, every member is set aside
    (named by the first reason found)."""
    why = _call_problem(members, store, tokens, ours, out)
    if why is None:
        return True
    for m in members:
        out.unrunnable.setdefault(m.stream_id, why)
    return False


def _call_problem(members: list[ev.AppendStartEvent], store: dict[str, _Rows], tokens: dict[str, tuple[int, ...]],
                  ours: _Model, out: HfReexecution) -> tuple[str, str] | None:
    for m in members:
        if m.stream_id in out.unrunnable:
            return out.unrunnable[m.stream_id]
    call = members[0].payload.call
    assert call is not None  # only starts that name their call are grouped
    if call.size > MAX_CALL_ROWS or call.size * call.key_extent > MAX_CALL_CELLS or call.threads > MAX_THREADS:
        return ("MALFORMED_EVENT", f"call {call.call_id} of {call.size} rows x {call.key_extent} key columns on "
                                   f"{call.threads} threads is beyond any real batch")
    width, past_cols = call.new_pad, call.key_extent - call.new_pad
    rows: dict[int, tuple[str, int, int]] = {}  # batch row -> its handle, first position, tokens
    for m in members:
        p, c = m.payload, m.payload.call
        assert c is not None
        h, start, n = rows.get(c.index, (m.stream_id, p.interval_start, 0))
        rows[c.index] = (h, min(start, p.interval_start), n + p.interval_count)
        if h != m.stream_id or (c.size, c.new_pad, c.key_extent) != (call.size, width, call.key_extent):
            return ("MALFORMED_EVENT", f"append {p.txn_id} of {m.stream_id} does not fit its recorded call "
                                       f"{call.call_id}")
        why = ours.outside(p.token_ids)
        if why is not None:
            return ("ARTIFACT_MISMATCH", why)
    for index, (h, start, n) in rows.items():
        r, cached = store.get(h), _cached(start, n, width)
        # rows before the call's own are committed ones, those in its cache within its key
        # columns; a handle forked after the call holds none yet and has none there
        fits = index < call.size and past_cols >= 0 and n <= width and cached <= past_cols and (
            start <= r.k.shape[2] if r is not None else cached == 0 and h in tokens)
        if not fits or (start > cached and len(tokens.get(h, ())) < start):  # rows run again: from its tokens
            return ("MALFORMED_EVENT", f"the appends of {h} do not fit their recorded call {call.call_id}")
        why = ours.outside(tokens.get(h, ())[cached:start])
        if why is not None:
            return ("ARTIFACT_MISMATCH", why)
    return None


def _cached(start: int, n: int, width: int) -> int:
    """Of a row's rows before `start` (its append of n rows in a call `width` columns
    wide), how many precede the call's new columns: the rest run again in the call."""
    return max(0, start + n - width)


def _publish(r: _Rows | None, st: _Staged | None, start: ev.AppendStartEvent, e: ev.AppendPublishEvent,
             out: HfReexecution) -> None:
    p, t = e.payload, start.payload.interval_start
    lo = -1 if st is None else t - st.at  # the rows the call ran again before this append
    if r is None or st is None or lo < 0 or p.committed_length - p.accepted_count != t:
        got = "interval differs from the start"
    elif lo and not (_same(st.k[:, :, :lo], r.k[:, :, st.at:t]) and _same(st.v[:, :, :lo], r.v[:, :, st.at:t])):
        got = f"rows [{st.at}, {t}) run again in its call differ from the rows the handle holds"
    else:
        k = st.k[:, :, lo:lo + p.accepted_count]
        v = st.v[:, :, lo:lo + p.accepted_count]
        got = layers_sha256(hf_rows.span_layers([(k[i][None], v[i][None]) for i in range(k.shape[0])],
                                                0, 0, p.accepted_count))
        r.k = torch.cat((r.k[:, :, :t], k), dim=2)
        r.v = torch.cat((r.v[:, :, :t], v), dim=2)
    if got != p.rows_sha256:
        out.mismatches.append(Mismatch(e.stream_id, p.txn_id, e.global_position, p.rows_sha256, got))
    out.verified_rows += p.accepted_count
    out.verified_appends += 1


def _same(a: Tensor, b: Tensor) -> bool:
    """The same bytes (torch.equal compares values: -0.0 equals 0.0, NaN nothing)."""
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _run(model: Any, store: dict[str, _Rows], tokens: dict[str, tuple[int, ...]], staged: dict[str, _Staged],
         members_ev: list[ev.AppendStartEvent], padding: _Padding) -> None:
    """One journaled forward call, rebuilt; each member's rows it ran are staged."""
    call = members_ev[0].payload.call
    assert call is not None  # only starts that name their call are grouped
    by_index: dict[int, list[ev.AppendStartEvent]] = {}
    for m in members_ev:
        assert m.payload.call is not None
        by_index.setdefault(m.payload.call.index, []).append(m)
    if call.threads and call.threads != torch.get_num_threads():
        torch.set_num_threads(call.threads)
    size, width, extent = call.size, call.new_pad, call.key_extent
    past_cols = extent - width
    cfg = model.config.get_text_config(decoder=True)
    ids = torch.zeros((size, width), dtype=torch.long)
    mask = torch.ones((size, extent), dtype=torch.long)
    members: dict[int, tuple[str, int, int]] = {}  # index -> handle, committed rows, new rows
    for i, group in by_index.items():
        group.sort(key=lambda m: m.payload.interval_start)
        h = group[0].stream_id
        new = [t for m in group for t in m.payload.token_ids]
        past = group[0].payload.interval_start
        run = [*tokens.get(h, ())[_cached(past, len(new), width):past], *new]
        ids[i, width - len(run):] = torch.tensor(run)
        mask[i, :extent - past - len(new)] = 0
        members[i] = (h, past, len(new))
    if past_cols == 0:  # the generation's first call: its rows' padding decides for all its calls
        padding.padded[call.call_id] = not bool(mask.all())
        for h, _, _ in members.values():
            padding.origin[h] = call.call_id
    origins = {padding.origin.get(h, "") for h, _, _ in members.values()}
    explicit = any(padding.padded.get(o, False) for o in origins)
    origin = next(iter(origins)) if len(origins) == 1 else ""
    for i in range(size):
        if i in members:
            h, past, n = members[i]
            padding.row_pad[(origin, i)] = extent - past - n
        elif (origin, i) in padding.row_pad:  # the row as generate still masks it
            mask[i, :padding.row_pad[(origin, i)]] = 0
        elif past_cols == 0 and any(j < i for j in members):  # an expanded beam: its first row's prompt
            j = max(j for j in members if j < i)
            h, past, n = members[j]
            mask[i, :extent - past - n] = 0
            ids[i] = ids[j]
            padding.row_pad[(origin, i)] = extent - past - n
    positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, past_cols:]
    layers = []
    if past_cols:
        ref = next(iter(store.values())).k
        shape = (size, ref.shape[1], past_cols, ref.shape[3])
        for layer in range(ref.shape[0]):
            k = torch.zeros(shape, dtype=ref.dtype, device=ref.device)
            v = torch.zeros(shape, dtype=ref.dtype, device=ref.device)
            for i, (h, past, n) in members.items():
                cached = _cached(past, n, width)
                if cached:
                    k[i, :, past_cols - cached:] = store[h].k[layer, :, :cached]
                    v[i, :, past_cols - cached:] = store[h].v[layer, :, :cached]
            layers.append((k, v))
    cache = DynamicCache(ddp_cache_data=layers or None, config=cfg)
    device = next(model.parameters()).device
    model(input_ids=ids.to(device), attention_mask=mask.to(device) if explicit or not bool(mask.all()) else None,
          position_ids=positions.to(device), cache=cache, use_cache=True, logits_to_keep=1)
    written: list[Any] = cache.layers  # DynamicLayers: keys and values [B, H_kv, T, d_h]
    for i, (h, past, n) in members.items():
        cached = _cached(past, n, width)
        first = extent - (past - cached) - n  # the column of the first row it ran
        staged[h] = _Staged(torch.stack([layer.keys[i, :, first:] for layer in written]),
                            torch.stack([layer.values[i, :, first:] for layer in written]), cached)
