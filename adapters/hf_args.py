"""What `journaled_generate` accepts: model.generate's own arguments, read as generate
reads them, and checked before any work.

The prompt comes as generate takes it (positional `inputs`, `inputs=` or `input_ids=`,
or nothing with a BOS id). The generation config is generate's merge of the caller's,
the model's and transformers' defaults (`model._prepare_generation_config`, the one
place transformers keeps that rule), and the number of new tokens is what generate
derives from it: `max_new_tokens`, else `max_length` as a total length, or, when no
`max_length` was set anywhere, 20 new tokens capped at the model's positions.

What the journal cannot follow is refused here with a coded error, before the journal
or the model is touched: another cache (`cache_implementation`, a cache passed in,
`use_cache=False`, chunked prefill), decoding loops transformers runs from a Hub
repository (contrastive, group and constrained beam search, DoLa) or from a caller's
callable (`custom_generate`), inputs that are not token ids (`inputs_embeds`), positions
the proof could not rebuild (`position_ids`), and modes not proved here (multi-token
prediction, DFlash speculation, token healing, synced GPUs).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from kvledger.schemas.errors import ErrorCode, KvLedgerError

MAX_ID = 256  # a handle id's length in the event schema (schemas.events.Id)
FORK_SUFFIX = 12  # room for a fork's ".b<n>" after its request's id
# generate's named parameters after `inputs`, in its order (GenerationMixin.generate)
NAMED = ("generation_config", "logits_processor", "stopping_criteria", "prefix_allowed_tokens_fn", "synced_gpus",
         "assistant_model", "streamer", "negative_prompt_ids", "negative_prompt_attention_mask", "custom_generate")
JOURNALED_MODES = frozenset({"greedy_search", "sample", "beam_search", "beam_sample", "assisted_generation"})
ASSISTED = ("assistant_model", "prompt_lookup_num_tokens", "assistant_early_exit")
# model kwargs that change what a forward call computes in a way the journal does not record
REFUSED_MODEL_KWARGS = {
    "inputs_embeds": "the journal records token ids: pass input_ids",
    "position_ids": "positions follow the attention mask (the re-execution proof rebuilds them so)",
    "cache_position": "positions follow the attention mask (the re-execution proof rebuilds them so)",
    "cache": "the journaled cache takes that place",
    "past_key_values": "the journaled cache takes that place",
}


def _bad(message: str) -> KvLedgerError:
    return KvLedgerError(ErrorCode.INVALID_ARGUMENT, message)


@dataclass
class Call:
    """One checked journaled_generate call: the prompt, generate's merged config, the
    new tokens it will generate, and the arguments to hand to model.generate."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    config: Any  # transformers.GenerationConfig, merged as generate merges it
    max_new_tokens: int
    assisted: bool
    request_ids: list[str]
    generate_kwargs: dict[str, Any] = field(default_factory=dict)


class Bound(NamedTuple):
    """journaled_generate's arguments sorted out: generate's prompt, its named
    parameters (None where not given), its other keywords, and the wrapper's own."""

    inputs: Any
    named: dict[str, Any]
    kwargs: dict[str, Any]
    request_ids: Any
    own: dict[str, Any]


def bind(args: tuple[Any, ...], kwargs: dict[str, Any], own: Iterable[str]) -> Bound:
    """Bind positional `args` (after the model) to generate's parameters in its order
    (`inputs`, then NAMED), as Python binds a signature: too many of them, or one also
    given by keyword, is a TypeError. `request_ids` and the names in `own` are the
    wrapper's keywords, never generate's."""
    params = ("inputs", *NAMED)
    if len(args) > len(params):
        raise TypeError(f"journaled_generate takes the model and at most {len(params)} positional arguments "
                        f"(generate's), not {len(args)}")
    given = dict(zip(params, args))
    rest = dict(kwargs)
    for name in params:
        if name in rest:
            if name in given:
                raise TypeError(f"journaled_generate got multiple values for argument {name!r}")
            given[name] = rest.pop(name)
    request_ids = rest.pop("request_ids", None)
    mine = {k: rest.pop(k) for k in own if k in rest}
    return Bound(given.get("inputs"), {k: given.get(k) for k in NAMED}, rest, request_ids, mine)


