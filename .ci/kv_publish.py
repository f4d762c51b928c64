"""A KV-event publisher for CI's light venv (tests/kv_publisher.py: pyzmq and msgspec only).

    python .ci/kv_publish.py N ENDPOINTS_FILE

Publishes N vLLM-form batches into its replay buffer, writes "PUB_ENDPOINT REPLAY_ENDPOINT"
to ENDPOINTS_FILE, then N more live (a second later, over a second), and serves replays
until it is killed (or for 120 s)."""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from kv_publisher import Publisher, Workload

n, endpoints = int(sys.argv[1]), Path(sys.argv[2])
pub = Publisher("vllm", topic="kv")
work = Workload(0)
for _ in range(n):
    pub.publish(work.batch())
tmp = endpoints.with_suffix(".tmp")
tmp.write_text(f"{pub.endpoint} {pub.replay_endpoint}\n")
tmp.rename(endpoints)  # whole or not there: the reader never sees half a line
time.sleep(1.0)
for _ in range(n):
    pub.publish(work.batch())
    time.sleep(1.0 / n)
time.sleep(120)
pub.close()
