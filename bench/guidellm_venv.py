"""A virtual environment of its own for `guidellm` (vLLM's benchmark tool), made once and reused.

guidellm pins versions of pydantic, httpx, transformers and more that need not agree with Thaw's,
and it depends on torch: installed into the project's ``.venv`` it could move the packages the
engine runs on. So it lives apart, by default in ``~/.cache/thaw/venvs/guidellm-<version>``
(``$XDG_CACHE_HOME`` is honoured; ``THAW_GUIDELLM_VENV`` names another folder). torch's CPU build
is installed first, so that pip, resolving guidellm, finds torch already there and never pulls
the multi-gigabyte CUDA build (the same wheel `infra/setup.sh` picks on a machine without a GPU).

`prepare_guidellm_venv` creates the venv, installs into it, and writes a marker naming what was
installed only when every step succeeded; a later call that finds the marker returns at once. A
lock file serialises two callers (two test sessions) making the same venv (the lock, marker and
pip steps are `bench.isolated_venv`'s, shared with vLLM's venv). What cannot be had
(no package index, no network) raises `GuidellmUnavailable` whose message says what failed and
what to change, so a test can skip with it. Progress goes to ``log`` (stderr by default).

    python bench/guidellm_venv.py        # make (or find) the venv; prints its python's path
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):
    # Run as a script (`python bench/guidellm_venv.py`): make the repo root importable.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.isolated_venv import (  # noqa: E402
    VenvUnavailable,
    create_venv,
    is_marked,
    pip_install,
    refuse_running_venv,
    venv_lock,
    write_marker,
)
from bench.isolated_venv import default_venv_dir as _cache_venv_dir  # noqa: E402

GUIDELLM_VERSION = "0.8.1"
TORCH_SPEC = "torch==2.13.0+cpu"
VENV_ENV_VAR = "THAW_GUIDELLM_VENV"
MARKER = "thaw-guidellm-ready.json"
INSTALL_TIMEOUT_S = 1800.0


class GuidellmUnavailable(VenvUnavailable):
    """guidellm could not be installed; the message says why and what to change."""


def default_venv_dir(version: str = GUIDELLM_VERSION, environ: dict[str, str] | None = None) -> Path:
    """``$THAW_GUIDELLM_VENV``, else ``<cache>/thaw/venvs/guidellm-<version>``."""
    return _cache_venv_dir("guidellm", version, VENV_ENV_VAR, os.environ if environ is None else environ)


@dataclass(frozen=True)
class GuidellmVenvConfig:
    """Where the venv lives and what goes into it.

    venv_dir: the venv's folder (made if missing; never the project's ``.venv``).
    guidellm_version: the exact guidellm release installed.
    torch_spec: the torch requirement installed before guidellm (the CPU build by default).
    base_python: the interpreter the venv is made from.
    install_timeout_s: the longest one pip step may take.
    """

    venv_dir: Path
    guidellm_version: str = GUIDELLM_VERSION
    torch_spec: str = TORCH_SPEC
    base_python: str = sys.executable
    install_timeout_s: float = INSTALL_TIMEOUT_S

    def __post_init__(self) -> None:
        if not isinstance(self.venv_dir, Path):
            raise ValueError(f"venv_dir must be a pathlib.Path, got {self.venv_dir!r}")
        if not isinstance(self.guidellm_version, str) or not self.guidellm_version.strip():
            raise ValueError(f"guidellm_version must be a release like {GUIDELLM_VERSION!r}, "
                             f"got {self.guidellm_version!r}")
        if not isinstance(self.torch_spec, str) or not self.torch_spec.startswith("torch"):
            raise ValueError(f"torch_spec must be a torch requirement like {TORCH_SPEC!r}, got {self.torch_spec!r}")
        if not isinstance(self.install_timeout_s, (int, float)) or self.install_timeout_s <= 0:
            raise ValueError(f"install_timeout_s must be > 0 seconds, got {self.install_timeout_s!r}")

    @classmethod
    def default(cls) -> GuidellmVenvConfig:
        return cls(venv_dir=default_venv_dir())

    @property
    def python(self) -> Path:
        return self.venv_dir / "bin" / "python"

    @property
    def guidellm(self) -> Path:
        return self.venv_dir / "bin" / "guidellm"

    def marker(self) -> dict[str, str]:
        """What the ready marker records: a venv made for other versions is made again."""
        return {"guidellm": self.guidellm_version, "torch": self.torch_spec}


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def is_ready(config: GuidellmVenvConfig) -> bool:
    """True when the venv was fully made for exactly this config."""
    return is_marked(config.venv_dir, MARKER, config.marker()) and config.python.is_file() \
        and config.guidellm.is_file()


def prepare_guidellm_venv(config: GuidellmVenvConfig | None = None,
                          log: Callable[[str], None] = _stderr) -> Path:
    """Makes (or finds) the venv; returns the path of its ``guidellm`` executable.

    Raises `GuidellmUnavailable` when it cannot be made; a half-made venv is finished next time.
    """
    config = GuidellmVenvConfig.default() if config is None else config
    refuse_running_venv(config.venv_dir, GuidellmUnavailable,
                        f"give guidellm a folder of its own (unset {VENV_ENV_VAR} for the default)")
    if is_ready(config):
        return config.guidellm
    with venv_lock(config.venv_dir):  # another caller making it: wait, then find it made
        if is_ready(config):
            return config.guidellm
        started = time.monotonic()
        (config.venv_dir / MARKER).unlink(missing_ok=True)
        if not config.python.is_file():
            log(f"[guidellm-venv] creating {config.venv_dir}")
            create_venv(config.base_python, config.venv_dir, config.install_timeout_s, GuidellmUnavailable)
        log(f"[guidellm-venv] installing {config.torch_spec} (first, so guidellm never pulls a CUDA torch)")
        pip_install(config.python, config.torch_spec, config.install_timeout_s, GuidellmUnavailable)
        log(f"[guidellm-venv] installing guidellm=={config.guidellm_version}")
        pip_install(config.python, f"guidellm=={config.guidellm_version}", config.install_timeout_s,
                    GuidellmUnavailable)
        if not config.guidellm.is_file():
            raise GuidellmUnavailable(f"guidellm=={config.guidellm_version} installed no {config.guidellm}; "
                                      f"delete {config.venv_dir} and try again")
        write_marker(config.venv_dir, MARKER, config.marker())
        log(f"[guidellm-venv] ready in {time.monotonic() - started:.0f} s: {config.guidellm}")
        return config.guidellm


def main() -> None:
    try:
        print(prepare_guidellm_venv())
    except GuidellmUnavailable as exc:
        sys.exit(f"guidellm unavailable: {exc}")


if __name__ == "__main__":
    main()
