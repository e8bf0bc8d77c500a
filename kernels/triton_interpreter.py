"""Whether Triton runs its kernels in its interpreter (``TRITON_INTERPRET=1``), as the tests do
on CPU: the backend choice (`kernels.select`) allows Triton off CUDA only then, and the kernels
compute bfloat16 dot products in float32 there (the interpreter's numpy has no bfloat16).

Apart from `kernels.select` so the kernels read it without importing the module that chooses them.
"""

from __future__ import annotations

import os

__all__ = ["triton_interpreter_enabled"]


def triton_interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"
