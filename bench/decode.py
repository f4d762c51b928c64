"""3. Decode: worker tokens/s with the journal on vs off, and vs transformers `generate`
on the same weights, at batch 1 and 16; on the default demo model and a larger one.

Each run serves B requests (32-token prompts, G greedy tokens each) end to end,
prefill included, for all three contenders alike; runs are interleaved and repeated
and the best rate of each is kept (noise on a shared machine only slows a run down). A quick
run drops, after its first repeat, a pool that served a contender at under half the
other pool's rate then (bench.first_repeat_losers).
Journal on = SQLite WAL, synchronous=FULL, an fsync per iteration; off = the same
worker loop with no command service at all. Journal on is measured with both writers
a user can choose (`--writer`): `thread`, the command service in the worker's process
(its commit thread overlaps the next model call), at torch's full pool and at one core
fewer, and `process`, the command service in a writer process (kvledger.engine.remote) with
torch's pool one core smaller (kvledger.worker.serving.leave_a_core). The headline takes the
best of these per case; every rate is reported. Journal off and transformers run at
both pool sizes and keep their better rate, so neither baseline is handicapped by a
thread count a writer happens to suit.
"""

from __future__ import annotations

import random
import time
from contextlib import nullcontext
from typing import Any

import torch

from bench import Context, at_threads, best_rate, first_repeat_losers

GOALS = {"decode_journal_overhead": ("<=", 0.10), "decode_vs_transformers": (">=", 1.0)}
NOTES = {
    "decode_journal_overhead": "worst case over models and batch sizes: (off rate / on rate) - 1, "
                               "on = the better writer; with the service in a writer process, "
                               "bounded on 2 cores by that process competing with the model for "
                               "CPU, and by sending commands and reading results",
    "decode_vs_transformers": "worst case of worker (journal on, better writer) / transformers "
                              "generate, same weights",
}

LARGE = dict(vocab_size=2048, hidden_size=1024, num_layers=8, num_heads=16, num_kv_heads=4,
             head_dim=64, intermediate_size=2816)


def _hf_twin(model) -> Any:
    """transformers' LlamaForCausalLM carrying exactly our weights."""
    import transformers as tf

    c = model.cfg
    cfg = tf.LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size,
                         intermediate_size=c.intermediate_size, num_hidden_layers=c.num_layers,
                         num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
                         head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta,
                         max_position_embeddings=c.max_position_embeddings,
                         tie_word_embeddings=c.tie_word_embeddings, bos_token_id=None,
                         eos_token_id=None, pad_token_id=0)
    hf = tf.LlamaForCausalLM(cfg).eval()
    state = {(k if k.startswith("lm_head") else f"model.{k}"): v for k, v in model.state_dict().items()}
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    return hf


def bench_prompts(b: int, vocab: int) -> list[tuple[int, ...]]:
    """b prompts of 32 token ids, the same for every contender (seeded by b)."""
    rng = random.Random(b)
    return [tuple(rng.randrange(1, vocab) for _ in range(32)) for _ in range(b)]


def serving_worker(model, artifact, prompts, g: int, service):
    """A worker with every prompt (32 tokens each) submitted for g greedy tokens, all
    running at once; `service` None: journaling off."""
    from kvledger.worker.serving import RequestSpec, Worker

    w = Worker(model, service=service, artifact=artifact, max_running=len(prompts),
               capacity=32 + g + 1, prefill_tokens=32 * len(prompts))
    for i, p in enumerate(prompts):
        w.submit(RequestSpec(request_id=f"r{i}", prompt=p, max_new_tokens=g))
    return w


def _worker_rate(ctx: Context, model, artifact, prompts, g: int, writer: str | None) -> float:
    """Tokens/s of the worker with the journal written by `writer`, or off (None)."""
    from kvledger.engine.remote import command_service
    from kvledger.migrations.storage import open_or_create_journal

    url = ctx.sqlite_journal_url("decode")
    with open_or_create_journal(url) as j, command_service(j, writer=writer) if writer else nullcontext() as service:
        w = serving_worker(model, artifact, prompts, g, service)
        t0 = time.perf_counter()
        w.run()
        dt = time.perf_counter() - t0
        assert not w.errors, w.errors[:3]
    return len(prompts) * g / dt


