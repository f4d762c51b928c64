"""Runtimes that are not ours: KV-event streams of serving engines (kv_events*), ..."""
