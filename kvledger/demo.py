"""The main job: a torch GQA worker serving a mixed workload under the journal."""

from __future__ import annotations

import random
import time

import torch

from engine.loading import load_model
from engine.remote import command_service
from engine.worker import RequestSpec, Worker
from journal import SqlJournal


def demo_workload(requests: int, max_new_tokens: int, seed: int, vocab: int,
                  run_id: str = "") -> list[RequestSpec]:
    """About `requests` ragged requests arriving four per iteration, with one long prompt
    (prefilled in chunks), one fork (n=2, sampled), one cancellation, one truncate,
    one repair and one speculative request (when there are enough requests)."""
    rng = random.Random(seed)
    specs = []
    for i in range(requests):
        long = i == 3
        plen = 160 if long else rng.randint(4, 48)
        role = {5: "fork", 7: "cancel", 9: "truncate", 11: "repair", 13: "speculate"}.get(i)
        specs.append(RequestSpec(
            request_id=f"req-{run_id or seed}-{i:03d}", prompt=tuple(rng.randrange(vocab) for _ in range(plen)),
            max_new_tokens=max_new_tokens, arrival_step=i // 4, seed=seed * 1000 + i,
            n=2 if role == "fork" else 1, temperature=0.8 if role == "fork" else 0.0,
            cancel_after=max(1, max_new_tokens // 4) if role == "cancel" else None,
            truncate_after=max(3, max_new_tokens // 2) if role == "truncate" else None,
            repair=role == "repair", speculate=3 if role == "speculate" else 0))
    return specs


def run_demo(journal: SqlJournal, *, requests: int = 32, max_new_tokens: int = 16, seed: int = 0,
             model_dir: str | None = None, device: str = "cpu", on_step=None,
             source_instance: str = "kvledger-demo", run_id: str = "", telemetry=None,
             writer: str = "thread") -> dict:
    """`telemetry`: an engine.telemetry.Telemetry to attach to the service and worker
    (the caller closes it). `writer`: see engine.remote.command_service."""
    torch.manual_seed(seed)
    model, artifact = load_model(model_dir, device=device)
    specs = demo_workload(requests, max_new_tokens, seed, model.cfg.vocab_size, run_id)
    capacity = max(len(s.prompt) for s in specs) + max_new_tokens + 1
    with command_service(journal, writer=writer, source_instance=source_instance) as service:
        worker = Worker(model, service=service, artifact=artifact, capacity=capacity, device=device)
        if telemetry is not None:
            telemetry.attach(service, worker)
        for s in specs:
            worker.submit(s)
        first = journal.last_position()
        t0 = time.perf_counter()
        outputs = worker.run(on_step=on_step)
        elapsed = time.perf_counter() - t0
    return {
        "outputs": outputs,
        "requests": len(specs),
        "handles": len(outputs),
        "tokens": sum(len(v) for v in outputs.values()),
        "events_written": journal.last_position() - first,
        "iterations": worker.step_no,
        "model_calls": worker.calls,
        "seconds": elapsed,
        "errors": worker.errors,
    }
