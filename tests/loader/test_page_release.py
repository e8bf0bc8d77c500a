"""`loader.release_pages`: the pages wholly inside a dead tensor go back to the OS (the process's
resident memory drops by them), the bytes around it -- a neighbour sharing a page -- are untouched,
and what is not a CPU tensor, or spans no whole page, is left alone."""

from __future__ import annotations

import mmap
import os
import sys

import pytest
import torch

from loader.page_release import release_pages

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise(MADV_DONTNEED) is Linux's")
PAGE = mmap.PAGESIZE


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_a_dead_view_s_pages_leave_and_its_neighbours_stay():
    buffer = torch.full((64 << 20,), 7, dtype=torch.uint8)  # [64 MiB], every page touched
    base = buffer.data_ptr()
    start = (-base) % PAGE + 3 * PAGE + 100  # a view starting mid-page: that page is a neighbour's too
    dead = buffer[start:start + (48 << 20)]
    before = resident_bytes()
    released = release_pages(dead)
    after = resident_bytes()
    assert released == (48 << 20) - PAGE  # the whole pages inside it: a partial one at each end stays
    assert before - after >= released * 0.9  # resident memory fell by them
    first_whole = start + (PAGE - 100)
    assert int(buffer[first_whole:first_whole + released].max()) == 0  # released pages read back as zeros
    assert int(buffer[:first_whole].min()) == 7 and int(buffer[first_whole + released:].min()) == 7  # neighbours


def test_what_spans_no_whole_page_or_is_not_plain_cpu_memory_is_left_alone():
    buffer = torch.full((4 * PAGE,), 5, dtype=torch.uint8)
    assert release_pages(buffer[10:PAGE + 10]) == 0  # no whole page inside it
    assert release_pages(buffer.view(4, PAGE)[:, :8]) == 0  # not contiguous
    assert int(buffer.min()) == 5
