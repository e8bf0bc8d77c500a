"""README's quick start, exactly as written, as a new user runs it on this machine: its first
command (set-up, then ``thaw serve --demo`` on the default port 8000 and ``~/.thaw``), and the
moment the banner is shown its ``curl`` and its Python snippet, each run as it stands in the
README (HOME points at a fresh directory, so ``~/.thaw`` is this test's). The banner means ready:
the demo model answers the first request (before #37 the gateway answered ``/readyz`` before the
demo model was deployed, and a request right after could get a 404). Ctrl-C stops it all.

The commands are read from README.md itself, so a change there is tested as written. Then, on
the same platform, every other ``thaw`` command the README and docs/ show is run as shown, its
placeholders (``/path/to/hf-dir``, ``DIR``, ``spec.yaml``, a deploy id) filled in, each ending as
the page says (`run_the_docs_commands`); the few that need another set-up are run by the tests
named in `RUN_ELSEWHERE`.
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

from tests.doc_commands import doc_commands
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

        run_the_docs_commands(tmp_path, env)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGINT)  # Ctrl-C in the user's terminal reaches the whole group
            try:
                process.wait(DEADLINE_S)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode == 0 and "[thaw] stopped" in "".join(output), "".join(output[-20:])


# Commands the docs show that need what this platform is not (a second node, a moving request, a
# bucket, hours of simulation), with the test that runs each.
RUN_ELSEWHERE = {
    "serve": "this test's first command; tests/infra/test_platform_e2e.py",
    "drain": "tests/infra/test_admin_operations.py (the CLI), tests/infra/test_multinode.py (a real node)",
    "migrate": "tests/infra/test_admin_operations.py (the CLI), tests/infra/test_gateway_migration.py",
    "simulate": "tests/sim/test_simulator.py (thaw simulate --quick; the full run is BENCHMARKS.md's)",
}
S3_SOURCE_TESTS = "tests/controller/test_model_registry.py (a deploy job from another bucket, against moto)"


def run_the_docs_commands(home: Path, env: dict[str, str]) -> None:
    """Every docs command on the running platform, in page order (see the module docstring). A
    plain deploy starts from no model of its name (the pages show each on its own); an update,
    scale or delete follows the deploy before it."""
    model = home / "hf-dir"
    subprocess.run([str(ROOT / ".venv/bin/thaw"), "demo-model", str(model)], env=env, check=True, timeout=DEADLINE_S,
                   capture_output=True)
    (home / "spec.yaml").write_text(f"name: acme/llama\nsource: {model}\nautoscaling:\n  max_instances: 2\n")
    places = {"/path/to/hf-dir": str(model), "/path/to/hf-or-thaw-dir": str(model), "DIR": str(home / "demo"),
              "HF_DIR": str(model), "MODEL_DIR": str(model), "SRC_DIR": str(model), "OUT_DIR": str(home / "out"),
              "URI": str(home / "repo"), "spec.yaml": str(home / "spec.yaml")}
    last_deploy_id = None
    ran: list[str] = []

    def thaw(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(ROOT / ".venv/bin/thaw"), *argv], cwd=home, env=env, capture_output=True,
                              text=True, timeout=DEADLINE_S)

    commands = sorted(doc_commands(), key=lambda c: c.page != "docs/engine.md")  # its demo-model makes DIR
    for command in commands:
        if command.subcommand in RUN_ELSEWHERE:
            continue
        if command.subcommand == "deploy" and any(a.startswith("s3://") for a in command.argv):
            assert S3_SOURCE_TESTS
            continue
        argv = [places.get(a, a) for a in command.argv]
        if command.subcommand == "deploys" and "d1f2a-3" in argv:
            assert last_deploy_id is not None, "the docs show --no-wait before following its id"
            argv = [last_deploy_id if a == "d1f2a-3" else a for a in argv]
        if command.subcommand == "convert":
            argv.append("--overwrite") if "--overwrite" not in argv else None
        if command.subcommand == "deploy" and "--update" not in argv:  # each deploy shown stands alone
            name = argv[argv.index("--name") + 1] if "--name" in argv else "acme/llama"  # spec.yaml's
            thaw("delete", name)  # absent is fine
        result = thaw(*argv)
        ran.append(command.where)
        if "--max-model-len" in argv:  # the docs' long-context example, refused for a 2,048-token model
            assert result.returncode == 2 and "exceeds the model's context (max_position_embeddings 2048)" in \
                result.stderr, (command.where, result.stderr)
            continue
        assert result.returncode == 0, (command.where, result.stdout[-2000:], result.stderr[-2000:])
        if "--no-wait" in argv:
            found = re.search(r"started as (\S+);", result.stderr)
            assert found, result.stderr
            last_deploy_id = found.group(1)
    ran_subcommands = {c.subcommand for c in commands if c.where in ran}
    assert len(ran) >= 20 and {c.subcommand for c in commands} <= ran_subcommands | set(RUN_ELSEWHERE)
