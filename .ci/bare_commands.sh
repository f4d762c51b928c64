#!/usr/bin/env bash
# Every CLI command that needs no extra but the worker, in the bare venv (`.[worker]`, as
# the README's first command installs it), on the journal that command wrote in the current
# directory: a green run with every extra once hid a missing dependency. Each must exit 0.
# (record and serve need no extra: .ci/light_commands.sh records a stream without torch.)
set -euxo pipefail
kvledger schema --compact > /dev/null
kvledger replay --json > replay.json
kvledger export --out audit.jsonl
kvledger import --db sqlite:///imported.db audit.jsonl
kvledger verify --db sqlite:///imported.db
kvledger generate --prompt-ids 1,2,3 --max-new-tokens 4 --db sqlite:///generate.db
kvledger demo --requests 8 --db sqlite:///telemetry.db --telemetry telemetry.jsonl --metrics-out scrape.txt > /dev/null
kvledger reconcile --db sqlite:///telemetry.db --telemetry telemetry.jsonl --metrics scrape.txt
kvledger recover --db sqlite:///generate.db
kvledger crash-test --trials 2 --db sqlite:///crash.db > /dev/null
printf '{"seq":0,"ts":1.0,"events":[{"type":"BlockStored","block_hashes":["00ff"],"token_ids":[1],"block_size":1}]}\n' > kv.jsonl
kvledger kv-events import kv.jsonl --dialect vllm --db sqlite:///kv.db
kvledger verify --db sqlite:///kv.db
# PostgreSQL needs the postgres extra: without it, one coded line naming it (exit 2)
if kvledger replay --db postgresql://kv@127.0.0.1:1/kv 2> pg.err; then exit 1; fi
grep -qx "INVALID_ARGUMENT: .*pip install 'kvledger\[postgres\]'" pg.err
