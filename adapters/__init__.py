"""Runtimes that are not ours: Hugging Face transformers under the journal (hf*: a
journaled Cache and its re-execution proof; `kvledger.hf` is the public entry point) and
KV-event streams of serving engines (kv_events*). Imports engine, journal, schemas, worker
and replay, never the facade."""
