"""The platform a benchmark drives as a user would: ``python -m infra.cli serve`` (``thaw serve``)
started in a process group of its own, waited for until its admin API answers, asked for its
status and sent deploy specs through that API (`infra.admin_client`), and stopped with SIGINT so
it stops its Ray cleanly (`bench/gpu_platform.py` runs it; split from there).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

from bench.coldstart import wait_for
from bench.gpu_common import ROOT


class ServedPlatform:
    """``python -m infra.cli serve`` in a process group of its own, and its admin API."""

    def __init__(self, command: list[str], url: str, log_path: Path, request_timeout_s: float) -> None:
        self.command, self.url, self.log_path = command, url, log_path
        self.request_timeout_s = request_timeout_s  # each admin API call's timeout
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
               "PYTHONUNBUFFERED": "1"}
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen(self.command, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        wait_for(self._answers, "the platform's admin API", timeout_s, 0.5)

    def _answers(self) -> bool:
        from infra.admin_client import AdminUnreachable

        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"thaw serve exited ({self.proc.returncode}); its log ends: {self.log_tail()}")
        try:
            self.status()
        except AdminUnreachable:
            return False
        return True

    def _call(self, name: str, *args: Any) -> Any:
        from infra.admin_client import AdminClient

        async def call() -> Any:
            async with AdminClient(self.url, None, timeout_s=self.request_timeout_s) as client:
                return await getattr(client, name)(*args)

        return asyncio.run(call())

    def status(self) -> dict[str, Any]:
        return self._call("status")

    def deploy(self, spec: dict[str, Any]) -> dict[str, Any]:
        return self._call("deploy", spec)

    def log_tail(self, num_chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-num_chars:] if self.log_path.exists() else ""

    def stop(self) -> None:
        """SIGINT (``thaw serve`` stops the platform and its Ray cleanly), then the group killed."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
