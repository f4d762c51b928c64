"""Telemetry about the journal's mutations: structlog records, Prometheus metrics, and the
exporter that writes them off the producer's thread. Reconciling telemetry against the
journal is the read side's (kvledger.replay.reconcile), which imports none of this."""
