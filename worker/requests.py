"""The serving worker's bookkeeping: a request as a client asks for it, the worker's view
of a running one, the appends it plans and the calls that ran them, and the chain of
commands one handle contributes to an iteration's commit."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
from torch import Tensor

from kvledger.engine import commands as c
from kvledger.engine.gather import add_step
from kvledger.engine.ids import new_id
from kvledger.schemas.decode_batch import BatchBuilder
from kvledger.schemas.events import AppendKind
from kvledger.worker.executor import CallShape


class RequestSpec(msgspec.Struct, frozen=True):
    request_id: str
    prompt: tuple[int, ...]
    max_new_tokens: int
    temperature: float = 0.0  # 0: greedy
    seed: int = 0
    arrival_step: int = 0
    n: int = 1  # parallel samples: n - 1 forks at the prompt
    speculate: int = 0  # drafts per verify (prompt lookup); greedy only


@dataclass
class Live:
    handle: str
    spec: RequestSpec
    seed: int  # sampling seed; each draw is seeded by (seed, output index): no hidden RNG state
    outputs: list[int] = field(default_factory=list)
    logits: Tensor | None = None  # next-token logits of the newest publication
    greedy: int | None = None  # their argmax, when the call computed it
    forked: bool = False
    done: str | None = None  # finish reason, "cancelled", or None while running
    abi: str = ""  # cache ABI digest of the handle (chain steps name it without reading state)
    failures: int = 0  # appends of this handle that ended in a failure event


@dataclass
class Planned:
    handle: str
    txn: str
    kind: AppendKind
    past: int
    tokens: tuple[int, ...]


@dataclass
class Ran:
    planned: Planned
    logits: Tensor  # [R, V]: last row, or every row for verify
    accepted: int
    rows_sha256: str  # schemas.canonical.layers_sha256 of the accepted rows' per-layer digests
    correction: int | None = None  # verify: the token chosen after the accepted drafts
    greedy: int | None = None  # argmax of the last row, computed for the whole call at once


Ok = Callable[[], None]  # called once the command committed (at once, journaling off)
Err = Callable[[Exception], None]  # why it was refused
Entry = tuple[c.Command | c.Relative, Ok | None, Err | None]


@dataclass
class Inflight:
    done: Callable[[], set[str]]  # serving.Worker._submit's: waits, applies, names the refused handles
    ran: list[Ran]  # the calls it started


def command_of(e: Entry | Chain) -> c.Command:
    cmd = e.first if isinstance(e, Chain) else e[0]
    return cmd.command if isinstance(cmd, c.Relative) else cmd


class Chain:
    """A handle's publication and what follows it in the same iteration (the output it
    chose, the next append's start), submitted as one engine Chain: one decision, one
    guarded write, one receipt. The publication names the real base; the later steps
    leave theirs to the chain. Any other command on the handle ends the chain."""

    def __init__(self, handle: str, first: c.Publish, ok: Ok | None, err: Err | None) -> None:
        self.handle, self.first = handle, first
        self.steps: list[c.Step] = []
        self.oks, self.errs = [ok], [err]

    def add(self, step: c.Step, err: Err | None = None) -> None:
        self.steps.append(step)
        self.errs.append(err)

    def entry(self) -> Entry:
        if not self.steps:
            return (c.Relative(self.first), self.oks[0], self.errs[0])
        return (c.Relative(c.Chain(handle_id=self.handle, steps=(self.first, *self.steps))), *self.callbacks())

    def callbacks(self) -> tuple[Ok, Err]:
        def ok() -> None:
            for f in self.oks:
                if f:
                    f()

        def err(exc: Exception) -> None:
            for f in self.errs:
                if f:
                    f(exc)

        return ok, err

    def add_to(self, steps: BatchBuilder) -> bool:
        """Add this chain to `steps` if it is a decode step (engine.gather.decode_shape);
        else False."""
        return add_step(steps, (self.first, *self.steps))



def accepted_drafts(prev_logits: Tensor, rows: Tensor, drafts: tuple[int, ...]) -> int:
    """Greedy acceptance: draft j stands if it is what the target would have chosen."""
    predictions = [int(prev_logits.argmax())] + [int(r.argmax()) for r in rows[:-1]]
    a = 0
    while a < len(drafts) and drafts[a] == predictions[a]:
        a += 1
    return a


def call_shape(members: list[Planned]) -> CallShape:
    return CallShape(len(members), max(len(p.tokens) for p in members),
                     max(p.past + len(p.tokens) for p in members))


def new_txn() -> str:
    return new_id()

