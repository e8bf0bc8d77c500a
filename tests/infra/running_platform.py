"""``thaw serve`` as a subprocess, the way a user runs it, for the end-to-end tests.

`start_platform` launches it on a free port with a state directory and a Ray namespace of its own
(so two platforms can run side by side), waits for its banner, and on exit stops it with SIGINT;
`RunningPlatform` holds its output and operates it: the ``thaw`` CLI against its state
directory, ``thaw status --json``, the official ``openai`` client with the admin key or a
tenant's, and a record of its processes so a test can check that none is left at the end.
Every wait is a poll with a deadline (`wait_for`).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import psutil

THAW = str(Path(sys.executable).parent / "thaw")
START_DEADLINE_S = 180.0
DEADLINE_S = 90.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for(predicate: Callable[[], Any], what: str, timeout_s: float = DEADLINE_S, interval_s: float = 0.1) -> Any:
    """Polls until `predicate()` is truthy and returns it; fails after the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out after {timeout_s:g} s waiting for {what}"
        time.sleep(interval_s)


class RunningPlatform:
    """The ``thaw serve`` subprocess, its output, and helpers to operate and call it."""

    def __init__(self, process: subprocess.Popen, url: str, state_dir: Path, namespace: str, env: dict[str, str],
                 model_dir: Path) -> None:
        self.process, self.url, self.state_dir, self.namespace, self.env = process, url, state_dir, namespace, env
        self.model_dir = model_dir
        self.output: list[str] = []
        self.tenant_keys: dict[str, str] = {}
        self.references: dict[str, Any] = {}
        self.pids: set[int] = set()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.output.append(line)

    @property
    def admin_key(self) -> str:
        return (self.state_dir / "admin_key").read_text().strip()

    def thaw(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        """Runs a ``thaw`` admin command; the URL and key come from the state directory, as for a user."""
        result = subprocess.run([THAW, *args, "--state", str(self.state_dir)], capture_output=True, text=True,
                                timeout=DEADLINE_S, env=self.env)
        if check:
            assert result.returncode == 0, f"thaw {' '.join(args)}: {result.stderr}"
        return result

    def status(self) -> dict[str, Any]:
        return json.loads(self.thaw("status", "--json").stdout)

    def model_status(self, model_id: str) -> dict[str, Any]:
        return next(m for m in self.status()["models"] if m["model_id"] == model_id)

    def client(self, api_key: str | None = None, timeout_s: float = DEADLINE_S) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key or self.admin_key, max_retries=0,
                             timeout=timeout_s)

    def processes(self) -> list[psutil.Process]:
        """Every process the platform runs now (``thaw serve``'s descendants)."""
        return psutil.Process(self.process.pid).children(recursive=True)

    def note_processes(self) -> None:
        """Remembers every process the platform runs now, to check at the end that none is left."""
        self.pids |= {p.pid for p in self.processes()}

    def leftover_pids(self) -> list[int]:
        """Noted processes still running (zombies excluded)."""
        left = []
        for pid in self.pids:
            with contextlib.suppress(psutil.NoSuchProcess):
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    left.append(pid)
        return left


@contextlib.contextmanager
def start_platform(root: Path, model_dir: Path, *args: str, prefix: str = "e2e", demo: bool = True
                   ) -> Iterator[RunningPlatform]:
    """``thaw serve --demo`` (without `demo`: no demo model) with `args` (after the state, port and
    namespace it picks), running until the block ends; then SIGINT (a kill after the deadline)."""
    state_dir, port, namespace = root / "state", free_port(), f"{prefix}{uuid.uuid4().hex[:8]}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("THAW_", "RAY_ADDRESS"))}
    process = subprocess.Popen(
        [THAW, "serve", *(["--demo"] if demo else []), "--state", str(state_dir), "--port", str(port), "--namespace", namespace, *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    running = RunningPlatform(process, f"http://127.0.0.1:{port}", state_dir, namespace, env, model_dir)
    try:
        wait_for(lambda: any("Ctrl-C stops" in line for line in running.output) or process.poll() is not None,
                 "thaw serve to start", START_DEADLINE_S)
        assert process.poll() is None, "thaw serve exited:\n" + "".join(running.output)
        yield running
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(DEADLINE_S)
            except subprocess.TimeoutExpired:
                process.kill()
