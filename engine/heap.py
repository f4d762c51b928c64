"""The collector and a long-lived serving process.

A serving process (the model's worker, the journal's writer process) loads everything it
will keep at start-up: the model, torch and the libraries, the journal's modules. A full
collection later traverses all of it, a stop proportional to the heap: 45-100 ms in the
bench's worker (~250,000 objects), ~20 ms in a writer process (~75,000), every few hundred
iterations (docs/PERFORMANCE.md, step 24). freeze_heap puts what start-up loaded out of the
collector's reach once, as vLLM does after its start-up.
"""

from __future__ import annotations

import gc

_frozen = False


def freeze_heap() -> None:
    """Once a process: freeze every object alive (gc.freeze, ~2 µs). Refcounting still
    frees them; only a cycle among them that is garbage (or becomes garbage) is kept. No
    collection first: it cost ~80 ms at every process's start (a crash trial's children,
    a test's) to free ~1,750 objects of import-time garbage, a few hundred KB that now
    stay once."""
    global _frozen
    if not _frozen:
        _frozen = True
        gc.freeze()
