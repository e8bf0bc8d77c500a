"""README's quick start, exactly as written, as a new user runs it on this machine: its first
command (set-up, then ``thaw serve --demo`` on the default port 8000 and ``~/.thaw``), and the
moment the banner is shown its ``curl`` and its Python snippet, each run as it stands in the
README (HOME points at a fresh directory, so ``~/.thaw`` is this test's). The banner means ready:
the demo model answers the first request (before #37 the gateway answered ``/readyz`` before the
demo model was deployed, and a request right after could get a 404). Ctrl-C stops it all.

The commands are read from README.md itself, so a change there is tested as written.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tests.infra.running_platform import DEADLINE_S, START_DEADLINE_S, wait_for

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SETUP_DEADLINE_S = 600.0  # the first command sets up first: seconds on a set-up clone, minutes on a fresh one


def readme_blocks(language: str) -> list[str]:
    """The README's fenced code blocks in `language`, in order."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    return re.findall(rf"```{language}\n(.*?)```", text, flags=re.S)


def the_block(language: str, containing: str) -> str:
    found = [block for block in readme_blocks(language) if containing in block]
    assert found, f"README.md has no ```{language} block with {containing!r}"
    return found[0]


def test_the_readme_quick_start_as_written(tmp_path):
    serve_command = the_block("bash", "thaw serve --demo").strip()
    assert serve_command.startswith("bash infra/setup.sh") and serve_command.count("\n") == 0
    curl_command = the_block("bash", "curl ")
    python_snippet = the_block("python", "from openai import OpenAI")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("THAW_", "RAY_ADDRESS"))}
    env["HOME"] = str(tmp_path)  # ~/.thaw is this test's own
    process = subprocess.Popen(["bash", "-c", serve_command], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True)
    output: list[str] = []
    threading.Thread(target=lambda: output.extend(process.stdout), daemon=True).start()
    try:
        wait_for(lambda: any("Ctrl-C stops" in line for line in output) or process.poll() is not None,
                 "the banner", SETUP_DEADLINE_S + START_DEADLINE_S, interval_s=0.05)
        assert process.poll() is None, "the first command exited:\n" + "".join(output)
        text = "".join(output)
        assert "demo model demo/tiny deployed" in text and "admin key" in text.lower()
        assert (tmp_path / ".thaw" / "admin_key").is_file()

        # The moment the banner shows: README's curl, as written.
        curl = subprocess.run(["bash", "-c", curl_command], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=DEADLINE_S)
        assert curl.returncode == 0, curl.stderr
        events = [line for line in curl.stdout.splitlines() if line.startswith("data: ")]
        assert events and events[-1] == "data: [DONE]", curl.stdout
        assert '"model":"demo/tiny"' in events[0].replace(" ", "") and '"finish_reason":"' in curl.stdout.replace(" ", "")

        # And the Python snippet, as written.
        snippet = subprocess.run([sys.executable, "-c", python_snippet], cwd=tmp_path, env=env, capture_output=True,
                                 text=True, timeout=DEADLINE_S)
        assert snippet.returncode == 0, snippet.stderr
        assert snippet.stdout.strip()  # the streamed text (gibberish: the demo weights are random)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGINT)  # Ctrl-C in the user's terminal reaches the whole group
            try:
                process.wait(DEADLINE_S)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode == 0 and "[thaw] stopped" in "".join(output), "".join(output[-20:])
