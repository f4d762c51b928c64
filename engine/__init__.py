"""The domain: pure decide/evolve over handle state, the command service that loads,
decides and appends through the journal, and the torch model, KV store and worker."""
