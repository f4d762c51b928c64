"""A scripted client over the worker's public API: what the demo does to its requests.

A `Script` is a list of `Action`s, each on one request, taken once that request has a
number of outputs. Between the worker's iterations (`Worker.run`'s on_step) the script
asks what is due through the worker's client methods (`cancel`, `truncate`, `reorder`,
`repair`), which take effect at the next iteration. A failed forward call is injected
from outside the worker too: a forward hook on the model the script's caller owns makes
the next decode call raise, as a device error would, and the worker ends that call's
appends in failure events and runs them again.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal

import msgspec
from torch.utils.hooks import RemovableHandle

from kvledger.worker.serving import Worker

Kind = Literal["cancel", "truncate", "repair", "reorder", "fault"]


class Action(msgspec.Struct, frozen=True):
    """`kind` on request `request_id` once it has `after` outputs (reorder: once every
    row of its fork group has; repair is asked for before the request runs)."""

    request_id: str
    kind: Kind
    after: int = 0
    rows: int = 2  # truncate: how many rows to roll back (never into the prompt)
    permutation: tuple[int, ...] = ()  # reorder: new row i <- old row permutation[i]


class InjectedFault(RuntimeError):
    """The forward call failed because a script's `fault` action asked it to."""


class Script(msgspec.Struct, frozen=True):
    actions: tuple[Action, ...] = ()

    def play(self, worker: Worker, on_step: Callable[[Worker], None] | None = None,
             max_steps: int = 100_000) -> dict[str, list[int]]:
        """Run `worker` until every request is done, taking each action when it is due;
        `on_step` is then called as Worker.run calls it. Returns Worker.run's outputs."""
        player = _Player(self.actions, worker)

        def step(w: Worker) -> None:
            player.step()
            if on_step is not None:
                on_step(w)

        try:
            return worker.run(on_step=step, max_steps=max_steps)
        finally:
            player.close()


class _Player:
    """One play of a script on one worker: the actions still to come, and the armed fault."""

    def __init__(self, actions: Sequence[Action], worker: Worker) -> None:
        self.worker = worker
        self.todo = [a for a in actions if a.kind != "repair"]
        for a in actions:
            if a.kind == "repair":
                worker.repair(a.request_id)
        self.hook: RemovableHandle | None = None

    def step(self) -> None:
        for a in list(self.todo):
            rows = _rows(self.worker, a)
            if rows is None:
                continue  # not arrived yet
            live = [self.worker.live[h] for h in rows]
            if any(lv.done is not None for lv in live):
                self.todo.remove(a)  # done first: too late
            elif all(len(lv.outputs) >= a.after for lv in live):
                self.todo.remove(a)
                self._take(a, rows)

    def _take(self, a: Action, rows: tuple[str, ...]) -> None:
        w, h = self.worker, a.request_id
        if a.kind == "cancel":
            w.cancel(h)
        elif a.kind == "truncate":
            p, n = len(w.live[h].spec.prompt), len(w.live[h].outputs)
            w.truncate(h, max(p, p + n - 1 - a.rows))  # the newest output stays as the frontier at most
        elif a.kind == "reorder":
            w.reorder(rows, a.permutation)
        elif a.kind == "fault" and self.hook is None:
            self.hook = w.model.register_forward_hook(self._fail_decode)

    def _fail_decode(self, module: Any, args: tuple[Any, ...], output: Any) -> None:
        """After the next decode call ran (its rows are staged), fail it, once."""
        if args[0].shape[1] != 1:  # a prefill or verify call: one row per member is a decode
            return
        assert self.hook is not None
        self.hook.remove()
        raise InjectedFault("injected fault in a decode call")

    def close(self) -> None:
        if self.hook is not None:
            self.hook.remove()


def _rows(w: Worker, a: Action) -> tuple[str, ...] | None:
    """The handles `a` waits on, once they are all live."""
    rows = (a.request_id, *(f"{a.request_id}.{i}" for i in range(1, len(a.permutation))))
    return rows if all(h in w.live for h in rows) else None
