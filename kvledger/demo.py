"""The main job: a torch GQA worker serving a mixed workload under the journal."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple, TypedDict

import msgspec
import torch

from kvledger.engine.remote import command_service
from kvledger.journal import Journal
from kvledger.scenario import Action, Script
from kvledger.worker.loading import load_model
from kvledger.worker.serving import RequestSpec, Worker

if TYPE_CHECKING:
    from kvledger.telemetry.producer import Telemetry

# The scenarios, most telling first: a demo of N requests plays the first min(N, 8).
SCENARIOS = ("long", "fork", "cancel", "truncate", "repair", "speculate", "fault", "plain")


class Workload(NamedTuple):
    specs: list[RequestSpec]
    script: Script  # what the demo's client does to them while they run


def demo_workload(requests: int, max_new_tokens: int, seed: int, vocab: int, run_id: str = "") -> Workload:
    """`requests` ragged requests arriving four per iteration. The scenarios sit at
    evenly spread indexes, so every N >= 8 plays them all: one long prompt (prefilled in
    chunks), one fork (n=2, sampled) whose two rows then swap (a beam-style reorder), one
    cancellation, one truncate, one repair, one speculative request, and one after whose
    first output a decode call fails once (injected) and is retried."""
    rng = random.Random(seed)
    g = max_new_tokens
    step = max(1, requests // len(SCENARIOS))
    roles = {k * step: role for k, role in enumerate(SCENARIOS[:requests])}
    specs, actions = [], []
    for i in range(requests):
        role = roles.get(i, "plain")
        plen = 160 if role == "long" else rng.randint(4, 48)
        rid = f"req-{run_id or seed}-{i:03d}"
        specs.append(RequestSpec(
            request_id=rid, prompt=tuple(rng.randrange(vocab) for _ in range(plen)),
            max_new_tokens=g, arrival_step=i // 4, seed=seed * 1000 + i,
            n=2 if role == "fork" else 1, temperature=0.8 if role == "fork" else 0.0,
            speculate=3 if role == "speculate" else 0))
        actions += {
            "fork": [Action(rid, "reorder", after=min(2, g), permutation=(1, 0))],
            "cancel": [Action(rid, "cancel", after=max(1, g // 4))],
            "truncate": [Action(rid, "truncate", after=max(3, g // 2), rows=2)],
            "repair": [Action(rid, "repair")],
            "fault": [Action(rid, "fault", after=min(1, g - 1))],
        }.get(role, [])
    return Workload(specs, Script(tuple(actions)))


class DemoResult(TypedDict):
    outputs: dict[str, list[int]]  # request id -> output token ids
    requests: int
    handles: int
    tokens: int
    events_written: int
    iterations: int
    model_calls: int
    seconds: float
    errors: list[str]


class DemoOptions(msgspec.Struct, frozen=True, kw_only=True):
    """A demo run: its workload (demo_workload's requests, new tokens, seed and run id)
    and where it is served (the model's directory, None: the built-in one; the device;
    the service's source instance; its writer, see kvledger.engine.remote.command_service)."""

    requests: int = 32
    max_new_tokens: int = 16
    seed: int = 0
    run_id: str = ""
    model_dir: str | None = None
    device: str = "cpu"
    source_instance: str = "kvledger-demo"
    writer: str = "thread"


def run_demo(journal: Journal, options: DemoOptions | None = None, *,
             on_step: Callable[[Worker], None] | None = None, telemetry: Telemetry | None = None) -> DemoResult:
    """`on_step` is called with the worker after each of its steps; `telemetry`: a
    kvledger.telemetry.producer.Telemetry to attach to the service and worker (the caller closes it)."""
    o = options or DemoOptions()
    torch.manual_seed(o.seed)
    model, artifact = load_model(o.model_dir, device=o.device)
    specs, script = demo_workload(o.requests, o.max_new_tokens, o.seed, model.cfg.vocab_size, o.run_id)
    capacity = max(len(s.prompt) for s in specs) + o.max_new_tokens + 1
    with command_service(journal, writer=o.writer, source_instance=o.source_instance) as service:
        worker = Worker(model, service=service, artifact=artifact, capacity=capacity, device=o.device)
        if telemetry is not None:
            telemetry.attach(service, worker)
        for s in specs:
            worker.submit(s)
        first = journal.last_position()
        t0 = time.perf_counter()
        outputs = script.play(worker, on_step=on_step)
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