def prepare(model: Any, inputs: Any, named: dict[str, Any], kwargs: dict[str, Any],
            request_ids: Any = None) -> Call:
    """`named`: generate's named parameters as given (None where not); `kwargs` the rest;
    `request_ids` one per row of the prompt, or None (generated)."""
    kwargs = dict(kwargs)
    _refuse_callers_loops(model, named, kwargs)
    input_ids = _prompt(model, inputs, kwargs)
    mask = _mask(kwargs.pop("attention_mask", None), input_ids)
    gen_config = named.get("generation_config")
    if gen_config is not None and not _is_generation_config(gen_config):
        raise _bad(f"generation_config must be a transformers GenerationConfig, not {type(gen_config).__name__}")
    config, mode = _merged(model, named, kwargs, input_ids, mask)
    assisted = named.get("assistant_model") is not None or any(getattr(config, k, None) is not None
                                                                for k in ASSISTED[1:])
    _check_mode(config, mode, assisted, input_ids)
    out: dict[str, Any] = {k: v for k, v in named.items() if v is not None}
    gen_config = _own_cache(config, gen_config, kwargs, out)
    if mask is None:  # the one generate infers from pad tokens must be left padding too
        _mask(_inferred_mask(config, input_ids), input_ids)
    max_new = _new_tokens(model, config, gen_config, kwargs, input_ids.shape[1])
    forked = max(config.num_beams or 1, config.num_return_sequences or 1) > 1
    rids = _request_ids(request_ids, input_ids.shape[0], MAX_ID - (FORK_SUFFIX if forked else 0))
    out.update(kwargs)
    return Call(input_ids=input_ids, attention_mask=mask, config=config, max_new_tokens=max_new,
                assisted=assisted, request_ids=rids, generate_kwargs=out)


def _refuse_callers_loops(model: Any, named: dict[str, Any], kwargs: dict[str, Any]) -> None:
    """Not a generate() to journal, or arguments that replace what the journal follows:
    the model itself, the refused model kwargs, a decoding loop of the caller's or a Hub's."""
    if not callable(getattr(model, "generate", None)) or getattr(model, "generation_config", None) is None:
        raise _bad(f"model must be a transformers model with generate(), not {type(model).__name__}")
    for key, why in REFUSED_MODEL_KWARGS.items():
        if kwargs.get(key) is not None:
            raise _bad(f"{key}= is not journaled: {why}")
    if named.get("custom_generate") is not None:
        raise _bad("custom_generate= replaces generate's decoding loop: not journaled")
    if named.get("synced_gpus"):
        raise _bad("synced_gpus=True (ZeRO-3/FSDP across processes) is not journaled")
    if kwargs.get("trust_remote_code"):
        raise _bad("trust_remote_code=True runs a decoding loop from a Hub repository: not journaled")


def _merged(model: Any, named: dict[str, Any], kwargs: dict[str, Any], input_ids: torch.Tensor,
            mask: torch.Tensor | None) -> tuple[Any, str]:
    """generate's merged config and its generation mode, by generate's own checks."""
    try:
        # generate's own steps, private but the one place transformers keeps each rule: the
        # merge of a call's config with the model's and its defaults, the mode, its checks
        config, model_kwargs = model._prepare_generation_config(named.get("generation_config"), **kwargs)
        mode_enum = config.get_generation_mode(named.get("assistant_model"))
        model._validate_model_kwargs({**model_kwargs, "input_ids": input_ids, "attention_mask": mask})
        model._validate_generation_mode(mode_enum, config, {k: named[k] for k in ("assistant_model", "streamer")
                                                            if named.get(k) is not None})
    except (ValueError, TypeError, AttributeError) as exc:
        raise _bad(f"generate's arguments: {_short(exc)}") from None
    return config, str(getattr(mode_enum, "value", mode_enum))


