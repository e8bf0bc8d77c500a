"""Suite-wide setup.

Triton's interpreter must be switched on before any Triton kernel is defined, so it is set
here, before test modules import `kernels.triton_attention`. On a CUDA machine it is left
alone: there the kernels compile for the GPU and CUDA-marked tests run too.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_cuda = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip_cuda)
