"""`served_app`: an ASGI app served over real HTTP by uvicorn on a free port, in a background
thread, for tests that call it with real clients (the official `openai` client). "Up" is a
/healthz poll with a deadline; leaving the context stops the server and joins its thread."""

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


def wait_healthy(base_url: str, thread: threading.Thread) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while True:
        try:
            with urllib.request.urlopen(f"{base_url}/healthz", timeout=1) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        assert thread.is_alive(), "uvicorn exited during start-up"
        assert time.monotonic() < deadline, "the gateway did not answer /healthz in time"
        time.sleep(0.02)


@contextmanager
def served_app(app) -> Iterator[str]:
    """Serves `app`; yields its base URL (``http://127.0.0.1:<port>``)."""
    sock = free_socket()
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    base_url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    try:
        wait_healthy(base_url, thread)
        yield base_url
    finally:
        server.should_exit = True
        thread.join(DEADLINE_S)
        sock.close()
