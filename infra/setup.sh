#!/usr/bin/env bash
# Sets up Thaw in ./.venv: the right torch build for this machine, then the project.
#   bash infra/setup.sh          # runtime only
#   bash infra/setup.sh --test   # plus what the test suite and benchmarks need
# On a machine without an NVIDIA driver this installs the CPU build of torch 2.13.0 and
# never a CUDA build. Override the torch requirement with THAW_TORCH_SPEC (e.g. a CUDA
# build from your own wheel index, set through PIP_EXTRA_INDEX_URL).
set -euo pipefail
cd "$(dirname "$0")/.."

python_bin="${THAW_PYTHON:-python3.11}"
command -v "$python_bin" >/dev/null 2>&1 || python_bin=python3
venv="${THAW_VENV:-.venv}"

if [ ! -x "$venv/bin/python" ]; then
    echo "[setup] creating $venv with $($python_bin --version)"
    "$python_bin" -m venv "$venv"
fi
abs_venv="$(cd "$venv" && pwd)"
pip_install() {
    # Some machines' pip configs name index folders that do not exist; that noise is not ours.
    local status
    set +e
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "$@" 2>&1 \
        | grep -v "is ignored: it is neither a file nor a directory"
    status=${PIPESTATUS[0]}
    set -e
    return "$status"
}

if [ -n "${THAW_TORCH_SPEC:-}" ]; then
    torch_spec="$THAW_TORCH_SPEC"
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    torch_spec="torch==2.13.0"          # PyPI's default build is the CUDA one
else
    torch_spec="torch==2.13.0+cpu"      # CPU-only machine: never pull CUDA wheels
fi
if ! "$venv/bin/python" -c "import torch" >/dev/null 2>&1; then
    echo "[setup] installing $torch_spec"
    if ! pip_install "$torch_spec"; then
        echo "[setup] could not install '$torch_spec'." >&2
        echo "        Point pip at a wheel index that has it (PIP_EXTRA_INDEX_URL) or set THAW_TORCH_SPEC." >&2
        exit 1
    fi
fi

extras=""
[ "${1:-}" = "--test" ] && extras="[test]"
echo "[setup] installing thaw$extras (editable)"
pip_install -e ".$extras"
# Hugging Face's `kernels` distribution (a dependency of transformers >= 5.25) has the same import
# name as Thaw's kernels/ package and shadows it wherever the repository is not the working folder.
if ! (cd / && "$abs_venv/bin/python" -c "import kernels; raise SystemExit(not hasattr(kernels, 'prepare_cpu_kernels'))") 2>/dev/null; then
    echo "[setup] 'import kernels' does not find Thaw's kernels package in $venv: another distribution" >&2
    echo "        named 'kernels' is installed there (Hugging Face's, pulled in by transformers >= 5.25)." >&2
    echo "        Remove it ($venv/bin/python -m pip uninstall kernels) and keep transformers < 5.25." >&2
    exit 1
fi
if "$venv/bin/python" -c "import torch; raise SystemExit(torch.cuda.is_available())"; then  # exits 0 without CUDA
    echo "[setup] building the CPU kernels for this CPU's instruction set (once, ~60 s; cached)"
    "$venv/bin/python" -c "
from kernels import prepare_cpu_kernels
from kernels.cpu_isa import best_isa
why = prepare_cpu_kernels()
print(f'[setup] CPU kernels ready ({best_isa().name})' if why is None else f'[setup] warning: CPU kernels unavailable ({why}); the engine will use the slower PyTorch paths')"
fi
"$venv/bin/python" -c "import torch; print('[setup] ok: torch', torch.__version__, 'cuda' if torch.cuda.is_available() else 'cpu')"
