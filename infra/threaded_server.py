"""`served_app`: an ASGI app served over real HTTP by uvicorn on a free port, in a background
thread of this process, for the tests and benchmarks that call the gateway with real clients
(the official `openai` client, guidellm). "Up" is a poll of a health path with a deadline;
leaving the context stops the server and joins its thread. (`thaw serve` runs the gateway
under Ray Serve instead: `infra.platform`.)"""

from __future__ import annotations

import socket
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn

DEADLINE_S = 20.0


def free_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))  # the OS picks a free port; uvicorn serves on this very socket
    return sock


def wait_healthy(base_url: str, thread: threading.Thread, path: str = "/healthz") -> None:
    """Polls ``base_url + path`` until it answers 200; `RuntimeError` if the server thread died
    or `DEADLINE_S` passed."""
    deadline = time.monotonic() + DEADLINE_S
    while True:
        try:
            with urllib.request.urlopen(f"{base_url}{path}", timeout=1) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        if not thread.is_alive():
            raise RuntimeError("uvicorn exited during start-up")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the server did not answer {path} within {DEADLINE_S:g} s")
        time.sleep(0.02)  # a poll interval, bounded by the deadline


@contextmanager
def served_app(app, health_path: str = "/healthz") -> Iterator[str]:
    """Serves `app`; yields its base URL (``http://127.0.0.1:<port>``) once `health_path` answers."""
    sock = free_socket()
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="served-app", daemon=True)
    thread.start()
    base_url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    try:
        wait_healthy(base_url, thread, health_path)
        yield base_url
    finally:
        server.should_exit = True
        thread.join(DEADLINE_S)
        sock.close()
