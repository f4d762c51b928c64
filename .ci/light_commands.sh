#!/usr/bin/env bash
# The light core, in a venv with `pip install .` only (no extras, no torch), in an empty
# directory: kvledger imports, records a KV-event stream from a real publisher, replays and
# verifies it; torch and psycopg are not importable there. Each step must succeed.
set -euxo pipefail
ci=$(cd "$(dirname "$0")" && pwd)
if python -c 'import torch' 2>/dev/null; then echo "torch is installed in the light venv"; exit 1; fi
if python -c 'import psycopg' 2>/dev/null; then echo "psycopg is installed in the light venv"; exit 1; fi
python -c 'import kvledger; from kvledger import Ledger'
python "$ci/kv_publish.py" 50 endpoints.txt &
publisher=$!
trap 'kill "$publisher" 2>/dev/null || true' EXIT
for _ in $(seq 300); do [ -s endpoints.txt ] && break; sleep 0.1; done
read -r pub replay < endpoints.txt
kvledger kv-events record --endpoint "$pub" --replay-endpoint "$replay" --topic kv --idle-exit 3 \
    --db sqlite:///kv.db --json
kill "$publisher"
kvledger replay --db sqlite:///kv.db --json > replay.json
kvledger verify --db sqlite:///kv.db
kvledger export --db sqlite:///kv.db --out kv.jsonl
batches=$(grep -c '"kv_events_batch"' kv.jsonl)
[ "$batches" -eq 100 ] || { echo "journaled $batches batches of 100"; exit 1; }
# a command that needs an extra: one coded line naming it
if kvledger demo --requests 8 --db sqlite:///demo.db 2> demo.err; then exit 1; fi
grep -qx "INVALID_ARGUMENT: .*pip install 'kvledger\[worker\]'" demo.err
[ ! -e demo.db ]
if kvledger replay --db postgresql://kv@127.0.0.1:1/kv 2> pg.err; then exit 1; fi
grep -qx "INVALID_ARGUMENT: .*pip install 'kvledger\[postgres\]'" pg.err
