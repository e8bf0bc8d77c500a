"""`tune_host_allocator`: applied on glibc, validated input; a subprocess keeps the suite's own
allocator untouched."""

import subprocess
import sys

import pytest

from worker.loading.host_allocator import tune_host_allocator


def test_rejects_a_non_positive_threshold():
    with pytest.raises(ValueError, match="positive"):
        tune_host_allocator(0)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt is Linux-only")
def test_large_blocks_stay_in_the_heap_after_tuning():
    # With glibc's defaults a freed 64 MiB tensor is unmapped and the next one faults every page
    # in again; after tuning, an allocation reuses a freed heap block: (almost) no faults. The
    # first few cycles only settle the heap (an aligned request may not fit the chunk the very
    # first one left, depending on what earlier imports allocated), then one is measured.
    code = """
import resource, sys, torch
from worker.loading.host_allocator import tune_host_allocator
if sys.argv[1] == "tuned":
    assert tune_host_allocator()
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(3):
    x = torch.empty(16 << 20); x.fill_(1); del x
before = faults()
x = torch.empty(16 << 20); x.fill_(1); del x
print(faults() - before)
"""
    pages = (64 << 20) // 4096

    def refaults(mode):
        out = subprocess.run([sys.executable, "-c", code, mode], capture_output=True, text=True, check=True,
                             timeout=120)
        return int(out.stdout)

    assert refaults("default") > pages // 2  # the control: defaults do fault the block in again
    assert refaults("tuned") < pages // 20