def _check_mode(config: Any, mode: str, assisted: bool, input_ids: torch.Tensor) -> None:
    """The decoding modes the journal follows, and the config values it records."""
    if mode not in JOURNALED_MODES:
        raise _bad(f"generation mode {mode!r} is not journaled (transformers "
                   "runs it from a Hub repository); greedy, sampling, beam search and assisted decoding are")
    if assisted and mode != "assisted_generation":
        raise _bad("assisted decoding with beams is not journaled (transformers would ignore the assistant)")
    if assisted and input_ids.shape[0] != 1:
        raise _bad("assisted decoding takes one prompt (transformers runs it for batch size 1 only)")
    for flag, what in (("use_mtp", "multi-token prediction"), ("speculation_type", "DFlash speculation"),
                       ("token_healing", "token healing (a second generate on the prompt)")):
        if getattr(config, flag, None):
            raise _bad(f"{what} is not journaled")
    if getattr(config, "prefill_chunk_size", None) is not None:
        raise _bad("prefill_chunk_size: a chunked prefill is not journaled")
    _check_config(config)
    if config.use_cache is False:
        raise _bad("use_cache=False recomputes every row on every call: nothing to journal")


def _own_cache(config: Any, gen_config: Any, kwargs: dict[str, Any], out: dict[str, Any]) -> Any:
    """The journaled cache is generate's cache: another implementation is refused, and
    a "dynamic" one asked for is dropped from the arguments (in `out` and `kwargs`) so
    generate builds none. Returns the caller's generation config as generate will see it."""
    cache_implementation = getattr(config, "cache_implementation", None)
    if cache_implementation not in (None, "dynamic"):
        raise _bad(f"cache_implementation={cache_implementation!r} is not journaled: kvledger.hf journals "
                   "a DynamicCache of its own (cache_implementation=None asks for one)")
    if cache_implementation == "dynamic":  # what the journaled cache is: generate must not build another
        if gen_config is not None and gen_config.cache_implementation is not None:
            out["generation_config"] = gen_config = _copy_with(gen_config, cache_implementation=None)
        if kwargs.get("cache_implementation") is not None or gen_config is None:
            kwargs["cache_implementation"] = None
    return gen_config


def _is_generation_config(value: Any) -> bool:
    from transformers.generation.configuration_utils import GenerationConfig

    return isinstance(value, GenerationConfig)


def _copy_with(config: Any, **changes: Any) -> Any:
    import copy

    config = copy.deepcopy(config)
    for k, v in changes.items():
        setattr(config, k, v)
    return config


def _short(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:300]


def _prompt(model: Any, inputs: Any, kwargs: dict[str, Any]) -> torch.Tensor:
    """The prompt ids as generate takes them: `inputs` (positional or named) or
    `input_ids`, not both; none at all is one row of the BOS id, as generate starts."""
    given = kwargs.pop("input_ids", None)
    if inputs is not None and given is not None:
        raise _bad("inputs and input_ids both given: pass one")
    ids = inputs if inputs is not None else given
    if ids is None:
        bos = getattr(getattr(model, "generation_config", None), "bos_token_id", None)
        if not isinstance(bos, int) or isinstance(bos, bool):
            raise _bad("no input_ids, and the model has no bos_token_id to start from")
        ids = torch.tensor([[bos]], dtype=torch.long, device=_device(model))
    if not isinstance(ids, torch.Tensor):
        raise _bad(f"input_ids must be a torch tensor [batch, tokens], not {type(ids).__name__}")
    if ids.dim() != 2:
        raise _bad(f"input_ids must be [batch, tokens], not of shape {tuple(ids.shape)}")
    if ids.dtype not in (torch.int64, torch.int32):  # what an embedding takes
        raise _bad(f"input_ids must hold int64 (or int32) token ids, not {ids.dtype}")
    if ids.is_meta:
        raise _bad("input_ids on the meta device hold no token ids")
    if ids.shape[0] == 0 or ids.shape[1] == 0:
        raise _bad(f"input_ids of shape {tuple(ids.shape)} holds no prompt")
    vocab = _vocab(model)
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or (vocab is not None and high >= vocab):
        bad = low if low < 0 else high
        raise _bad(f"token id {bad} is outside the model's vocabulary [0, {vocab})")
    return ids


