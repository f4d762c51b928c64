"""The torch-free domain: commands, pure decide/evolve over handle state, views, ids,
and the command service (in this process, or a writer process) that decides and appends
through the journal. Imports schemas and journal only; no torch."""
