"""Sizing torch's CPU thread pool so a journal writer keeps a core of its own."""

from __future__ import annotations

import torch

from kvledger.journal import tuning


def use_threads(n: int) -> int:
    """Set torch's CPU thread pool to n threads. When that leaves a core for a journal
    writer, the calling (model) thread moves off the CPU that takes the disk's interrupts,
    so the core left is that one (kvledger.journal.tuning.pin_model); with every core in the pool it may
    run anywhere again. Returns n."""
    torch.set_num_threads(n)
    tuning.pin_model(leaves_a_core(n))
    return n


def leaves_a_core(threads: int) -> bool:
    """A torch pool of this size leaves a CPU free for the journal's writer."""
    return threads < tuning.usable_cpus()


def leave_a_core() -> int:
    """Shrink torch's CPU thread pool by one core (never below 1) for a journal writer
    process (kvledger.engine.remote) to run on; returns the thread count now set. The writer's
    commit then overlaps the model call instead of preempting it. What the model gives
    up (2 cores, default model): nothing at batch 1, 10-25% of its rate at batch 16."""
    return use_threads(max(1, min(torch.get_num_threads(), tuning.usable_cpus() - 1)))