def _mask(mask: Any, ids: torch.Tensor) -> torch.Tensor | None:
    """None, or a 0/1 mask of the prompt's shape whose every row is left padding (0s)
    followed by at least one token (1s): how a decoder-only batch is laid out."""
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor) or tuple(mask.shape) != tuple(ids.shape):
        shape = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise _bad(f"attention_mask must be a tensor of input_ids' shape {tuple(ids.shape)}, not {shape}")
    if mask.dtype.is_floating_point or mask.dtype.is_complex or bool(((mask != 0) & (mask != 1)).any()):
        raise _bad("attention_mask must hold integer 0s and 1s")
    m = mask.to(torch.long)
    if not bool(m[:, -1].all()) or bool((m[:, 1:] < m[:, :-1]).any()):
        raise _bad("attention_mask: each row must be left padding (0s) followed by its prompt (1s)")
    return mask


def _check_config(config: Any) -> None:
    """The values the journal records from the config (sampling temperature, stop ids),
    held to their types before they reach a manifest."""
    for key in ("eos_token_id", "pad_token_id", "bos_token_id"):
        v = getattr(config, key, None)
        vs = v.tolist() if isinstance(v, torch.Tensor) else v
        vs = vs if isinstance(vs, list) else [] if vs is None else [vs]
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 1 << 63 for t in vs):
            raise _bad(f"{key} must be a token id or a list of them, not {v!r}"[:200])
    t = config.temperature
    if config.do_sample and t is not None and (not isinstance(t, (int, float)) or isinstance(t, bool)
                                               or not math.isfinite(t) or t <= 0):
        raise _bad(f"temperature must be a positive finite number, not {t!r}"[:200])


def _inferred_mask(config: Any, ids: torch.Tensor) -> torch.Tensor:
    """The mask generate makes when none is given (its _prepare_attention_mask_for_generation):
    pad tokens masked out, when the pad id is set, occurs and is no EOS id."""
    pad, eos = config.pad_token_id, config.eos_token_id
    eos_ids = set(eos) if isinstance(eos, list) else {eos}
    if not isinstance(pad, int) or pad in eos_ids or ids.dtype not in (torch.int32, torch.int64):
        return torch.ones_like(ids)
    return ids.ne(pad).long()


def _request_ids(ids: Any, batch: int, longest: int) -> list[str]:
    if ids is None:
        return []
    if isinstance(ids, (str, bytes)) or not all(isinstance(r, str) and 0 < len(r) <= longest for r in ids):
        raise _bad(f"request_ids must be a sequence of strings of 1 to {longest} characters, one per row of "
                   "input_ids")
    out: list[str] = list(ids)
    if len(out) != batch or len(set(out)) != batch:
        raise _bad(f"{len(out)} distinct request ids for {batch} rows")
    return out


def _vocab(model: Any) -> int | None:
    try:
        return int(model.get_input_embeddings().num_embeddings)
    except (AttributeError, TypeError, NotImplementedError):
        cfg = model.config.get_text_config(decoder=True)
        return getattr(cfg, "vocab_size", None)


def _device(model: Any) -> Any:
    return getattr(model, "device", "cpu")


def _new_tokens(model: Any, config: Any, gen_config: Any, kwargs: dict[str, Any], width: int) -> int:
    """New tokens per sequence, as generate derives them (its _prepare_generated_length)."""
    for key in ("max_new_tokens", "max_length"):
        v = getattr(config, key)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool)):
            raise _bad(f"{key} must be an int, not {v!r}"[:200])
    if config.max_new_tokens is not None:
        max_length = config.max_new_tokens + width
    elif (kwargs.get("max_length") is None and (gen_config is None or gen_config.max_length is None)
          and model.generation_config.max_length is None):
        max_length = config.max_length + width  # transformers' default: 20 new tokens, within the positions
        positions = getattr(model.config, "max_position_embeddings", None)
        if isinstance(positions, int):
            max_length = min(max_length, positions)
    else:
        max_length = config.max_length  # a total length
    if not isinstance(max_length, int) or isinstance(max_length, bool) or max_length - width < 1:
        raise _bad(f"max_length {max_length!r} leaves no new token after a prompt of {width} columns "
                   "(set max_new_tokens)")
    return max_length - width
