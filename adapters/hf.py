"""Journal a Hugging Face model's generate(): a transformers Cache that writes kvledger events.

    from kvledger.hf import journaled_generate
    out = journaled_generate(model, ledger=ledger, input_ids=ids, attention_mask=mask, max_new_tokens=32)

`out` is what `model.generate(input_ids=ids, attention_mask=mask, **kwargs)` returns; the
journal gets the lifecycle of every sequence (adapters.hf_journal says how each call,
crop and beam reorder maps to events). The cache is a DynamicCache built from the
model's config, as generate() would build it; the wrapper adds hooks around the model's
forward (where calls begin and end) and listens to the cache (layers written, crops,
reorders). Nothing it does touches the random generator or the tensors generate uses.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, NamedTuple, Protocol

import torch
from transformers.cache_utils import DynamicCache
from transformers.generation.stopping_criteria import StoppingCriteria, StoppingCriteriaList

from kvledger.adapters import hf_args, hf_identity, hf_rows
from kvledger.adapters.hf_journal import Plan, Tracker
from kvledger.engine.port import CommandPort
from kvledger.schemas.errors import ErrorCode, KvLedgerError
from kvledger.schemas.manifest import SamplingPolicy


class HasService(Protocol):
    """A kvledger.Ledger: its command service takes the wrapper's commands."""

    @property
    def service(self) -> CommandPort: ...


class JournaledCache(DynamicCache):
    """A DynamicCache that tells a Tracker which layers each call wrote and how beam
    search moved its rows. Crops need no notice: the tracker reads the length after."""

    def __init__(self, model: Any, tracker: Tracker, rows: hf_rows.Layers | None = None) -> None:
        super().__init__(rows, config=model.config.get_text_config(decoder=True))
        self.tracker = tracker
        tracker.cache = self
        # the rows as the last forward call left them, while a reorder after it is the last
        # word: beam search reorders after its final call, and the closing call needs the
        # rows its returned beams were chosen from
        self.before_reorder: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        self.before_reorder = None  # another call runs: the reorder was not the last word
        out = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        self.tracker.wrote(layer_idx)
        return out

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.before_reorder is None:  # index_select leaves these tensors as they were
            self.before_reorder = hf_rows.of_cache(self)
        super().reorder_cache(beam_idx)
        self.tracker.reordered([int(i) for i in beam_idx.tolist()])

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise KvLedgerError(ErrorCode.INVALID_ARGUMENT, "batch_repeat_interleave on a journaled cache: "
                                                        "a generation mode kvledger.hf does not journal")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise KvLedgerError(ErrorCode.INVALID_ARGUMENT, "batch_select_indices on a journaled cache: "
                                                        "a generation mode kvledger.hf does not journal")


class _Candidates(StoppingCriteria):
    """Stops nothing: shows the tracker each step's scored beam continuations, where a
    sequence that ends on EOS and may be returned is seen before its parent moves on."""

    def __init__(self, tracker: Tracker) -> None:
        self.tracker = tracker

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs: Any) -> torch.BoolTensor:
        self.tracker.candidates(input_ids)
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)  # type: ignore[return-value]


def _ids(value: Any) -> frozenset[int]:
    if value is None:
        return frozenset()
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    return frozenset([value] if isinstance(value, int) else value)


def plan_for(model: Any, call: hf_args.Call, seed: int | None = None) -> Plan:
    gc = call.config
    batch, width = call.input_ids.shape
    request_ids = call.request_ids
    if not request_ids:
        run = uuid.uuid4().hex[:12]
        request_ids = [f"hf-{run}-{b}" for b in range(batch)]
    beams = (gc.num_beams or 1) > 1
    expand = max(gc.num_beams or 1, gc.num_return_sequences or 1)
    max_new = call.max_new_tokens
    eos = _ids(gc.eos_token_id)
    sampling = SamplingPolicy(kind="temperature" if gc.do_sample else "greedy",
                              temperature=float(gc.temperature or 1.0) if gc.do_sample else 1.0,
                              seed=0 if seed is None else seed)

    def manifest_for(rid: str, prompt: tuple[int, ...]) -> Any:
        return hf_identity.manifest(model, request_id=rid, prompt=prompt, max_new_tokens=max_new,
                                    max_context_tokens=len(prompt) + max_new + 1,
                                    stop_token_ids=tuple(sorted(eos)), sampling=sampling)

    return Plan(request_ids=request_ids, prompt_width=width, expand=expand, beams=beams,
                assisted=call.assisted, eos=eos,
                manifest_for=manifest_for, reserve_for=lambda prompt: len(prompt) + max_new + 1)


class Options(NamedTuple):
    """journaled_generate's own keyword arguments (the rest are generate's)."""

    close_frontier: bool = True
    seed: int | None = None
    overlap_commit: bool = False
    stats: dict[str, float] | None = None


