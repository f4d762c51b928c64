"""Runtimes that are not ours: Hugging Face transformers under the journal (a journaled
Cache and its re-execution proof). Imports engine, journal, schemas, worker and replay,
never the facade; `kvledger.hf` is the public entry point."""
