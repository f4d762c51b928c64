"""The torch-free domain: commands, pure decide/evolve over handle state, views, ids,
and the command service (in this process, or a writer process) that decides and appends
through the journal. Imports schemas and journal only; no torch."""

# Where a worker's command service runs: in the worker's own process (`thread`) or in a writer
# process on the same database (`process`, engine.remote). Here, not in engine.remote, so
# the CLI can offer the choice without loading the journal.
WRITERS = ("thread", "process")