OWN = frozenset(Options._fields)  # journaled_generate's keywords that generate does not take


def prepare(model: Any, *args: Any, **kwargs: Any) -> tuple[hf_args.Call, Options]:
    """journaled_generate's arguments (model.generate's signature, then its own), checked
    before any work: what the journal cannot follow is INVALID_ARGUMENT (adapters.hf_args)."""
    bound = hf_args.bind(args, kwargs, OWN)
    options = Options(**bound.own)
    seed, stats = options.seed, options.stats
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 1 << 63):
        raise KvLedgerError(ErrorCode.INVALID_ARGUMENT, f"seed must be an int in [0, 2**63), not {seed!r}")
    if stats is not None and not isinstance(stats, dict):
        raise KvLedgerError(ErrorCode.INVALID_ARGUMENT, f"stats must be a dict to fill in, not {type(stats).__name__}")
    return hf_args.prepare(model, bound.inputs, bound.named, bound.kwargs, bound.request_ids), options


def journaled_generate(model: Any, *args: Any, ledger: HasService, **kwargs: Any) -> Any:
    """model.generate(*args, **kwargs), journaled: generate's own signature (positional
    `inputs`, `inputs=` or `input_ids=`, its generation config and defaults), plus
    `ledger` (anything with a command `service`, such as a kvledger.Ledger) and the
    keyword arguments `request_ids` and those of `Options` (close_frontier, seed,
    overlap_commit, stats). kvledger.hf.journaled_generate also takes a database URL as `ledger`.
    The arguments are checked before any work (`prepare`); then `run`."""
    call, options = prepare(model, *args, **kwargs)
    return run(model, call, options, ledger)


def run(model: Any, call: hf_args.Call, options: Options, ledger: HasService) -> Any:
    """model.generate on a checked call, journaled.

    One handle per batch row (named by `request_ids`, one per row of input_ids, or
    generated), forks for beams and extra return sequences. If generate raises, every
    open append ends in a failure event, every handle is cancelled and released, and the
    original exception is raised.

    generate() never runs the last token it chooses. By default (`close_frontier=True`)
    one more forward call runs after generate, on a cache built from each returned
    sequence's own rows: it emits the last token, decodes it (real model work whose
    logits are discarded) and publishes the row, then the handle finishes, so every
    handle's committed length is its whole unpadded sequence. `close_frontier=False`
    skips that call: each handle then ends one row short (the last token emitted,
    never run), unless generate itself ran it (an EOS row of a batch, closed by a
    repair). With beams and EOS, each of a step's best candidates that ends on EOS is
    forked off its parent before the next reorder moves the parent on, with a copy of
    its rows kept to the end (one sequence's rows per such candidate), so a beam
    returned after ending early is closed too. A returned beam ended early by a
    stopping criterion other than EOS cannot be: that is FRONTIER_MISMATCH, raised
    after generate with the journal cancelled and released; close_frontier=False
    returns it unjournaled (held by no handle), as before.

    `seed` seeds torch's generator just before generate (what `torch.manual_seed(seed)`
    before `model.generate` would do) and is recorded in each request's sampling policy;
    without it the policy's seed is 0 and whatever state the generator is in is used.

    `overlap_commit=True` lets each call's journal commit (its fsync) run while the call
    computes, as the worker's pipeline does; nothing is published before that commit is
    seen durable. It pays where torch leaves a core free (a GPU, fewer threads than
    cores), and costs where the commit thread preempts a CPU forward using every core.

    `stats`, if given, is filled in as generate returns (or raises): `journal_s`, the
    seconds spent in the journal's own work (before and after each forward call, the
    closing call, finishing), and `forward_calls`. What the journal costs, apart from
    the wall time of a run, which the machine's load also moves."""
    close_frontier, seed, overlap_commit, stats = options
    input_ids, generate_kwargs = call.input_ids, dict(call.generate_kwargs)
    if not callable(getattr(getattr(ledger, "service", None), "execute_many", None)):
        raise KvLedgerError(ErrorCode.INVALID_ARGUMENT, f"ledger= must be a kvledger.Ledger (or, through "
                                                        f"kvledger.hf, a database URL), not {type(ledger).__name__}")
    plan = plan_for(model, call, seed)
    tracker = Tracker(ledger.service, plan, hf_identity.cache_schema(model).num_cache_layers,
                      overlap=overlap_commit)
    tracker.keep_rows = close_frontier
    cache = JournaledCache(model, tracker)
    if plan.beams and plan.eos:
        generate_kwargs["stopping_criteria"] = StoppingCriteriaList(
            [*(generate_kwargs.get("stopping_criteria") or []), _Candidates(tracker)])
    _check_window(model, cache, input_ids.shape[1] + max(plan.reserve_for(()) - 1, 0))
    spent = {"journal_s": 0.0, "forward_calls": 0.0}
    hooks = _hook(model, tracker, spent)
    try:
        if seed is not None:
            torch.manual_seed(seed)
        out = _generate(model, tracker, input_ids=input_ids, attention_mask=call.attention_mask, cache=cache,
                        **generate_kwargs)
        sequences = out if isinstance(out, torch.Tensor) else out.sequences
        t0, during = time.perf_counter(), spent["journal_s"]  # the closing call is all journal work
        if close_frontier:
            _close(model, tracker, sequences)
    except BaseException as exc:
        tracker.abort(exc)
        raise
    finally:
        for h in hooks:
            h.remove()
        if stats is not None:
            stats.update(spent)
    tracker.finish(sequences)
    if stats is not None:
        stats["journal_s"] = during + time.perf_counter() - t0
    return out


