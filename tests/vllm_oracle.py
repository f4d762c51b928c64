"""vLLM's own KV-event publisher and decoder, as a test oracle in a process of its own
(importing vllm changes torch settings of the process that imports it).

    python tests/vllm_oracle.py PUB_ENDPOINT REPLAY_ENDPOINT TOPIC

Runs vllm.distributed.kv_events.ZmqEventPublisher (rank 0) on the endpoints and reads
commands on stdin, one a line; each answer is one stdout line `ORACLE <json>` (vLLM may
log on stdout too):

- (at start) {"ready": true, "version": vllm.__version__}, or {"skip": reason} when vllm
  does not import;
- `publish N SEED`: N generated KVEventBatch through publisher.publish, {"published": N}
  once the publisher's replay buffer holds them all;
- `decode HEX,HEX,...`: each payload through msgspec.msgpack.Decoder(KVEventBatch), as
  vLLM's consumers decode, {"decoded": [to_builtins(batch) or {"error": message}, ...]};
- `quit`: the publisher shut down, exit 0.
"""

from __future__ import annotations

import json
import random
import sys
import time
from typing import Any


def _say(doc: dict[str, Any]) -> None:
    print("ORACLE " + json.dumps(doc), flush=True)


def _hash(rng: random.Random) -> Any:
    # vLLM's ExternalBlockHash is bytes (a sha256 digest) or an int (64 bits, either sign)
    return rng.randbytes(32) if rng.random() < 0.7 else rng.choice([rng.randrange(1 << 64), -rng.randrange(1 << 63)])


def _batches(kv: Any, n: int, seed: int) -> list[Any]:
    rng = random.Random(seed)
    resident: list[Any] = []
    out = []
    for i in range(n):
        events: list[Any] = []
        for _ in range(rng.randint(0, 5)):
            roll = rng.random()
            if roll < 0.6 or not resident:
                hashes = [_hash(rng) for _ in range(rng.randint(1, 3))]
                lora = rng.random() < 0.3
                extra = rng.choice([None, [("salt-1",)] * len(hashes),
                                    [None] * (len(hashes) - 1) + [("ad", ("mm0", 4))]])
                events.append(kv.BlockStored(
                    block_hashes=hashes, parent_block_hash=rng.choice([None, *resident[-2:]]),
                    token_ids=[rng.randrange(1 << 17) for _ in range(16 * len(hashes))], block_size=16,
                    lora_id=rng.randint(1, 4) if lora else None, medium=rng.choice(["GPU", "CPU", None]),
                    lora_name="ad" if lora else None, extra_keys=extra, group_idx=rng.choice([None, 0, 1]),
                    kv_cache_spec_kind=rng.choice([None, "full_attention", "sliding_window"]),
                    kv_cache_spec_sliding_window=rng.choice([None, 4096]), locality=rng.choice([None, "LOCAL"]),
                    ownership=rng.choice([None, "tier-2"]), session_id=rng.choice([None, f"s{i}"]),
                    lookahead_token_ids=rng.choice([None, [[1, 2]] * len(hashes)])))
                resident += hashes
            elif roll < 0.95:
                gone = rng.sample(resident, min(len(resident), rng.randint(1, 2)))
                resident = [h for h in resident if h not in gone]
                events.append(kv.BlockRemoved(block_hashes=gone, medium=rng.choice(["GPU", None]),
                                              group_idx=rng.choice([None, 0]), locality=rng.choice([None, "REMOTE"]),
                                              ownership=rng.choice([None, "tier-2"])))
            else:
                resident = []
                events.append(kv.AllBlocksCleared())
        out.append(kv.KVEventBatch(ts=time.time() + rng.random(), events=events))
    return out


def main(pub: str, replay: str, topic: str) -> None:
    try:
        import msgspec
        import vllm
        from vllm.distributed import kv_events as kv
    except Exception as exc:  # noqa: BLE001 - any import failure is the reason to skip
        _say({"skip": f"vllm does not import here: {type(exc).__name__}: {exc}"[:300]})
        return
    publisher = kv.ZmqEventPublisher(0, endpoint=pub, replay_endpoint=replay, buffer_steps=10_000, topic=topic)
    decoder = msgspec.msgpack.Decoder(kv.KVEventBatch)
    _say({"ready": True, "version": vllm.__version__})
    for line in sys.stdin:
        command, *args = line.split()
        if command == "publish":
            n, seed = int(args[0]), int(args[1])
            for batch in _batches(kv, n, seed):
                publisher.publish(batch)
            deadline = time.monotonic() + 30
            while len(publisher._buffer) < n and time.monotonic() < deadline:  # its replay buffer has them all
                time.sleep(0.01)
            _say({"published": len(publisher._buffer)})
        elif command == "decode":
            decoded = []
            for payload in (bytes.fromhex(h) for h in (args[0].split(",") if args else [])):
                try:
                    decoded.append(msgspec.to_builtins(decoder.decode(payload)))
                except msgspec.MsgspecError as exc:
                    decoded.append({"error": str(exc)})
            _say({"decoded": decoded})
        elif command == "quit":
            break
    publisher.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:4])