def _hf_rate(hf, prompts, g: int) -> float:
    ids = torch.tensor(prompts)
    with torch.inference_mode():
        t0 = time.perf_counter()
        hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=g,
                    min_new_tokens=g, eos_token_id=None, pad_token_id=0)
        dt = time.perf_counter() - t0
    return len(prompts) * g / dt


def run(ctx: Context) -> dict[str, Any]:
    from kvledger.worker.loading import load_model
    from kvledger.worker.model import DEFAULT_CONFIG, ModelConfig
    from kvledger.worker.serving import leave_a_core

    out: dict[str, Any] = {}
    overheads, vs_hf = [], []
    full = torch.get_num_threads()
    less = at_threads(full, leave_a_core)  # the pool --writer process leaves torch
    out["torch_threads_full"], out["torch_threads_less"] = full, less
    cases = [("default", DEFAULT_CONFIG, 1, ctx.size(smoke=8, quick=64, full=128)),
             ("default", DEFAULT_CONFIG, 16, ctx.size(smoke=8, quick=64, full=128))]
    if ctx.mode != "smoke":
        cases.append(("large", ModelConfig(**LARGE), 16, ctx.size(smoke=4, quick=24, full=64)))
    for name, cfg, b, g in cases:
        model, artifact = load_model(config=cfg)
        hf = _hf_twin(model)
        prompts = bench_prompts(b, cfg.vocab_size)
        # Every contender at torch's full pool and at the pool a writer process leaves
        # (one core fewer), the better kept; the process writer runs only at the latter.
        rates: dict[str, list[float]] = {}
        skip: set[str] = set()
        for rep in range(ctx.repeats):
            for key, threads, fn, args in (
                    ("off_full", full, _worker_rate, (ctx, model, artifact, prompts, g, None)),
                    ("off_less", less, _worker_rate, (ctx, model, artifact, prompts, g, None)),
                    ("thread_full", full, _worker_rate, (ctx, model, artifact, prompts, g, "thread")),
                    ("thread_less", less, _worker_rate, (ctx, model, artifact, prompts, g, "thread")),
                    ("process", less, _worker_rate, (ctx, model, artifact, prompts, g, "process")),
                    ("hf_full", full, _hf_rate, (hf, prompts, g)),
                    ("hf_less", less, _hf_rate, (hf, prompts, g))):
                if key not in skip:
                    rates.setdefault(key, []).append(at_threads(threads, fn, *args))
            if rep == 0 and ctx.mode == "quick" and full != less:
                skip = first_repeat_losers(rates, [("off_full", "off_less"), ("thread_full", "thread_less"),
                                                   ("hf_full", "hf_less")])
        best = {k: best_rate(v) for k, v in rates.items()}
        r_thread, r_proc = max(best["thread_full"], best["thread_less"]), best["process"]
        r_on = max(r_thread, r_proc)
        r_off = max(best["off_full"], best["off_less"])
        r_hf = max(best["hf_full"], best["hf_less"])
        tag = f"{name}_b{b}"
        out[f"decode_tokens_per_s_journal_on_{tag}"] = round(r_on, 1)
        out[f"decode_tokens_per_s_writer_thread_{tag}"] = round(r_thread, 1)
        out[f"decode_tokens_per_s_writer_process_{tag}"] = round(r_proc, 1)
        out[f"decode_tokens_per_s_journal_off_{tag}"] = round(r_off, 1)
        out[f"decode_tokens_per_s_transformers_{tag}"] = round(r_hf, 1)
        for k in ("thread_full", "thread_less", "off_full", "off_less", "hf_full", "hf_less"):
            out[f"decode_tokens_per_s_{k}_{tag}"] = round(best[k], 1)
        out[f"decode_journal_overhead_{tag}"] = round(r_off / r_on - 1, 4)
        out[f"decode_vs_transformers_{tag}"] = round(r_on / r_hf, 3)
        overheads.append(r_off / r_on - 1)
        vs_hf.append(r_on / r_hf)
        ctx.log(f"   {tag}: on {r_on:.0f} tok/s (thread writer {r_thread:.0f}, process writer "
                f"{r_proc:.0f}), off {r_off:.0f}, transformers {r_hf:.0f}")
    out["decode_journal_overhead"] = round(max(overheads), 4)
    out["decode_vs_transformers"] = round(min(vs_hf), 3)
    return out