def _check_window(model: Any, cache: JournaledCache, longest: int) -> None:
    """Refuses a run longer than a sliding layer's window: a sliding layer drops old
    rows, and column positions would no longer be the rows' own."""
    window = getattr(model.config.get_text_config(decoder=True), "sliding_window", None)
    if any(getattr(layer, "is_sliding", False) for layer in cache.layers) and window and longest > window:
        raise KvLedgerError(ErrorCode.INVALID_ARGUMENT, f"up to {longest} tokens exceed the sliding window "
                                                        f"of {window}: not journaled")


def _hook(model: Any, tracker: Tracker, spent: dict[str, float]) -> list[Any]:
    """Hooks around the model's forward that tell the tracker where each call of
    generate's cache begins and ends, adding the journal's own time to `spent`."""

    def before(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if kwargs.get("cache") is not tracker.cache:  # the closing call swaps in its own cache
            return
        ids = kwargs.get("input_ids")
        if ids is None:
            raise KvLedgerError(ErrorCode.INVALID_ARGUMENT, "a forward without input_ids is not journaled")
        t0 = time.perf_counter()
        try:
            tracker.before_forward(ids, kwargs.get("attention_mask"))
        finally:
            spent["journal_s"] += time.perf_counter() - t0
            spent["forward_calls"] += 1

    def after(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        if kwargs.get("cache") is tracker.cache:
            t0 = time.perf_counter()
            try:
                tracker.after_forward()
            finally:
                spent["journal_s"] += time.perf_counter() - t0

    return [model.register_forward_pre_hook(before, with_kwargs=True),
            model.register_forward_hook(after, with_kwargs=True)]


def _generate(model: Any, tracker: Tracker, **kwargs: Any) -> Any:
    """model.generate(**kwargs); its refusal of its own arguments, before its first
    forward call (nothing journaled), is INVALID_ARGUMENT."""
    try:
        return model.generate(**kwargs)
    except (ValueError, TypeError, NotImplementedError) as exc:
        if tracker.started:
            raise
        raise KvLedgerError(ErrorCode.INVALID_ARGUMENT, f"model.generate refused its arguments: "
                                                        f"{type(exc).__name__}: {exc}"[:400]) from exc


@torch.inference_mode()
def _close(model: Any, tracker: Tracker, sequences: torch.Tensor) -> None:
    """One forward call of each returned sequence's last token, on a new cache holding
    that sequence's own rows, laid out as hf_reexec rebuilds a call (each row's rows
    right-aligned after zero columns the mask hides), so the proof recomputes it."""
    ends = tracker.closing_rows(sequences.tolist())
    if not ends:
        return
    width = max(seq.committed for seq, _, _ in ends)
    rows = []
    for layer, (k, v) in enumerate(ends[0][2]):
        nk = k.new_zeros((len(ends), k.shape[0], width, k.shape[2]))
        nv = v.new_zeros((len(ends), v.shape[0], width, v.shape[2]))
        for i, (seq, _, held) in enumerate(ends):
            nk[i, :, width - seq.committed:] = held[layer][0]
            nv[i, :, width - seq.committed:] = held[layer][1]
        rows.append((nk, nv))
    closing = JournaledCache(model, tracker, rows)
    tracker.rows = [seq for seq, _, _ in ends]
    ids = torch.tensor([[token] for _, token, _ in ends])
    mask = torch.ones((len(ends), width + 1), dtype=torch.long)
    for i, (seq, _, _) in enumerate(ends):
        mask[i, :width - seq.committed] = 0
    positions = torch.tensor([[seq.committed] for seq, _, _ in ends])
    # transformers keeps a 2D mask through a generation whose prompts were padded and
    # drops an all-ones one otherwise; the proof rebuilds the call by the same rule
    explicit = any(s.pad for s in tracker.seqs.values()) or not bool(mask.all())
    model(input_ids=ids.to(model.device), attention_mask=mask.to(model.device) if explicit else None,
          position_ids=positions.to(model.device), cache=closing, use_cache=True, logits_to_keep=1)
