"""The pieces every bench-owned virtual environment shares: where it lives, its lock, its marker, its pip steps.

A peer the benches compare against (guidellm, vLLM's CPU build) pins versions of packages the
project also uses, torch included; installed into the project's ``.venv`` it could move what the
engine runs on. So each peer lives in a venv of its own under ``~/.cache/thaw/venvs/<name>-<version>``
(``$XDG_CACHE_HOME`` honoured, an environment variable per peer names another folder), made once
and reused. The peer's module (`bench.guidellm_venv`, `bench.vllm_cpu_venv`) says what goes in;
this one says how:

* `default_venv_dir`: the folder, from the environment passed in (no global state read here
  unless the caller passes ``os.environ``).
* `venv_lock`: an exclusive ``flock`` beside the venv, so two callers (two test sessions) making the
  same venv take turns and the second finds it made.
* `is_marked` / `write_marker`: a JSON marker naming exactly what was installed, written last, only
  when every step succeeded; a venv made for other versions (or half made) is made again.
* `run_step` / `pip_install`: one subprocess step whose failure raises the peer's ``...Unavailable``
  error (a subclass of `VenvUnavailable`) naming the step, pip's last words and what to change,
  so a test or a bench can skip with the message.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path

# Some machines' pip configs name index folders that do not exist; that noise is not ours.
PIP_NOISE = "is ignored: it is neither a file nor a directory"


class VenvUnavailable(RuntimeError):
    """A bench venv could not be made; the message says why and what to change."""


def default_venv_dir(name: str, version: str, env_var: str, environ: Mapping[str, str]) -> Path:
    """``$<env_var>``, else ``<$XDG_CACHE_HOME or ~/.cache>/thaw/venvs/<name>-<version>``."""
    if environ.get(env_var):
        return Path(environ[env_var]).expanduser()
    cache = Path(environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "thaw" / "venvs" / f"{name}-{version}"


def refuse_running_venv(venv_dir: Path, unavailable: type[VenvUnavailable], hint: str) -> None:
    """Raises when ``venv_dir`` is the venv this Python runs in (the project's): never install there."""
    if venv_dir.resolve() == Path(sys.prefix).resolve():
        raise unavailable(f"{venv_dir} is the venv this Python runs in (the project's); {hint}")


def is_marked(venv_dir: Path, marker_name: str, expected: Mapping[str, str]) -> bool:
    """True when the venv's marker records exactly ``expected`` (what a finished make writes)."""
    try:
        recorded = json.loads((venv_dir / marker_name).read_text())
    except (OSError, ValueError):
        return False
    return recorded == dict(expected)


def write_marker(venv_dir: Path, marker_name: str, recorded: Mapping[str, str]) -> None:
    (venv_dir / marker_name).write_text(json.dumps(dict(recorded)))


@contextlib.contextmanager
def venv_lock(venv_dir: Path) -> Iterator[None]:
    """Holds an exclusive lock on ``.<venv name>.lock`` beside the venv (its parent is made)."""
    venv_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(venv_dir.parent / f".{venv_dir.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        yield


def run_step(argv: list[str], what: str, timeout_s: float, unavailable: type[VenvUnavailable],
             failure_hint: str = "check that a package index is reachable (pip's index-url / PIP_EXTRA_INDEX_URL)",
             ) -> subprocess.CompletedProcess:
    """Runs one step; raises ``unavailable`` naming the step, its last three lines and ``failure_hint``."""
    try:
        result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise unavailable(f"{what} took longer than {timeout_s:.0f} s (a slow or absent package index?); "
                          "raise install_timeout_s or check the network") from None
    except OSError as exc:  # the interpreter itself is missing or not executable
        raise unavailable(f"{what} could not start {argv[0]} ({exc.strerror}); "
                          "give base_python an interpreter that exists") from None
    if result.returncode != 0:
        lines = [line for line in (result.stderr + result.stdout).splitlines()
                 if line.strip() and PIP_NOISE not in line]
        tail = " | ".join(lines[-3:]) or f"exit status {result.returncode}"
        raise unavailable(f"{what} failed ({tail}); {failure_hint}")
    return result


def create_venv(base_python: str, venv_dir: Path, timeout_s: float, unavailable: type[VenvUnavailable]) -> None:
    run_step([base_python, "-m", "venv", str(venv_dir)], "creating the venv", timeout_s, unavailable)


def pip_install(python: Path, requirement: str, timeout_s: float, unavailable: type[VenvUnavailable]) -> None:
    run_step([str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", requirement],
             f"pip install {requirement}", timeout_s, unavailable)
